"""The ucx adapter with two agents in one process: semantics, errors, lifetime.

UCX moves bytes between two workers of one process over its ``self``/shared-memory paths,
which is enough to check the adapter's contract; the cross-process behaviour is in
``test_ucx_two_process.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from kvwire_ucx import UcxTransport, _ucp

from kvwire import transport as kt
from kvwire.errors import (
    ConfigError,
    DescriptorError,
    PeerMetadataError,
    RegistrationError,
    TransportClosedError,
    TransportError,
    TransportUnavailableError,
    UnknownPeerError,
)
from kvwire.transport import XferState, region_of_array, wait_for

TIMEOUT = 30.0
BLOCK = 4096


@pytest.fixture
def pair() -> Iterator[tuple[UcxTransport, UcxTransport, np.ndarray, np.ndarray]]:
    a = UcxTransport("a")
    b = UcxTransport("b")
    mine = np.zeros(64 * BLOCK, dtype=np.uint8)
    theirs = np.random.default_rng(1).integers(0, 256, 64 * BLOCK, dtype=np.uint8)
    a.register([region_of_array(mine)])
    b.register([region_of_array(theirs)])
    assert a.add_peer(b.local_metadata()) == "b"
    assert b.add_peer(a.local_metadata()) == "a"
    yield a, b, mine, theirs
    a.close()
    b.close()


def rows(buf: np.ndarray, blocks: list[int], size: int = BLOCK) -> np.ndarray:
    base = buf.ctypes.data
    return np.array([[base + i * size, size, 0] for i in blocks], dtype=np.int64)


def notifications(agent: UcxTransport, count: int) -> list[tuple[str, bytes]]:
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + TIMEOUT
    while len(got) < count and time.monotonic() < deadline:
        agent.wait(0.05)
        got.extend(agent.drain_notifications())
    return got


def test_factory_is_found_through_the_entry_point() -> None:
    assert kt.load("ucx") is UcxTransport
    agent = kt.create("ucx", "ep-check")
    try:
        assert isinstance(agent, kt.Transport)
        caps = agent.capabilities
        assert caps.read and caps.write and caps.notifications
        assert kt.MemKind.DRAM in caps.mem_kinds
    finally:
        agent.close()


def test_read_scattered_blocks_with_notification(pair) -> None:  # type: ignore[no-untyped-def]
    a, b, mine, theirs = pair
    src_blocks = [5, 3, 4, 9, 63, 0]
    dst_blocks = [0, 1, 2, 10, 11, 40]
    handle = a.read("b", rows(mine, dst_blocks), rows(theirs, src_blocks), notify=b"done-1")
    assert wait_for(a, handle, TIMEOUT) is XferState.DONE
    for d, s in zip(dst_blocks, src_blocks, strict=True):
        assert np.array_equal(
            mine[d * BLOCK : (d + 1) * BLOCK], theirs[s * BLOCK : (s + 1) * BLOCK]
        )
    assert notifications(b, 1) == [("a", b"done-1")]
    a.release(handle)


def test_write_lands_before_its_notification(pair) -> None:  # type: ignore[no-untyped-def]
    a, b, mine, theirs = pair
    mine[:] = np.arange(mine.size, dtype=np.uint64).astype(np.uint8) ^ 0x5A
    blocks = list(range(0, 64, 3))
    handle = a.write("b", rows(mine, blocks), rows(theirs, blocks), notify=b"w")
    got = notifications(b, 1)
    # The peer saw the notification: every byte must already be there.
    assert got == [("a", b"w")]
    for i in blocks:
        assert np.array_equal(
            theirs[i * BLOCK : (i + 1) * BLOCK], mine[i * BLOCK : (i + 1) * BLOCK]
        )
    assert wait_for(a, handle, TIMEOUT) is XferState.DONE


def test_large_transfer_uses_vectorised_path(pair) -> None:  # type: ignore[no-untyped-def]
    a, _, mine, theirs = pair
    order = np.random.default_rng(2).permutation(64).tolist()
    handle = a.read("b", rows(mine, list(range(64))), rows(theirs, order))
    assert wait_for(a, handle, TIMEOUT) is XferState.DONE
    assert np.array_equal(mine.reshape(64, BLOCK), theirs.reshape(64, BLOCK)[order])


def test_empty_and_zero_length_transfers_complete(pair) -> None:  # type: ignore[no-untyped-def]
    a, b, mine, _ = pair
    empty = np.zeros((0, 3), dtype=np.int64)
    assert wait_for(a, a.read("b", empty, empty, notify=b"e"), TIMEOUT) is XferState.DONE
    zero = np.array([[mine.ctypes.data, 0, 0]], dtype=np.int64)
    assert wait_for(a, a.write("b", zero, zero), TIMEOUT) is XferState.DONE
    assert notifications(b, 1) == [("a", b"e")]


def test_standalone_notifications(pair) -> None:  # type: ignore[no-untyped-def]
    a, b, _, _ = pair
    for i in range(5):
        a.notify("b", f"m{i}".encode())
    b.notify("a", b"back")
    assert sorted(m for _, m in notifications(b, 5)) == [f"m{i}".encode() for i in range(5)]
    assert notifications(a, 1) == [("b", b"back")]


def test_descriptor_errors(pair) -> None:  # type: ignore[no-untyped-def]
    a, _, mine, theirs = pair
    outside = np.array([[theirs.ctypes.data + theirs.size - 10, 20, 0]], dtype=np.int64)
    with pytest.raises(DescriptorError, match="remote descriptor 0"):
        a.read("b", rows(mine, [0])[:, :] * [1, 0, 1] + [0, 20, 0], outside)
    with pytest.raises(DescriptorError, match="local"):
        a.read("b", np.array([[12345, BLOCK, 0]]), rows(theirs, [0]))
    with pytest.raises(DescriptorError):
        a.read("b", rows(mine, [0, 1]), rows(theirs, [0]))
    with pytest.raises(DescriptorError):
        a.read("b", rows(mine, [0]), rows(theirs, [0], size=BLOCK // 2))
    many = rows(mine, list(range(10)))
    bad = rows(theirs, list(range(10)))
    bad[7, 0] = 16
    with pytest.raises(DescriptorError, match="remote descriptor 7"):
        a.read("b", many, bad)
    with pytest.raises(DescriptorError):
        a.read("b", np.zeros((2, 2), dtype=np.int64), np.zeros((2, 2), dtype=np.int64))


def test_notifications_must_be_bytes_like(pair) -> None:  # type: ignore[no-untyped-def]
    a, b, mine, theirs = pair
    bad: list[Any] = ["text", 5]  # bytes(5) would be five zero bytes on the wire
    for message in bad:
        with pytest.raises(TransportError, match="must be bytes"):
            a.notify("b", message)
        with pytest.raises(TransportError, match="must be bytes"):
            a.read("b", rows(mine, [0]), rows(theirs, [0]), notify=message)
    a.notify("b", bytearray(b"ok"))
    assert notifications(b, 1) == [("a", b"ok")]


def test_unknown_peer_and_bad_metadata(pair) -> None:  # type: ignore[no-untyped-def]
    a, _, mine, theirs = pair
    with pytest.raises(UnknownPeerError):
        a.read("nobody", rows(mine, [0]), rows(theirs, [0]))
    with pytest.raises(UnknownPeerError):
        a.notify("nobody", b"x")
    for blob in (b"", b"\x00garbage", b"\x93\xa3abc\x01\x02"):
        with pytest.raises(PeerMetadataError):
            a.add_peer(blob)


def test_remove_peer_then_unknown(pair) -> None:  # type: ignore[no-untyped-def]
    a, b, mine, theirs = pair
    a.remove_peer("b")
    with pytest.raises(UnknownPeerError):
        a.read("b", rows(mine, [0]), rows(theirs, [0]))
    assert a.add_peer(b.local_metadata()) == "b"
    assert wait_for(a, a.read("b", rows(mine, [0]), rows(theirs, [0])), TIMEOUT) is XferState.DONE


def test_new_registration_reaches_peer_through_fresh_metadata(pair) -> None:  # type: ignore[no-untyped-def]
    a, b, mine, _ = pair
    extra = np.full(BLOCK, 7, dtype=np.uint8)
    handle = b.register([region_of_array(extra)])
    with pytest.raises(DescriptorError):
        a.read("b", rows(mine, [0]), rows(extra, [0]))
    a.add_peer(b.local_metadata())
    assert wait_for(a, a.read("b", rows(mine, [0]), rows(extra, [0])), TIMEOUT) is XferState.DONE
    assert (mine[:BLOCK] == 7).all()
    b.deregister(handle)
    with pytest.raises(RegistrationError):
        b.deregister(handle)
    with pytest.raises(RegistrationError):
        b.deregister(object())


def test_kept_plans_go_when_local_memory_changes(pair) -> None:  # type: ignore[no-untyped-def]
    a, _, mine, theirs = pair
    local, remote = rows(mine, [0]), rows(theirs, [2])
    assert wait_for(a, a.read("b", local, remote), TIMEOUT) is XferState.DONE
    assert a._peers["b"].plans  # kept: the next identical READ skips planning
    registration = a._registrations[0]
    a.deregister(registration)
    # The kept plan named the unmapped handle; posting it would be a use after free.
    with pytest.raises(DescriptorError):
        a.read("b", local, remote)
    mine[:] = 0
    a.register([region_of_array(mine)])
    assert wait_for(a, a.read("b", local, remote), TIMEOUT) is XferState.DONE
    assert np.array_equal(mine[:BLOCK], theirs[2 * BLOCK : 3 * BLOCK])


def test_kept_plans_go_when_the_peer_remaps(pair) -> None:  # type: ignore[no-untyped-def]
    a, b, mine, theirs = pair
    local, remote = rows(mine, [0]), rows(theirs, [3])
    assert wait_for(a, a.read("b", local, remote), TIMEOUT) is XferState.DONE
    b.deregister(b._registrations[0])
    a.add_peer(b.local_metadata())  # no regions now: the old rkeys are destroyed
    with pytest.raises(DescriptorError):
        a.read("b", local, remote)
    theirs[3 * BLOCK : 4 * BLOCK] = 9
    b.register([region_of_array(theirs)])
    a.add_peer(b.local_metadata())  # the same memory under a new rkey
    assert wait_for(a, a.read("b", local, remote), TIMEOUT) is XferState.DONE
    assert (mine[:BLOCK] == 9).all()


def test_plan_cache_keeps_at_most_its_size() -> None:
    a = UcxTransport("a", plan_cache=2)
    b = UcxTransport("b", plan_cache=0)
    try:
        mine = np.zeros(8 * BLOCK, dtype=np.uint8)
        theirs = np.arange(8 * BLOCK, dtype=np.uint64).astype(np.uint8)
        a.register([region_of_array(mine)])
        b.register([region_of_array(theirs)])
        a.add_peer(b.local_metadata())
        b.add_peer(a.local_metadata())
        for block in range(5):
            local, remote = rows(mine, [block]), rows(theirs, [7 - block])
            assert wait_for(a, a.read("b", local, remote), TIMEOUT) is XferState.DONE
            assert wait_for(b, b.write("a", remote, local), TIMEOUT) is XferState.DONE
        assert len(a._peers["b"].plans) == 2
        assert b._peers["a"].plans == {}
        for block in range(5):
            assert np.array_equal(
                mine[block * BLOCK : (block + 1) * BLOCK],
                theirs[(7 - block) * BLOCK : (8 - block) * BLOCK],
            )
    finally:
        a.close()
        b.close()


def test_release_twice_and_foreign_handles(pair) -> None:  # type: ignore[no-untyped-def]
    a, b, mine, theirs = pair
    handle = a.read("b", rows(mine, [0]), rows(theirs, [0]))
    a.release(handle)
    with pytest.raises(TransportError):
        a.release(handle)
    with pytest.raises(TransportError):
        a.poll(handle)
    other = b.read("a", rows(theirs, [1]), rows(mine, [1]))
    with pytest.raises(TransportError):
        a.poll(other)
    with pytest.raises(TransportError):
        a.poll("not a handle")


def test_options_are_validated() -> None:
    with pytest.raises(ConfigError):
        UcxTransport("x", error_handling="maybe")
    with pytest.raises(ConfigError):
        UcxTransport("x", progress="busy")
    with pytest.raises(ConfigError):
        UcxTransport("x", no_such_option=1)
    for bad in (-1, True, "8"):
        with pytest.raises(ConfigError, match="plan_cache"):
            UcxTransport("x", plan_cache=bad)
    with pytest.raises(TransportError) as info:
        UcxTransport("x", config={"NO_SUCH_UCX_SETTING": "1"})
    assert info.value.status is not None


def test_close_leaves_no_thread_and_rejects_use() -> None:
    before = {t.name for t in threading.enumerate()}
    agent = UcxTransport("closing")
    assert "kvwire-ucx-closing" in {t.name for t in threading.enumerate()}
    buf = np.zeros(BLOCK, dtype=np.uint8)
    agent.register([region_of_array(buf)])
    agent.close()
    agent.close()
    assert {t.name for t in threading.enumerate()} == before
    with pytest.raises(TransportClosedError):
        agent.local_metadata()
    with pytest.raises(TransportClosedError):
        agent.register([region_of_array(buf)])


def test_idle_progress_thread_does_not_spin() -> None:
    agents = [UcxTransport(f"idle{i}") for i in range(2)]
    try:
        agents[0].add_peer(agents[1].local_metadata())
        start = time.process_time()
        threading.Event().wait(1.0)
        used = time.process_time() - start
        # A spinning progress thread would burn about a full second of CPU here.
        assert used < 0.2
    finally:
        for agent in agents:
            agent.close()


def test_caller_progress_mode_moves_data() -> None:
    a = UcxTransport("ca", progress="caller")
    b = UcxTransport("cb", progress="caller")
    try:
        src = np.arange(BLOCK, dtype=np.uint8)
        dst = np.zeros(BLOCK, dtype=np.uint8)
        a.register([region_of_array(dst)])
        b.register([region_of_array(src)])
        a.add_peer(b.local_metadata())
        b.add_peer(a.local_metadata())
        handle = a.read("cb", rows(dst, [0]), rows(src, [0]), notify=b"x")
        assert wait_for(a, handle, TIMEOUT) is XferState.DONE
        assert np.array_equal(src, dst)
        assert notifications(b, 1) == [("ca", b"x")]
    finally:
        a.close()
        b.close()


def test_missing_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_ucp, "_LIBRARY", None)
    monkeypatch.setitem(sys.modules, "libucx", None)
    with pytest.raises(TransportUnavailableError, match=r"kvwire\[ucx\]"):
        UcxTransport("nolib")


def test_import_is_lazy() -> None:
    code = (
        "import kvwire_ucx, sys\n"
        "maps = open('/proc/self/maps').read()\n"
        "assert 'libucp' not in maps, 'libucp loaded at import'\n"
        "assert 'libucx' not in sys.modules\n"
        "print('lazy')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "lazy"
