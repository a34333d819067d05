"""Rows of MLA pages with TP-sharded states beside them, between any TP sizes.

vLLM 0.32.0 lays Glm5Next over one buffer of rows: its latents, pooled keys and tail
rings are the same on every TP rank, while its KDA states are each rank's shard, padded
to a page at the same row offsets on every TP size. A block id belongs to one group, so a
row moves as its group's kind: an MLA or ring page whole, from one producer rank; a state
as each consumer rank's slice of each of its parts (the conv state's q, k and v columns,
then the temporal state's heads), from the producer ranks that hold it.

The oracle below writes and reads rows with plain numpy, no kvwire code; Hypothesis draws
the state groups and layers per group, a ring or none, block sizes, the prompt, prefix
hits, the TP sizes and the mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.errors import IncompatiblePeerError
from kvwire.layout import PeerLayout
from kvwire.layout.geometry import (
    SHARED_GROUP_ID,
    BlockRegion,
    KVGeometry,
    RegionKind,
    RemoteGeometry,
)

POOL = 24  # rows
SLOT = 48  # bytes of one layer's page in a row, the longest page there
PARTS = (8, 8, 8, 16)  # a state's parts at TP 1 (q, k, v conv columns; temporal heads)
SENTINEL = 0xEE
SPACE = 1 << 32


@dataclass(frozen=True)
class Case:
    kinds: tuple[RegionKind, ...]  # group 0 attention (MLA), then a ring or states
    layers: tuple[int, ...]
    sizes: tuple[int, ...]  # tokens per block, per group
    tokens: int
    hits: int  # D's prefix hits, in blocks of group 0
    p_tp: int
    d_tp: int
    mode: str

    @property
    def row(self) -> int:
        return max(self.layers) * SLOT


def parts(tp: int) -> tuple[int, ...]:
    return tuple(p // tp for p in PARTS)


def geometry(c: Case, who: int, rank: int) -> KVGeometry:
    tp = (c.p_tp, c.d_tp)[who]
    base = (who * 4 + rank + 1) * SPACE
    regions = [
        BlockRegion(
            base + j * SLOT,
            SLOT,
            POOL,
            block_stride=c.row,
            group_id=SHARED_GROUP_ID,
            mem_kind="DRAM",
            name=f"slot.{j}",
        )
        for j in range(max(c.layers))
    ]
    own = parts(tp)
    return KVGeometry(
        regions, kv_cache_layout="BLHNC", block_size=c.sizes[0], group_block_sizes=c.sizes,
        group_kinds=c.kinds, is_mla=True, ssm_sizes=(sum(own[:3]), own[3]), ssm_parts=own,
        tp_rank=rank, tp_size=tp,
    )  # fmt: skip


def lists(c: Case, rng: np.random.Generator) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each side's ids per group (no id in two groups): group 0 the prompt's blocks (D's
    after its hits), a ring's or a state's one block."""
    out = []
    for who in (0, 1):
        blocks = -(-c.tokens // c.sizes[0])
        counts = [blocks - (c.hits if who else 0), *(1 for _ in c.kinds[1:])]
        ids = rng.permutation(POOL)
        cuts = np.cumsum([0, *counts])
        out.append([ids[cuts[g] : cuts[g + 1]].astype(np.int64) for g in range(len(counts))])
    return out[0], out[1]


def page(g: int, layer: int, position: int) -> np.ndarray:
    """An MLA page (or a ring's, at position 0): the same on every rank."""
    return ((np.arange(SLOT) * 7 + (g * 31 + layer) * 1009 + position * 13) % 251 + 1).astype(
        np.uint8
    )


def state(g: int, layer: int, rank: int, tp: int) -> np.ndarray:
    """A rank's state: its slice of each part of the model's one state of this layer."""
    out = []
    for k, whole in enumerate(PARTS):
        values = (np.arange(whole) * 11 + (g * 17 + layer) * 97 + k * 5) % 249 + 1
        width = whole // tp
        out.append(values[rank * width : (rank + 1) * width].astype(np.uint8))
    return np.concatenate(out)


def fill(c: Case, buf: np.ndarray, ids: list[np.ndarray], rank: int, tp: int, hits: int) -> None:
    for g, kind in enumerate(c.kinds):
        for i, b in enumerate(ids[g].tolist()):
            for layer in range(c.layers[g]):
                at = b * c.row + layer * SLOT
                if kind is RegionKind.SSM:
                    own = state(g, layer, rank, tp)
                    buf[at : at + own.size] = own
                else:
                    position = hits + i if kind is RegionKind.ATTENTION else 0
                    buf[at : at + SLOT] = page(g, layer, position)


def sources(d_rank: int, d_tp: int, p_tp: int) -> list[int]:
    """The producer ranks a consumer rank pairs with: its own rank between equal sizes,
    the ranks whose shards its own covers, or the one whose shard covers it."""
    if p_tp >= d_tp:
        k = p_tp // d_tp
        return list(range(d_rank * k, (d_rank + 1) * k))
    return [d_rank // (d_tp // p_tp)]


def run(c: Case) -> None:
    rng = np.random.default_rng(abs(hash(repr(c))) % (1 << 32))
    p_ids, d_ids = lists(c, rng)
    p_bufs = [np.full(POOL * c.row, SENTINEL, np.uint8) for _ in range(c.p_tp)]
    for p_rank, buf in enumerate(p_bufs):
        fill(c, buf, p_ids, p_rank, c.p_tp, 0)
    before = [buf.copy() for buf in p_bufs]
    for d_rank in range(c.d_tp):
        d_buf = np.full(POOL * c.row, SENTINEL, np.uint8)
        whole = np.zeros(POOL, dtype=np.int64)  # per row, the producer ranks moving pages whole
        for p_rank in sources(d_rank, c.d_tp, c.p_tp):
            p_geo, d_geo = geometry(c, 0, p_rank), geometry(c, 1, d_rank)
            if c.mode == "pull":
                layout = PeerLayout(d_geo, RemoteGeometry.from_local(p_geo), mode="pull")
                plan = layout.plan(d_ids, p_ids, num_tokens=c.tokens)
                p_descs, d_descs = plan.remote_descs, plan.local_descs
            else:
                layout = PeerLayout(p_geo, RemoteGeometry.from_local(d_geo), mode="push")
                plan = layout.plan(p_ids, d_ids, num_tokens=c.tokens)
                p_descs, d_descs = plan.local_descs, plan.remote_descs
            moved = np.zeros(POOL, dtype=bool)
            for (pa, n, _), (da, m, _) in zip(p_descs.tolist(), d_descs.tolist(), strict=True):
                assert n == m and pa // SPACE == p_rank + 1 and da // SPACE == 4 + d_rank + 1
                d_buf[da % SPACE : da % SPACE + n] = p_bufs[p_rank][pa % SPACE : pa % SPACE + n]
                moved[(da % SPACE) // c.row : (da % SPACE + n - 1) // c.row + 1] |= n >= SLOT
            whole += moved
        pages = [b for g, k in enumerate(c.kinds) if k is not RegionKind.SSM for b in d_ids[g]]
        assert (whole[pages] == 1).all(), f"an MLA or ring page read from {whole[pages]} ranks"
        check(c, d_buf, d_ids, d_rank)
    assert all((a == b).all() for a, b in zip(p_bufs, before, strict=True)), "P was written"


def check(c: Case, d_buf: np.ndarray, d_ids: list[np.ndarray], d_rank: int) -> None:
    """Each of D's blocks holds its group's pages: MLA and ring pages whole, each state
    this rank's slice; no row outside D's lists is touched."""
    want = np.full_like(d_buf, SENTINEL)
    fill(c, want, d_ids, d_rank, c.d_tp, c.hits)
    mine = np.zeros(POOL, dtype=bool)
    for g, kind in enumerate(c.kinds):
        for b in d_ids[g].tolist():
            mine[b] = True
            for layer in range(c.layers[g]):
                at = b * c.row + layer * SLOT
                width = sum(parts(c.d_tp)) if kind is RegionKind.SSM else SLOT
                got, exp = d_buf[at : at + width], want[at : at + width]
                assert (got == exp).all(), f"group {g} layer {layer} block {b}, rank {d_rank}, {c}"
    others = ~np.repeat(mine, c.row)
    assert (d_buf[others] == SENTINEL).all(), f"rows outside D's lists written, {c}"


@st.composite
def cases(draw: st.DrawFn) -> Case:
    extra = draw(
        st.lists(st.sampled_from([RegionKind.SSM, RegionKind.RING]), min_size=1, max_size=3)
    )
    kinds = (RegionKind.ATTENTION, *extra)
    full = draw(st.sampled_from([8, 16]))
    sizes = (full, *(draw(st.sampled_from([4, full, 64])) for _ in extra))
    tokens = draw(st.integers(1, 100))
    p_tp, d_tp = draw(st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 2)]))
    return Case(
        kinds=kinds,
        layers=tuple(draw(st.integers(1, 3)) for _ in kinds),
        sizes=sizes,
        tokens=tokens,
        hits=draw(st.integers(0, -(-tokens // full) - 1)),
        p_tp=p_tp,
        d_tp=d_tp,
        mode=draw(st.sampled_from(["pull", "push"])),
    )


@settings(max_examples=200, deadline=None, derandomize=True)
@given(c=cases())
def test_rows_move_mla_pages_whole_and_states_sliced(c: Case) -> None:
    run(c)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)])
def test_glm5nexts_rows_in_small(p_tp: int, d_tp: int, mode: str) -> None:
    """Three state groups, the MLA group and a tail ring, as vLLM 0.32.0 groups Glm5Next."""
    S, A, R = RegionKind.SSM, RegionKind.ATTENTION, RegionKind.RING
    run(Case((A, S, S, S, R), (2, 1, 1, 1, 2), (16, 16, 16, 16, 4), 40, 1, p_tp, d_tp, mode))


def test_rows_of_states_without_parts_are_refused_between_unequal_tp() -> None:
    """A state kvwire cannot slice (no ``ssm_parts``) moves whole, only between equal TP
    sizes: refused at the handshake, by name."""
    from dataclasses import replace

    c = Case((RegionKind.ATTENTION, RegionKind.SSM), (1, 1), (16, 16), 40, 0, 1, 2, "pull")
    d = replace(geometry(c, 1, 0), ssm_parts=())
    with pytest.raises(IncompatiblePeerError, match=r"only with its TP-sharded parts"):
        PeerLayout(d, RemoteGeometry.from_local(geometry(c, 0, 0)), mode="pull")
