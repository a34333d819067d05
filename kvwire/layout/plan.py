"""From block ids to descriptor arrays: the byte ranges one transfer moves.

Entry points (what the runtime calls):

* :class:`PeerLayout` — built once per remote rank at handshake time. It validates the
  peer's geometry (raising :class:`~kvwire.errors.IncompatiblePeerError`), pairs the regions
  and precomputes the per-region byte patterns. ``PeerLayout.plan(local_ids, remote_ids)``
  then turns one request's block ids into a :class:`TransferPlan`.
* :func:`plan_read` / :func:`plan_write` — the same in one call (validation included), for
  pull (the local consumer READs from the remote producer) and push (the local producer
  WRITEs into the remote consumer).

A :class:`TransferPlan` holds ``local_descs`` and ``remote_descs``, two ``(N, 3)`` int64
arrays of absolute ``(address, length, device_id)`` rows that pair up row by row, ready for
``Transport.read`` / ``Transport.write``; and the consumer's ranges the transfer leaves
unwritten, to be zeroed (``local_zero`` in pull, ``remote_zero`` in push).

How the math works (see docs/layout.md): both sides' logical block ids are expanded to
kernel blocks with their own ratio; both lists end with the sequence, so a shorter list is
a tail (the consumer's prefix-cache hits, or a sliding window). The covered token range is cut
into *chunks* of ``min(producer kernel, consumer kernel)`` tokens, each chunk being one
(producer block, consumer block) pair with a sub-position in the larger block. Within a
chunk the bytes that move form a small fixed *pattern* of (producer offset, consumer offset,
length) segments that depends only on the layouts, the heads each rank holds and the heads
this producer rank supplies; it is computed once per region shape. Descriptors are the
broadcast ``base + block * stride + sub * shift + pattern`` over regions x chunks x segments,
in region-major order (attention regions, then SSM), optionally coalesced.

Why one module of ~830 lines: the pattern, chunk and cluster functions are the steps of
one vectorised algorithm (:class:`PeerLayout`) and are only meaningful together; the
descriptor-array operations the adapters share are in :mod:`kvwire.layout.descs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from kvwire.errors import ConfigError, LocalProtocolError, RemoteProtocolError
from kvwire.layout import descs, topology
from kvwire.layout.alignment import Mode, PeerPolicy, RegionPair, RegionView, validate_peer
from kvwire.layout.descs import (
    BlockIds,
    Descs,
    IntArray,
    as_groups,
    coalesce_ranges,
    empty_descs,
    expand_to_kernel_blocks,
    run_starts,
)
from kvwire.layout.geometry import (
    SHARED_GROUP_ID,
    KVGeometry,
    KVLayout,
    RegionKind,
    RemoteGeometry,
    parse_layout,
    rank_heads,
)

__all__ = ["MAX_TABLE_ROWS", "PeerLayout", "TransferPlan", "plan_read", "plan_write"]

_CLUSTER_CACHE_SIZE = 512
"""Region ranges (and block-list counts) whose clusters a layout keeps."""

MAX_TABLE_ROWS = 1 << 21
"""The most rows :meth:`PeerLayout.tables` returns (both sides together: 96 MiB of
descriptors): a 70B model's 80 layers of a 32k-token pool are 160k rows a side."""


@dataclass(frozen=True)
class TransferPlan:
    """One request's transfer between this rank and one remote rank.

    ``local_descs[i]`` and ``remote_descs[i]`` have the same length. Zero ranges are
    consumer memory the transfer does not write (the untransferred tail of a partially
    covered block, and blocks past what the producer holds); they are identical in every
    per-source plan of a consumer rank, so zeroing them once is enough.
    """

    local_descs: Descs
    remote_descs: Descs
    local_zero: Descs
    remote_zero: Descs
    local_rows: IntArray | None = None
    """With ``plan(rows=True)``: each row of the request, uncoalesced, as its index in the
    layout's local table (None without tables)."""
    remote_rows: IntArray | None = None

    @property
    def num_descs(self) -> int:
        return int(self.local_descs.shape[0])

    @property
    def num_bytes(self) -> int:
        return int(self.local_descs[:, 1].sum()) if self.num_descs else 0

    @property
    def is_empty(self) -> bool:
        """Nothing to move: the caller sends its notification only."""
        return self.num_descs == 0


# ---------------------------------------------------------------------------------------
# Block id helpers
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Side:
    """What the chunk math needs to know about one end of the transfer."""

    layout: KVLayout
    kernel: int
    ppl: int
    logical: int
    tp_rank: int
    tp_size: int
    heads: tuple[int, ...]


def _row_offsets(
    layout: KVLayout, head_pos: IntArray, tokens: IntArray, num_heads: int, kernel: int
) -> IntArray:
    """Row index (in units of one head-token content) of (head position, token) pairs."""
    if layout.heads_first:
        return head_pos * kernel + tokens
    return tokens * num_heads + head_pos


def _merge(first: IntArray, second: IntArray, unit: int) -> IntArray:
    """Segments ``(first, second, length)`` of unit rows sorted by ``second``, merged where
    both sides continue."""
    order = np.lexsort((first, second))
    a, b = first[order] * unit, second[order] * unit
    if a.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    joins = (a[1:] == a[:-1] + unit) & (b[1:] == b[:-1] + unit)
    starts = run_starts(joins)
    lengths = np.diff(np.concatenate((starts, [a.size]))) * unit
    return np.stack((a[starts], b[starts], lengths), axis=1).astype(np.int64)


@dataclass(frozen=True)
class _Pattern:
    """Segments of one chunk at sub-position 0, and how a sub-position shifts them."""

    segments: IntArray  # (M, 3): producer offset, consumer offset, length
    producer_shift: int  # bytes per sub-position on the producer side
    consumer_shift: int  # also shifts the zero segments: they are consumer offsets
    zero_segments: IntArray  # (Mz, 2): consumer offset, length (all consumer heads)


