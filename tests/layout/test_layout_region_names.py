"""BlockRegion names matter where vLLM 0.31.0 uses them, and nowhere else.

vLLM's ``_validate_remote_agent_handshake`` requires a peer's ``region_names`` to equal its
own when it pairs regions by index and the peer advertises names; it skips the check when
the peer advertises none, and after aligning a pipeline stage by ``region_members`` it
rewrites the peer's names to its own. A pipeline stage facing a peer that registered every
layer slices the peer's regions to its window and compares the names there.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvwire.errors import IncompatiblePeerError
from kvwire.layout.alignment import PeerPolicy, validate_peer
from kvwire.layout.geometry import BlockRegion, KVGeometry, RemoteGeometry

BLOCK_LEN = 8 * 16 * 256  # 8 heads x 16 tokens x 256 bytes


def hf_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn"


def geometry(
    names: list[str],
    *,
    members: bool = False,
    first_layer: int = 0,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> KVGeometry:
    regions = [
        BlockRegion(
            base_addr=(1 + first_layer + i) << 30,
            block_len=BLOCK_LEN,
            num_blocks=64,
            name=name,
            members=(hf_name(first_layer + i),) if members else (),
        )
        for i, name in enumerate(names)
    ]
    return KVGeometry(regions, total_kv_heads=8, pp_rank=pp_rank, pp_size=pp_size)


def peer(geo: KVGeometry, **changes: Any) -> RemoteGeometry:
    fields = dict(geo.agent_metadata_fields(), engine_id="peer", agent_metadata=b"")
    fields.update(changes)
    return RemoteGeometry.from_agent_metadata(
        SimpleNamespace(**fields), pp_rank=geo.pp_rank, pp_size=geo.pp_size
    )


def index_pairs(local: KVGeometry, remote: RemoteGeometry, **kw: Any) -> list[tuple[int, int]]:
    return [(p.local.index, p.remote.index) for p in validate_peer(local, remote, **kw)]


def refused(local: KVGeometry, remote: RemoteGeometry, *parts: str, **kw: Any) -> None:
    with pytest.raises(IncompatiblePeerError) as info:
        validate_peer(local, remote, **kw)
    for part in parts:
        assert part in str(info.value), (part, str(info.value))


def test_differently_named_regions_are_refused_when_paired_by_index() -> None:
    # vLLM: assert nixl_agent_meta.region_names == self.region_names.
    local = geometry([hf_name(0), hf_name(1)])
    other = peer(geometry(["layer0", "layer1"]))
    refused(
        local,
        other,
        "region 0 name",
        f"expected {hf_name(0)!r}",
        "got 'layer0'",
        "region 1 name",
        "got 'layer1'",
    )
    refused(local, other, "region 0 name", policy=PeerPolicy(vllm_strict=True))


def test_a_peer_without_region_names_pairs_by_index_unchecked() -> None:
    local = geometry([hf_name(0), hf_name(1)])
    other = peer(geometry(["layer0", "layer1"]), region_names=None)
    assert index_pairs(local, other) == [(0, 0), (1, 1)]
    assert index_pairs(local, other, policy=PeerPolicy(vllm_strict=True)) == [(0, 0), (1, 1)]


def test_unnamed_regions_advertise_no_names_so_any_peer_pairs_them_by_index() -> None:
    unnamed = geometry(["", ""])
    assert unnamed.agent_metadata_fields()["region_names"] is None
    assert geometry([hf_name(0), ""]).agent_metadata_fields()["region_names"] is None
    named = geometry([hf_name(0), hf_name(1)])
    assert named.agent_metadata_fields()["region_names"] == [hf_name(0), hf_name(1)]
    assert index_pairs(named, peer(unnamed)) == [(0, 0), (1, 1)]
    assert index_pairs(unnamed, peer(named)) == [(0, 0), (1, 1)]


def test_matching_members_decide_and_names_are_not_compared() -> None:
    # Both advertise which layers each region holds; the names are only labels then.
    local = geometry(["a", "b"], members=True)
    other = peer(geometry(["x", "y"], members=True))
    assert index_pairs(local, other) == [(0, 0), (1, 1)]
    # vLLM compares names unless the local side is a pipeline stage (then it aligns by
    # members and rewrites the names); strict mode follows it.
    refused(local, other, "region 0 name", policy=PeerPolicy(vllm_strict=True))
    stage = geometry(["a", "b"], members=True, pp_rank=0, pp_size=2)
    strict = PeerPolicy(vllm_strict=True)
    assert index_pairs(stage, peer(geometry(["x", "y"], members=True)), policy=strict) == [
        (0, 0),
        (1, 1),
    ]


def test_regions_grouped_differently_pair_by_members_whatever_their_names() -> None:
    local = geometry(["a", "b"], members=True)
    # The peer lists the same layers in the other order, under other names.
    other = peer(
        geometry(["x", "y"], members=True),
        region_members=[[hf_name(1)], [hf_name(0)]],
    )
    assert index_pairs(local, other) == [(0, 1), (1, 0)]


def test_a_pipeline_stage_finds_its_window_among_a_full_peer_by_names() -> None:
    full = geometry([hf_name(i) for i in range(4)])
    stage = geometry([hf_name(2), hf_name(3)], first_layer=2, pp_rank=1, pp_size=2)
    assert index_pairs(stage, peer(full)) == [(0, 2), (1, 3)]


def test_a_pipeline_stage_refuses_a_full_peer_whose_names_do_not_place_it() -> None:
    stage = geometry([hf_name(2), hf_name(3)], first_layer=2, pp_rank=1, pp_size=2)
    renamed = peer(geometry([f"layer{i}" for i in range(4)]))
    refused(stage, renamed, "region count", "expected 2", "got 4", "pipeline stage")
    nameless = peer(geometry([hf_name(i) for i in range(4)]), region_names=None)
    refused(stage, nameless, "region count", "pipeline stage")
    # Not a pipeline stage: a different region count is refused as before.
    refused(geometry([hf_name(0), hf_name(1)]), peer(geometry([hf_name(i) for i in range(4)])))
