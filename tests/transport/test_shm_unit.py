"""The shm transport's own behaviour beyond the conformance suite: its two copy paths,
batching past IOV_MAX, metadata checks, options, and waking on activity."""

from __future__ import annotations

import gc
import itertools
import os
import threading
import time

import numpy as np
import pytest
from kvwire_shm import ShmTransport, _memcopy, allocate
from kvwire_shm._cma import IOV_MAX
from kvwire_shm._segments import segment_of
from kvwire_shm._tables import DRAM, MAPPED, Row, Table

from kvwire.errors import (
    ConfigError,
    DescriptorError,
    PeerMetadataError,
    TransportClosedError,
    UnknownPeerError,
)
from kvwire.layout import coalesce_columns as coalesce
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


# -- the mapped copy engine ------------------------------------------------------------


def _layout(rng: np.random.Generator, lengths: np.ndarray) -> np.ndarray:
    """Offsets placing span i of ``lengths`` in a shuffled order, a gap after each, in a
    buffer of twice the bytes: no two spans overlap and nothing is contiguous."""
    order = rng.permutation(lengths.shape[0])
    room = 2 * lengths[order]
    offsets = np.empty(lengths.shape[0], dtype=np.int64)
    offsets[order] = np.cumsum(room) - room
    return offsets


def _run_chunks_on_two_threads(chunks: list, seed: int) -> None:
    """Every chunk once, in a shuffled order, split between this thread and another."""
    order = np.random.default_rng(seed).permutation(len(chunks)).tolist()
    other = threading.Thread(target=lambda: [chunks[i]() for i in order[1::2]])
    other.start()
    for i in order[0::2]:
        chunks[i]()
    other.join()


