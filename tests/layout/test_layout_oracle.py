"""Descriptors proven on real bytes.

The logical KV of a sequence is one array ``[layers, K/V, tokens, heads, head_dim]`` whose
every element is its own flat index. The oracle lays it out into each rank's buffer with
plain numpy reshapes and transposes (no kvwire code); kvwire's descriptors then move bytes
between the producer's buffers and the consumer's, and each consumer buffer must equal the
oracle laid out for the consumer: every listed block holds the right tokens, nothing
outside the listed blocks is touched, and whatever the transfer does not write is covered
by the zero ranges.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest

from kvwire.layout import Descs, PeerLayout, TransferPlan, topology
from kvwire.layout.alignment import Mode
from kvwire.layout.geometry import BlockRegion, KVGeometry, RegionKind, RemoteGeometry, rank_heads

HEAD_DIM = 2  # int32 elements per head per K or V
ITEM = 4
SENTINEL = -1
CAPACITY = 32  # logical blocks per region
SPACE = 1 << 32  # each buffer gets its own 4 GiB of fake address space


@dataclass(frozen=True)
class Side:
    tp: int = 1
    layout: str = "HND"
    block: int = 16  # logical tokens per block
    ppl: int = 1  # kernel blocks per logical block
    pad: int = 0  # bytes between a block's payload and the next block


@dataclass(frozen=True)
class Case:
    p: Side
    d: Side
    heads: int = 4
    layers: int = 2
    kv_split: bool = False  # K and V in separate regions
    mla: bool = False
    groups: int = 1
    tokens: int = 45
    hits: int = 0  # consumer prefix-cache hits, in consumer logical blocks
    coalesce: bool = True
    contiguous: bool = False
    pass_tokens: bool = True
    mode: str = "pull"
    members: bool = False  # advertise layer names (pairs regions by name)
    packed: str = ""  # "p" or "d": that side packs every layer's page into one row (v13)
    window: int = 0  # group 1 is a sliding window of this many tokens (its lists are clipped)

    def __str__(self) -> str:
        p, d = self.p, self.d
        bits = [
            f"{self.mode}",
            f"P{p.tp}{p.layout}b{p.block}k{p.block // p.ppl}",
            f"D{d.tp}{d.layout}b{d.block}k{d.block // d.ppl}",
            f"h{self.heads}",
        ]
        if self.packed:
            bits.append(f"packed{self.packed}")
        if self.window:
            bits.append(f"win{self.window}")
        for flag in ("kv_split", "mla", "contiguous", "members"):
            if getattr(self, flag):
                bits.append(flag)
        if self.groups > 1:
            bits.append(f"g{self.groups}")
        if self.hits:
            bits.append(f"hit{self.hits}")
        if not self.coalesce:
            bits.append("nocoal")
        if not self.pass_tokens:
            bits.append("notok")
        if p.pad or d.pad:
            bits.append("pad")
        return "-".join(bits)


# ----------------------------------------------------------------------------------------
# The oracle: numpy layouts of the logical KV, independent of kvwire's descriptor code
# ----------------------------------------------------------------------------------------


@dataclass
class RegionSpec:
    layer: int
    parts: tuple[int, ...]  # 0 = K, 1 = V
    group: int
    offset: int  # from the buffer start
    block_len: int
    stride: int
    num_blocks: int  # kernel blocks
    name: str


@dataclass
class RankBuffer:
    base: int
    device: int
    buf: np.ndarray  # uint8
    regions: list[RegionSpec]
    heads: np.ndarray
    geometry: KVGeometry
    packed: bool = False


def region_plan(case: Case, side: Side) -> list[tuple[int, tuple[int, ...], str]]:
    out: list[tuple[int, tuple[int, ...], str]] = []
    for layer in range(case.layers):
        if case.mla:
            out.append((layer, (0,), f"layers.{layer}"))
        elif case.kv_split:
            out.append((layer, (0,), f"layers.{layer}.k"))
            out.append((layer, (1,), f"layers.{layer}.v"))
        else:
            out.append((layer, (0, 1), f"layers.{layer}"))
    return out


def make_rank(case: Case, side: Side, rank: int, who: int) -> RankBuffer:
    total_heads = 1 if case.mla else case.heads
    heads = rank_heads(rank, side.tp, total_heads)
    kernel = side.block // side.ppl
    num_blocks = CAPACITY * side.ppl
    packed = case.packed == ("p" if who == 0 else "d")
    layers = region_plan(case, side)
    pages = [len(heads) * kernel * len(parts) * HEAD_DIM * ITEM for _, parts, _ in layers]
    specs: list[RegionSpec] = []
    regions_meta: list[tuple[int, int, int, list[str], dict[str, tuple[int, int]], int]] = []
    offset = 0
    if packed:
        row = sum(pages)
        stride = row + side.pad
        inside = 0
        for (layer, parts, name), page in zip(layers, pages, strict=True):
            specs.append(
                RegionSpec(layer, parts, 0, offset + inside, page, stride, num_blocks, name)
            )
            inside += page
        packed_members = {s.name: (s.offset - offset, s.block_len) for s in specs}
        regions_meta.append((offset, row, stride, [s.name for s in specs], packed_members, 0))
        offset += stride * num_blocks + stride
    else:
        for (layer, parts, name), page in zip(layers, pages, strict=True):
            stride = page + side.pad
            group = layer % case.groups
            specs.append(RegionSpec(layer, parts, group, offset, page, stride, num_blocks, name))
            regions_meta.append((offset, page, stride, [name], {}, group))
            offset += stride * num_blocks + 64  # a gap between regions
    base = (who * 64 + rank + 1) * SPACE
    device = who * 100 + rank
    buf = np.full(offset // ITEM, SENTINEL, dtype=np.int32).view(np.uint8)
    regions = [
        BlockRegion(
            base_addr=base + start,
            block_len=length,
            num_blocks=num_blocks,
            block_stride=stride,
            group_id=group,
            name=names[0] if len(names) == 1 else f"row{who}",
            members=tuple(names) if case.members else (),
            packed_members=packed_members,
            kind=RegionKind.REPLICATED if case.mla else RegionKind.ATTENTION,
        )
        for start, length, stride, names, packed_members, group in regions_meta
    ]
    geometry = KVGeometry(
        regions,
        kv_cache_layout=side.layout,
        block_size=side.block,
        physical_blocks_per_logical=side.ppl,
        total_kv_heads=total_heads,
        tp_rank=rank,
        tp_size=side.tp,
        is_mla=case.mla,
        device_id=device,
    )
    return RankBuffer(base, device, buf, specs, heads, geometry, packed)


def logical_kv(case: Case, padded_tokens: int) -> np.ndarray:
    heads = 1 if case.mla else case.heads
    shape = (case.layers, 2, padded_tokens, heads, HEAD_DIM)
    return np.arange(np.prod(shape), dtype=np.int32).reshape(shape)


def kernel_tokens(side: Side, logical_ids: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray]:
    """Kernel block ids of a logical list and the token index of every slot, ``[nb, K]``."""
    kernel = side.block // side.ppl
    kernel_ids = (logical_ids[:, None] * side.ppl + np.arange(side.ppl)[None, :]).reshape(-1)
    tokens = start + np.arange(kernel_ids.size * kernel).reshape(-1, kernel)
    return kernel_ids, tokens


def block_view(rb: RankBuffer, spec: RegionSpec) -> np.ndarray:
    rows = rb.buf[spec.offset : spec.offset + spec.stride * spec.num_blocks]
    return rows.reshape(spec.num_blocks, spec.stride)


def to_blocks(values: np.ndarray, layout: str) -> np.ndarray:
    """``[nb, K, H, C]`` token-major values into ``[nb, block bytes]`` in a layout."""
    if layout == "HND":
        values = values.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(values).reshape(values.shape[0], -1).view(np.uint8)


def from_blocks(raw: np.ndarray, layout: str, kernel: int, heads: int) -> np.ndarray:
    """Inverse of :func:`to_blocks`: ``[nb, block bytes]`` back to ``[nb, K, H, C]``."""
    ints = np.ascontiguousarray(raw).view(np.int32)
    if layout == "HND":
        return ints.reshape(raw.shape[0], heads, kernel, -1).transpose(0, 2, 1, 3)
    return ints.reshape(raw.shape[0], kernel, heads, -1)


def expected_values(
    kv: np.ndarray, spec: RegionSpec, heads: np.ndarray, tokens: np.ndarray
) -> np.ndarray:
    """``[nb, K, H, parts * head_dim]`` of the logical KV at these tokens and heads."""
    sel: np.ndarray = kv[spec.layer][list(spec.parts)]  # [P, T, H, D]
    sel = sel[:, tokens][:, :, :, heads]  # [P, nb, K, H, D]
    sel = sel.transpose(1, 2, 3, 0, 4)  # [nb, K, H, P, D]
    return sel.reshape(*sel.shape[:3], -1)


def lay_out(
    rb: RankBuffer, side: Side, kv: np.ndarray, ids: list[np.ndarray], starts: list[int]
) -> None:
    for spec in rb.regions:
        kernel_ids, tokens = kernel_tokens(side, ids[spec.group], starts[spec.group])
        values = expected_values(kv, spec, rb.heads, tokens)
        block_view(rb, spec)[kernel_ids, : spec.block_len] = to_blocks(values, side.layout)


# ----------------------------------------------------------------------------------------
# Moving bytes along descriptor rows
# ----------------------------------------------------------------------------------------


def locate(buffers: dict[int, RankBuffer], rows: Descs) -> list[tuple[RankBuffer, int, int]]:
    out = []
    for addr, length, device in rows.tolist():
        rb = buffers[addr - addr % SPACE]
        assert device == rb.device, f"descriptor device {device} != buffer device {rb.device}"
        offset = addr - rb.base
        assert length > 0 and offset >= 0 and offset + length <= rb.buf.size
        out.append((rb, offset, length))
    return out


def copy_rows(buffers: dict[int, RankBuffer], src: Descs, dst: Descs) -> None:
    assert src.shape == dst.shape and src.dtype == np.int64 and dst.dtype == np.int64
    for (s, so, n), (d, do, m) in zip(locate(buffers, src), locate(buffers, dst), strict=True):
        assert n == m
        d.buf[do : do + n] = s.buf[so : so + n]


def zero_rows(buffers: dict[int, RankBuffer], rows: Descs) -> None:
    for rb, offset, length in locate(buffers, rows):
        rb.buf[offset : offset + length] = 0


# ----------------------------------------------------------------------------------------
# The check
# ----------------------------------------------------------------------------------------


def pick_ids(rng: np.random.Generator, count: int, contiguous: bool) -> np.ndarray:
    if contiguous:
        start = int(rng.integers(0, CAPACITY - count + 1))
        return np.arange(start, start + count, dtype=np.int64)
    return rng.permutation(CAPACITY)[:count].astype(np.int64)


def run_case(case: Case) -> dict[str, int]:
    rng = np.random.default_rng(abs(hash(str(case))) % (1 << 32))
    p_total = -(-case.tokens // case.p.block)
    d_total = -(-case.tokens // case.d.block)
    assert case.hits < d_total
    window_start = max(0, case.tokens - case.window) if case.window else 0
    p_first = [window_start // case.p.block if g == 1 else 0 for g in range(case.groups)]
    d_first = [
        max(case.hits, window_start // case.d.block if g == 1 else 0) for g in range(case.groups)
    ]
    p_ids = [pick_ids(rng, p_total - p_first[g], case.contiguous) for g in range(case.groups)]
    d_ids = [pick_ids(rng, d_total - d_first[g], case.contiguous) for g in range(case.groups)]
    p_starts = [f * case.p.block for f in p_first]
    d_starts = [f * case.d.block for f in d_first]
    padded = max(p_total * case.p.block, d_total * case.d.block)
    kv = logical_kv(case, padded)

    producers = [make_rank(case, case.p, r, 0) for r in range(case.p.tp)]
    consumers = [make_rank(case, case.d, r, 1) for r in range(case.d.tp)]
    buffers = {rb.base: rb for rb in producers + consumers}
    for rb in producers:
        lay_out(rb, case.p, kv, p_ids, p_starts)

    num_tokens = case.tokens if case.pass_tokens else None
    stats = {"descs": 0, "empty_plans": 0}
    zeros: list[Descs] = []

    def plan_between(local: RankBuffer, remote: RankBuffer, mode: Mode) -> TransferPlan:
        layout = PeerLayout(
            local.geometry,
            RemoteGeometry.from_local(remote.geometry),
            mode=mode,
            coalesce=case.coalesce,
        )
        if mode == "pull":
            return layout.plan(d_ids, p_ids, num_tokens=num_tokens)
        return layout.plan(p_ids, d_ids, num_tokens=num_tokens)

    if case.mode == "pull":
        for d, consumer in enumerate(consumers):
            for p in topology.remote_tp_ranks(d, case.d.tp, case.p.tp):
                plan = plan_between(consumer, producers[p], "pull")
                assert plan.remote_zero.shape == (0, 3)
                copy_rows(buffers, plan.remote_descs, plan.local_descs)
                zeros.append(plan.local_zero)
                stats["descs"] += plan.num_descs
                stats["empty_plans"] += plan.is_empty
    else:
        for p, producer in enumerate(producers):
            for d in topology.consumer_ranks_of_producer(p, case.p.tp, case.d.tp):
                plan = plan_between(producer, consumers[d], "push")
                assert plan.local_zero.shape == (0, 3)
                # The consumer reading the same pair would move exactly the same bytes.
                mirror = plan_between(consumers[d], producer, "pull")
                np.testing.assert_array_equal(plan.local_descs, mirror.remote_descs)
                np.testing.assert_array_equal(plan.remote_descs, mirror.local_descs)
                np.testing.assert_array_equal(plan.remote_zero, mirror.local_zero)
                copy_rows(buffers, plan.local_descs, plan.remote_descs)
                zeros.append(plan.remote_zero)
                stats["descs"] += plan.num_descs
                stats["empty_plans"] += plan.is_empty
    for rows in zeros:
        zero_rows(buffers, rows)

    kernel = case.d.block // case.d.ppl
    for consumer in consumers:
        for spec in consumer.regions:
            kernel_ids, tokens = kernel_tokens(case.d, d_ids[spec.group], d_starts[spec.group])
            rows = block_view(consumer, spec)
            got = from_blocks(
                rows[kernel_ids, : spec.block_len], case.d.layout, kernel, len(consumer.heads)
            )
            want = expected_values(kv, spec, consumer.heads, tokens)
            # Tokens before the producer's list (outside its window) are zeroed, not moved.
            real = (tokens < case.tokens) & (tokens >= p_starts[spec.group])
            np.testing.assert_array_equal(
                got[real],
                want[real],
                err_msg=f"{case} region {spec.name} rank heads {consumer.heads}",
            )
            assert not (got == SENTINEL).any(), (
                f"{case} region {spec.name}: bytes neither moved nor zeroed"
            )
            untouched = np.ones(spec.num_blocks, dtype=bool)
            untouched[kernel_ids] = False
            assert (rows[untouched, : spec.block_len].view(np.int32) == SENTINEL).all(), (
                "a block outside the list was written"
            )
            if not consumer.packed:  # a packed row's other bytes are other layers' pages
                padding = rows[:, spec.block_len :].view(np.int32)
                assert (padding == SENTINEL).all(), "padding was written"
    for producer in producers:  # sources are read only
        fresh = make_rank(case, case.p, producer.geometry.tp_rank, 0)
        lay_out(fresh, case.p, kv, p_ids, p_starts)
        np.testing.assert_array_equal(fresh.buf, producer.buf)
    return stats


# ----------------------------------------------------------------------------------------
# The cases
# ----------------------------------------------------------------------------------------

TP_PAIRS = [(1, 1), (2, 4), (4, 2), (1, 8), (8, 1)]
LAYOUTS = ["HND", "NHD"]


def _cases() -> list[Case]:
    cases: list[Case] = []
    # Heterogeneous TP x layouts, 8 heads, both modes.
    for p_tp, d_tp in TP_PAIRS:
        for layout in LAYOUTS:
            for mode in ("pull", "push"):
                cases.append(
                    Case(Side(p_tp, layout), Side(d_tp, layout), heads=8, mode=mode, tokens=37)
                )
    # GQA: fewer KV heads than TP ranks on one or both sides.
    for p_tp, d_tp in [(1, 4), (4, 1), (8, 2), (2, 8), (4, 8), (8, 4), (8, 8)]:
        for mode in ("pull", "push"):
            cases.append(Case(Side(p_tp), Side(d_tp), heads=2, mode=mode, tokens=33))
    # MLA: replicated, read once.
    for p_tp, d_tp in TP_PAIRS:
        cases.append(Case(Side(p_tp, "NHD"), Side(d_tp, "NHD"), mla=True, tokens=50))
    cases.append(Case(Side(4), Side(2), mla=True, mode="push", tokens=50))
    cases.append(Case(Side(2), Side(4), mla=True, mode="push", tokens=50))
    # Block-size ratios both ways, with kernel/logical ratios on either side.
    for p_side, d_side in [
        (Side(2, "HND", 4), Side(2, "HND", 16)),
        (Side(2, "NHD", 4), Side(2, "NHD", 16)),
        (Side(1, "HND", 16), Side(2, "HND", 4)),
        (Side(2, "NHD", 16), Side(1, "NHD", 8)),
        (Side(1, "HND", 32, 2), Side(1, "HND", 16)),
        (Side(1, "NHD", 16), Side(1, "NHD", 32, 4)),
        (Side(2, "HND", 32, 4), Side(4, "HND", 16, 2)),
        (Side(4, "NHD", 8, 2), Side(2, "HND", 32, 2)),
    ]:
        for mode in ("pull", "push"):
            cases.append(Case(p_side, d_side, tokens=45, mode=mode))
    # Mixed layouts on the two sides.
    cases.append(Case(Side(2, "HND"), Side(4, "NHD"), tokens=29))
    cases.append(Case(Side(4, "NHD"), Side(1, "HND", 8), tokens=29, mode="push"))
    # Prefix hits, with and without the token count.
    for p_side, d_side, hits, pass_tokens in [
        (Side(1), Side(1), 1, True),
        (Side(1), Side(1), 2, False),
        (Side(2, "HND", 16, 2), Side(4, "HND", 16), 1, False),
        (Side(1, "HND", 4), Side(2, "HND", 16), 1, True),
        (Side(2, "NHD", 32), Side(1, "NHD", 8), 3, True),
        (Side(1, "NHD", 8), Side(1, "NHD", 16, 2), 2, True),
    ]:
        for mode in ("pull", "push"):
            cases.append(
                Case(p_side, d_side, hits=hits, pass_tokens=pass_tokens, tokens=61, mode=mode)
            )
    # Multiple regions (K and V apart) and KV-cache groups.
    cases.append(Case(Side(2), Side(4), kv_split=True, layers=3))
    cases.append(
        Case(Side(4, "NHD"), Side(2, "NHD"), kv_split=True, groups=2, layers=3, mode="push")
    )
    cases.append(Case(Side(1), Side(1), groups=3, layers=5, hits=1))
    cases.append(Case(Side(2, "HND", 8), Side(2, "HND", 16), groups=2, layers=4, kv_split=True))
    # A sliding-window group: both sides hold only the window's tail blocks.
    for p_side, d_side in [
        (Side(1), Side(1)),
        (Side(2, "HND", 8), Side(1, "HND", 16)),
        (Side(1, "NHD", 32, 2), Side(2, "NHD", 8)),
    ]:
        for mode in ("pull", "push"):
            cases.append(
                Case(p_side, d_side, groups=2, layers=4, window=20, tokens=70, hits=1, mode=mode)
            )
    # Padding between blocks, layer-name pairing.
    cases.append(Case(Side(2, "HND", 16, 1, 24), Side(4, "HND", 16, 1, 8), tokens=40))
    cases.append(Case(Side(2), Side(2), members=True, layers=3, mode="push"))
    cases.append(Case(Side(1, "NHD"), Side(2, "NHD"), members=True, kv_split=True))
    # v13 packed rows on either side, paired by layer name.
    for packed in ("p", "d"):
        for mode in ("pull", "push"):
            cases.append(
                Case(Side(2), Side(2), members=True, mla=True, packed=packed, layers=3, mode=mode)
            )
        cases.append(
            Case(Side(1, "HND", 16, 1, 32), Side(2), members=True, packed=packed, layers=2)
        )
        cases.append(
            Case(Side(2, "NHD", 8), Side(1, "NHD", 16), members=True, packed=packed, kv_split=True)
        )
    # Contiguous allocation (what coalescing feeds on), coalescing on and off.
    more: list[Case] = []
    for case in cases:
        if case.mode == "pull" and not case.hits and case.groups == 1:
            more.append(replace(case, contiguous=True))
            more.append(replace(case, coalesce=False))
    return cases + more


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_descriptors_move_the_right_bytes(case: Case) -> None:
    run_case(case)


def test_coalescing_reduces_contiguous_requests_to_one_descriptor_per_region() -> None:
    base = Case(Side(1), Side(1), heads=8, layers=4, contiguous=True, tokens=64)
    merged = run_case(base)
    per_block = run_case(replace(base, coalesce=False))
    # 4 blocks of 16 tokens, 4 regions: 16 descriptors, or one per region.
    assert per_block["descs"] == 16
    assert merged["descs"] == 4


def test_hetero_tp_with_nhd_costs_one_descriptor_per_token_run() -> None:
    hnd = run_case(Case(Side(1, "HND"), Side(2, "HND"), heads=8, tokens=32, coalesce=False))
    nhd = run_case(Case(Side(1, "NHD"), Side(2, "NHD"), heads=8, tokens=32, coalesce=False))
    # HND: one slice per block; NHD: one run of heads per token.
    assert hnd["descs"] == 2 * 2 * 2  # consumer ranks x regions x blocks
    assert nhd["descs"] == 2 * 2 * 32


def test_gqa_duplicate_holders_send_notification_only() -> None:
    stats = run_case(Case(Side(8), Side(2), heads=2, tokens=20))
    # Each consumer rank holds one head and talks to 4 producer ranks that all hold it:
    # the first sends the data, the other 3 only get the completion notification.
    assert stats["empty_plans"] == 2 * 3


def test_mla_reads_one_rank_only() -> None:
    stats = run_case(Case(Side(8, "NHD"), Side(1, "NHD"), mla=True, tokens=20))
    assert stats["empty_plans"] == 7


# ----------------------------------------------------------------------------------------
# Random geometries: whatever the combination, the bytes must land where the oracle says
# ----------------------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def sides(draw: st.DrawFn) -> Side:
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    block = draw(st.sampled_from([4, 8, 16, 32]))
    ppl = draw(st.sampled_from([p for p in (1, 2, 4) if block // p >= 2]))
    return Side(tp, draw(st.sampled_from(LAYOUTS)), block, ppl, draw(st.sampled_from([0, 8])))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    p, d = draw(sides()), draw(sides())
    tokens = draw(st.integers(1, 90))
    d_total = -(-tokens // d.block)
    mla = draw(st.booleans())
    packed = draw(st.sampled_from(["", "", "p", "d"]))
    return Case(
        p,
        d,
        heads=draw(st.sampled_from([1, 2, 4, 8])),
        layers=draw(st.integers(1, 3)),
        kv_split=not mla and draw(st.booleans()),
        mla=mla,
        groups=1 if packed else 2,
        tokens=tokens,
        hits=draw(st.integers(0, d_total - 1)),
        window=draw(st.sampled_from([0, 0, 5, 24])),
        coalesce=draw(st.booleans()),
        contiguous=draw(st.booleans()),
        pass_tokens=True,
        mode=draw(st.sampled_from(["pull", "push"])),
        members=bool(packed) or draw(st.booleans()),
        packed=packed,
    )


@settings(max_examples=150, deadline=None, derandomize=True)
@given(cases())
def test_random_geometries_move_the_right_bytes(case: Case) -> None:
    run_case(case)
