"""The shm transport's own behaviour beyond the conformance suite: its two copy paths,
batching past IOV_MAX, metadata checks, options, and waking on activity."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from kvwire_shm import ShmTransport, allocate
from kvwire_shm._cma import IOV_MAX
from kvwire_shm._tables import coalesce

from kvwire.errors import ConfigError, PeerMetadataError, TransportClosedError, UnknownPeerError
from kvwire.transport import XferState, create, region_of_array, wait_for


def _pair() -> tuple[ShmTransport, ShmTransport]:
    return ShmTransport("unit-a"), ShmTransport("unit-b")


def _descs(base: int, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return np.stack([base + offsets, lengths, np.zeros_like(lengths)], axis=1).astype(np.int64)


def _maps_with(token: str) -> int:
    with open("/proc/self/maps") as maps:
        return sum(token in line for line in maps)


def test_entry_point_loads_the_shm_factory() -> None:
    agent = create("shm", "unit-ep")
    try:
        assert isinstance(agent, ShmTransport)
        assert agent.capabilities.ordered_notifications
    finally:
        agent.close()


def test_allocate_gives_zeroed_shareable_memory() -> None:
    array = allocate(10_000)
    assert array.dtype == np.uint8 and array.shape == (10_000,)
    assert not array.any()
    array[:] = 7
    assert int(array.sum()) == 70_000


@pytest.mark.parametrize("shared", [False, True], ids=["cma", "mapped"])
def test_read_and_write_past_iov_max(shared: bool) -> None:
    a, b = _pair()
    try:
        n = 3 * IOV_MAX + 17  # several syscalls' worth, with a ragged last batch
        src = allocate(n * 64) if shared else np.zeros(n * 64, dtype=np.uint8)
        src[:] = np.random.default_rng(1).integers(0, 256, src.shape[0], dtype=np.uint8)
        dst = np.zeros(n * 64, dtype=np.uint8)
        b.register([region_of_array(src)])
        a.register([region_of_array(dst)])
        peer = a.add_peer(b.local_metadata())
        # Every other 32-byte half, so nothing coalesces.
        offsets = np.arange(n, dtype=np.int64) * 64
        lengths = np.full(n, 32, dtype=np.int64)
        handle = a.read(
            peer,
            _descs(dst.ctypes.data, offsets, lengths),
            _descs(src.ctypes.data, offsets + 16, lengths),
        )
        assert wait_for(a, handle, 30) is XferState.DONE
        a.release(handle)
        got = dst.reshape(n, 64)[:, :32]
        assert np.array_equal(got, src.reshape(n, 64)[:, 16:48])
        assert not dst.reshape(n, 64)[:, 32:].any()
        dst[:] = 0xAB
        handle = a.write(
            peer,
            _descs(dst.ctypes.data, offsets, lengths),
            _descs(src.ctypes.data, offsets, lengths),
        )
        assert wait_for(a, handle, 30) is XferState.DONE
        assert (src.reshape(n, 64)[:, :32] == 0xAB).all()
    finally:
        a.close()
        b.close()


def test_peer_segments_are_mapped_and_unmapped() -> None:
    a, b = _pair()
    src = allocate(1 << 20)
    b.register([region_of_array(src)])
    before = _maps_with("kvwire-shm-")
    a.add_peer(b.local_metadata())
    assert _maps_with("kvwire-shm-") > before, "the peer's segment was not mapped here"
    a.close()
    b.close()
    assert _maps_with("kvwire-shm-") == before, "close() left the peer's segment mapped"


def test_read_returns_before_the_copy_and_notifies_after() -> None:
    a, b = _pair()
    try:
        src = np.full(64 << 20, 3, dtype=np.uint8)
        dst = np.zeros(64 << 20, dtype=np.uint8)
        b.register([region_of_array(src)])
        a.register([region_of_array(dst)])
        peer = a.add_peer(b.local_metadata())
        whole = np.array([[0, 64 << 20, 0]], dtype=np.int64)
        local, remote = whole.copy(), whole.copy()
        local[0, 0], remote[0, 0] = dst.ctypes.data, src.ctypes.data
        handle = a.read(peer, local, remote, b"landed")
        assert wait_for(a, handle, 30) is XferState.DONE
        assert (dst == 3).all()
        deadline = time.monotonic() + 30
        got: list[tuple[str, bytes]] = []
        while not got and time.monotonic() < deadline:
            b.wait(1.0)
            got = b.drain_notifications()
        assert got == [("unit-a", b"landed")]
    finally:
        a.close()
        b.close()


def test_wait_wakes_on_a_notification() -> None:
    a, b = _pair()
    try:
        peer = a.add_peer(b.local_metadata())
        sender = threading.Timer(0.2, a.notify, args=(peer, b"wake"))
        sender.start()
        t0 = time.monotonic()
        b.wait(20.0)
        sender.join()
        assert time.monotonic() - t0 < 10.0, "wait() slept through a notification"
    finally:
        a.close()
        b.close()


def test_options_and_metadata_are_checked() -> None:
    with pytest.raises(ConfigError):
        ShmTransport("x", colour="blue")
    a = ShmTransport("x")
    try:
        with pytest.raises(PeerMetadataError):
            a.add_peer(b"\x93\x01\x02\x03")
        with pytest.raises(PeerMetadataError):
            a.add_peer(b"not msgpack at all")
        with pytest.raises(UnknownPeerError):
            a.notify("nobody", b"x")
    finally:
        a.close()
    with pytest.raises(TransportClosedError):
        a.local_metadata()


def test_coalesce_merges_only_runs_contiguous_on_both_sides() -> None:
    dst = np.array([0, 10, 20, 100, 110], dtype=np.int64)
    src = np.array([500, 510, 600, 700, 710], dtype=np.int64)
    length = np.array([10, 10, 10, 10, 0], dtype=np.int64)
    d, s, n = coalesce(dst, src, length)
    assert d.tolist() == [0, 20, 100]
    assert s.tolist() == [500, 600, 700]
    assert n.tolist() == [20, 10, 10]
