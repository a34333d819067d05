"""Groups of several block sizes over one buffer of rows (DeepSeek-V4 in vLLM).

vLLM lays V4's groups (windowed latents in 64-token blocks, compressed latents in 256,
compressor states in 4 or 8) over one buffer: a row per block id, as wide as the widest
group's pages, every group's layers overlaid on it, an id owned by one group at a time.
Stock registers the rows as one region and moves a whole row per id of every group. The
planner must place each group's list by that group's own block size: placed by the
engine's one block size, the small groups' tails would pair with the wrong rows. Qwen4Exp
overlays groups of other kinds the same way: rings and states (its GDN and embedding
states), whose lists pair by position from their end, never by token, beside GQA
attention, whose rows are each TP rank's own.

The oracle below moves rows with plain numpy by position in the prompt (a ring's or a
state's by position from its list's end); Hypothesis draws the groups' kinds and block
sizes, how many layers each overlays, the prompt, each side's tails, a leading null block
in P's windowed lists, replicated (MLA) or rank-own rows, the TP sizes and the mode. (A
state between unequal TP sizes is sliced: ``test_layout_row_states.py``.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.errors import (
    ConfigError,
    IncompatiblePeerError,
    LocalProtocolError,
    RemoteProtocolError,
)
from kvwire.layout import PeerLayout
from kvwire.layout.geometry import (
    SHARED_GROUP_ID,
    BlockRegion,
    KVGeometry,
    RegionKind,
    RemoteGeometry,
)

from .test_layout_oracle import assert_rows_in_tables

POOL = 40  # rows
PAGE = 6  # bytes of one layer's page of one block
SENTINEL = 0xEE
SPACE = 1 << 32


@dataclass(frozen=True)
class Rows:
    sizes: tuple[int, ...]  # tokens per block, per group
    layers: tuple[int, ...]  # layers per group, overlaid on the row
    tokens: int
    p_counts: tuple[int, ...]  # each group's list on P: the last blocks of the prompt
    d_counts: tuple[int, ...]
    null: tuple[bool, ...]  # P's list starts with the null block (a window's clipped tail)
    p_tp: int
    d_tp: int
    mode: str
    with_count: bool
    kinds: tuple[RegionKind, ...] = ()
    """Per group, attention, ring or state (SSM); empty: all attention."""
    sharded: bool = False
    """Rows of head-sharded pages and rank-own states: each P rank's bytes its own."""
    advertised: int = 0
    """Bytes of a block the region advertises, less than the row it moves (a vLLM engine
    advertises one page of several at an address); 0: the row."""

    def positional(self, g: int) -> bool:
        return bool(self.kinds) and self.kinds[g] is not RegionKind.ATTENTION

    @property
    def row(self) -> int:
        return max(self.layers) * PAGE

    def positions(self, g: int) -> int:
        return -(-self.tokens // self.sizes[g])


def geometry(r: Rows, who: int, rank: int) -> KVGeometry:
    region = BlockRegion(
        base_addr=(who * 4 + rank + 1) * SPACE,
        block_len=r.advertised or r.row,
        extent=r.row,
        block_stride=r.row,
        num_blocks=POOL,
        group_id=SHARED_GROUP_ID,
        mem_kind="DRAM",
        name="rows",
    )
    return KVGeometry(
        [region],
        kv_cache_layout="BLHNC",
        block_size=math.lcm(*(s for g, s in enumerate(r.sizes) if not r.positional(g))),
        group_block_sizes=r.sizes,
        group_kinds=r.kinds,
        is_mla=not r.sharded,
        total_kv_heads=2 if r.sharded else 1,
        tp_rank=rank,
        tp_size=(r.p_tp, r.d_tp)[who],
    )


def draw_ids(r: Rows, rng: np.random.Generator) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each side's ids per group, no id in two groups; 0 is vLLM's null block."""
    out = []
    for counts, nulls in ((r.p_counts, r.null), (r.d_counts, (False,) * len(r.sizes))):
        ids = rng.permutation(np.arange(1, POOL))
        cuts = np.cumsum([0, *counts])
        lists = [ids[cuts[g] : cuts[g + 1]].astype(np.int64) for g in range(len(counts))]
        for g, null in enumerate(nulls):
            if null and len(lists[g]):
                lists[g][0] = 0
        out.append(lists)
    return out[0], out[1]


def page(g: int, layer: int, position: int, rank: int = 0) -> np.ndarray:
    """One group's layer's page of the block at ``position`` in the prompt, on one P rank
    (rank 0 for replicated rows)."""
    seed = ((rank * 7 + g) * 31 + layer) * 1009 + position
    return ((seed * 13 + np.arange(PAGE)) % 251 + 1).astype(np.uint8)


def start(r: Rows, g: int, count: int) -> int:
    """Position in the prompt of a list's first block: every list ends with the prompt (a
    ring's or a state's list ends at position 0, counted from its end)."""
    return -count if r.positional(g) else r.positions(g) - count


def run(r: Rows) -> None:
    rng = np.random.default_rng(abs(hash(repr(r))) % (1 << 32))
    p_ids, d_ids = draw_ids(r, rng)
    p_bufs = [np.full(POOL * r.row, SENTINEL, np.uint8) for _ in range(r.p_tp)]
    for p_rank, buf in enumerate(p_bufs):  # replicated: every P rank holds the same rows
        rank = p_rank if r.sharded else 0
        for g, ids in enumerate(p_ids):
            for i, b in enumerate(ids.tolist()):
                if b == 0:  # vLLM's null block: no content of this request
                    continue
                for layer in range(r.layers[g]):
                    at = b * r.row + layer * PAGE
                    buf[at : at + PAGE] = page(g, layer, start(r, g, len(ids)) + i, rank)
    num_tokens = r.tokens if r.with_count else None
    short = [g for g in range(len(r.sizes)) if r.positional(g) and r.d_counts[g] > r.p_counts[g]]
    if short:  # D's ring or state past P's list would keep what it held: refused
        p_geo, d_geo = geometry(r, 0, 0), geometry(r, 1, 0)
        if r.mode == "pull":
            layout = PeerLayout(d_geo, RemoteGeometry.from_local(p_geo), mode="pull")
            refused, lists = RemoteProtocolError, (d_ids, p_ids)
        else:
            layout = PeerLayout(p_geo, RemoteGeometry.from_local(d_geo), mode="push")
            refused, lists = LocalProtocolError, (p_ids, d_ids)
        with pytest.raises(refused, match="would be left as it was"):
            layout.plan(*lists, num_tokens=num_tokens)
        return
    for d_rank in range(r.d_tp):
        d_buf = np.full(POOL * r.row, SENTINEL, np.uint8)
        written = np.zeros(POOL, dtype=np.int64)
        # Replicated rows: every P rank is asked, and one must answer; rank-own rows pair
        # rank to rank (equal TP sizes).
        ranks = [d_rank] if r.sharded else range(r.p_tp)
        for p_rank in ranks:
            p_geo, d_geo = geometry(r, 0, p_rank), geometry(r, 1, d_rank)
            if r.mode == "pull":
                layout = PeerLayout(d_geo, RemoteGeometry.from_local(p_geo), mode="pull")
                local, remote = d_ids, p_ids
            else:
                layout = PeerLayout(p_geo, RemoteGeometry.from_local(d_geo), mode="push")
                local, remote = p_ids, d_ids
            if r.with_count:
                assert_rows_in_tables(layout, local, remote, num_tokens)
            plan = layout.plan(local, remote, num_tokens=num_tokens)
            p_descs, d_descs = (
                (plan.remote_descs, plan.local_descs)
                if r.mode == "pull"
                else (plan.local_descs, plan.remote_descs)
            )
            zero = plan.local_zero if r.mode == "pull" else plan.remote_zero
            for (pa, n, _), (da, m, _) in zip(p_descs.tolist(), d_descs.tolist(), strict=True):
                assert n == m and pa // SPACE == p_rank + 1 and da // SPACE == 4 + d_rank + 1
                po, do = pa % SPACE, da % SPACE
                assert do % r.row == 0 and n % r.row == 0, "a row moves whole"
                d_buf[do : do + n] = p_bufs[p_rank][po : po + n]
                written[do // r.row : (do + n) // r.row] += 1
            for addr, n, _ in zero.tolist():
                d_buf[addr % SPACE : addr % SPACE + n] = 0
        check(r, d_buf, written, p_ids, d_ids, d_rank if r.sharded else 0)


def check(
    r: Rows,
    d_buf: np.ndarray,
    written: np.ndarray,
    p_ids: list[np.ndarray],
    d_ids: list[np.ndarray],
    rank: int,
) -> None:
    """Each of D's blocks holds its group's pages of its position, from one P rank (its
    own rank's, for rank-own rows); a block before P's list is zero; no other row is
    touched."""
    mine = np.zeros(POOL, dtype=bool)
    for g, ids in enumerate(d_ids):
        p_first = start(r, g, len(p_ids[g]))
        paired = min(len(ids), len(p_ids[g]))
        for i, b in enumerate(ids.tolist()):
            mine[b] = True
            # D's ring or state blocks take P's last ones, in order.
            position = i - paired if r.positional(g) else start(r, g, len(ids)) + i
            row = d_buf[b * r.row : (b + 1) * r.row]
            if position < p_first:
                assert (row == 0).all() and written[b] == 0, f"group {g} block {b}, {r}"
                continue
            p_block = int(p_ids[g][position - p_first])
            assert written[b] == 1, f"group {g} block {b} written {written[b]} times, {r}"
            for layer in range(r.layers[g]):
                got = row[layer * PAGE : (layer + 1) * PAGE]
                if p_block == 0:  # the null block's row: whatever P's holds (stock reads it)
                    assert (got == SENTINEL).all(), f"group {g} block {b}, {r}"
                else:
                    want = page(g, layer, position, rank)
                    assert (got == want).all(), f"group {g} layer {layer} block {b}, {r}"
    others = ~np.repeat(mine, r.row)
    assert (d_buf[others] == SENTINEL).all(), f"rows outside D's lists written, {r}"
    assert (written[~mine] == 0).all()


@st.composite
def rows(draw: st.DrawFn) -> Rows:
    groups = draw(st.integers(1, 4))
    # Group 0 is the full-attention group (V4's compressed latents): P's list reaches the
    # prompt's end from its start; kvwire refuses an engine without one.
    full = draw(st.sampled_from([8, 16]))
    # A state's block may be larger than every token group's (Qwen4Exp's: the model's length).
    sizes = (full, *(draw(st.sampled_from([2, 4, 8, 16, 64])) for _ in range(groups - 1)))
    others = st.sampled_from([RegionKind.ATTENTION, RegionKind.RING, RegionKind.SSM])
    kinds = (RegionKind.ATTENTION, *(draw(others) for _ in range(groups - 1)))
    tokens = draw(st.integers(1, 120))
    with_count = draw(st.booleans())
    p_counts, d_counts, nulls = [], [], []
    for g, size in enumerate(sizes):
        if kinds[g] is not RegionKind.ATTENTION:  # its running page, a scratch one or none
            p_counts.append(draw(st.integers(0, 2)))
            d_counts.append(draw(st.integers(0, 2)))
            nulls.append(False)
            continue
        total = -(-tokens // size)
        p = total if g == 0 else draw(st.integers(0, min(total, 8)))
        d = draw(st.integers(0, min(total, 8)))
        p_counts.append(p)
        d_counts.append(d)
        # P's windowed tail may lead with vLLM's null block; D may hold that position too
        # (and reads the null block's row, as stock does).
        nulls.append(g > 0 and p > 0 and draw(st.booleans()))
    sharded = draw(st.booleans())
    # A state is each rank's own, replicated rows or not; between unequal TP sizes beside
    # MLA pages it is sliced (tests/layout/test_layout_row_states.py).
    own = sharded or RegionKind.SSM in kinds
    pairs = [(1, 1), (2, 2)] if own else [(1, 1), (1, 2), (2, 1), (2, 2)]
    p_tp, d_tp = draw(st.sampled_from(pairs))
    return Rows(
        sizes=sizes,
        layers=tuple(draw(st.integers(1, 3)) for _ in sizes),
        tokens=tokens,
        p_counts=tuple(p_counts),
        d_counts=tuple(d_counts),
        null=tuple(nulls),
        p_tp=p_tp,
        d_tp=d_tp,
        mode=draw(st.sampled_from(["pull", "push"])),
        with_count=with_count,
        kinds=kinds,
        sharded=sharded,
        advertised=draw(st.sampled_from([0, 1, PAGE])),
    )


@settings(max_examples=300, deadline=None, derandomize=True)
@given(r=rows())
def test_each_group_moves_its_own_rows_by_its_own_block_size(r: Rows) -> None:
    run(r)


def test_v4s_lists_pair_as_stock_pairs_them() -> None:
    """What vLLM's scheduler sends for a 1000-token V4 prompt (groups of 64, 64, 256, 4
    and 8 tokens; P's windowed tails of 3, 3 and 17 blocks, two starting with the null
    block; D's counts 3, 3, 4, 2, 16): D's lists pair with the tails of P's."""
    sizes = (64, 64, 256, 4, 8)
    r = Rows(sizes, (3, 3, 5, 2, 2), 1000, (3, 3, 4, 3, 17), (3, 3, 4, 2, 16),
             (False, False, False, True, True), 1, 1, "pull", True)  # fmt: skip
    run(r)


def test_a_peer_of_another_block_size_is_refused() -> None:
    r = Rows((4, 16), (1, 1), 40, (1, 1), (1, 1), (False, False), 1, 1, "pull", True)
    local = geometry(r, 1, 0)
    other = KVGeometry(
        local.regions, kv_cache_layout="BLHNC", block_size=32, group_block_sizes=(8, 32),
        is_mla=True,
    )  # fmt: skip
    with pytest.raises(IncompatiblePeerError, match="block_size: expected 16"):
        PeerLayout(local, RemoteGeometry.from_local(other))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"block_size": 16, "group_block_sizes": (3, 16)}, "each must divide block_size 16"),
        ({"block_size": 16, "group_block_sizes": (0, 16)}, "each must divide"),
        ({"block_size": 16, "physical_blocks_per_logical": 2, "group_block_sizes": (16,)},
         "not split into kernel blocks"),
        ({"block_size": 16, "group_block_sizes": (4, 16), "group_kinds": ("attention",)},
         "one per group of group_kinds"),
    ],
)  # fmt: skip
def test_bad_group_block_sizes_are_refused_by_name(options: dict, message: str) -> None:
    """Each refusal names its rule."""
    region = BlockRegion(base_addr=0, block_len=48, num_blocks=4, group_id=SHARED_GROUP_ID)
    with pytest.raises(ConfigError, match=message):
        KVGeometry([region], **{"is_mla": True, **options})


