"""What every conformance test works with: the connected pair of agents and its memory,
and the checks that turn a wrong byte into a message naming it."""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvwire.peer.agent import PeerAgent
from kvwire.transport import Capabilities, Transport, XferState, wait_for
from kvwire_conformance import memory
from kvwire_conformance.memory import I64, U8

CLOSE_TIMEOUT_S = 10.0
"""How long a fixture's teardown waits for an agent's ``close()``."""

Note = tuple[str, bytes]
"""A notification as ``drain_notifications`` hands it out: (sender, message)."""


def seed(*parts: object) -> int:
    """A pattern seed named by its parts, the same in every run."""
    return zlib.crc32(repr(parts).encode())


@dataclass
class LocalRegion:
    array: Any
    addr: int
    nbytes: int
    handle: object

    @property
    def view(self) -> U8:
        return memory.view(self.addr, self.nbytes)


@dataclass
class PeerRegion:
    region: int
    addr: int
    nbytes: int


@dataclass
class Spec:
    transport: str
    options: dict[str, Any]
    env: dict[str, str]
    allocators: tuple[str, ...]


@dataclass
class Link:
    """A connected pair: this process's agent and a peer agent process."""

    spec: Spec
    local: Transport
    peer: PeerAgent
    peer_name: str
    local_name: str
    timeout: float
    local_regions: dict[str, LocalRegion] = field(default_factory=dict)
    peer_regions: dict[str, PeerRegion] = field(default_factory=dict)
    detached: list[Any] = field(default_factory=list)
    """Memory a released, possibly still running transfer may yet write into: registered
    and alive until the agent closes, and never used or checked by any other test."""

    @property
    def caps(self) -> Capabilities:
        return self.local.capabilities

    def wait(self, handle: object) -> XferState:
        """The state the transfer ends in; a terminal state must poll the same again."""
        state = wait_for(self.local, handle, self.timeout)
        if state is not XferState.PENDING:
            again = [self.local.poll(handle) for _ in range(2)]
            assert again == [state, state], (
                f"a transfer that ended {state.name} polled again as "
                f"{[s.name for s in again]}: a terminal state is final"
            )
        return state

    def local_notifications(
        self, at_least: int, own: Callable[[bytes], bool] | None = None
    ) -> list[Note]:
        """Drain this agent's notifications until ``at_least`` are in hand or timeout;
        with ``own``, only the messages it accepts count and are kept (see
        :func:`peer_notifications` for why)."""
        got: list[Note] = []
        deadline = time.monotonic() + self.timeout
        while True:
            got += [n for n in self.local.drain_notifications() if own is None or own(n[1])]
            if len(got) >= at_least or time.monotonic() >= deadline:
                return got
            self.local.wait(0.05)


def peer_notifications(
    peer: PeerAgent,
    own: Callable[[bytes], bool],
    at_least: int,
    timeout: float,
    until: bytes | None = None,
) -> list[Note]:
    """Drain ``peer`` until ``at_least`` notifications that ``own`` accepts (and, with
    ``until``, that message) are in hand, or ``timeout`` passes; only those are kept, in
    the order they arrived.

    A test counts only the notifications it sent (its messages carry its tag). An agent's
    inbox outlives the test: a notification of a transfer an earlier test released while
    it ran, or of an agent that has closed since, may still arrive during a later test.
    The contract lets it (notifications name senders never added; a released transfer
    detaches), so a count of everything drained would depend on when it landed.
    """
    got: list[Note] = []
    deadline = time.monotonic() + timeout
    while True:
        left = max(0.0, deadline - time.monotonic())
        need = max(1, at_least - len(got))
        got += [n for n in peer.drain(at_least=need, timeout=left) if own(n[1])]
        enough = len(got) >= at_least and (until is None or any(m == until for _, m in got))
        if enough or time.monotonic() >= deadline:
            return got


def close_within(agent: Transport, seconds: float, what: str) -> None:
    """``agent.close()`` on a helper thread, failing the test if it does not return in time.

    pytest-timeout fires once per test: after a test body timed out, its teardown runs
    unbounded, so a ``close()`` that hangs there needs its own limit.
    """
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            agent.close()
        except BaseException as exc:  # re-raised on the test's thread
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name="kvwire-conformance-close", daemon=True).start()
    if not done.wait(seconds):
        pytest.fail(f"{what}: close() did not return within {seconds:g} s", pytrace=False)
    if errors:
        raise errors[0]


def assert_bytes(got: U8, expected: U8, offsets: I64, lengths: I64, where: str) -> None:
    """Equal, or a message naming the first wrong byte and the descriptor that covers it."""
    if got.shape == expected.shape and np.array_equal(got, expected):
        return
    if got.shape != expected.shape:
        pytest.fail(f"{where}: got {got.shape[0]} bytes, expected {expected.shape[0]}")
    first = int(np.flatnonzero(got != expected)[0])
    wrong = int(np.count_nonzero(got != expected))
    hit = np.flatnonzero((offsets <= first) & (first < offsets + lengths))
    which = (
        f"inside descriptor {int(hit[0])} of {offsets.shape[0]}"
        if hit.shape[0]
        else "outside every descriptor (a stray write)"
    )
    pytest.fail(f"{where}: {wrong} wrong bytes; the first at offset {first}, {which}")
