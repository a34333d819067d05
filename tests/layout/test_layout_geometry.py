"""Geometry <-> AgentMetadata, block id helpers and SSM state pages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire import wire
from kvwire.errors import IncompatiblePeerError
from kvwire.layout import (
    PeerLayout,
    coalesce,
    descriptor_ids,
    expand_to_kernel_blocks,
    plan_read,
    plan_write,
)
from kvwire.layout.geometry import BlockRegion, KVGeometry, RegionKind, RemoteGeometry

VECTORS = Path("/work/shared/vectors")


def sample_geometry() -> KVGeometry:
    return KVGeometry(
        [
            BlockRegion(1 << 30, 8192, 64, block_stride=16384, group_id=0, name="layers.0"),
            BlockRegion(
                1 << 31,
                4 * 8192,
                64,
                group_id=1,
                mem_kind="DRAM",
                name="row",
                members=("layers.1", "layers.2"),
                packed_members={"layers.1": (0, 8192), "layers.2": (8192, 8192)},
                device_id=0,
            ),
        ],
        kv_cache_layout="NHD",
        block_size=32,
        physical_blocks_per_logical=2,
        total_kv_heads=8,
        tp_rank=1,
        tp_size=4,
        dcp_size=1,
        device_id=3,
        attn_backend_name="FLASH_ATTN",
    )


def test_agent_metadata_fields_are_exactly_the_v13_geometry_fields() -> None:
    fields = sample_geometry().agent_metadata_fields()
    schema = [
        f
        for f in wire.AgentMetadataV13.__struct_fields__
        if f not in ("engine_id", "agent_metadata")
    ]
    assert list(fields) == schema
    assert fields["block_size"] == 16  # the kernel block size, as vLLM advertises it
    assert fields["physical_blocks_per_logical_kv_block"] == 2
    assert fields["region_mem_types"] == ["VRAM", "DRAM"]
    assert fields["packed_member_layouts"] == {"layers.1": (0, 8192), "layers.2": (8192, 8192)}


def test_round_trip_through_the_wire() -> None:
    geometry = sample_geometry()
    md = wire.AgentMetadataV13(
        engine_id="e", agent_metadata=b"blob", **geometry.agent_metadata_fields()
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(md), type=wire.AgentMetadataV13)
    remote = RemoteGeometry.from_agent_metadata(decoded, tp_rank=1, tp_size=4)
    assert remote == RemoteGeometry.from_local(geometry, engine_id="e")
    assert remote.block_size == 32
    assert remote.regions[1].packed_members["layers.2"] == (8192, 8192)
    assert remote.device_id == 3


def _vector_metadata() -> list[dict[str, Any]]:
    doc = json.loads((VECTORS / "vllm-0.31.0-nixl-v13.json").read_text())
    out = []
    for entry in doc["agent_metadata"]:
        fields = dict(entry["fields"])
        fields["agent_metadata"] = bytes.fromhex(fields["agent_metadata"]["hex"])
        out.append(fields)
    return out


@pytest.mark.skipif(not VECTORS.exists(), reason="shared vectors not present")
def test_vllm_metadata_reads_back_or_is_refused_cleanly() -> None:
    read = 0
    for fields in _vector_metadata():
        md = msgspec.convert(fields, wire.AgentMetadataV13)
        try:
            remote = RemoteGeometry.from_agent_metadata(md)
        except IncompatiblePeerError as exc:
            assert "expected" in str(exc) and "got" in str(exc)
            continue
        read += 1
        assert [r.base_addr for r in remote.regions] == list(md.kv_caches_base_addr)
        assert remote.kernel_block_size == md.block_size
    assert read >= 1


def test_expand_to_kernel_blocks() -> None:
    assert expand_to_kernel_blocks([3, 7], 1).tolist() == [3, 7]
    assert expand_to_kernel_blocks([3, 7], 2).tolist() == [6, 7, 14, 15]
    assert expand_to_kernel_blocks(np.array([], dtype=np.int64), 4).tolist() == []


def test_descriptor_ids_are_region_major_with_per_region_capacity() -> None:
    assert descriptor_ids([[1, 2]], [10, 10]).tolist() == [1, 2, 11, 12]
    ids = descriptor_ids([[1], [5]], [10, 20, 30], region_group_ids=[0, 1, -1])
    assert ids.tolist() == [1, 15, 31, 35]
    # Regions all of one group take that group's ids, not every group's.
    assert descriptor_ids([[1], [5]], [10, 20], region_group_ids=[1, 1]).tolist() == [5, 15]


def test_coalesce_needs_both_sides_contiguous() -> None:
    local = np.array([[0, 4, 0], [4, 4, 0], [8, 4, 0], [100, 4, 0]], dtype=np.int64)
    remote = np.array([[50, 4, 1], [54, 4, 1], [60, 4, 1], [64, 4, 1]], dtype=np.int64)
    merged_local, merged_remote = coalesce(local, remote)
    assert merged_local.tolist() == [[0, 8, 0], [8, 4, 0], [100, 4, 0]]
    assert merged_remote.tolist() == [[50, 8, 1], [60, 4, 1], [64, 4, 1]]


def _ssm_geometry(base: int, device: int) -> KVGeometry:
    return KVGeometry(
        [
            BlockRegion(base, 16 * 4 * 64, 32, name="attn.0", group_id=0),
            BlockRegion(base + (1 << 20), 4096, 8, name="ssm.0", group_id=1, kind=RegionKind.SSM),
        ],
        block_size=16,
        total_kv_heads=4,
        ssm_sizes=(1024, 3072),
        device_id=device,
    )


def test_ssm_pages_follow_attention_and_pair_from_the_producer_tail() -> None:
    consumer = _ssm_geometry(1 << 40, 0)
    producer = _ssm_geometry(1 << 44, 1)
    plan = plan_read(
        consumer,
        RemoteGeometry.from_local(producer),
        [[4, 5], [2]],
        [[7, 8, 9], [3, 6]],
        coalesce=False,
    )
    # Attention: the consumer holds the last 2 of 3 blocks; SSM: the producer's last state.
    attn = 16 * 4 * 64
    assert plan.local_descs[:, 0].tolist() == [
        (1 << 40) + 4 * attn,
        (1 << 40) + 5 * attn,
        (1 << 40) + (1 << 20) + 2 * 4096,
    ]
    assert plan.remote_descs[:, 0].tolist() == [
        (1 << 44) + 8 * attn,
        (1 << 44) + 9 * attn,
        (1 << 44) + (1 << 20) + 6 * 4096,
    ]
    assert plan.local_descs[:, 1].tolist() == [attn, attn, 4096]
    push = plan_write(
        producer,
        RemoteGeometry.from_local(consumer),
        [[7, 8, 9], [3, 6]],
        [[4, 5], [2]],
        coalesce=False,
    )
    np.testing.assert_array_equal(push.local_descs, plan.remote_descs)


def test_a_request_with_nothing_to_move_is_empty() -> None:
    geometry = _ssm_geometry(1 << 40, 0)
    layout = PeerLayout(geometry, RemoteGeometry.from_local(geometry))
    plan = layout.plan([[], []], [[1, 2], [3]])
    assert plan.is_empty and plan.num_bytes == 0
    assert layout.plan([], [[1, 2], [3]]).is_empty  # vLLM's full prefix hit
    assert plan.local_descs.shape == (0, 3) and plan.local_descs.dtype == np.int64


def test_state_regions_of_one_page_size_share_a_cluster_and_keep_region_order() -> None:
    def hybrid(base: int, device: int) -> KVGeometry:
        return KVGeometry(
            [
                BlockRegion(
                    base + (1 << 20), 4096, 8, name="ssm.0", group_id=1, kind=RegionKind.SSM
                ),
                BlockRegion(base, 16 * 4 * 64, 32, name="attn.0", group_id=0),
                BlockRegion(
                    base + (2 << 20), 4096, 8, name="ssm.1", group_id=1, kind=RegionKind.SSM
                ),
            ],
            block_size=16,
            total_kv_heads=4,
            ssm_sizes=(1024, 3072),
            device_id=device,
        )

    layout = PeerLayout(hybrid(1 << 40, 0), RemoteGeometry.from_local(hybrid(1 << 44, 1)))
    assert len(layout._clusters(1)[0]) == 2  # attention, and both state regions together
    plan = layout.plan([[4], [2]], [[7], [6]], coalesce=False)
    # Attention regions first, then state regions in their own order.
    assert plan.local_descs[:, 0].tolist() == [
        (1 << 40) + 4 * 16 * 4 * 64,
        (1 << 40) + (1 << 20) + 2 * 4096,
        (1 << 40) + (2 << 20) + 2 * 4096,
    ]
    assert plan.remote_descs[:, 0].tolist() == [
        (1 << 44) + 7 * 16 * 4 * 64,
        (1 << 44) + (1 << 20) + 6 * 4096,
        (1 << 44) + (2 << 20) + 6 * 4096,
    ]


def test_rows_stay_region_major_when_kv_cache_groups_alternate_by_layer() -> None:
    block_len = 16 * 4 * 64

    def alternating(base: int, device: int) -> KVGeometry:
        regions = [
            BlockRegion(base + i * (1 << 20), block_len, 8, name=f"l{i}", group_id=i % 2)
            for i in range(4)
        ]
        return KVGeometry(regions, block_size=16, total_kv_heads=4, device_id=device)

    layout = PeerLayout(alternating(1 << 40, 0), RemoteGeometry.from_local(alternating(1 << 44, 1)))
    plan = layout.plan([[1, 2], [5]], [[3, 4], [6]], coalesce=False)
    assert plan.local_descs[:, 0].tolist() == [
        (1 << 40) + 1 * block_len,
        (1 << 40) + 2 * block_len,
        (1 << 40) + (1 << 20) + 5 * block_len,
        (1 << 40) + (2 << 20) + 1 * block_len,
        (1 << 40) + (2 << 20) + 2 * block_len,
        (1 << 40) + (3 << 20) + 5 * block_len,
    ]
    assert plan.remote_descs[:, 0].tolist() == [
        (1 << 44) + 3 * block_len,
        (1 << 44) + 4 * block_len,
        (1 << 44) + (1 << 20) + 6 * block_len,
        (1 << 44) + (2 << 20) + 3 * block_len,
        (1 << 44) + (2 << 20) + 4 * block_len,
        (1 << 44) + (3 << 20) + 6 * block_len,
    ]


def test_a_consumer_reads_one_producer_rank_only_where_no_page_is_a_ranks_own() -> None:
    """MLA pages are every rank's, so one producer rank serves a request; a TP-sharded
    state beside them (vLLM 0.31.0's Glm5Next: KDA states in its latents' slabs) is each
    rank's own, and then every producer rank holding a slice must be read."""
    slab = BlockRegion(1 << 30, 8192, 64, group_id=-1, name="slab")
    mla = KVGeometry([slab], block_size=16, is_mla=True)
    states = KVGeometry(
        [slab], block_size=16, is_mla=True, ssm_sizes=(1024, 4096),
        group_kinds=(RegionKind.ATTENTION, RegionKind.SSM),
    )  # fmt: skip
    heads = KVGeometry([slab], block_size=16, total_kv_heads=8)
    assert [g.replicated_whole for g in (mla, states, heads)] == [True, False, False]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    group_id=st.integers(-1, 3),
    groups=st.lists(st.integers(-2, 4), max_size=4),
)
def test_a_region_names_only_groups_it_can_hold(group_id: int, groups: list[int]) -> None:
    """``groups`` (a region's own, never advertised) are distinct ids and include the
    group it advertises; a shared region (-1) may name any; none names what ``group_id``
    says."""
    from kvwire.errors import ConfigError

    valid = not groups or (
        min(groups) >= 0 and len(set(groups)) == len(groups) and group_id in (-1, *groups)
    )
    if not valid:
        with pytest.raises(ConfigError, match="must be distinct group ids"):
            BlockRegion(1 << 30, 64, 4, group_id=group_id, groups=tuple(groups))
        return
    region = BlockRegion(1 << 30, 64, 4, group_id=group_id, groups=tuple(groups))
    geometry = KVGeometry([region], block_size=16, group_kinds=("attention",) * 5)
    named = groups or ([group_id] if group_id >= 0 else list(range(5)))
    assert [g for g in range(5) if geometry.holds(0, g)] == sorted(named)