@pytest.mark.parametrize(
    "shape", ["small-spans", "shared-64KiB", "large-spans", "mixed", "tiny-gathered"]
)
def test_chunks_move_every_span_and_nothing_else(shape: str) -> None:
    rng = np.random.default_rng(len(shape))
    if shape == "small-spans":  # many chunks of small spans, GIL kept per chunk
        lengths = rng.integers(1, 64 << 10, 400)
    elif shape == "shared-64KiB":  # past SHARE_FROM: every copy drops the GIL
        lengths = np.full(_memcopy.SHARE_FROM // (64 << 10), 64 << 10)
    elif shape == "large-spans":  # spans longer than a chunk are cut into pieces
        lengths = rng.integers(_memcopy.RELEASE_FROM, 3 * _memcopy.CHUNK_BYTES, 6)
    elif shape == "mixed":
        lengths = np.concatenate([rng.integers(1, 4096, 300), [_memcopy.RELEASE_FROM, 5 << 20]])
    else:  # mean under GATHER_BELOW: numpy gather/scatter
        lengths = rng.integers(1, 16, 5000)
    lengths = lengths.astype(np.int64)
    src_at, dst_at = _layout(rng, lengths), _layout(rng, lengths)
    total = int(2 * lengths.sum())
    src = rng.integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    chunks, shared = _memcopy.chunks(dst.ctypes.data + dst_at, src.ctypes.data + src_at, lengths)
    assert shared == (shape == "shared-64KiB")
    assert len(chunks) >= int(lengths.sum()) // _memcopy.CHUNK_BYTES
    _run_chunks_on_two_threads(chunks, seed=len(shape))
    expected = np.zeros_like(dst)
    for d, s, n in zip(dst_at.tolist(), src_at.tolist(), lengths.tolist(), strict=True):
        expected[d : d + n] = src[s : s + n]
    assert np.array_equal(dst, expected)


def test_split_long_cuts_only_spans_that_do_not_overlap_themselves() -> None:
    big = 2 * _memcopy.CHUNK_BYTES + 5
    dst = np.array([0, 10 * big, 30 * big], dtype=np.int64)
    src = np.array([50 * big, 10 * big + 7, 70 * big], dtype=np.int64)  # 2nd overlaps itself
    length = np.array([big, big, 9], dtype=np.int64)
    d, s, n = _memcopy.split_long(dst, src, length)
    assert n.tolist() == [_memcopy.CHUNK_BYTES, _memcopy.CHUNK_BYTES, 5, big, 9]
    assert d.tolist() == [0, _memcopy.CHUNK_BYTES, 2 * _memcopy.CHUNK_BYTES, 10 * big, 30 * big]
    assert (s - d).tolist() == [50 * big] * 3 + [7, 40 * big]


def test_cma_chunks_copy_within_this_process_on_two_threads() -> None:
    from kvwire_shm import _cma

    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 256 << 10, 3000).astype(np.int64)  # > IOV_MAX and > a chunk
    src_at, dst_at = _layout(rng, lengths), _layout(rng, lengths)
    total = int(2 * lengths.sum())
    src = rng.integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    chunks = _cma.chunks(
        os.getpid(), dst.ctypes.data + dst_at, src.ctypes.data + src_at, lengths, write=False
    )
    assert len(chunks) >= max(3, int(lengths.sum()) // _memcopy.CHUNK_BYTES)
    _run_chunks_on_two_threads(chunks, seed=5)
    assert np.array_equal(_gather(dst, dst_at, lengths), _gather(src, src_at, lengths)), (
        "bytes differ after the CMA chunks ran"
    )


def _gather(buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    spans = zip(offsets.tolist(), lengths.tolist(), strict=True)
    return np.concatenate([buf[o : o + n] for o, n in spans])


_ADDR = np.array([1, 0, 0], dtype=np.int64)
"""Times an offset: a shift of descriptors' addresses only."""


def test_releasing_a_running_transfer_stops_it_between_chunks() -> None:
    a, b = _pair()
    try:
        size = 16 * _memcopy.CHUNK_BYTES
        src = allocate(size)
        src[:] = 7
        dst = np.zeros(size, dtype=np.uint8)
        a.register([region_of_array(dst)])
        b.register([region_of_array(src)])
        peer = a.add_peer(b.local_metadata())
        ran: list[int] = []
        started, gate = threading.Event(), threading.Event()
        chunk = a._chunk

        def held_chunk(xfer: object, copy: object) -> None:
            ran.append(1)
            if len(ran) == 1:
                started.set()
                assert gate.wait(30)  # the first chunk copies only once the test released
            chunk(xfer, copy)  # type: ignore[arg-type]  # sees the release: copies nothing

        a._chunk = held_chunk  # type: ignore[method-assign]
        whole = np.array([[dst.ctypes.data, size, 0]], dtype=np.int64)
        handle = a.read(peer, whole, whole + (src.ctypes.data - dst.ctypes.data) * _ADDR)
        assert started.wait(30)
        a.release(handle)
        gate.set()
        page = np.array([[dst.ctypes.data, 4096, 0]], dtype=np.int64)
        follow = a.read(peer, page, page + (src.ctypes.data - dst.ctypes.data) * _ADDR)
        assert wait_for(a, follow, timeout=30) is XferState.DONE
        # 1st, 2nd (refused); the small follow-up is one step of its own, not chunks.
        assert len(ran) == 2, "chunks were claimed after the release"
        assert (dst[:4096] == 7).all()
        assert not dst[4096:].any(), "the released copy went on"
    finally:
        a.close()
        b.close()


def test_group_bounds_cover_every_span_and_bound_each_group() -> None:
    lengths = np.random.default_rng(3).integers(1, 3 << 20, 2000).tolist()
    lengths[7] = 3 * _memcopy.CHUNK_BYTES  # larger than a group: a group of its own
    ends = list(itertools.accumulate(lengths))
    bounds = _memcopy.group_bounds(ends)
    assert bounds[0] == 0 and bounds[-1] == len(lengths)
    assert all(a < b for a, b in itertools.pairwise(bounds))
    for a, b in itertools.pairwise(bounds):
        size = sum(lengths[a:b])
        assert size <= _memcopy.CHUNK_BYTES or b == a + 1, (a, b, size)
        if b < len(lengths):  # a group stops only where the next span would overflow it
            assert size + lengths[b] > _memcopy.CHUNK_BYTES
    assert (
        max(
            itertools.starmap(
                lambda a, b: b - a,
                itertools.pairwise(_memcopy.group_bounds([1] * 5000, most=IOV_MAX)),
            )
        )
        == IOV_MAX
    )


# -- posting ---------------------------------------------------------------------------


def test_descriptor_arrays_may_be_reused_once_read_returns() -> None:
    """The worker reads the descriptors later; read() must have taken its own copy."""
    a, b = _pair()
    try:
        size = 32 << 20
        src = allocate(size)
        src[:] = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
        dst = np.zeros(size, dtype=np.uint8)
        b.register([region_of_array(src)])
        a.register([region_of_array(dst)])
        peer = a.add_peer(b.local_metadata())
        whole = np.array([[dst.ctypes.data, size // 2, 0]], dtype=np.int64)
        busy = a.read(peer, whole, np.array([[src.ctypes.data, size // 2, 0]], dtype=np.int64))
        local = np.array([[dst.ctypes.data + size // 2, 4096, 0]], dtype=np.int64)
        remote = np.array([[src.ctypes.data + 4096, 4096, 0]], dtype=np.int64)
        handle = a.read(peer, local, remote)
        local[0, 0] = dst.ctypes.data + size - 4096  # the caller moves on to its next transfer
        remote[0, 0] = src.ctypes.data
        assert wait_for(a, busy, 30) is XferState.DONE
        assert wait_for(a, handle, 30) is XferState.DONE
        half = size // 2
        assert np.array_equal(dst[half : half + 4096], src[4096:8192])
        assert not dst[size - 4096 :].any(), "the worker used the caller's later edit"
    finally:
        a.close()
        b.close()


def test_single_region_tables_reject_what_is_outside() -> None:
    start, length = 1 << 40, 1 << 20
    table = Table([Row(start, length, 0, DRAM, MAPPED, 5)])
    inside = np.array([[start, length, 0], [start + length - 1, 1, 0]], dtype=np.int64)
    assert table.locate(inside, "remote").tolist() == [0, 0]
    big = np.iinfo(np.int64).max
    for addr, n in [
        (start - 1, 1),  # before the region
        (start + length - 1, 2),  # straddles its end
        (big - 8, 16),  # addr + length overflows int64
        (start, big),
    ]:
        bad = np.array([[start, 1, 0], [addr, n, 0]], dtype=np.int64)
        with pytest.raises(DescriptorError, match="remote descriptor 1"):
            table.locate(bad, "remote")


# -- pre-faulting a peer's segments ----------------------------------------------------


def _rss_kib_of_other_mappings(token: str, own_base: int) -> int:
    """Resident KiB of this process's mappings of a segment, except the one at own_base."""
    total, counting = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                counting = token in line and int(head[0].split("-")[0], 16) != own_base
            elif counting and head[0] == "Rss:":
                total += int(head[1])
    return total


def test_add_peer_prefaults_only_registered_spans() -> None:
    a, b = _pair()
    try:
        src = allocate(16 << 20)
        src[:] = 1  # every page of the segment exists
        b.register([region_of_array(src[: 8 << 20])])
        token = segment_of(src.ctypes.data, 1)
        assert token is not None
        base = src.ctypes.data
        a.add_peer(b.local_metadata())
        deadline = time.monotonic() + 30
        while _rss_kib_of_other_mappings(token.token, base) < (8 << 10):
            assert time.monotonic() < deadline, "the registered span was never pre-faulted"
            time.sleep(0.01)
        assert _rss_kib_of_other_mappings(token.token, base) < (16 << 10), (
            "pages outside the registered span were faulted in too"
        )
    finally:
        a.close()
        b.close()


def test_close_wakes_a_blocked_wait_and_leaves_no_descriptor() -> None:
    gc.collect()  # so earlier tests' garbage closes its fds before the count, not during
    before = set(os.listdir("/proc/self/fd"))
    a = ShmTransport("unit-waiter")
    outcome: list[str] = []

    def waiter() -> None:
        try:
            a.wait(60.0)
            outcome.append("returned")
        except TransportClosedError:
            outcome.append("closed")

    thread = threading.Thread(target=waiter)
    thread.start()
    deadline = time.monotonic() + 30
    while not a._waiters:  # the thread is inside wait()
        assert time.monotonic() < deadline, "the waiter never entered wait()"
        time.sleep(0.001)
    t0 = time.monotonic()
    a.close()
    thread.join(30)
    assert not thread.is_alive() and outcome, "close() left a waiter blocked"
    assert time.monotonic() - t0 < 20
    # Only fds opened since may not be left; an unrelated one closing meanwhile is no leak.
    left = set(os.listdir("/proc/self/fd")) - before
    assert not left, f"fds {sorted(left)} outlived close() and its waiter"
    with pytest.raises(TransportClosedError):
        a.wait(0.0)


@pytest.mark.parametrize("where", ["planning", "copying", "copying-inline"])
def test_a_bug_fails_that_transfer_and_the_worker_lives_on(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    a, b = _pair()
    try:
        src = np.full(8192, 3, dtype=np.uint8)
        dst = np.zeros(8192, dtype=np.uint8)
        a.register([region_of_array(dst)])
        b.register([region_of_array(src)])
        peer = a.add_peer(b.local_metadata())
        # Eight 512-byte rows are cut into chunks by the job; one row is copied inline.
        rows = 1 if where == "copying-inline" else 8
        offsets = np.arange(rows, dtype=np.int64) * (4096 // rows)
        lengths = np.full(rows, 4096 // rows, dtype=np.int64)
        local = _descs(dst.ctypes.data, offsets, lengths)
        remote = _descs(src.ctypes.data, offsets, lengths)

        def bug(*_: object, **__: object) -> None:
            raise RuntimeError("planted bug")

        def broken(*_: object, **__: object) -> list[object]:
            if where == "planning":
                bug()
            return [bug]

        with monkeypatch.context() as patch:
            if where == "copying-inline":
                patch.setattr("kvwire_shm._cma.copy_few", bug)
            patch.setattr("kvwire_shm._cma.chunks", broken)
            patch.setattr("kvwire_shm._cma.native_chunks", broken)
            patch.setattr("kvwire_shm._cma.planned_chunks", broken)
            handle = a.read(peer, local, remote)
            assert wait_for(a, handle, timeout=30) is XferState.FAILED
            assert "RuntimeError: planted bug" in (a.failure_reason(handle) or "")
            a.release(handle)
        assert wait_for(a, a.read(peer, local, remote), timeout=30) is XferState.DONE
        assert (dst[:4096] == 3).all()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("where", ["few", "inline", "helped"])
def test_ctrl_c_in_a_copy_fails_that_transfer_and_close_returns(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Ctrl-C lands in the copy the main thread is running (a small transfer in ``read``,
    or a chunk it helps with in ``wait``): the interrupt goes on up, that transfer FAILS,
    the next one moves, and ``close`` returns (it once waited forever for the chunk)."""
    a, b = _pair()
    try:
        rows = {"few": 2, "inline": 16, "helped": 128}[where]
        src = np.full(rows * 4096, 5, dtype=np.uint8)
        dst = np.zeros(rows * 4096, dtype=np.uint8)
        a.register([region_of_array(dst)])
        b.register([region_of_array(src)])
        peer = a.add_peer(b.local_metadata())
        offsets = np.arange(rows, dtype=np.int64) * 4096
        lengths = np.full(rows, 2048, dtype=np.int64)  # half of each row: nothing coalesces
        local = _descs(dst.ctypes.data, offsets, lengths)
        remote = _descs(src.ctypes.data, offsets, lengths)
        interrupted = threading.Event()

        def copy(*_: object, **__: object) -> None:
            if threading.current_thread() is threading.main_thread():
                interrupted.set()
                raise KeyboardInterrupt  # where Python raises a real Ctrl-C
            assert interrupted.wait(30), "the main thread never helped"

        with monkeypatch.context() as patch:
            patch.setattr("kvwire_shm._cma.copy_few", copy)
            for name in ("chunks", "native_chunks", "planned_chunks"):
                patch.setattr(f"kvwire_shm._cma.{name}", lambda *_, **__: [copy] * 4)
            with pytest.raises(KeyboardInterrupt):
                handle = a.read(peer, local, remote)
                assert where == "helped", "a small transfer is copied in read"
                wait_for(a, handle, timeout=30)
        (cut,) = a._xfers  # the handle read never returned, for the small ones
        assert wait_for(a, cut, timeout=30) is XferState.FAILED
        assert "interrupted (KeyboardInterrupt)" in (a.failure_reason(cut) or "")
        a.release(cut)
        assert wait_for(a, a.read(peer, local, remote), timeout=30) is XferState.DONE
        assert (dst.reshape(rows, 4096)[:, :2048] == 5).all()
    finally:
        closing = threading.Thread(target=a.close, daemon=True)
        closing.start()
        closing.join(30)
        assert not closing.is_alive(), "close waited for a chunk nobody runs"
        b.close()
