"""Mamba state between unequal TP sizes: each part of a layer's state (the conv state's
sub-projections, then the temporal state) is sharded across TP ranks in rank order, so a
rank holds its slice of every part, one after another in its page. A consumer rank must end
with exactly its slices, whichever producer ranks hold them, and nothing else of its pool
may change.

The oracle writes each rank's page with plain numpy from the whole model's parts, no kvwire
code; Hypothesis draws the parts, both TP sizes, the mode and the request's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.errors import ConfigError, IncompatiblePeerError
from kvwire.layout import PeerLayout
from kvwire.layout.geometry import (
    SHARED_GROUP_ID,
    BlockRegion,
    KVGeometry,
    RegionKind,
    RemoteGeometry,
)
from kvwire.layout.topology import remote_tp_ranks

HEADS = 4
CONTENT = 8
BLOCK = 16
POOL = 12
SENTINEL = 0xEE
SPACE = 1 << 32


@dataclass(frozen=True)
class Case:
    parts: tuple[int, ...]
    """The whole model's bytes of each part; the last is the temporal state."""
    p_tp: int
    d_tp: int
    mode: str
    p_state: int
    d_state: int
    layers: int


@dataclass
class Rank:
    buf: np.ndarray
    base: int
    page: int
    geometry: KVGeometry


