"""Where every (layer, K/V, token, head, channel) of a sequence lives in a rank's KV cache.

An oracle independent of kvwire's descriptor code: the logical KV of a sequence is one array
``[layers, K/V, tokens, heads, head_dim]`` of int32 whose every element is its own flat
index, laid out into each rank's buffer with plain numpy reshapes and transposes. A test
moves bytes with kvwire (the planner alone, or the whole runtime between processes) and
then asks :func:`check_consumer` whether each consumer buffer equals the oracle laid out
for it: every token the consumer must hold is right, no block outside its lists and no
padding was touched, and (where the mover promises it) nothing inside its blocks was left
neither moved nor zeroed.

A :class:`Case` names one P/D pair: each side's TP size, layout, logical block size,
kernel blocks per logical block and padding; the model's heads and layers, K and V apart
or together, MLA, KV-cache groups (group 1 a sliding window when ``window`` is set, the
last a ring when ``ring`` is), the consumer's prefix-cache hits, and the mode.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvwire.layout.geometry import BlockRegion, KVGeometry, RegionKind, rank_heads

HEAD_DIM = 2
"""int32 elements per head per K or V."""
ITEM = 4
SENTINEL = -1
"""What every int32 of a fresh buffer holds: a byte still equal to it was never written."""
CAPACITY = 32
"""Logical blocks per region."""
SPACE = 1 << 32
"""Fake address space per buffer when no real memory is registered (planner-only tests)."""

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Side:
    """One engine's choices."""

    tp: int = 1
    layout: str = "HND"
    block: int = 16
    """Logical tokens per block."""
    ppl: int = 1
    """Kernel blocks per logical block."""
    pad: int = 0
    """Bytes between a block's payload and the next block."""

    @property
    def kernel(self) -> int:
        return self.block // self.ppl


@dataclass(frozen=True)
class Case:
    """One P/D pair and one request between them."""

    p: Side
    d: Side
    heads: int = 4
    layers: int = 2
    kv_split: bool = False
    """K and V in separate regions."""
    mla: bool = False
    groups: int = 1
    tokens: int = 45
    hits: int = 0
    """Consumer prefix-cache hits, in consumer logical blocks."""
    coalesce: bool = True
    contiguous: bool = False
    pass_tokens: bool = True
    """The producer passes the prompt's token count (``remote_num_tokens``)."""
    mode: str = "pull"
    members: bool = False
    """Advertise layer names (pairs regions by name)."""
    packed: str = ""
    """``p`` or ``d``: that side packs every layer's page into one row (v13)."""
    window: int = 0
    """Group 1 is a sliding window of this many tokens (both sides' lists are clipped)."""
    past: int = 0
    """Tokens the producer computed beyond the consumer's prompt (it generated past it):
    its lists, and its window, end that much later."""
    ring: bool = False
    """The last group is a ring (vLLM's ``CircularBufferSpec``): one block a side whose
    slot ``t % block`` holds token ``t``, the latest ``block`` tokens' (both sides' blocks
    equal, one kernel block each: its capacity is the model's)."""
    ids_form: str = "lists"
    """How the engines pass their block ids: ``lists`` (one list of ints per group, right)
    or a mistake kvwire must refuse at the call: ``flat`` (one list for all groups),
    ``float`` or ``str`` ids."""

    def __str__(self) -> str:
        p, d = self.p, self.d
        bits = [
            f"{self.mode}",
            f"P{p.tp}{p.layout}b{p.block}k{p.kernel}",
            f"D{d.tp}{d.layout}b{d.block}k{d.kernel}",
            f"h{self.heads}",
            f"t{self.tokens}",
        ]
        if self.packed:
            bits.append(f"packed{self.packed}")
        if self.window:
            bits.append(f"win{self.window}")
        if self.past:
            bits.append(f"past{self.past}")
        if self.ring:
            bits.append("ring")
        for flag in ("kv_split", "mla", "contiguous", "members"):
            if getattr(self, flag):
                bits.append(flag)
        if self.layers != 2:
            bits.append(f"l{self.layers}")
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
        if self.ids_form != "lists":
            bits.append(f"ids-{self.ids_form}")
        return "-".join(bits)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Case:
        fields = dict(raw)
        fields["p"] = Side(**fields["p"])
        fields["d"] = Side(**fields["d"])
        return cls(**fields)

    @property
    def total_heads(self) -> int:
        return 1 if self.mla else self.heads


# ----------------------------------------------------------------------------------------
# One rank's buffer and geometry
# ----------------------------------------------------------------------------------------


