"""Two NIXL agents in one process: the adapter's own behaviour beyond the conformance suite
(request reuse, notification hygiene, NIXL status names, backends, telemetry, progress)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from kvwire_nixl import NixlTransport

from kvwire.errors import (
    DescriptorError,
    PeerMetadataError,
    RegistrationError,
    TransportClosedError,
    TransportError,
    TransportUnavailableError,
    UnknownPeerError,
)
from kvwire.transport import MemKind, Region, Transport, XferState, wait_for

TIMEOUT = 30.0
SIZE = 1 << 20


def _name(role: str) -> str:
    return f"kvwire-test-{role}-{uuid.uuid4().hex[:6]}"


class Pair:
    """An initiator ``a`` and a target ``b`` with one registered buffer each."""

    def __init__(self, **options: object) -> None:
        self.a = NixlTransport(_name("a"), **options)
        self.b = NixlTransport(_name("b"), **options)
        self.dst = np.zeros(SIZE, dtype=np.uint8)
        self.src = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8)
        self.reg_a = self.a.register([self.dst])
        self.reg_b = self.b.register([self.src])
        self.peer_b = self.a.add_peer(self.b.local_metadata())
        self.peer_a = self.b.add_peer(self.a.local_metadata())

    def descs(self, array: np.ndarray, offsets: list[int], lengths: list[int]) -> np.ndarray:
        out = np.zeros((len(offsets), 3), dtype=np.int64)
        out[:, 0] = int(array.ctypes.data) + np.asarray(offsets)
        out[:, 1] = lengths
        return out

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def _notifications(agent: Transport, count: int) -> list[tuple[str, bytes]]:
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + TIMEOUT
    while len(got) < count and time.monotonic() < deadline:
        got += agent.drain_notifications()
        agent.wait(0.01)
    return got


def _done(agent: Transport, handle: object) -> None:
    assert wait_for(agent, handle, TIMEOUT) is XferState.DONE
    agent.release(handle)


def test_names_and_metadata(pair: Pair) -> None:
    assert pair.peer_b == pair.b.name and pair.peer_a == pair.a.name
    assert isinstance(pair.a, Transport)
    assert pair.a.peers == frozenset({pair.b.name})
    assert pair.a.capabilities.mem_kinds >= {MemKind.DRAM}


def test_read_and_write_move_exact_bytes_and_merge_adjacent_spans(pair: Pair) -> None:
    # rows 0-2 are adjacent on both sides (merged into one NIXL descriptor), row 3 is not
    offsets_l, offsets_r, lengths = [0, 100, 300, 5000], [7, 107, 307, 9000], [100, 200, 50, 999]
    local = pair.descs(pair.dst, offsets_l, lengths)
    remote = pair.descs(pair.src, offsets_r, lengths)
    _done(pair.a, pair.a.read(pair.peer_b, local, remote))
    for lo, ro, n in zip(offsets_l, offsets_r, lengths, strict=True):
        assert np.array_equal(pair.dst[lo : lo + n], pair.src[ro : ro + n])
    pair.dst[:] = 42
    _done(pair.a, pair.a.write(pair.peer_b, local[3:], pair.descs(pair.src, [0], [999])))
    assert np.all(pair.src[:999] == 42)


def test_reused_requests_never_replay_an_old_notification(pair: Pair) -> None:
    """NIXL keeps a request's last message when re-posted without one: kvwire must not
    hand a request that carried a notification to a transfer that has none."""
    local = pair.descs(pair.dst, [0], [4096])
    remote = pair.descs(pair.src, [0], [4096])
    sequence: list[bytes | None] = [b"one", None, b"two", None, b"", b"three", None]
    for message in sequence:
        _done(pair.a, pair.a.read(pair.peer_b, local, remote, message))
    marker = b"marker-" + uuid.uuid4().bytes
    pair.a.notify(pair.peer_b, marker)
    got = _notifications(pair.b, 5)
    assert [m for _, m in got] == [b"one", b"two", b"", b"three", marker]
    assert {peer for peer, _ in got} == {pair.a.name}
    stats = pair.a.stats()
    assert stats["requests_reused"] >= 3, stats  # the same descriptors re-posted


def test_unknown_memory_keeps_nixl_status(pair: Pair) -> None:
    stray = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(DescriptorError) as info:
        pair.a.read(pair.peer_b, pair.descs(stray, [0], [64]), pair.descs(pair.src, [0], [64]))
    assert info.value.status == "NIXL_ERR_NOT_FOUND"
    with pytest.raises(UnknownPeerError):
        pair.a.read("nobody", pair.descs(pair.dst, [0], [64]), pair.descs(pair.src, [0], [64]))
    with pytest.raises(UnknownPeerError):
        pair.a.notify("nobody", b"x")


def test_notifications_must_be_bytes_like(pair: Pair) -> None:
    local = pair.descs(pair.dst, [0], [64])
    remote = pair.descs(pair.src, [0], [64])
    bad: list[Any] = ["text", 5]
    for message in bad:
        with pytest.raises(TransportError, match="must be bytes"):
            pair.a.notify(pair.peer_b, message)
        with pytest.raises(TransportError, match="must be bytes"):
            pair.a.read(pair.peer_b, local, remote, message)
    pair.a.notify(pair.peer_b, memoryview(b"ok"))
    assert [m for _, m in _notifications(pair.b, 1)] == [b"ok"]


def test_bad_peer_metadata(pair: Pair) -> None:
    with pytest.raises(PeerMetadataError) as info:
        pair.a.add_peer(b"not nixl metadata")
    assert info.value.status == "NIXL_ERR_MISMATCH"
    with pytest.raises(PeerMetadataError):
        pair.a.add_peer(b"")


def test_metadata_covers_later_registrations(pair: Pair) -> None:
    late = np.arange(8192, dtype=np.uint8)
    reg = pair.b.register([Region(int(late.ctypes.data), late.nbytes)])
    pair.a.add_peer(pair.b.local_metadata())  # refresh: the blob now has the new region
    _done(
        pair.a,
        pair.a.read(pair.peer_b, pair.descs(pair.dst, [0], [8192]), pair.descs(late, [0], [8192])),
    )
    assert np.array_equal(pair.dst[:8192], late)
    pair.b.deregister(reg)
    with pytest.raises(RegistrationError):
        pair.b.deregister(reg)


def test_deregistered_memory_drops_kept_requests(pair: Pair) -> None:
    extra = np.zeros(4096, dtype=np.uint8)
    reg = pair.a.register([extra])
    local = pair.descs(extra, [0], [4096])
    remote = pair.descs(pair.src, [0], [4096])
    _done(pair.a, pair.a.read(pair.peer_b, local, remote))
    assert pair.a.stats()["requests_kept"] == 1
    pair.a.deregister(reg)
    assert pair.a.stats()["requests_kept"] == 0
    with pytest.raises(DescriptorError):
        pair.a.read(pair.peer_b, local, remote)


def test_release_twice_and_foreign_handles(pair: Pair) -> None:
    handle = pair.a.read(
        pair.peer_b, pair.descs(pair.dst, [0], [64]), pair.descs(pair.src, [0], [64])
    )
    _done(pair.a, handle)
    with pytest.raises(TransportError):
        pair.a.release(handle)
    with pytest.raises(TransportError):
        pair.b.poll(object())


def test_a_released_handle_stays_dead_when_its_request_is_posted_again(pair: Pair) -> None:
    """Re-posting a kept request makes a new handle: the old one must not see it."""
    local = pair.descs(pair.dst, [0], [4096])
    remote = pair.descs(pair.src, [0], [4096])
    first = pair.a.read(pair.peer_b, local, remote)
    _done(pair.a, first)
    second = pair.a.read(pair.peer_b, local.copy(), remote.copy())  # same bytes: re-posted
    assert second is not first
    assert pair.a.stats()["requests_reused"] == 1
    with pytest.raises(TransportError):
        pair.a.poll(first)
    with pytest.raises(TransportError):
        pair.a.release(first)
    assert wait_for(pair.a, second, TIMEOUT) is XferState.DONE  # untouched by the old one
    pair.a.release(second)
    assert pair.a.stats()["requests_kept"] == 1


def test_the_reuse_path_rejects_what_the_validating_path_rejects(pair: Pair) -> None:
    """A kept request skips validation and the peer check only for inputs that would pass
    them: the same bytes in another shape, or a peer removed since, still fail."""
    local = pair.descs(pair.dst, [0, 8192], [64, 64])
    remote = pair.descs(pair.src, [0, 8192], [64, 64])
    _done(pair.a, pair.a.read(pair.peer_b, local, remote))
    with pytest.raises(DescriptorError):
        pair.a.read(pair.peer_b, local.reshape(1, 6), remote.reshape(1, 6))
    with pytest.raises(DescriptorError):
        pair.a.read(pair.peer_b, local, remote[:1])
    pair.a.remove_peer(pair.peer_b)
    assert pair.a.stats()["requests_kept"] == 0
    with pytest.raises(UnknownPeerError):
        pair.a.read(pair.peer_b, local, remote)


def test_close_frees_requests_that_handles_still_hold(pair: Pair) -> None:
    held = pair.a.read(
        pair.peer_b, pair.descs(pair.dst, [0], [64]), pair.descs(pair.src, [0], [64])
    )
    kept = pair.a.read(
        pair.peer_b, pair.descs(pair.dst, [128], [64]), pair.descs(pair.src, [128], [64])
    )
    _done(pair.a, kept)
    assert wait_for(pair.a, held, TIMEOUT) is XferState.DONE  # never released
    assert pair.a.stats()["requests_live"] == 2
    pair.a.close()
    assert pair.a.stats()["requests_live"] == 0
    with pytest.raises(TransportClosedError):
        pair.a.poll(held)
    with pytest.raises(TransportClosedError):
        pair.a.release(held)


def test_release_of_a_running_transfer_aborts_cleanly(pair: Pair) -> None:
    big_src = np.ones(64 << 20, dtype=np.uint8)
    big_dst = np.zeros(64 << 20, dtype=np.uint8)
    pair.b.register([big_src])
    pair.a.register([big_dst])
    pair.a.add_peer(pair.b.local_metadata())
    offsets = list(range(0, 64 << 20, 64 << 10))
    handle = pair.a.write(
        pair.peer_b,
        pair.descs(big_dst, offsets, [64 << 10] * len(offsets)),
        pair.descs(big_src, offsets, [64 << 10] * len(offsets)),
        b"aborted?",
    )
    pair.a.release(handle)
    _done(
        pair.a,
        pair.a.read(pair.peer_b, pair.descs(pair.dst, [0], [64]), pair.descs(pair.src, [0], [64])),
    )


def test_empty_transfer_and_empty_notification(pair: Pair) -> None:
    empty = np.zeros((0, 3), dtype=np.int64)
    handle = pair.a.read(pair.peer_b, empty, empty, b"nothing moved")
    assert pair.a.poll(handle) is XferState.DONE
    pair.a.release(handle)
    assert [m for _, m in _notifications(pair.b, 1)] == [b"nothing moved"]


def test_telemetry_reports_the_bytes() -> None:
    p = Pair(telemetry=True)
    try:
        handle = p.a.read(
            p.peer_b, p.descs(p.dst, [0, 8192], [4096, 100]), p.descs(p.src, [0, 9000], [4096, 100])
        )
        assert wait_for(p.a, handle, TIMEOUT) is XferState.DONE
        record = p.a.telemetry(handle)
        p.a.release(handle)
        assert record is not None and record["bytes"] == 4196 and record["descriptors"] == 2
    finally:
        p.close()


@pytest.mark.parametrize("progress", ["inline", "nixl"])
def test_other_progress_modes_move_data_and_notify(progress: str) -> None:
    p = Pair(progress=progress)
    try:
        _done(
            p.a, p.a.read(p.peer_b, p.descs(p.dst, [0], [4096]), p.descs(p.src, [0], [4096]), b"m")
        )
        assert np.array_equal(p.dst[:4096], p.src[:4096])
        assert [m for _, m in _notifications(p.b, 1)] == [b"m"]
        assert "progress_rounds" not in p.a.stats()
    finally:
        p.close()


def test_backend_selection() -> None:
    with pytest.raises(TransportUnavailableError, match="no plugin 'NO_SUCH_PLUGIN'"):
        NixlTransport(_name("x"), backend="NO_SUCH_PLUGIN")
    posix = NixlTransport(_name("posix"), backend="POSIX")
    try:
        assert posix.backend == "POSIX"
        assert posix.capabilities.cross_host is False
    finally:
        posix.close()


def test_closed_agent_refuses_work_and_stops_its_thread() -> None:
    agent = NixlTransport(_name("closing"))
    thread_name = f"kvwire-nixl-progress-{agent.name}"
    import threading

    assert any(t.name == thread_name for t in threading.enumerate())
    agent.close()
    agent.close()
    assert not any(t.name == thread_name for t in threading.enumerate())
    with pytest.raises(TransportClosedError):
        agent.local_metadata()
    with pytest.raises(TransportClosedError):
        agent.register([np.zeros(16, dtype=np.uint8)])