def make_rank(case: Case, who: int, rank: int) -> Rank:
    tp = case.p_tp if who == 0 else case.d_tp
    parts = tuple(p // tp for p in case.parts)
    page = max(HEADS // tp * BLOCK * CONTENT, sum(parts))
    page += -page % (HEADS // tp * BLOCK * CONTENT)
    base = (1 + who * 8 + rank) * SPACE
    regions = [
        BlockRegion(
            base_addr=base + layer * POOL * page,
            block_len=page,
            num_blocks=POOL,
            group_id=SHARED_GROUP_ID,
            mem_kind="DRAM",
            name=f"slab.{layer}",
        )
        for layer in range(case.layers)
    ]
    geometry = KVGeometry(
        regions,
        block_size=BLOCK,
        total_kv_heads=HEADS,
        tp_rank=rank,
        tp_size=tp,
        ssm_sizes=(sum(parts[:-1]), parts[-1]),
        ssm_parts=parts,
        group_kinds=(RegionKind.ATTENTION, RegionKind.SSM),
    )
    return Rank(np.full(case.layers * POOL * page, SENTINEL, np.uint8), base, page, geometry)


def whole_state(case: Case, layer: int) -> list[np.ndarray]:
    rng = np.random.default_rng((layer, len(case.parts)))
    return [rng.integers(0, 256, size, np.uint8) for size in case.parts]


def rank_state(case: Case, layer: int, rank: int, tp: int) -> np.ndarray:
    return np.concatenate(
        [
            part[rank * part.size // tp : (rank + 1) * part.size // tp]
            for part in whole_state(case, layer)
        ]
    )


def page(side: Rank, layer: int, block: int) -> np.ndarray:
    start = (layer * POOL + block) * side.page
    return side.buf[start : start + side.page]


def run(case: Case) -> None:
    producers = [make_rank(case, 0, r) for r in range(case.p_tp)]
    consumers = [make_rank(case, 1, r) for r in range(case.d_tp)]
    for r, side in enumerate(producers):
        for layer in range(case.layers):
            state = rank_state(case, layer, r, case.p_tp)
            page(side, layer, case.p_state)[: state.size] = state
    sides = {s.base: s for s in producers + consumers}
    p_lists, d_lists = (
        [np.array([], np.int64), [case.p_state]],
        [np.array([], np.int64), [case.d_state]],
    )
    # The side that plans: D reading (pull) or P writing (push), each rank with its peers.
    pull = case.mode == "pull"
    planners, peers = (consumers, producers) if pull else (producers, consumers)
    own, theirs = (d_lists, p_lists) if pull else (p_lists, d_lists)
    plans = []
    for r, side in enumerate(planners):
        for peer in remote_tp_ranks(r, side.geometry.tp_size, peers[0].geometry.tp_size):
            remote = RemoteGeometry.from_local(peers[peer].geometry)
            plan = PeerLayout(side.geometry, remote, mode=case.mode).plan(own, theirs, num_tokens=1)
            descs = (plan.remote_descs, plan.local_descs)
            plans.append(descs if pull else descs[::-1])
    before = [s.buf.copy() for s in producers]
    for src, dst in plans:
        for (sa, n, _), (da, m, _) in zip(src.tolist(), dst.tolist(), strict=True):
            assert n == m
            s_side, d_side = sides[sa - sa % SPACE], sides[da - da % SPACE]
            d_side.buf[da - d_side.base : da - d_side.base + n] = s_side.buf[
                sa - s_side.base : sa - s_side.base + n
            ]
    for c, side in enumerate(consumers):
        want = np.full_like(side.buf, SENTINEL)
        for layer in range(case.layers):
            state = rank_state(case, layer, c, case.d_tp)
            page(Rank(want, side.base, side.page, side.geometry), layer, case.d_state)[
                : state.size
            ] = state
        assert (side.buf == want).all(), f"consumer rank {c}: wrong bytes, {case}"
    assert all((s.buf == b).all() for s, b in zip(producers, before, strict=True))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    p_tp, d_tp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    count = draw(st.integers(1, 4))
    parts = tuple(draw(st.integers(1, 6)) * 4 * 3 for _ in range(count + 1))
    return Case(
        parts=parts,
        p_tp=p_tp,
        d_tp=d_tp,
        mode=draw(st.sampled_from(["pull", "push"])),
        p_state=draw(st.integers(0, POOL - 1)),
        d_state=draw(st.integers(0, POOL - 1)),
        layers=draw(st.integers(1, 2)),
    )


@settings(max_examples=150, deadline=None, derandomize=True)
@given(case=cases())
def test_each_consumer_rank_ends_with_its_slice_of_every_part(case: Case) -> None:
    run(case)


def test_a_peer_whose_state_does_not_scale_with_tp_is_refused_by_name() -> None:
    case = Case((24, 24, 24, 48), 1, 2, "pull", 0, 0, 1)
    d = make_rank(case, 1, 0)
    p = make_rank(case, 0, 0)
    wrong = RemoteGeometry.from_local(
        KVGeometry(
            p.geometry.regions,
            block_size=BLOCK,
            total_kv_heads=HEADS,
            ssm_sizes=(72, 40),
            group_kinds=p.geometry.group_kinds,
        )
    )
    with pytest.raises(IncompatiblePeerError, match="ssm_sizes: expected"):
        PeerLayout(d.geometry, wrong, mode="pull")


def test_a_state_without_its_parts_or_that_does_not_shard_evenly_is_refused() -> None:
    """Between unequal TP sizes a state moves part by part, so a geometry that does not
    name its parts is refused, naming ssm_parts; so is a part that does not split evenly
    across the peer's ranks."""
    case = Case((24, 24, 24, 48), 1, 2, "pull", 0, 0, 1)
    d, p = make_rank(case, 1, 0), make_rank(case, 0, 0)
    remote = RemoteGeometry.from_local(p.geometry)
    bare = KVGeometry(
        d.geometry.regions,
        block_size=BLOCK,
        total_kv_heads=HEADS,
        tp_size=2,
        ssm_sizes=d.geometry.ssm_sizes,
        group_kinds=d.geometry.group_kinds,
    )
    with pytest.raises(IncompatiblePeerError, match="only with its TP-sharded parts"):
        PeerLayout(bare, remote, mode="pull")
    odd = make_rank(Case((6, 6, 6, 12), 1, 4, "push", 0, 0, 1), 0, 0)  # 6 B: not in 4
    four = make_rank(Case((24, 24, 24, 48), 1, 4, "push", 0, 0, 1), 1, 0)
    with pytest.raises(IncompatiblePeerError, match="must shard evenly"):
        PeerLayout(odd.geometry, RemoteGeometry.from_local(four.geometry), mode="push")


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    parts=st.lists(st.integers(-4, 40), min_size=1, max_size=5),
    conv=st.integers(1, 80),
    temporal=st.integers(1, 80),
)
def test_ssm_parts_are_accepted_exactly_when_they_split_the_sizes(
    parts: list[int], conv: int, temporal: int
) -> None:
    """A geometry takes ``ssm_parts`` only when every part is positive, they add up to the
    state and a part ends where the conv state does; anything else is a ConfigError that
    names them."""
    ends = list(np.cumsum(parts))
    valid = min(parts) > 0 and ends[-1] == conv + temporal and conv in ends
    region = BlockRegion(base_addr=SPACE, block_len=4096, num_blocks=4, mem_kind="DRAM")

    def build() -> KVGeometry:
        return KVGeometry(
            [region], block_size=BLOCK, total_kv_heads=HEADS, ssm_sizes=(conv, temporal),
            ssm_parts=tuple(parts), group_kinds=(RegionKind.ATTENTION, RegionKind.SSM),
        )  # fmt: skip

    if valid:
        assert build().state_parts == tuple(parts)
    else:
        with pytest.raises(ConfigError, match="ssm_parts"):
            build()