@lru_cache(maxsize=1024)
def _attention_pattern(
    producer: _Side,
    consumer: _Side,
    producer_heads: tuple[int, ...],
    consumer_heads: tuple[int, ...],
    moved_heads: tuple[int, ...],
    content: int,
) -> _Pattern:
    unit = min(producer.kernel, consumer.kernel)
    tokens = np.arange(unit, dtype=np.int64)
    p_index = {h: i for i, h in enumerate(producer_heads)}
    c_index = {h: i for i, h in enumerate(consumer_heads)}
    moved_p = np.array([p_index[h] for h in moved_heads], dtype=np.int64)
    moved_c = np.array([c_index[h] for h in moved_heads], dtype=np.int64)
    hp = np.repeat(moved_p, unit)
    hc = np.repeat(moved_c, unit)
    tt = np.tile(tokens, len(moved_heads))
    rows_p = _row_offsets(producer.layout, hp, tt, len(producer_heads), producer.kernel)
    rows_c = _row_offsets(consumer.layout, hc, tt, len(consumer_heads), consumer.kernel)
    segments = _merge(rows_p, rows_c, content)

    all_c = np.repeat(np.arange(len(consumer_heads), dtype=np.int64), unit)
    all_t = np.tile(tokens, len(consumer_heads))
    zero_rows = _row_offsets(consumer.layout, all_c, all_t, len(consumer_heads), consumer.kernel)
    zero = _merge(zero_rows, zero_rows, content)[:, 1:]

    def shift(side: _Side, heads: int) -> int:
        per_token = content if side.layout.heads_first else content * heads
        return unit * per_token

    return _Pattern(
        segments=segments,
        producer_shift=shift(producer, len(producer_heads)),
        consumer_shift=shift(consumer, len(consumer_heads)),
        zero_segments=zero,
    )


@lru_cache(maxsize=256)
def _whole_block_pattern(length: int) -> _Pattern:
    """Cached like the attention patterns: regions are clustered by pattern identity, so
    state regions of one page size share one cluster instead of one cluster each."""
    return _Pattern(
        segments=np.array([[0, 0, length]], dtype=np.int64),
        producer_shift=0,
        consumer_shift=0,
        zero_segments=np.array([[0, length]], dtype=np.int64),
    )


@lru_cache(maxsize=256)
def _no_move_pattern(length: int) -> _Pattern:
    """A whole block another producer rank supplies: nothing moves from this one."""
    return _Pattern(
        segments=np.zeros((0, 3), dtype=np.int64),
        producer_shift=0,
        consumer_shift=0,
        zero_segments=np.array([[0, length]], dtype=np.int64),
    )


@lru_cache(maxsize=256)
def _sharded_state_pattern(
    p_parts: tuple[int, ...],
    c_parts: tuple[int, ...],
    p_rank: int,
    p_tp: int,
    c_rank: int,
    c_tp: int,
) -> _Pattern:
    """One producer rank's share of one consumer rank's state, part by part (each part
    TP-sharded in rank order); no segments when the two hold no slice in common."""
    p_offsets = np.concatenate([[0], np.cumsum(p_parts)[:-1]]).astype(np.int64)
    c_offsets = np.concatenate([[0], np.cumsum(c_parts)[:-1]]).astype(np.int64)
    rows = []
    if c_tp >= p_tp:
        ratio = c_tp // p_tp
        if c_rank // ratio == p_rank:
            at = c_rank % ratio
            rows = [
                [po + at * cl, co, cl]
                for po, co, cl in zip(p_offsets, c_offsets, c_parts, strict=True)
            ]
    else:
        ratio = p_tp // c_tp
        if p_rank // ratio == c_rank:
            at = p_rank % ratio
            rows = [
                [po, co + at * pl, pl]
                for po, co, pl in zip(p_offsets, c_offsets, p_parts, strict=True)
            ]
    segments = np.array(rows, dtype=np.int64).reshape(-1, 3)
    return _Pattern(
        segments=segments,
        producer_shift=0,
        consumer_shift=0,
        zero_segments=segments[:, 1:].copy(),
    )


# ---------------------------------------------------------------------------------------
# Chunks: which (producer block, consumer block, sub-position) pairs a request covers
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Chunks:
    producer_blocks: IntArray
    consumer_blocks: IntArray
    producer_sub: IntArray
    consumer_sub: IntArray
    zero_blocks: IntArray  # consumer blocks (or sub-positions of them) left unwritten
    zero_sub: IntArray


def _group_ids(block_ids: Sequence[IntArray], group: int, who: str) -> IntArray:
    if not block_ids:  # vLLM's way of saying "nothing": a full prefix-cache hit
        return np.zeros(0, dtype=np.int64)
    if not 0 <= group < len(block_ids):
        raise _error(who)(
            f"{who} block ids: expected a list for KV-cache group {group}, "
            f"got {len(block_ids)} groups"
        )
    return block_ids[group]


