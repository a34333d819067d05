"""Prepared tables (``NixlTransport.prepare``): requests made from index arrays into lists
NIXL took once per peer, and never from lists checked against memory that has changed."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from kvwire_nixl import NixlTransport

from kvwire.errors import DescriptorError, UnknownPeerError, UnpreparedTablesError
from kvwire.transport import XferState, wait_for

BLOCK = 4096
BLOCKS = 64
TIMEOUT = 30.0


def _table(array: np.ndarray) -> np.ndarray:
    """Every block of a buffer, one row each: what a pairing's table lists."""
    out = np.zeros((BLOCKS, 3), dtype=np.int64)
    out[:, 0] = int(array.ctypes.data) + np.arange(BLOCKS) * BLOCK
    out[:, 1] = BLOCK
    return out


class Pair:
    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.a = NixlTransport(f"kvwire-test-prep-a-{tag}")
        self.b = NixlTransport(f"kvwire-test-prep-b-{tag}")
        self.dst = np.zeros(BLOCKS * BLOCK, dtype=np.uint8)
        self.src = np.random.default_rng(5).integers(0, 256, BLOCKS * BLOCK, dtype=np.uint8)
        self.reg_a = self.a.register([self.dst])
        self.reg_b = self.b.register([self.src])
        self.peer = self.a.add_peer(self.b.local_metadata())
        self.b.add_peer(self.a.local_metadata())

    def prepare(self) -> None:
        self.a.prepare(self.peer, _table(self.dst), _table(self.src))

    def read_rows(self, local: np.ndarray, remote: np.ndarray) -> None:
        """READ blocks by row index and check every byte landed."""
        self.dst[:] = 0
        handle = self.a.read_rows(self.peer, local, remote)
        assert wait_for(self.a, handle, TIMEOUT) is XferState.DONE
        self.a.release(handle)
        got = self.dst.reshape(BLOCKS, BLOCK)[local]
        assert np.array_equal(got, self.src.reshape(BLOCKS, BLOCK)[remote])

    def prepared(self) -> int:
        return self.a.stats()["requests_prepared"]


@pytest.fixture
def pair() -> Iterator[Pair]:
    made = Pair()
    try:
        yield made
    finally:  # the initiator first: its requests hold lists naming the target's memory
        for agent in (made.a, made.b):
            agent.close()


def _scattered(seed: int, n: int = 24) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.permutation(BLOCKS)[:n], rng.permutation(BLOCKS)[:n]


def test_rows_move_the_right_bytes_both_ways(pair: Pair) -> None:
    pair.prepare()
    assert pair.a.stats()["peers_prepared"] == 1
    for seed in range(3):
        pair.read_rows(*_scattered(seed))
    pair.dst[:] = 7
    local, remote = _scattered(9)
    handle = pair.a.write_rows(pair.peer, local, remote, b"written")
    assert wait_for(pair.a, handle, TIMEOUT) is XferState.DONE
    pair.a.release(handle)
    assert (pair.src.reshape(BLOCKS, BLOCK)[remote] == 7).all()
    assert pair.prepared() == 4
    got: list[tuple[str, bytes]] = []
    while not got:
        got = pair.b.drain_notifications()
        pair.b.wait(0.01)
    assert got == [(pair.a.name, b"written")]
    # Adjacent rows too (NIXL merges them inside the prepared path).
    pair.read_rows(np.arange(8, 16), np.arange(40, 48))


def test_a_refreshed_peer_drops_its_tables_before_any_request_uses_them(pair: Pair) -> None:
    """The peer re-registers the very same memory (new keys, same addresses) and sends a
    new blob: requests made from the old lists would name keys that no longer exist. None
    is made until the tables are prepared again."""
    pair.prepare()
    pair.read_rows(*_scattered(1))
    pair.b.deregister(pair.reg_b)
    pair.src[:] = np.random.default_rng(11).integers(0, 256, pair.src.size, dtype=np.uint8)
    pair.reg_b = pair.b.register([pair.src])
    assert pair.a.add_peer(pair.b.local_metadata()) == pair.peer
    assert pair.a.stats()["peers_prepared"] == 0
    with pytest.raises(UnpreparedTablesError):
        pair.a.read_rows(pair.peer, *_scattered(2))
    assert pair.prepared() == 1
    pair.prepare()
    pair.read_rows(*_scattered(3))  # the new keys: the new bytes
    assert pair.prepared() == 2


def test_a_local_registration_change_drops_the_tables(pair: Pair) -> None:
    pair.prepare()
    extra = np.zeros(BLOCK, dtype=np.uint8)
    reg = pair.a.register([extra])
    with pytest.raises(UnpreparedTablesError):
        pair.a.read_rows(pair.peer, *_scattered(4))
    pair.prepare()
    pair.a.deregister(reg)
    assert pair.a.stats()["peers_prepared"] == 0


def test_a_removed_peer_drops_its_tables_and_a_request_in_hand_keeps_its_lists(
    pair: Pair,
) -> None:
    pair.prepare()
    local, remote = _scattered(6)
    handle = pair.a.read_rows(pair.peer, local, remote)
    pair.a.remove_peer(pair.peer)  # the request still holds the lists it was made from
    assert pair.a.stats()["peers_prepared"] == 0
    wait_for(pair.a, handle, TIMEOUT)
    pair.a.release(handle)  # ... and gives them back now
    pair.peer = pair.a.add_peer(pair.b.local_metadata())
    pair.prepare()
    pair.read_rows(local, remote)
    assert pair.prepared() == 2


def test_bad_tables_and_rows_are_refused_by_name(pair: Pair) -> None:
    with pytest.raises(UnknownPeerError):
        pair.a.prepare("nobody", _table(pair.dst), _table(pair.src))
    outside = np.zeros(BLOCK, dtype=np.uint8)  # never registered on the peer
    with pytest.raises(DescriptorError, match="preparing"):
        pair.a.prepare(pair.peer, _table(pair.dst)[:1], _table(outside)[:1])
    with pytest.raises(DescriptorError):
        pair.a.prepare(pair.peer, np.zeros((2, 2), dtype=np.int64), _table(pair.src))
    assert pair.a.stats()["peers_prepared"] == 0
    with pytest.raises(UnpreparedTablesError):
        pair.a.read_rows(pair.peer, [0], [0])
    pair.prepare()
    for local, remote, match in (
        ([0, 1], [BLOCKS], r"remote rows must lie in \[0, 64\)"),
        ([-1], [0], "local rows must lie"),
        ([0.5], [0], "1-D integer"),
        ([[0]], [[0]], "1-D integer"),
        ([0, 1], [0], "2 local rows but 1 remote"),
    ):
        with pytest.raises(DescriptorError, match=match):
            pair.a.read_rows(pair.peer, local, remote)
    pair.read_rows(*_scattered(8))  # the agent serves on
