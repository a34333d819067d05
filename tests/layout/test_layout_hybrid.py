"""vLLM's hybrid layout: every KV-cache group in one allocation, regions shared by groups.

With the hybrid KV cache manager, vLLM carves every group's tensors out of one buffer: the
j-th layer of each group lives in slab j, a block id belongs to one group at a time, and a
slab is advertised as one region with group id -1. A slab's block holds a full-attention
page, a sliding-window page or an SSM state page, depending on which group owns that id.
The planner must move each group's blocks as that group's kind: attention pages by token
(the window's tail for a sliding-window group), SSM state as the bytes at the start of the
page at its logical id. It once joined the groups' lists into one token sequence: the
window's blocks and the state moved as if they were the next tokens of the full group.

A ring group (vLLM's ``CircularBufferSpec``) has one block per request whose slot
``t % block`` holds token ``t``'s rows, the latest ``block`` tokens': it pairs by position
and moves whole, for the one token count it was written at; in regions of kernel blocks,
all of its block's kernel blocks.

A region may name the groups it holds (``BlockRegion.groups``) while it advertises one
group's id, as a vLLM 0.31.0 engine advertises Glm5Next's indexer keys, its tail ring
(a group of its own) laid over them: only those groups move there.

The oracle below writes and reads slabs with plain numpy, no kvwire code; Hypothesis draws
the groups, layers per group, block sizes either way (equal beside a ring, whose capacity
is the model's, as is its kernel split), kernel blocks, prompt lengths, prefix hits, the
mode, and whether regions name their groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.errors import RemoteProtocolError
from kvwire.layout import PeerLayout
from kvwire.layout.geometry import (
    SHARED_GROUP_ID,
    BlockRegion,
    KVGeometry,
    RegionKind,
    RemoteGeometry,
)

from .test_layout_oracle import assert_rows_in_tables

HEADS = 2
CONTENT = 8  # bytes one head stores for one token (K and V)
SSM = (24, 40)  # conv state and SSM state bytes per page
POOL = 24  # logical blocks
SENTINEL = 0xEE
SPACE = 1 << 32


@dataclass(frozen=True)
class Hybrid:
    kinds: tuple[str, ...]  # per group: "full", "swa", "ring" or "ssm"
    layers: tuple[int, ...]  # layers per group
    p_block: int
    d_block: int
    p_ppl: int
    d_ppl: int
    tokens: int
    hits: int
    window: int
    mode: str
    named: bool = False
    """Each slab names the groups it holds and advertises the first one's id."""

    def block(self, who: int) -> int:
        return self.p_block if who == 0 else self.d_block

    def ppl(self, who: int) -> int:
        return self.p_ppl if who == 0 else self.d_ppl


@dataclass
class Side:
    buf: np.ndarray
    base: int
    page: int  # bytes per logical block
    geometry: KVGeometry


def make_side(h: Hybrid, who: int) -> Side:
    block, ppl = h.block(who), h.ppl(who)
    attention_page = HEADS * block * CONTENT
    page = max(attention_page, sum(SSM))
    page += -page % (ppl * HEADS * CONTENT)  # a kernel block is a whole page slice
    slabs = max(h.layers)
    slab = POOL * page
    base = (who + 1) * SPACE

    def slab_group(j: int) -> int:
        """vLLM's region_group_ids: -1 where layers of several groups share the slab."""
        groups = held(h, j)
        return groups[0] if len(groups) == 1 or h.named else SHARED_GROUP_ID

    regions = [
        BlockRegion(
            base_addr=base + j * slab,
            block_len=page // ppl,
            num_blocks=POOL * ppl,
            group_id=slab_group(j),
            mem_kind="DRAM",
            name=f"slab.{j}",
            groups=held(h, j) if h.named else (),
        )
        for j in range(slabs)
    ]
    by_name = {"ssm": RegionKind.SSM, "ring": RegionKind.RING}
    kinds = tuple(by_name.get(k, RegionKind.ATTENTION) for k in h.kinds)
    geometry = KVGeometry(
        regions,
        block_size=block,
        physical_blocks_per_logical=ppl,
        total_kv_heads=HEADS,
        ssm_sizes=SSM if "ssm" in h.kinds else (0, 0),
        group_kinds=kinds,
    )
    buf = np.full(slabs * slab, SENTINEL, dtype=np.uint8)
    return Side(buf, base, page, geometry)


def held(h: Hybrid, slab: int) -> tuple[int, ...]:
    """The groups with a layer in slab ``slab``."""
    return tuple(g for g, n in enumerate(h.layers) if slab < n)


