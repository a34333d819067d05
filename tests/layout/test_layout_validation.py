"""Handshake geometry checks: every invalid pair is refused with region, expected and actual."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest

from kvwire.errors import ConfigError, IncompatiblePeerError, KVWireError
from kvwire.layout import PeerLayout
from kvwire.layout.alignment import PeerPolicy, validate_peer
from kvwire.layout.geometry import BlockRegion, KVGeometry, RegionKind, RemoteGeometry

CONTENT = 256  # bytes per head per token (K and V of head_dim 64, bf16)


def geometry(
    *,
    tp_rank: int = 0,
    tp: int = 1,
    heads: int = 8,
    block: int = 16,
    ppl: int = 1,
    layout: str = "HND",
    layers: int = 2,
    mla: bool = False,
    members: bool = False,
    ssm: bool = False,
    dcp: int = 1,
) -> KVGeometry:
    per_rank = 1 if mla else max(1, heads // tp)
    kernel = block // ppl
    block_len = per_rank * kernel * CONTENT
    regions = [
        BlockRegion(
            base_addr=(1 + layer) << 30,
            block_len=block_len,
            num_blocks=64,
            name=f"layers.{layer}",
            members=(f"layers.{layer}",) if members else (),
        )
        for layer in range(layers)
    ]
    if ssm:
        regions.append(
            BlockRegion(
                base_addr=1 << 40, block_len=4096, num_blocks=16, name="ssm.0", kind=RegionKind.SSM
            )
        )
    return KVGeometry(
        regions,
        kv_cache_layout=layout,
        block_size=block,
        physical_blocks_per_logical=ppl,
        total_kv_heads=1 if mla else heads,
        tp_rank=tp_rank,
        tp_size=tp,
        is_mla=mla,
        ssm_sizes=(1024, 3072) if ssm else (0, 0),
        dcp_size=dcp,
    )


def remote_of(
    local: KVGeometry, *, tp_rank: int | None = None, tp: int | None = None, **changes: Any
) -> RemoteGeometry:
    fields = dict(local.agent_metadata_fields(), engine_id="peer", agent_metadata=b"")
    fields.update(changes)
    return RemoteGeometry.from_agent_metadata(
        SimpleNamespace(**fields),
        tp_rank=local.tp_rank if tp_rank is None else tp_rank,
        tp_size=local.tp_size if tp is None else tp,
    )


def refused(local: KVGeometry, remote: RemoteGeometry, *parts: str, **kwargs: Any) -> str:
    with pytest.raises(IncompatiblePeerError) as info:
        validate_peer(local, remote, **kwargs)
    message = str(info.value)
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"
    assert "\n" not in message
    return message


def test_compatible_pairs_pass() -> None:
    local = geometry(tp=4, tp_rank=1)
    pairs = validate_peer(local, remote_of(geometry(tp=2), tp_rank=0, tp=2))
    assert len(pairs) == 2
    assert [p.local.label for p in pairs] == ["0 (layers.0)", "1 (layers.1)"]


def test_block_len_mismatch_names_region_expected_and_actual() -> None:
    local = geometry()
    peer = remote_of(local, block_lens=[16 * 8 * CONTENT, 12345])
    refused(
        local, peer, "region 1 (layers.1)", "block_len", f"expected {16 * 8 * CONTENT}", "got 12345"
    )


def test_split_block_len_follows_heads_not_tp_ratio() -> None:
    # 2 KV heads, producer TP 4: each producer rank holds 1 head (GQA cap), not 2/4.
    local = geometry(tp=1, heads=2)
    good = remote_of(geometry(tp=4, tp_rank=0, heads=2), tp_rank=0, tp=4)
    validate_peer(local, good)
    wrong = remote_of(geometry(tp=4, tp_rank=0, heads=2), tp_rank=0, tp=4, block_lens=[2048, 4096])
    refused(local, wrong, "region 0 (layers.0)", "expected 4096", "got 2048", "1 heads x 16 tokens")


def test_replicated_block_len_must_match_up_to_block_size() -> None:
    local = geometry(mla=True, tp=2)
    peer = remote_of(geometry(mla=True, tp=4), tp=4, block_lens=[16 * CONTENT // 2] * 2)
    refused(
        local, peer, "region 0 (layers.0)", f"expected {16 * CONTENT}", f"got {16 * CONTENT // 2}"
    )


def test_region_count_mismatch() -> None:
    local = geometry(layers=3)
    peer = remote_of(geometry(layers=2))
    refused(local, peer, "region count", "expected 3", "got 2")


def test_region_name_mismatch() -> None:
    local = geometry()
    peer = remote_of(local, region_names=["layers.0", "layers.7"])
    refused(local, peer, "region 1 name", "expected 'layers.1'", "got 'layers.7'")


def test_vllm_layout_names_are_accepted_and_sent() -> None:
    """vLLM 0.31-0.33 send their KVCacheLayout enum names; kvwire once knew only HND/NHD
    and refused every non-MLA vLLM peer."""
    local = geometry()
    assert local.agent_metadata_fields()["kv_cache_layout"] == "LBHNC"
    for name in ("LBHNC", "BLHNC"):
        assert validate_peer(local, remote_of(local, kv_cache_layout=name), mode="pull")


def test_unknown_and_unsupported_layouts_are_refused_by_name() -> None:
    local = geometry()
    refused(local, remote_of(local, kv_cache_layout="XYZ"), "kv_cache_layout", "LBHNC", "'XYZ'")
    refused(
        local, remote_of(local, kv_cache_layout="LHBNC"), "kv_cache_layout",
        "LHBNC (heads outside blocks",
    )  # fmt: skip


def test_vllm_strict_refuses_a_layout_name_that_differs() -> None:
    local = geometry()
    peer = remote_of(local, kv_cache_layout="LBNHC")
    refused(local, peer, "kv_cache_layout", "LBHNC", "LBNHC", policy=PeerPolicy(vllm_strict=True))


def test_kernel_block_sizes_must_divide() -> None:
    local = geometry(block=16)
    peer = remote_of(geometry(block=12), block_lens=[12 * 8 * CONTENT] * 2)
    refused(local, peer, "kernel block size", "a divisor or multiple of 16", "got 12")


def test_tp_sizes_must_divide() -> None:
    local = geometry(tp=4)
    refused(local, remote_of(local, tp=3, tp_rank=0), "tp_size", "of 4", "got 3")


def test_tp_rank_outside_size() -> None:
    local = geometry(tp=2)
    refused(local, remote_of(local, tp=2, tp_rank=2), "tp_rank", "[0, 2)", "got 2")


def test_dcp_must_match() -> None:
    local = geometry()
    refused(local, remote_of(local, dcp_size=2), "dcp_size", "expected 1", "got 2")


def test_stride_shorter_than_block() -> None:
    local = geometry()
    lens = local.agent_metadata_fields()["block_lens"]
    peer = remote_of(local, block_strides=[lens[0], lens[1] - 1])
    refused(
        local,
        peer,
        "remote region 1 (layers.1) block_stride",
        f">= {lens[1]}",
        f"got {lens[1] - 1}",
    )


def test_bad_memory_type() -> None:
    local = geometry()
    refused(
        local,
        remote_of(local, region_mem_types=["VRAM", "HBM"]),
        "region 1",
        "VRAM or DRAM",
        "'HBM'",
    )


def test_metadata_lists_of_wrong_length() -> None:
    local = geometry()
    with pytest.raises(
        IncompatiblePeerError, match=r"remote block_strides: expected 2 entries.*got 1"
    ):
        remote_of(local, block_strides=[4096])
    with pytest.raises(
        IncompatiblePeerError, match=r"remote region_num_blocks: expected 2 .*got 3"
    ):
        remote_of(local, region_num_blocks=[1, 2, 3])
    with pytest.raises(IncompatiblePeerError, match="at least one"):
        remote_of(local, kv_caches_base_addr=[], block_lens=[], block_strides=[])


def test_every_problem_is_reported_at_once() -> None:
    local = geometry()
    peer = remote_of(local, dcp_size=2, block_lens=[1, 2])
    message = refused(local, peer, "dcp_size", "region 0 (layers.0)", "region 1 (layers.1)")
    assert message.count(";") == 2


# -- layer names and packed members --------------------------------------------------------


def test_duplicate_remote_layer() -> None:
    local = geometry(members=True)
    peer = remote_of(local, region_members=[["layers.0"], ["layers.0"]])
    refused(local, peer, "remote layer 'layers.0'", "one region", "regions 0 and", "1")


def test_missing_remote_layer() -> None:
    local = geometry(members=True, layers=3)
    peer = remote_of(geometry(members=True, layers=2))
    refused(local, peer, "remote layers", "layers.2", "got none")


def test_pipeline_stage_may_hold_a_slice_of_the_layers() -> None:
    full = geometry(members=True, layers=4)
    stage = KVGeometry(
        [r for r in full.regions[2:]],
        block_size=16,
        total_kv_heads=8,
        pp_rank=1,
        pp_size=2,
    )
    remote = RemoteGeometry.from_agent_metadata(
        SimpleNamespace(**stage.agent_metadata_fields(), engine_id="p", agent_metadata=b""),
        pp_rank=1,
        pp_size=2,
    )
    pairs = validate_peer(full, remote)
    assert [(p.local.index, p.remote.index) for p in pairs] == [(2, 0), (3, 1)]


def packed_peer(
    local: KVGeometry, block_len: int, layouts: dict[str, tuple[int, int]]
) -> RemoteGeometry:
    """A peer with one row packing ``layers.0`` and ``layers.1`` at ``layouts``."""
    return remote_of(
        local,
        region_members=[["layers.0", "layers.1"]],
        kv_caches_base_addr=[1 << 30],
        block_lens=[block_len],
        block_strides=[block_len],
        region_num_blocks=[64],
        region_group_ids=[0],
        region_names=["row"],
        region_mem_types=["VRAM"],
        packed_member_layouts=layouts,
    )


def test_packed_member_escaping_its_block() -> None:
    local = geometry(members=True, mla=True)
    page = 16 * CONTENT
    with pytest.raises(IncompatiblePeerError, match=r"packed.*layers.1"):
        packed_peer(local, 2 * page, {"layers.0": (0, page), "layers.1": (page + 8, page)})


def test_packed_member_page_must_match_local_page() -> None:
    local = geometry(members=True, mla=True)
    page = 16 * CONTENT
    peer = packed_peer(local, 3 * page, {"layers.0": (0, page), "layers.1": (page, 2 * page)})
    refused(
        local,
        peer,
        "region 1 (layers.1) <-> remote 0 (row)[layers.1]",
        f"expected {page}",
        f"got {2 * page}",
    )


def test_packed_members_unlisted() -> None:
    local = geometry(members=True)
    with pytest.raises(IncompatiblePeerError, match="unlisted"):
        remote_of(local, packed_member_layouts={"layers.9": (0, 16)})


# -- SSM ------------------------------------------------------------------------------------


def test_ssm_needs_equal_tp_and_sizes() -> None:
    local = geometry(ssm=True, tp=2)
    refused(
        local, remote_of(geometry(ssm=True, tp=1), tp=1), "tp_size", "expected 2", "got 1", "SSM"
    )
    refused(
        local, remote_of(local, ssm_sizes=(1024, 1024)), "ssm_sizes", "(1024, 3072)", "(1024, 1024)"
    )
    fields = local.agent_metadata_fields()
    lens = [*fields["block_lens"][:-1], 2048]
    refused(
        local, remote_of(local, block_lens=lens), "region 2 (ssm.0)", "expected 4096", "got 2048"
    )


# -- vLLM's stricter rules --------------------------------------------------------------------

STRICT = PeerPolicy(vllm_strict=True)


def test_strict_rejects_mixed_layouts() -> None:
    local = geometry(layout="HND")
    peer = remote_of(geometry(layout="NHD"))
    validate_peer(local, peer)  # kvwire moves it
    refused(local, peer, "kv_cache_layout", "expected LBHNC", "got LBNHC", policy=STRICT)


def test_strict_rejects_head_slicing_of_nhd() -> None:
    local = geometry(layout="NHD", tp=2)
    peer = remote_of(geometry(layout="NHD", tp=1), tp=1, tp_rank=0)
    validate_peer(local, peer)
    refused(
        local,
        peer,
        "kv_cache_layout",
        "heads before tokens for heterogeneous TP",
        "got LBNHC",
        policy=STRICT,
    )


def test_strict_rejects_producer_blocks_larger_than_consumer_blocks() -> None:
    local = geometry(block=16)  # pull: local is the consumer
    peer = remote_of(geometry(block=32))
    validate_peer(local, peer)
    refused(local, peer, "kernel block size", "producer <= consumer 16", "got 32", policy=STRICT)
    # In push the local side produces: 16 into 32 is fine, 32 into 16 is not.
    validate_peer(local, peer, mode="push", policy=STRICT)


def test_strict_rejects_block_ratio_when_producer_tp_is_larger() -> None:
    local = geometry(block=16, tp=1)
    peer = remote_of(geometry(block=8, tp=2), tp=2, tp_rank=0)
    refused(local, peer, "kernel block size", "producer TP 2 > consumer TP 1", policy=STRICT)


# -- local configuration and request errors ---------------------------------------------------


def test_local_geometry_errors_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="multiple of physical_blocks_per_logical"):
        geometry(block=16, ppl=3)
    with pytest.raises(ConfigError, match="tp_rank 2 is outside tp_size 2"):
        geometry(tp=2, tp_rank=2)
    with pytest.raises(ConfigError, match="divide one another"):
        geometry(tp=3, heads=8)
    with pytest.raises(ConfigError, match="block_stride 10 < block_len 20"):
        BlockRegion(0, 20, 4, block_stride=10)
    with pytest.raises(ConfigError, match="not a multiple of heads x kernel tokens"):
        KVGeometry([BlockRegion(0, 1000, 4)], total_kv_heads=8, block_size=16)


def test_block_ids_outside_a_region_are_protocol_errors() -> None:
    local = geometry()
    layout = PeerLayout(local, remote_of(local))
    with pytest.raises(
        KVWireError, match=re.escape("remote block ids for region 0 (layers.0)")
    ) as info:
        layout.plan([[1]], [[64]])
    assert type(info.value).__name__ == "RemoteProtocolError"
    with pytest.raises(KVWireError, match="local block ids") as info:
        layout.plan([[-1]], [[3]])
    assert type(info.value).__name__ == "LocalProtocolError"
    with pytest.raises(KVWireError, match="group 1"):
        _missing_group()


def _missing_group() -> None:
    local = KVGeometry(
        [BlockRegion(0, 16 * 8 * CONTENT, 8, group_id=1, name="g1")],
        total_kv_heads=8,
        block_size=16,
    )
    PeerLayout(local, remote_of(local)).plan([[1]], [[3]])


def row_geometry(*, tp: int, block: int = 16, packed: bool = True) -> KVGeometry:
    """Two layers' pages in one block row (how vLLM registers BLNHC), naming the pages or not."""
    page = max(1, 8 // tp) * block * CONTENT
    pages = {"layers.0": (0, page), "layers.1": (page, page)} if packed else {}
    row = BlockRegion(
        base_addr=1 << 30, block_len=2 * page, num_blocks=64, name="layers.0",
        members=tuple(pages), packed_members=pages,
    )  # fmt: skip
    return KVGeometry(
        [row], kv_cache_layout="BLNHC", block_size=block, total_kv_heads=8, tp_size=tp
    )


def test_whole_rows_against_bare_rows_need_equal_shards() -> None:
    """A row is every layer's page in turn: sliced by heads or tokens it would mix layers,
    and the sizes alone cannot tell (a row scales like a page)."""
    local = row_geometry(tp=1)
    assert len(validate_peer(local, remote_of(row_geometry(tp=1, packed=False)))) == 1
    for peer, got in ((row_geometry(tp=2, packed=False), "4 x 16"),
                      (row_geometry(tp=1, block=32, packed=False), "8 x 32")):  # fmt: skip
        refused(local, remote_of(peer, tp=peer.tp_size), "whole block rows of 2 layers", got)


def test_rows_that_name_their_pages_pair_layer_by_layer() -> None:
    local = row_geometry(tp=1)
    pairs = validate_peer(local, remote_of(row_geometry(tp=2), tp=2))
    assert [p.local.label for p in pairs] == ["0 (layers.0)[layers.0]", "0 (layers.0)[layers.1]"]
    assert [p.remote.block_len for p in pairs] == [4 * 16 * CONTENT] * 2