def test_a_region_of_states_alone_is_not_a_row() -> None:
    """A row is every group's; a region advertised as whole SSM pages is a slab model's."""
    region = BlockRegion(
        base_addr=0, block_len=48, num_blocks=4, group_id=SHARED_GROUP_ID, kind=RegionKind.SSM
    )
    with pytest.raises(ConfigError, match="its regions are attention regions"):
        KVGeometry([region], block_size=16, group_block_sizes=(4, 16), ssm_sizes=(8, 8))


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_rank_own_rows_between_unequal_tp_are_refused_at_the_handshake(
    p_tp: int, d_tp: int, mode: str
) -> None:
    """A row of head-sharded pages or a rank's own state moves whole: between unequal TP
    sizes every producer rank would write a consumer's whole row, one rank's heads winning."""
    kinds = (RegionKind.ATTENTION, RegionKind.SSM)
    r = Rows((8, 8), (1, 1), 16, (2, 1), (2, 1), (False, False), p_tp, d_tp, mode, True,
             kinds, sharded=True)  # fmt: skip
    mine, theirs = (geometry(r, 1, 0), geometry(r, 0, 0))
    if mode == "push":
        mine, theirs = theirs, mine
    with pytest.raises(IncompatiblePeerError, match="only between equal TP sizes"):
        PeerLayout(mine, RemoteGeometry.from_local(theirs), mode=mode)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_more_lists_than_groups_are_refused(mode: str) -> None:
    r = Rows((8, 2), (1, 1), 16, (2, 1), (2, 1), (False, False), 1, 1, mode, True)
    p_ids, d_ids = draw_ids(r, np.random.default_rng(0))
    local, remote = (d_ids, p_ids) if mode == "pull" else (p_ids, d_ids)
    theirs = RemoteGeometry.from_local(geometry(r, 0 if mode == "pull" else 1, 0))
    layout = PeerLayout(geometry(r, 1 if mode == "pull" else 0, 0), theirs, mode=mode)
    with pytest.raises(LocalProtocolError, match="local block ids: expected at most 2 lists"):
        layout.plan([*local, np.array([3])], remote, num_tokens=16)
    with pytest.raises(RemoteProtocolError, match="remote block ids: expected at most 2 lists"):
        layout.plan(local, [*remote, np.array([3])], num_tokens=16)
    with pytest.raises(LocalProtocolError, match="local block ids: expected at most 2 lists"):
        layout.tables(3)  # the prepared tables of requests with three lists