def lists(h: Hybrid, rng: np.random.Generator) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each side's block ids per group, drawn so no id serves two groups (one owner)."""
    out = []
    for who in (0, 1):
        block = h.block(who)
        total = -(-h.tokens // block)
        window_first = max(0, h.tokens - h.window) // block
        counts = []
        for kind in h.kinds:
            if kind in ("ssm", "ring"):
                counts.append(1)
            else:
                first = window_first if kind == "swa" else 0
                if who == 1:
                    first = max(first, h.hits)
                counts.append(max(0, total - first))
        ids = rng.permutation(POOL)
        cuts = np.cumsum([0, *counts])
        out.append([ids[cuts[g] : cuts[g + 1]].astype(np.int64) for g in range(len(counts))])
    return out[0], out[1]


def value(g: int, layer: int, token: np.ndarray, head: int) -> np.ndarray:
    """The bytes one head stores for one token: unique per (group, layer, token, head)."""
    seed = ((g * 7 + layer) * 1009 + token) * 31 + head
    return ((seed[..., None] * 13 + np.arange(CONTENT)) % 251).astype(np.uint8)


def state(g: int, layer: int) -> np.ndarray:
    return ((np.arange(sum(SSM)) * 7 + g * 53 + layer * 11) % 249 + 1).astype(np.uint8)


def ring_rows(h: Hybrid, g: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(slots, rows) of a ring page after the prompt: slot ``t % block`` of each of the
    latest ``block`` tokens, its heads' bytes in the page's head-major order."""
    tokens = np.arange(max(0, h.tokens - h.p_block), h.tokens)
    rows = np.stack([value(g, layer, tokens, head) for head in range(HEADS)])
    return tokens % h.p_block, rows


def page_view(side: Side, layer: int, block: int) -> np.ndarray:
    start = layer * POOL * side.page + block * side.page
    return side.buf[start : start + side.page]


def attention_tokens(h: Hybrid, who: int, ids: np.ndarray, kind: str) -> np.ndarray:
    """The token each slot of a list's blocks holds, ``[n, block]`` (lists end together)."""
    block = h.block(who)
    total = -(-h.tokens // block)
    start = (total - len(ids)) * block
    return start + np.arange(len(ids) * block).reshape(len(ids), block)


def write_side(h: Hybrid, side: Side, who: int, groups: list[np.ndarray]) -> None:
    block, ppl = h.block(who), h.ppl(who)
    kernel = block // ppl
    for g, kind in enumerate(h.kinds):
        for layer in range(h.layers[g]):
            if kind == "ssm":
                page_view(side, layer, int(groups[g][0]))[: sum(SSM)] = state(g, layer)
                continue
            if kind == "ring":
                page = page_view(side, layer, int(groups[g][0]))
                slots, rows = ring_rows(h, g, layer)
                page[: HEADS * block * CONTENT].reshape(HEADS, block, CONTENT)[:, slots] = rows
                continue
            tokens = attention_tokens(h, who, groups[g], kind)
            for row, b in enumerate(groups[g].tolist()):
                page = page_view(side, layer, b)
                for k in range(ppl):  # each kernel block: heads x kernel tokens x content
                    sub = page[k * (page.size // ppl) : (k + 1) * (page.size // ppl)]
                    toks = tokens[row, k * kernel : (k + 1) * kernel]
                    for head in range(HEADS):
                        span = sub[head * kernel * CONTENT : (head + 1) * kernel * CONTENT]
                        span[:] = value(g, layer, toks, head).reshape(-1)


def check_consumer(
    h: Hybrid, d: Side, p_groups: list[np.ndarray], d_groups: list[np.ndarray]
) -> None:
    want = Side(np.full_like(d.buf, SENTINEL), d.base, d.page, d.geometry)
    write_side(h, want, 1, d_groups)
    # The request's own pages in D, in every slab: a group with no layer in a slab owns
    # its ids there too (stock reads every group's ids from every shared slab), unless
    # the slab names the groups it holds.
    touched = np.zeros(d.buf.size, dtype=bool)
    for g, kind in enumerate(h.kinds):
        for layer in range(max(h.layers)):
            if h.named and g not in held(h, layer):
                continue
            for b in d_groups[g].tolist():
                start = layer * POOL * d.page + b * d.page
                touched[start : start + (sum(SSM) if kind == "ssm" else d.page)] = True
    kernel = h.d_block // h.d_ppl
    for g, kind in enumerate(h.kinds):
        p_first = -(-h.tokens // h.p_block) - len(p_groups[g])  # P's list starts here
        for layer in range(h.layers[g]):
            if kind == "ssm":
                got = page_view(d, layer, int(d_groups[g][0]))
                assert (got[: sum(SSM)] == state(g, layer)).all(), f"group {g} state, {h}"
                continue
            if kind == "ring":
                got = page_view(d, layer, int(d_groups[g][0]))
                heads = got[: HEADS * h.d_block * CONTENT].reshape(HEADS, h.d_block, CONTENT)
                slots, rows = ring_rows(h, g, layer)
                assert (heads[:, slots] == rows).all(), f"group {g} layer {layer} ring, {h}"
                continue
            tokens = attention_tokens(h, 1, d_groups[g], kind)
            for row, b in enumerate(d_groups[g].tolist()):
                got, exp = page_view(d, layer, b), page_view(want, layer, b)
                for k in range(h.d_ppl):
                    size = d.page // h.d_ppl
                    toks = tokens[row, k * kernel : (k + 1) * kernel]
                    real = (toks < h.tokens) & (toks >= p_first * h.p_block)
                    for head in range(HEADS):
                        lo = k * size + head * kernel * CONTENT
                        g_rows = got[lo : lo + kernel * CONTENT].reshape(kernel, CONTENT)
                        e_rows = exp[lo : lo + kernel * CONTENT].reshape(kernel, CONTENT)
                        assert (g_rows[real] == e_rows[real]).all(), (
                            f"group {g} layer {layer} block {b} head {head}: wrong tokens, {h}"
                        )
    assert (d.buf[~touched] == SENTINEL).all(), f"bytes outside the consumer's pages written, {h}"


def run(h: Hybrid) -> int:
    rng = np.random.default_rng(abs(hash(repr(h))) % (1 << 32))
    p_groups, d_groups = lists(h, rng)
    p, d = make_side(h, 0), make_side(h, 1)
    write_side(h, p, 0, p_groups)
    before = p.buf.copy()
    sides = {p.base: p, d.base: d}
    if h.mode == "pull":
        layout = PeerLayout(d.geometry, RemoteGeometry.from_local(p.geometry), mode="pull")
        assert_rows_in_tables(layout, d_groups, p_groups, h.tokens)
        plan = layout.plan(d_groups, p_groups, num_tokens=h.tokens)
        src, dst = plan.remote_descs, plan.local_descs
        zero = plan.local_zero
    else:
        layout = PeerLayout(p.geometry, RemoteGeometry.from_local(d.geometry), mode="push")
        assert_rows_in_tables(layout, p_groups, d_groups, h.tokens)
        plan = layout.plan(p_groups, d_groups, num_tokens=h.tokens)
        src, dst = plan.local_descs, plan.remote_descs
        zero = plan.remote_zero
    for (sa, n, _), (da, m, _) in zip(src.tolist(), dst.tolist(), strict=True):
        assert n == m
        s_side, d_side = sides[sa - sa % SPACE], sides[da - da % SPACE]
        so, do = sa - s_side.base, da - d_side.base
        d_side.buf[do : do + n] = s_side.buf[so : so + n]
    for addr, n, _ in zero.tolist():
        d.buf[addr - d.base : addr - d.base + n] = 0
    check_consumer(h, d, p_groups, d_groups)
    assert (p.buf == before).all(), "the producer's KV was written"
    return plan.num_descs


@st.composite
def hybrids(draw: st.DrawFn) -> Hybrid:
    extra = draw(
        st.sampled_from(
            [("swa",), ("ssm",), ("swa", "ssm"), (), ("ring",), ("swa", "ring"), ("ring", "ssm")]
        )
    )
    kinds = ("full", *extra)
    ring = "ring" in kinds  # its capacity is the model's: one block size, one kernel split
    p_block = draw(st.sampled_from([8, 16, 32]))
    d_block = p_block if ring else draw(st.sampled_from([8, 16, 32]))
    p_ppl = draw(st.sampled_from([1, 2]))
    tokens = draw(st.integers(1, 96))
    d_total = -(-tokens // d_block)
    return Hybrid(
        kinds=kinds,
        layers=tuple(draw(st.integers(1, 2)) for _ in kinds),
        p_block=p_block,
        d_block=d_block,
        p_ppl=p_ppl,
        d_ppl=p_ppl if ring else draw(st.sampled_from([1, 2])),
        tokens=tokens,
        hits=draw(st.integers(0, d_total - 1)),
        window=draw(st.sampled_from([5, 20, 40])),
        mode=draw(st.sampled_from(["pull", "push"])),
        named=draw(st.booleans()),
    )


@settings(max_examples=300, deadline=None, derandomize=True)
@given(h=hybrids())
def test_shared_regions_move_each_group_as_its_own_kind(h: Hybrid) -> None:
    run(h)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_ring_over_another_groups_region_moves_there_alone(mode: str) -> None:
    """vLLM 0.31.0's Glm5Next in small, in kernel blocks of half a block, each slab
    advertised as its first group's and naming the groups it holds: a slab of the full
    group, a state and a ring, beside one of the full group and the ring alone (the state
    moves in the first only); then a slab of all three beside one of the full group alone
    (the ring and the state are written nowhere in it). A ring moves where it lies, all of
    its kernel blocks."""
    run(Hybrid(("full", "ssm", "ring"), (2, 1, 2), 16, 16, 2, 2, 40, 0, 20, mode, True))
    run(Hybrid(("full", "ring", "ssm"), (2, 1, 1), 16, 16, 2, 2, 9, 0, 20, mode, True))


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_attention_next_to_mamba_state_in_one_slab(mode: str) -> None:
    """The issue's case: one slab holds the full group's pages and the SSM group's state;
    the state moves whole at its own id, not as the full group's next tokens."""
    run(Hybrid(("full", "ssm"), (1, 1), 16, 16, 1, 1, 40, 0, 20, mode))
    run(Hybrid(("full", "swa", "ssm"), (2, 2, 1), 16, 16, 1, 1, 70, 1, 20, mode))


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_ring_beside_attention_moves_whole_at_its_own_id(mode: str) -> None:
    """A ring's one block pairs with the consumer's one block, all its slots moved: a
    prompt longer than the ring (slots overwritten) and one shorter."""
    run(Hybrid(("full", "ring"), (2, 2), 16, 16, 1, 1, 40, 0, 20, mode))
    run(Hybrid(("full", "swa", "ring"), (2, 1, 2), 16, 16, 1, 1, 9, 0, 20, mode))


@pytest.mark.parametrize("kind", ["ssm", "ring"])
@pytest.mark.parametrize("producer_tokens", [39, 41, 47])
def test_a_state_for_another_count_is_refused(producer_tokens: int, kind: str) -> None:
    """A state or a ring is the prompt's last one: a producer that computed another count
    than the consumer's lists end at (even within the same last block) holds the wrong
    one."""
    h = Hybrid(("full", kind), (1, 1), 16, 16, 1, 1, 40, 0, 20, "pull")
    p_groups, d_groups = lists(h, np.random.default_rng(0))
    p, d = make_side(h, 0), make_side(h, 1)
    layout = PeerLayout(d.geometry, RemoteGeometry.from_local(p.geometry), mode="pull")
    words = "a state is for one token count" if producer_tokens > 40 else "it lacks the rest"
    with pytest.raises(RemoteProtocolError, match=words):
        layout.plan(d_groups, p_groups, num_tokens=40, producer_tokens=producer_tokens)


def test_a_ring_pairs_only_with_rings_of_its_own_block() -> None:
    """A ring's capacity is the model's, one page a side: its kernel blocks apart, a peer
    of another block size or kernel split, or a region of ring kind are refused by name."""
    from dataclasses import replace

    from kvwire.errors import ConfigError, IncompatiblePeerError

    h = Hybrid(("full", "ring"), (1, 1), 16, 16, 1, 1, 40, 0, 20, "pull")
    d = make_side(h, 1).geometry
    apart = [replace(r, block_len=r.block_len // 2, num_blocks=r.num_blocks * 2) for r in d.regions]
    apart = [replace(r, block_stride=r.block_len * 2) for r in apart]
    with pytest.raises(ConfigError, match="kernel blocks that do not abut"):
        KVGeometry(
            apart, block_size=16, physical_blocks_per_logical=2, group_kinds=d.group_kinds,
            total_kv_heads=HEADS,
        )  # fmt: skip
    split = make_side(replace(h, p_ppl=2, d_ppl=2), 0)
    with pytest.raises(IncompatiblePeerError, match="same block and kernel sizes"):
        PeerLayout(d, RemoteGeometry.from_local(split.geometry), mode="pull")
    # In kernel blocks a ring of head-sharded pages moves as bytes: one layout a side, and
    # the peer's kernel blocks abutting too.
    ours = make_side(replace(h, p_ppl=2, d_ppl=2), 1).geometry
    nhd = RemoteGeometry.from_local(replace(split.geometry, kv_cache_layout="NHD"))
    with pytest.raises(IncompatiblePeerError, match="only between equal TP sizes and one layout"):
        PeerLayout(ours, nhd, mode="pull")
    remote = RemoteGeometry.from_local(split.geometry)
    spaced = [replace(r, block_stride=r.block_len * 2) for r in remote.regions]
    remote = replace(remote, regions=spaced)
    with pytest.raises(IncompatiblePeerError, match="they must abut"):
        PeerLayout(ours, remote, mode="pull")
    ring_region = BlockRegion(base_addr=1 << 20, block_len=256, num_blocks=4, kind=RegionKind.RING)
    with pytest.raises(ConfigError, match="ring is a KV-cache group's kind"):
        KVGeometry([ring_region], block_size=16, total_kv_heads=HEADS)
    other = make_side(Hybrid(("full", "ring"), (1, 1), 32, 32, 1, 1, 40, 0, 20, "pull"), 0)
    with pytest.raises(IncompatiblePeerError, match="a ring group's block is the model's ring"):
        PeerLayout(d, RemoteGeometry.from_local(other.geometry), mode="pull")