def _list_start(num_tokens: int, logical: int, count: int) -> int:
    """First token of a list of ``count`` logical blocks that ends with the sequence.

    A list shorter than the sequence needs is its tail: the blocks before it are prefix-cache
    hits (consumer) or outside a sliding window (either side).
    """
    needed = -(-num_tokens // logical)
    return max(0, needed - count) * logical


def _attention_chunks(
    producer: _Side,
    consumer: _Side,
    p_logical: IntArray,
    c_logical: IntArray,
    num_tokens: int,
    window: tuple[int, int] | None = None,
    producer_end: int | None = None,
) -> _Chunks:
    pk = expand_to_kernel_blocks(p_logical, producer.ppl)
    ck = expand_to_kernel_blocks(c_logical, consumer.ppl)
    unit = min(producer.kernel, consumer.kernel)
    # Where each list starts in the sequence: both end with it (the producer's with the
    # tokens it computed), except a producer's list of a prompt still being computed (a
    # window), which starts with it.
    p_end = num_tokens if producer_end is None else producer_end
    p_start = 0 if window else _list_start(p_end, producer.logical, len(p_logical))
    c_start = _list_start(num_tokens, consumer.logical, len(c_logical))
    c_end = c_start + len(ck) * consumer.kernel
    if p_end > num_tokens and c_start < min(p_start, num_tokens) and len(ck):
        # Computed past the consumer's end, the producer clipped its list (a window, the
        # last chunk) at its own end: what it dropped, the consumer may still attend to,
        # and with one count for both the slots would be zeroed and the request done.
        raise _Unheld(c_start, min(p_start, num_tokens))
    lo = max(p_start, c_start)
    hi = min(p_start + len(pk) * producer.kernel, c_end, -(-num_tokens // unit) * unit)
    if window:
        lo = max(lo, window[0])
        hi = min(hi, -(-window[1] // unit) * unit)
    hi = max(hi, lo)
    tokens = np.arange(lo, hi, unit, dtype=np.int64)
    p_rel = tokens - p_start
    c_rel = tokens - c_start
    # Consumer slots no producer byte lands in: before the producer's list, after the end
    # (a window zeroes nothing: the rest of the sequence is another window's).
    zero_rel = (
        np.zeros(0, dtype=np.int64)
        if window
        else np.concatenate(
            (
                np.arange(0, min(lo, c_end) - c_start, unit, dtype=np.int64),
                np.arange(hi - c_start, c_end - c_start, unit, dtype=np.int64),
            )
        )
    )
    return _Chunks(
        producer_blocks=pk[p_rel // producer.kernel],
        consumer_blocks=ck[c_rel // consumer.kernel],
        producer_sub=(p_rel % producer.kernel) // unit,
        consumer_sub=(c_rel % consumer.kernel) // unit,
        zero_blocks=ck[zero_rel // consumer.kernel],
        zero_sub=(zero_rel % consumer.kernel) // unit,
    )


class _Unheld(Exception):
    """Tokens ``[start, stop)`` of the consumer's list that the producer no longer holds."""

    def __init__(self, start: int, stop: int) -> None:
        super().__init__(start, stop)
        self.start, self.stop = start, stop


def _state_chunks(p_ids: IntArray, c_ids: IntArray) -> _Chunks:
    """SSM state pages pair by position from the end of the producer's list: a longer
    producer list carries states the consumer already has (a shorter one is refused
    before this: the consumer's last blocks would keep what they held)."""
    n = min(len(p_ids), len(c_ids))
    zeros = np.zeros(n, dtype=np.int64)
    return _Chunks(
        producer_blocks=p_ids[len(p_ids) - n :],
        consumer_blocks=c_ids[:n],
        producer_sub=zeros,
        consumer_sub=zeros,
        zero_blocks=np.zeros(0, dtype=np.int64),
        zero_sub=np.zeros(0, dtype=np.int64),
    )


def _sequence_end(
    num_tokens: int | None,
    producer: _Side,
    consumer: _Side,
    held: int,
    p_who: str,
) -> int:
    """The prompt's length in tokens, which places every list in the sequence.

    The producer's lists reach furthest in a full-attention group's, the whole prompt, so
    they hold (``held`` tokens) between one block less and exactly its length. Without
    ``num_tokens`` that bound is the length itself: every list still lands right when the
    consumer's block is a whole number of the producer's (both end in the same consumer
    block), but not when the consumer's blocks are smaller: the prompt may end in any of
    the consumer blocks inside the producer's last one, so the count is required.
    """
    if num_tokens is None:
        if consumer.logical % producer.logical:
            raise LocalProtocolError(
                f"the producer's blocks hold {producer.logical} tokens and the consumer's "
                f"{consumer.logical}: without the prompt's token count (remote_num_tokens, "
                "or num_tokens at the call) the consumer cannot tell where the prompt ends"
            )
        return held
    if num_tokens > held:
        raise _error(p_who)(
            f"num_tokens {num_tokens} is more than the producer's blocks hold ({held} tokens)"
        )
    return num_tokens


def _producer_end(producer_tokens: int | None, end: int, held: int | None, p_who: str) -> int:
    """Where the producer's lists end: at ``end`` unless it computed more (never fewer:
    the consumer would wait for tokens that do not exist), and within what they hold
    (``held``; None for a streamed window, whose pieces take one count)."""
    if producer_tokens is None or producer_tokens == end:
        return end
    if held is not None and producer_tokens > held:
        raise _error(p_who)(
            f"the producer computed {producer_tokens} tokens, more than its blocks hold "
            f"({held} tokens)"
        )
    if held is None or producer_tokens < end:
        raise _error(p_who)(
            f"the producer computed {producer_tokens} tokens and the consumer's lists end "
            f"at token {end}: "
            + ("a streamed window needs one count" if held is None else "it lacks the rest")
        )
    return producer_tokens


def _check_counts(**counts: object) -> None:
    """Token counts are whole numbers of tokens, or None."""
    for name, value in counts.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise LocalProtocolError(f"{name} must be an int >= 0 or None, got {value!r}")


def _error(who: str) -> type[LocalProtocolError] | type[RemoteProtocolError]:
    return LocalProtocolError if who == "local" else RemoteProtocolError


# ---------------------------------------------------------------------------------------
# PeerLayout
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Cluster:
    """BlockRegion pairs sharing one pattern and one pair of KV-cache groups."""

    order: IntArray  # position of each pair in the region-major output
    p_base: IntArray
    p_stride: IntArray
    p_dev: IntArray
    p_limit: int
    c_base: IntArray
    c_stride: IntArray
    c_dev: IntArray
    c_limit: int
    p_group: int
    c_group: int
    state: bool
    pattern: _Pattern
    labels: tuple[str, ...]


@dataclass(frozen=True)
class _Entry:
    """One region pair moving one group's blocks with one pattern."""

    pair: RegionPair
    p_group: int
    c_group: int
    state: bool
    pattern: _Pattern
    slab: bool = False
    """An SSM group's state page in a region laid out for attention, or a ring's block in
    regions of kernel blocks (addressed by logical id across the region's kernel
    blocks)."""


@dataclass(frozen=True)
class _Span:
    """One cluster's rows on one side of the prepared tables: from row ``offset``, ordered
    region x block x sub-position x segment."""

    offset: int
    blocks: int
    subs: int
    segments: int

    def rows(self, regions: int, blocks: IntArray, sub: IntArray) -> IntArray:
        """Table indices of the rows ``_emit`` writes for these chunks, in its order."""
        m = self.segments
        first = (np.arange(regions, dtype=np.int64)[:, None] * self.blocks + blocks) * self.subs
        first = (first + sub) * m + self.offset
        if m == 1:
            return first.reshape(-1)
        return (first[:, :, None] + np.arange(m, dtype=np.int64)).reshape(-1)


def _join(parts: list[Descs]) -> Descs:
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else empty_descs()


def _join_ints(parts: list[IntArray]) -> IntArray:
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class PeerLayout:
    """A validated pairing of this rank's KV cache with one remote rank's.

    Build it once per remote rank at handshake time; :meth:`plan` is the per-request hot
    path and does no Python work per block or per descriptor.
    """

    def __init__(
        self,
        local: KVGeometry,
        remote: RemoteGeometry,
        *,
        mode: Mode = "pull",
        policy: PeerPolicy | None = None,
        coalesce: bool = True,
    ) -> None:
        if mode not in ("pull", "push"):
            raise ConfigError(f"mode must be 'pull' or 'push', got {mode!r}")
        self.local = local
        self.remote = remote
        self.mode: Mode = mode
        self.coalesce = coalesce
        self.pairs: tuple[RegionPair, ...] = validate_peer(local, remote, mode=mode, policy=policy)
        total = local.total_kv_heads
        local_side = _Side(
            layout=local.layout,
            kernel=local.kernel_block_size,
            ppl=local.physical_blocks_per_logical,
            logical=local.block_size,
            tp_rank=local.tp_rank,
            tp_size=local.tp_size,
            heads=tuple(int(h) for h in local.heads),
        )
        remote_side = _Side(
            layout=parse_layout(remote.kv_cache_layout, who="remote"),
            kernel=remote.kernel_block_size,
            ppl=remote.physical_blocks_per_logical,
            logical=remote.block_size,
            tp_rank=remote.tp_rank,
            tp_size=remote.tp_size,
            heads=tuple(int(h) for h in rank_heads(remote.tp_rank, remote.tp_size, total)),
        )
        self._producer, self._consumer = (
            (remote_side, local_side) if mode == "pull" else (local_side, remote_side)
        )
        self._by_group = tuple(
            (
                replace(self._producer, kernel=tokens, logical=tokens, ppl=1),
                replace(self._consumer, kernel=tokens, logical=tokens, ppl=1),
            )
            for tokens in local.group_block_sizes
        )
        """Per group of its own block size, (producer, consumer) as its chunks see them."""
        self._cluster_cache: dict[
            tuple[int, tuple[int, int] | None], tuple[list[_Cluster], bool]
        ] = {}
        self._span_cache: dict[int, list[tuple[_Span, _Span]] | None] = {}
        self._clusters(1)  # a pairing that cannot be planned fails here, at the handshake

    # -- handshake-time preparation ----------------------------------------------------

    def _moved_heads(self) -> tuple[int, ...]:
        """Consumer heads this producer rank supplies (empty: notification only)."""
        p, c = self._producer, self._consumer
        sources = topology.head_sources(c.tp_rank, c.tp_size, p.tp_size, self.local.total_kv_heads)
        return tuple(h for h, src in zip(c.heads, sources, strict=True) if src == p.tp_rank)

    def _replicated_moves(self) -> bool:
        p, c = self._producer, self._consumer
        return topology.replicated_source(c.tp_rank, c.tp_size, p.tp_size) == p.tp_rank

    def _pattern(self, pair: RegionPair) -> _Pattern:
        if pair.kind is RegionKind.SSM:
            return _whole_block_pattern(pair.local.block_len)
        if self.local.group_block_sizes:
            # Rows of several groups' pages: a row moves whole, from one producer rank,
            # each region its longest page (its extent).
            return self._whole_page(pair, self.local.regions[pair.local.index].extent)
        if pair.kind is RegionKind.REPLICATED:
            p_heads: tuple[int, ...] = (0,)
            c_heads: tuple[int, ...] = (0,)
            moved: tuple[int, ...] = (0,) if self._replicated_moves() else ()
        else:
            p_heads, c_heads = self._producer.heads, self._consumer.heads
            moved = self._moved_heads()
        heads_here = self.local.heads_in_region(pair.local.index)
        content = pair.local.block_len // (heads_here * self.local.kernel_block_size)
        return _attention_pattern(self._producer, self._consumer, p_heads, c_heads, moved, content)

    def _entries(self, num_groups: int, regions: tuple[int, int] | None) -> list[_Entry]:
        """What each region pair moves, attention before state (vLLM's descriptor order).

        A region of one group moves that group's blocks. A *shared* region (group -1 on
        either side, vLLM's hybrid layout) holds a page of every group, so it is moved once
        per group, each group's blocks as that group's kind: joining the groups' lists into
        one sequence moved a sliding window's or an SSM group's blocks as if they were the
        full-attention group's next tokens. An SSM group's page in a region laid out for
        attention (a slab of vLLM's one allocation) is its states at the page's start; in
        rows of several block sizes it is the row, moved whole as every row is between
        equal TP sizes, each rank's slice of the state otherwise. A ring
        group's block is an attention page paired by position, as a state is."""
        attention: list[_Entry] = []
        states: list[_Entry] = []
        ppl = self.local.physical_blocks_per_logical
        split = ppl if ppl > 1 else 0
        for pair in self.pairs:
            if regions is not None and not regions[0] <= pair.local.index < regions[1]:
                continue
            for g, p_group, c_group in self._groups_in(pair, num_groups):
                if pair.kind is RegionKind.SSM:
                    states.append(_Entry(pair, p_group, c_group, True, self._pattern(pair)))
                elif self._is_ring(g) and split:
                    # A ring's block in kernel blocks: all of them, one span of the logical
                    # block (the pairing held both sides to one kernel split).
                    ring = self._whole_page(pair, pair.local.block_len * split)
                    attention.append(_Entry(pair, p_group, c_group, True, ring, True))
                elif self._is_ring(g):
                    attention.append(_Entry(pair, p_group, c_group, True, self._pattern(pair)))
                elif self.local.group_kind(g, pair.local.index) is not RegionKind.SSM:
                    attention.append(_Entry(pair, p_group, c_group, False, self._pattern(pair)))
                elif self.local.group_block_sizes:
                    # A row's state is its rank's own: whole between equal TP sizes, each
                    # rank's slice of it otherwise (from the page's start, as in a slab).
                    equal = self._producer.tp_size == self._consumer.tp_size
                    row_state = self._pattern(pair) if equal else self._slab_state_pattern()
                    states.append(_Entry(pair, p_group, c_group, True, row_state))
                else:
                    slab_state = self._slab_state_pattern()
                    states.append(_Entry(pair, p_group, c_group, True, slab_state, True))
        return attention + states

    def _groups_in(self, pair: RegionPair, num_groups: int) -> list[tuple[int, int, int]]:
        """(group, the producer's id of it, the consumer's) of each group whose pages the
        pair's regions hold. A shared region (group -1 on either side) or one that names
        its groups (:attr:`BlockRegion.groups`, ours and so the peer's) moves group g on
        both sides; any other keeps each side's own group id, as advertised."""
        held = self.local.regions[pair.local.index].groups
        if held:
            return [(g, g, g) for g in held if g < num_groups]
        pv, cv = self._sides(pair)
        if SHARED_GROUP_ID in (pv.group_id, cv.group_id):
            return [(g, g, g) for g in range(num_groups)]
        return [(max(pv.group_id, cv.group_id), pv.group_id, cv.group_id)]

    def _whole_page(self, pair: RegionPair, length: int) -> _Pattern:
        """``length`` bytes of a block moved whole: a replicated page from the one producer
        rank it is read from (nothing from the others), any other from its own rank (the
        pairing held such pages to equal TP sizes)."""
        if pair.kind is RegionKind.REPLICATED and not self._replicated_moves():
            return _no_move_pattern(length)
        return _whole_block_pattern(length)

    def _is_ring(self, group: int) -> bool:
        kinds = self.local.group_kinds
        return 0 <= group < len(kinds) and kinds[group] is RegionKind.RING

    def _slab_state_pattern(self) -> _Pattern:
        """An SSM group's page in a slab: the states at its start, then padding up to the
        attention page (vLLM pads the state page to it); only the states move. Between
        unequal TP sizes each part of the state (:attr:`KVGeometry.ssm_parts`) is sharded
        in rank order, so a consumer rank holding a fraction of a producer's shard reads
        its slice of every part, and one holding several producers' shards takes each
        producer's parts at its place among them."""
        p, c = self._producer, self._consumer
        if p.tp_size == c.tp_size:
            return _whole_block_pattern(int(sum(self.local.ssm_sizes)))
        local = self.local.state_parts
        scaled = tuple(part * self.local.tp_size // self.remote.tp_size for part in local)
        remote_is_producer = self.mode == "pull"
        p_parts, c_parts = (scaled, local) if remote_is_producer else (local, scaled)
        return _sharded_state_pattern(p_parts, c_parts, p.tp_rank, p.tp_size, c.tp_rank, c.tp_size)

    def _clusters(
        self, num_groups: int, regions: tuple[int, int] | None = None
    ) -> tuple[list[_Cluster], bool]:
        """The clusters for requests with ``num_groups`` block lists (computed once per
        count: only shared regions depend on it) over the local regions ``[r0, r1)`` (all
        when None), and whether their rows interleave."""
        key = (num_groups, regions)
        built = self._cluster_cache.get(key)
        if built is None:
            built = self._build_clusters(num_groups, regions)
            if len(self._cluster_cache) >= _CLUSTER_CACHE_SIZE:
                # Streaming rounds name region ranges: at most one per pair of layers, but
                # a deep model has many pairs; start over rather than grow without bound.
                whole = self._cluster_cache.get((num_groups, None))
                self._cluster_cache.clear()
                if whole is not None:
                    self._cluster_cache[(num_groups, None)] = whole
            self._cluster_cache[key] = built
        return built

    def _build_clusters(
        self, num_groups: int, regions: tuple[int, int] | None
    ) -> tuple[list[_Cluster], bool]:
        buckets: dict[tuple[int, int, int, bool, bool], list[tuple[int, _Entry]]] = {}
        for position, entry in enumerate(self._entries(num_groups, regions)):
            key = (id(entry.pattern), entry.p_group, entry.c_group, entry.state, entry.slab)
            buckets.setdefault(key, []).append((position, entry))
        clusters = []
        for (_, p_group, c_group, state, slab), members in buckets.items():
            views = [self._sides(entry.pair) for _, entry in members]
            # An SSM page in a slab, or a ring's, sits at a logical block id in a region
            # that advertises kernel blocks: one page spans a logical block's kernel blocks.
            p_scale = self._producer.ppl if slab else 1
            c_scale = self._consumer.ppl if slab else 1
            clusters.append(
                _Cluster(
                    order=np.array([pos for pos, _ in members], dtype=np.int64),
                    p_base=np.array([pv.base for pv, _ in views], dtype=np.int64),
                    p_stride=np.array([pv.stride * p_scale for pv, _ in views], dtype=np.int64),
                    p_dev=np.array([pv.device_id for pv, _ in views], dtype=np.int64),
                    p_limit=min(pv.num_blocks for pv, _ in views) // p_scale,
                    c_base=np.array([cv.base for _, cv in views], dtype=np.int64),
                    c_stride=np.array([cv.stride * c_scale for _, cv in views], dtype=np.int64),
                    c_dev=np.array([cv.device_id for _, cv in views], dtype=np.int64),
                    c_limit=min(cv.num_blocks for _, cv in views) // c_scale,
                    p_group=p_group,
                    c_group=c_group,
                    state=state,
                    pattern=members[0][1].pattern,
                    labels=tuple(entry.pair.local.label for _, entry in members),
                )
            )
        # Clusters emit their rows one after another; only when their regions interleave
        # (KV-cache groups alternating by layer) must the rows be put back in region order.
        if not clusters:
            return clusters, False
        positions = np.concatenate([cluster.order for cluster in clusters])
        return clusters, bool(np.any(np.diff(positions) < 0))

    def _group_sides(self, group: int) -> tuple[_Side, _Side]:
        """(producer, consumer) as group ``group``'s chunks see them: a group of its own
        block size (:attr:`KVGeometry.group_block_sizes`) has blocks of that many tokens
        on both sides, one row each. The peer's groups are ours: its sizes are not
        advertised, the compatibility hash covers the model that sets them, and the
        pairing checked the block size they share."""
        return self._by_group[group] if self._by_group else (self._producer, self._consumer)

    def _held(self, p_groups: Sequence[IntArray]) -> int:
        """Tokens the producer's lists reach: the furthest of its groups'."""
        if self.local.group_block_sizes:
            return self.local.tokens_held(p_groups)
        return max((len(g) for g in p_groups), default=0) * self._producer.logical

    def _check_group_count(self, counts: tuple[int, int], whose: tuple[str, str]) -> None:
        """Lists of groups of their own block sizes: one per group, no more."""
        groups = len(self._by_group)
        for count, who in zip(counts, whose, strict=True):
            if groups and count > groups:
                raise _error(who)(
                    f"{who} block ids: expected at most {groups} lists (one per KV-cache "
                    f"group of block sizes {list(self.local.group_block_sizes)}), got {count}"
                )

    def _sides(self, pair: RegionPair) -> tuple[RegionView, RegionView]:
        """(producer view, consumer view) of a pair."""
        return (pair.remote, pair.local) if self.mode == "pull" else (pair.local, pair.remote)

    # -- prepared descriptor tables ------------------------------------------------------

    def tables(self, num_groups: int = 1) -> tuple[Descs, Descs] | None:
        """Every descriptor row a request with ``num_groups`` block lists can post, as
        ``(local, remote)`` tables; ``plan(..., rows=True)`` names a request's rows by their
        index in these.

        A transport that prepares descriptor lists (NIXL's ``prep_xfer_dlist``) takes them
        once per peer and then makes each request from index arrays, which the plan computes
        in numpy as cheaply as the rows themselves. None when the tables would exceed
        :data:`MAX_TABLE_ROWS` (many small segments per block, as in tokens-first layouts
        between unequal TP sizes): preparing them would cost more than it saves.
        """
        self._check_group_count((num_groups, num_groups), ("local", "local"))
        spans = self._table_spans(num_groups)
        if spans is None:
            return None
        clusters, _ = self._clusters(max(num_groups, 1))
        p_parts: list[Descs] = []
        c_parts: list[Descs] = []
        for cluster, (p_span, c_span) in zip(clusters, spans, strict=True):
            segs = cluster.pattern.segments
            for (base, stride, dev, shift, col, span), parts in (
                ((cluster.p_base, cluster.p_stride, cluster.p_dev,
                  cluster.pattern.producer_shift, 0, p_span), p_parts),
                ((cluster.c_base, cluster.c_stride, cluster.c_dev,
                  cluster.pattern.consumer_shift, 1, c_span), c_parts),
            ):  # fmt: skip
                blocks = np.repeat(np.arange(span.blocks, dtype=np.int64), span.subs)
                sub = np.tile(np.arange(span.subs, dtype=np.int64), span.blocks)
                out = np.empty((base.size * blocks.size * segs.shape[0], 3), dtype=np.int64)
                if out.size:
                    _fill(out, base, stride, blocks, sub, shift, segs[:, col], segs[:, 2], dev)
                parts.append(out)
        producer, consumer = _join(p_parts), _join(c_parts)
        return (consumer, producer) if self.mode == "pull" else (producer, consumer)

    def _table_spans(self, num_groups: int) -> list[tuple[_Span, _Span]] | None:
        """Where each cluster's rows sit in the tables, (producer, consumer) per cluster."""
        key = max(num_groups, 1)
        if key not in self._span_cache:
            clusters, _ = self._clusters(key)
            spans: list[tuple[_Span, _Span]] = []
            p_at = c_at = 0
            for cluster in clusters:
                m = cluster.pattern.segments.shape[0]
                producer, consumer = self._group_sides(cluster.p_group)
                unit = min(producer.kernel, consumer.kernel)
                p_subs = 1 if cluster.state else producer.kernel // unit
                c_subs = 1 if cluster.state else consumer.kernel // unit
                p_span = _Span(p_at, cluster.p_limit, p_subs, m)
                c_span = _Span(c_at, cluster.c_limit, c_subs, m)
                p_at += cluster.p_base.size * cluster.p_limit * p_subs * m
                c_at += cluster.c_base.size * cluster.c_limit * c_subs * m
                spans.append((p_span, c_span))
            self._span_cache[key] = None if p_at + c_at > MAX_TABLE_ROWS else spans
        return self._span_cache[key]

    # -- the hot path ----------------------------------------------------------------------

    def plan(
        self,
        local_block_ids: BlockIds,
        remote_block_ids: BlockIds,
        *,
        num_tokens: int | None = None,
        coalesce: bool | None = None,
        rows: bool = False,
        regions: tuple[int, int] | None = None,
        window: tuple[int, int] | None = None,
        producer_tokens: int | None = None,
    ) -> TransferPlan:
        """Descriptors moving one request between this rank and the remote rank.

        Block ids are *logical* ids per KV-cache group, each side's own and untrimmed: the
        producer's lists are the request's full lists, the consumer's hold only the
        uncomputed suffix (its prefix-cache hits stay local). Every list ends with the
        sequence, so the prompt's length places each one in tokens and the pairing is by
        token, whatever the two block sizes. ``num_tokens`` (``remote_num_tokens``) is that
        length; without it the producer's longest list stands in for it, which is exact
        unless the consumer's blocks are smaller (then the plan is refused, by name).

        ``producer_tokens``: where the producer's lists end when it computed past the
        consumer's ``num_tokens`` (a prefill engine that generated more than one token: its
        ``remote_num_tokens``); the consumer's lists still end at ``num_tokens`` and only
        those tokens move. A list the producer clipped at its own end (a window, the last
        attention chunk) may then lack tokens the consumer's list asks for, and a state is
        for the producer's count only: such a plan is refused by name, never zero-filled.

        ``rows``: also name every row, uncoalesced, by its index in :meth:`tables` (for the
        same number of block lists), when the tables exist.

        A streaming push moves a prompt in pieces while it is computed: ``regions`` keeps
        the local regions ``[r0, r1)`` only, and ``window`` the tokens ``[t0, t1)`` only,
        with the producer's lists then starting at the sequence's first token and reaching
        at least ``t1`` (the blocks computed so far); ``num_tokens`` is still the prompt's
        whole length, which places the consumer's lists. SSM states move only in a window
        from token 0 (they are the prompt's last state, not per token).
        """
        _check_counts(num_tokens=num_tokens, producer_tokens=producer_tokens)
        merge = self.coalesce if coalesce is None else coalesce
        local_groups = as_groups(local_block_ids)
        remote_groups = as_groups(remote_block_ids)
        if self.mode == "pull":
            c_groups, p_groups = local_groups, remote_groups
            c_who, p_who = "local", "remote"
        else:
            p_groups, c_groups = local_groups, remote_groups
            p_who, c_who = "local", "remote"
        p_parts: list[IntArray] = []
        c_parts: list[IntArray] = []
        z_parts: list[IntArray] = []
        order_parts: list[IntArray] = []
        chunk_cache: dict[tuple[int, int, bool], _Chunks] = {}
        self._check_group_count((len(p_groups), len(c_groups)), (p_who, c_who))
        if num_tokens is None:  # the consumer's lists end where the producer's do
            num_tokens = producer_tokens
        if window is not None:
            if num_tokens is None or not 0 <= window[0] <= window[1] <= num_tokens:
                raise LocalProtocolError(
                    f"a window of tokens {window} needs the prompt's length, at least "
                    f"its end (num_tokens={num_tokens})"
                )
            end = num_tokens
            p_end = _producer_end(producer_tokens, end, None, p_who)
        else:
            held = self._held(p_groups)
            end = _sequence_end(num_tokens, self._producer, self._consumer, held, p_who)
            p_end = _producer_end(producer_tokens, end, held, p_who)
        num_groups = max(len(p_groups), len(c_groups), 1)
        clusters, reorder = self._clusters(num_groups, regions)
        whole = regions is None and window is None
        spans = self._table_spans(num_groups) if rows and whole else None
        p_index: list[IntArray] = []
        c_index: list[IntArray] = []
        for k, cluster in enumerate(clusters):
            key = (cluster.p_group, cluster.c_group, cluster.state)
            chunks = chunk_cache.get(key)
            if chunks is None:
                p_ids = _group_ids(p_groups, cluster.p_group, p_who)
                c_ids = _group_ids(c_groups, cluster.c_group, c_who)
                if cluster.state:
                    if window and window[0]:
                        continue
                    if p_end != end and len(c_ids):
                        raise _error(p_who)(
                            f"region {cluster.labels[0]} holds a state or a ring for the "
                            f"producer's {p_end} tokens, and the consumer's lists end at token "
                            f"{end}: a state is for one token count"
                        )
                    if len(c_ids) > len(p_ids):
                        raise _error(p_who)(
                            f"{p_who} block ids of KV-cache group {cluster.p_group}: "
                            f"{len(p_ids)} for a state or a ring the consumer holds in "
                            f"{len(c_ids)}: each of its blocks would be left as it was"
                        )
                    chunks = _state_chunks(p_ids, c_ids)
                else:
                    p_side, c_side = self._group_sides(cluster.p_group)
                    try:
                        chunks = _attention_chunks(p_side, c_side, p_ids, c_ids, end, window, p_end)
                    except _Unheld as gap:
                        raise _error(p_who)(
                            f"{p_who} block ids of KV-cache group {cluster.p_group}: the "
                            f"producer computed {p_end} tokens and its list starts past "
                            f"tokens [{gap.start}, {gap.stop}) that the consumer's list, "
                            f"ending at token {end}, asks for (a window or chunk it "
                            "dropped)"
                        ) from None
                chunk_cache[key] = chunks
            self._check_bounds(cluster, chunks, p_who, c_who)
            p_rows, c_rows, z_rows = _emit(cluster, chunks)
            p_parts.append(p_rows)
            c_parts.append(c_rows)
            z_parts.append(z_rows)
            if spans is not None:
                count = cluster.p_base.size
                p_span, c_span = spans[k]
                p_index.append(p_span.rows(count, chunks.producer_blocks, chunks.producer_sub))
                c_index.append(c_span.rows(count, chunks.consumer_blocks, chunks.consumer_sub))
            if reorder:
                segs = cluster.pattern.segments.shape[0] * chunks.producer_blocks.size
                order_parts.append(np.repeat(cluster.order, segs))
        producer = _join(p_parts)
        consumer = _join(c_parts)
        zero = _join(z_parts)
        p_at = _join_ints(p_index) if spans is not None else None
        c_at = _join_ints(c_index) if spans is not None else None
        if reorder:
            order = np.argsort(np.concatenate(order_parts), kind="stable")
            # ``take`` copies whole rows; ``producer[order]`` made the whole plan about twice
            # as slow in a hand measurement (160 regions alternating two KV-cache groups).
            producer = np.take(producer, order, axis=0)
            consumer = np.take(consumer, order, axis=0)
            if p_at is not None and c_at is not None:
                p_at, c_at = p_at[order], c_at[order]
        if merge:
            producer, consumer = descs.coalesce(producer, consumer)  # the flag shadows the name
            zero = coalesce_ranges(zero)
        if self.mode == "pull":
            return TransferPlan(consumer, producer, zero, empty_descs(), c_at, p_at)
        return TransferPlan(producer, consumer, empty_descs(), zero, p_at, c_at)

    @staticmethod
    def _check_bounds(cluster: _Cluster, chunks: _Chunks, p_who: str, c_who: str) -> None:
        for blocks, limit, who in (
            (chunks.producer_blocks, cluster.p_limit, p_who),
            (chunks.consumer_blocks, cluster.c_limit, c_who),
            (chunks.zero_blocks, cluster.c_limit, c_who),
        ):
            if blocks.size and (int(blocks.min()) < 0 or int(blocks.max()) >= limit):
                raise _error(who)(
                    f"{who} block ids for region {cluster.labels[0]}: expected kernel ids in "
                    f"[0, {limit}), got [{int(blocks.min())}, {int(blocks.max())}]"
                )


def _fill(
    out: Descs,
    base: IntArray,
    stride: IntArray,
    blocks: IntArray,
    sub: IntArray,
    shift: int,
    offsets: IntArray,
    lengths: IntArray,
    devices: IntArray,
) -> None:
    """Write the rows ``(base + block * stride + sub * shift + offset, length, device)`` of
    every (region, chunk, segment) into ``out``.

    Each column is computed in place through a strided ``(regions, chunks, segments)`` view
    of ``out``, so no temporary as large as the output is allocated and paged in.
    """
    regions, chunks, m = base.size, blocks.size, offsets.size
    addr = out[:, 0].reshape(regions, chunks, m)
    np.multiply(blocks[None, :, None], stride[:, None, None], out=addr)
    addr += base[:, None, None]
    if shift:
        addr += (sub * shift)[None, :, None]
    if m > 1 or offsets[0]:
        addr += offsets[None, None, :]
    np.copyto(out[:, 1].reshape(regions, chunks, m), lengths[None, None, :])
    np.copyto(out[:, 2].reshape(regions, chunks * m), devices[:, None])


def _emit(cluster: _Cluster, chunks: _Chunks) -> tuple[Descs, Descs, Descs]:
    """BlockRegion-major rows of one cluster: regions x chunks x pattern segments."""
    pattern = cluster.pattern
    seg = pattern.segments
    regions, n, m = cluster.p_base.size, chunks.producer_blocks.size, seg.shape[0]
    # One allocation for both sides: a large array may come back from the allocator as
    # fresh pages that fault in on first write, and one allocation risks that once, not twice.
    both = np.empty((2, regions * n * m, 3), dtype=np.int64)
    producer, consumer = both[0], both[1]
    if producer.size:
        _fill(
            producer,
            cluster.p_base,
            cluster.p_stride,
            chunks.producer_blocks,
            chunks.producer_sub,
            pattern.producer_shift,
            seg[:, 0],
            seg[:, 2],
            cluster.p_dev,
        )
        _fill(
            consumer,
            cluster.c_base,
            cluster.c_stride,
            chunks.consumer_blocks,
            chunks.consumer_sub,
            pattern.consumer_shift,
            seg[:, 1],
            seg[:, 2],
            cluster.c_dev,
        )
    zseg = pattern.zero_segments
    zn, zm = chunks.zero_blocks.size, zseg.shape[0]
    zero = np.empty((regions * zn * zm, 3), dtype=np.int64)
    if zero.size:
        _fill(
            zero,
            cluster.c_base,
            cluster.c_stride,
            chunks.zero_blocks,
            chunks.zero_sub,
            pattern.consumer_shift,
            zseg[:, 0],
            zseg[:, 1],
            cluster.c_dev,
        )
    return producer, consumer, zero


def plan_read(
    local: KVGeometry,
    remote: RemoteGeometry,
    local_block_ids: BlockIds,
    remote_block_ids: BlockIds,
    *,
    num_tokens: int | None = None,
    coalesce: bool = True,
    policy: PeerPolicy | None = None,
) -> TransferPlan:
    """Pull: the local consumer (D) READs ``remote_block_ids`` of the producer ``remote``.

    Validates the pair every call; keep a :class:`PeerLayout` per remote rank instead on a
    hot path.
    """
    layout = PeerLayout(local, remote, mode="pull", policy=policy, coalesce=coalesce)
    return layout.plan(local_block_ids, remote_block_ids, num_tokens=num_tokens)


def plan_write(
    local: KVGeometry,
    remote: RemoteGeometry,
    local_block_ids: BlockIds,
    remote_block_ids: BlockIds,
    *,
    num_tokens: int | None = None,
    coalesce: bool = True,
    policy: PeerPolicy | None = None,
) -> TransferPlan:
    """Push: the local producer (P) WRITEs its ``local_block_ids`` into the consumer
    ``remote``'s ``remote_block_ids`` (the consumer's prefix-trimmed lists)."""
    layout = PeerLayout(local, remote, mode="push", policy=policy, coalesce=coalesce)
    return layout.plan(local_block_ids, remote_block_ids, num_tokens=num_tokens)