@dataclass
class RegionSpec:
    layer: int
    parts: tuple[int, ...]
    """0 = K, 1 = V."""
    group: int
    offset: int
    """From the buffer start."""
    block_len: int
    stride: int
    num_blocks: int
    """Kernel blocks."""
    name: str


@dataclass
class RankBuffer:
    base: int
    device: int
    buf: npt.NDArray[np.uint8]
    regions: list[RegionSpec]
    heads: IntArray
    geometry: KVGeometry
    side: Side
    packed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _region_plan(case: Case) -> list[tuple[int, tuple[int, ...], str]]:
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


def make_rank(case: Case, who: int, rank: int, *, real: bool = False) -> RankBuffer:
    """Rank ``rank`` of the producer (``who`` 0) or the consumer (1), every byte SENTINEL.

    ``real`` describes the buffer's own memory (DRAM, device 0) so a transport can register
    it; otherwise each buffer gets a fake address space of its own.
    """
    side = case.p if who == 0 else case.d
    heads = rank_heads(rank, side.tp, case.total_heads)
    num_blocks = CAPACITY * side.ppl
    packed = case.packed == ("p" if who == 0 else "d")
    layers = _region_plan(case)
    pages = [len(heads) * side.kernel * len(parts) * HEAD_DIM * ITEM for _, parts, _ in layers]
    specs: list[RegionSpec] = []
    meta: list[tuple[int, int, int, list[str], dict[str, tuple[int, int]], int]] = []
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
        members = {s.name: (s.offset - offset, s.block_len) for s in specs}
        meta.append((offset, row, stride, [s.name for s in specs], members, 0))
        offset += stride * num_blocks + stride
    else:
        for (layer, parts, name), page in zip(layers, pages, strict=True):
            stride = page + side.pad
            group = layer % case.groups
            specs.append(RegionSpec(layer, parts, group, offset, page, stride, num_blocks, name))
            meta.append((offset, page, stride, [name], {}, group))
            offset += stride * num_blocks + 64  # a gap between regions
    buf = np.full(offset // ITEM, SENTINEL, dtype=np.int32).view(np.uint8)
    if real:
        base, device, mem_kind = int(buf.ctypes.data), 0, "DRAM"
    else:
        base, device, mem_kind = (who * 64 + rank + 1) * SPACE, who * 100 + rank, "VRAM"
    regions = [
        BlockRegion(
            base_addr=base + start,
            block_len=length,
            num_blocks=num_blocks,
            block_stride=stride,
            group_id=group,
            mem_kind=mem_kind,
            name=names[0] if len(names) == 1 else f"row{who}",
            members=tuple(names) if case.members else (),
            packed_members=packed_members,
            kind=RegionKind.REPLICATED if case.mla else RegionKind.ATTENTION,
        )
        for start, length, stride, names, packed_members, group in meta
    ]
    geometry = KVGeometry(
        regions,
        kv_cache_layout=side.layout,
        block_size=side.block,
        physical_blocks_per_logical=side.ppl,
        total_kv_heads=case.total_heads,
        tp_rank=rank,
        tp_size=side.tp,
        is_mla=case.mla,
        device_id=device,
        group_kinds=tuple(
            RegionKind.RING if g == ring_group(case) else RegionKind.ATTENTION
            for g in range(case.groups)
        )
        if case.ring
        else (),
    )
    return RankBuffer(base, device, buf, specs, heads, geometry, side, packed)


# ----------------------------------------------------------------------------------------
# The request: block lists and the logical KV
# ----------------------------------------------------------------------------------------


def ring_group(case: Case) -> int | None:
    """The case's ring group (its last), or None."""
    return case.groups - 1 if case.ring else None


def ring_tokens(count: int, block: int) -> IntArray:
    """The token each slot of a ring holds after ``count`` tokens, ``[1, block]``: the
    latest with its slot's remainder; a slot no token reached yet holds its own index's
    (what the engine happened to leave there, the same on both sides once moved)."""
    slots = np.arange(block, dtype=np.int64)
    latest = slots + (count - 1 - slots) // block * block
    return np.where(slots < count, latest, slots)[None, :]


@dataclass(frozen=True)
class Request:
    """Both sides' logical block ids per group and the token each list starts at."""

    p_ids: list[IntArray]
    d_ids: list[IntArray]
    p_starts: list[int]
    d_starts: list[int]
    kv: npt.NDArray[np.int32]
    attended: list[int]
    """Per group, the consumer's first token its next one attends to (its window's)."""
    computed: int = 0
    """Tokens the producer computed (its ring holds the latest of them)."""


def producer_lacks(case: Case, request: Request) -> tuple[bool, bool]:
    """Whether, below the prompt's end, the producer's lists start after a token the
    consumer attends to, and after one its lists hold (a producer past the prompt whose
    window moved on), in a group that has layers (layer ``i`` is in group ``i % groups``);
    both when the producer's ring holds its own count's tokens, not the consumer's.
    """
    spans = [
        (max(request.attended[g], request.d_starts[g]), request.d_starts[g], request.p_starts[g])
        for g in range(min(case.groups, case.layers))
        if len(request.d_ids[g])
    ]
    attended = any(needed < min(held, case.tokens) for needed, _, held in spans)
    listed = any(first < min(held, case.tokens) for _, first, held in spans)
    ring = ring_group(case)
    if ring is not None and ring < case.layers and case.past:  # a ring of another count
        return True, True
    return attended, listed


def engine_ids(case: Case, ids: list[IntArray]) -> list[Any]:
    """Block ids as the case's engine passes them (``ids_form``), mistakes included."""
    if case.ids_form == "flat":
        return [int(b) for group in ids for b in group.tolist()]
    if case.ids_form == "float":
        return [[b + 0.5 for b in group.tolist()] for group in ids]
    if case.ids_form == "str":
        return [[str(b) for b in group.tolist()] for group in ids]
    return [group.tolist() for group in ids]


def _pick(rng: np.random.Generator, count: int, contiguous: bool) -> IntArray:
    if contiguous:
        start = int(rng.integers(0, CAPACITY - count + 1))
        return np.arange(start, start + count, dtype=np.int64)
    return rng.permutation(CAPACITY)[:count].astype(np.int64)


def make_request(case: Case) -> Request:
    """The case's request; the same case gives the same ids in every process."""
    rng = np.random.default_rng(zlib.crc32(str(case).encode()))
    computed = case.tokens + case.past
    p_total = -(-computed // case.p.block)
    d_total = -(-case.tokens // case.d.block)
    p_window = max(0, computed - case.window) if case.window else 0
    window_start = max(0, case.tokens - case.window) if case.window else 0
    p_first = [p_window // case.p.block if g == 1 else 0 for g in range(case.groups)]
    d_first = [
        max(case.hits, window_start // case.d.block if g == 1 else 0) for g in range(case.groups)
    ]
    p_counts = [p_total - p_first[g] for g in range(case.groups)]
    d_counts = [max(0, d_total - d_first[g]) for g in range(case.groups)]
    ring = ring_group(case)
    if ring is not None:  # one block a side, whatever the tokens and hits
        p_first[ring] = d_first[ring] = 0
        p_counts[ring] = d_counts[ring] = 1
    p_ids = [_pick(rng, n, case.contiguous) for n in p_counts]
    d_ids = [_pick(rng, n, case.contiguous) for n in d_counts]
    padded = max(p_total * case.p.block, d_total * case.d.block)
    shape = (case.layers, 2, padded, case.total_heads, HEAD_DIM)
    kv = np.arange(np.prod(shape), dtype=np.int32).reshape(shape)
    return Request(
        p_ids,
        d_ids,
        [f * case.p.block for f in p_first],
        [f * case.d.block for f in d_first],
        kv,
        [window_start if g == 1 and g != ring else 0 for g in range(case.groups)],
        computed,
    )


# ----------------------------------------------------------------------------------------
# Laying out and reading back
# ----------------------------------------------------------------------------------------


def kernel_tokens(side: Side, logical_ids: IntArray, start: int) -> tuple[IntArray, IntArray]:
    """Kernel block ids of a logical list and the token index of every slot, ``[nb, K]``."""
    kernel_ids = (logical_ids[:, None] * side.ppl + np.arange(side.ppl)[None, :]).reshape(-1)
    tokens = start + np.arange(kernel_ids.size * side.kernel).reshape(-1, side.kernel)
    return kernel_ids, tokens


def block_view(rb: RankBuffer, spec: RegionSpec) -> npt.NDArray[np.uint8]:
    rows = rb.buf[spec.offset : spec.offset + spec.stride * spec.num_blocks]
    return rows.reshape(spec.num_blocks, spec.stride)


def _to_blocks(values: npt.NDArray[np.int32], layout: str) -> npt.NDArray[np.uint8]:
    """``[nb, K, H, C]`` token-major values into ``[nb, block bytes]`` in a layout."""
    if layout == "HND":
        values = values.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(values).reshape(values.shape[0], -1).view(np.uint8)


def _from_blocks(
    raw: npt.NDArray[np.uint8], layout: str, kernel: int, heads: int
) -> npt.NDArray[np.int32]:
    ints = np.ascontiguousarray(raw).view(np.int32)
    if layout == "HND":
        return ints.reshape(raw.shape[0], heads, kernel, -1).transpose(0, 2, 1, 3)
    return ints.reshape(raw.shape[0], kernel, heads, -1)


def _expected(
    kv: npt.NDArray[np.int32], spec: RegionSpec, heads: IntArray, tokens: IntArray
) -> npt.NDArray[np.int32]:
    """``[nb, K, H, parts * head_dim]`` of the logical KV at these tokens and heads."""
    sel: npt.NDArray[np.int32] = kv[spec.layer][list(spec.parts)]  # [P, T, H, D]
    sel = sel[:, tokens][:, :, :, heads]  # [P, nb, K, H, D]
    sel = sel.transpose(1, 2, 3, 0, 4)  # [nb, K, H, P, D]
    return sel.reshape(*sel.shape[:3], -1)


def _slots(
    case: Case, side: Side, spec: RegionSpec, ids: list[IntArray], start: int, count: int
) -> tuple[IntArray, IntArray]:
    """Kernel block ids of a region's list and the token of each slot (a ring's after
    ``count`` tokens)."""
    if spec.group == ring_group(case):
        return ids[spec.group], ring_tokens(count, side.block)
    return kernel_tokens(side, ids[spec.group], start)


def lay_out(
    case: Case, rb: RankBuffer, ids: list[IntArray], starts: list[int], request: Request
) -> None:
    """Write the request's KV into the listed blocks, as the engine's prefill would."""
    for spec in rb.regions:
        start, count = starts[spec.group], request.computed
        kernel_ids, tokens = _slots(case, rb.side, spec, ids, start, count)
        values = _expected(request.kv, spec, rb.heads, tokens)
        block_view(rb, spec)[kernel_ids, : spec.block_len] = _to_blocks(values, rb.side.layout)


def check_consumer(
    case: Case, consumer: RankBuffer, request: Request, *, zeroed: bool = True
) -> list[str]:
    """What is wrong in a consumer buffer after the transfer (empty: nothing).

    Tokens the consumer must hold (its lists, below the prompt's end, inside the producer's
    window) must equal the producer's. Blocks outside the lists and padding must be
    untouched. With ``zeroed`` every other slot of a listed block must have been moved or
    zeroed too (what the planner's zero ranges promise); without it such slots may also be
    left as they were.
    """
    problems: list[str] = []
    for spec in consumer.regions:
        group = spec.group
        start = request.d_starts[group]
        kernel_ids, tokens = _slots(case, case.d, spec, request.d_ids, start, case.tokens)
        rows = block_view(consumer, spec)
        got = _from_blocks(
            rows[kernel_ids, : spec.block_len], case.d.layout, case.d.kernel, len(consumer.heads)
        )
        want = _expected(request.kv, spec, consumer.heads, tokens)
        # What the consumer attends to, and whatever else of the producer's it listed.
        first = min(request.p_starts[group], request.attended[group])
        real = (tokens < case.tokens) & (tokens >= first) | (group == ring_group(case))
        wrong = np.argwhere((got != want).any(axis=-1) & real[:, :, None])
        where = f"rank {consumer.geometry.tp_rank} region {spec.name}"
        if wrong.size:
            block, slot, head = (int(x) for x in wrong[0])
            problems.append(
                f"{where}: {len(wrong)} (token, head) rows wrong, first token "
                f"{int(tokens[block, slot])} head {int(consumer.heads[head])}"
            )
        if zeroed and (got == SENTINEL).any():
            problems.append(f"{where}: bytes of a listed block neither moved nor zeroed")
        untouched = np.ones(spec.num_blocks, dtype=bool)
        untouched[kernel_ids] = False
        if not (rows[untouched, : spec.block_len].view(np.int32) == SENTINEL).all():
            problems.append(f"{where}: a block outside the consumer's list was written")
        padding = rows[:, spec.block_len :].view(np.int32)
        # A packed row's other bytes are other layers' pages, not padding.
        if not consumer.packed and not (padding == SENTINEL).all():
            problems.append(f"{where}: padding between blocks was written")
    return problems


def check_producer(case: Case, producer: RankBuffer, request: Request) -> list[str]:
    """A producer's KV is only read: its buffer still equals what prefill wrote."""
    fresh = make_rank(case, 0, producer.geometry.tp_rank)
    lay_out(case, fresh, request.p_ids, request.p_starts, request)
    if np.array_equal(fresh.buf, producer.buf):
        return []
    return [f"producer rank {producer.geometry.tp_rank}: its KV was written"]