def test_a_producer_whose_lists_stop_short_of_the_prompt_is_refused() -> None:
    """Each list reaches as far as its own blocks do: P's full group one block short of
    the prompt is refused, although a small group's list of as many ids would reach past
    it in blocks of the engine's block size."""
    r = Rows((8, 2), (1, 1), 40, (4, 8), (5, 2), (False, False), 1, 1, "pull", True)
    p_ids, d_ids = draw_ids(r, np.random.default_rng(0))
    layout = PeerLayout(geometry(r, 1, 0), RemoteGeometry.from_local(geometry(r, 0, 0)))
    with pytest.raises(RemoteProtocolError, match=r"num_tokens 40 is more than .* hold"):
        layout.plan(d_ids, p_ids, num_tokens=40)


@pytest.mark.parametrize("kind", [RegionKind.RING, RegionKind.SSM])
def test_a_ring_or_a_state_list_vouches_for_no_token(kind: RegionKind) -> None:
    """P's full group one block short of the prompt is refused even beside a state's
    list whose blocks, counted as tokens, would reach past it: the state is one page, and
    D's first block would be left zero and the request done."""
    r = Rows((8, 16), (1, 1), 40, (4, 3), (5, 1), (False, False), 1, 1, "pull", True,
             (RegionKind.ATTENTION, kind))  # fmt: skip
    p_ids, d_ids = draw_ids(r, np.random.default_rng(0))
    layout = PeerLayout(geometry(r, 1, 0), RemoteGeometry.from_local(geometry(r, 0, 0)))
    with pytest.raises(RemoteProtocolError, match=r"num_tokens 40 is more than .* hold"):
        layout.plan(d_ids, p_ids, num_tokens=40)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"block_len": 48, "extent": 40}, "extent 40 must lie between block_len 48"),
        ({"block_len": 48, "extent": 72, "block_stride": 64}, "and block_stride 64"),
    ],
)
def test_an_extent_outside_its_block_is_refused(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        BlockRegion(base_addr=0, num_blocks=4, **options)


def test_an_extent_is_for_rows_only() -> None:
    """Outside rows a region's pages are sliced by heads and tokens from its block_len."""
    region = BlockRegion(base_addr=0, block_len=32, extent=48, block_stride=64, num_blocks=4)
    with pytest.raises(ConfigError, match="only rows of several block sizes"):
        KVGeometry([region], block_size=16)


def test_a_region_registers_as_far_as_it_moves() -> None:
    """The memory a rank registers reaches its last block's extent, not its advertised
    length: a peer reading the longest page of the last row would read past it."""
    from kvwire.runtime.driver import regions_of

    region = BlockRegion(
        base_addr=4096, block_len=8, extent=48, block_stride=64, num_blocks=4,
        group_id=SHARED_GROUP_ID, mem_kind="DRAM",
    )  # fmt: skip
    geo = KVGeometry([region], block_size=16, group_block_sizes=(16,), is_mla=True)
    (span,) = regions_of(geo)
    assert (span.addr, span.length) == (4096, 3 * 64 + 48)
