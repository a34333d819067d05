"""A geometry's ``ple_block_len`` (the TP-replicated state page of Qwen4Exp's per-layer
embeddings) crosses the wire as vLLM 0.32.0's metadata v14 carries it, and stays out of
v13's, which has no such field (a v13 peer moves no such page apart)."""

from __future__ import annotations

import pytest

from kvwire.errors import ConfigError
from kvwire.layout.geometry import SHARED_GROUP_ID, BlockRegion, KVGeometry, RegionKind
from kvwire.runtime import Producer
from kvwire.wire.handshake import decode_handshake

from .conftest import config, make_side


def rows(base: int, ple_block_len: int | None) -> KVGeometry:
    region = BlockRegion(
        base_addr=base, block_len=64, extent=256, block_stride=256, num_blocks=4,
        group_id=SHARED_GROUP_ID, mem_kind="DRAM", name="model.layers.0.ple",
    )  # fmt: skip
    return KVGeometry(
        [region], block_size=16, group_block_sizes=(16, 64),
        group_kinds=(RegionKind.ATTENTION, RegionKind.SSM), total_kv_heads=8,
        ple_block_len=ple_block_len,
    )  # fmt: skip


@pytest.mark.parametrize(("version", "advertised"), [(13, None), (14, 256)])
def test_ple_block_len_is_advertised_from_v14(version: int, advertised: int | None) -> None:
    side = make_side()
    producer = Producer(config(side, "prefill-ple", version=version), "shm")
    try:
        producer.register_kv_caches(rows(int(side.buffer.ctypes.data), 256))
        md = decode_handshake(producer.handshake_payload(), local_hash=None, version=version)
        assert getattr(md, "ple_block_len", None) == advertised
        assert list(md.block_lens) == [64]
    finally:
        producer.close()
        side.listener.close()


def test_a_ple_block_len_that_is_no_length_is_refused() -> None:
    with pytest.raises(ConfigError, match="ple_block_len must be positive, got 0"):
        rows(0, 0)


def test_a_peer_whose_replicated_state_differs_is_refused_by_name() -> None:
    from kvwire.errors import IncompatiblePeerError
    from kvwire.layout import PeerLayout
    from kvwire.layout.geometry import RemoteGeometry

    theirs = RemoteGeometry.from_local(rows(1 << 20, 192))
    assert theirs.ple_block_len == 192
    with pytest.raises(IncompatiblePeerError, match="ple_block_len: expected 256, got 192"):
        PeerLayout(rows(0, 256), theirs)
    PeerLayout(rows(0, 256), RemoteGeometry.from_local(rows(1 << 20, None)))  # v13: unsaid
