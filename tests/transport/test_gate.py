"""The suite's write gate holds writes back until the test lets them through, and never
holds the test's own thread (kvwire.peer.gate)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvwire.peer.gate import PAGE, Gate, GateUnavailable, open_gate


@pytest.fixture
def gate() -> Iterator[Gate]:
    try:
        g = open_gate(16 * PAGE)
    except GateUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield g
    finally:
        g.close()


def test_a_write_by_another_thread_waits_until_released(gate: Gate) -> None:
    gate.protect(np.array([3 * PAGE + 5]), np.array([2 * PAGE]))  # pages 3, 4 and 5
    source = np.full(2 * PAGE, 9, dtype=np.uint8)
    landed = threading.Event()

    def write() -> None:
        ctypes.memmove(gate.addr + 3 * PAGE + 5, source.ctypes.data, 2 * PAGE)
        landed.set()

    writer = threading.Thread(target=write)
    writer.start()
    released = 0
    while not landed.is_set():
        mark = gate.recorded()
        if mark > released:
            # Held: the page the writer is in has not been written, nor any after it.
            assert not landed.is_set()
            assert gate.held() == 3 - released  # pages not yet let through
            assert (gate.array[5 * PAGE + 5 :] == 0).all()
            gate.release(mark)
            released = mark
        gate.wait_fault(0.01)
    writer.join()
    assert released == 3, "each protected page held its first write once"
    assert gate.held() == 0
    assert (gate.array[3 * PAGE + 5 : 5 * PAGE + 5] == 9).all()
    assert not gate.stalled()


def test_the_test_thread_is_never_held(gate: Gate) -> None:
    gate.protect(np.array([0]), np.array([4 * PAGE]))
    gate.array[: 4 * PAGE] = 7  # would deadlock if held
    assert (gate.array[: 4 * PAGE] == 7).all()
    assert gate.recorded() == 4, "each page's first write was seen"
    assert gate.held() == 0, "and let through at once"


def test_open_lets_every_waiting_writer_through(gate: Gate) -> None:
    gate.protect(np.array([0]), np.array([PAGE]))
    writer = threading.Thread(target=ctypes.memset, args=(gate.addr, 1, PAGE))
    writer.start()
    while not gate.recorded():
        gate.wait_fault(0.01)
    gate.open()
    writer.join()
    assert (gate.array[:PAGE] == 1).all()
