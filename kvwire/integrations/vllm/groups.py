"""What each of a vLLM engine's KV-cache groups holds and which of a request's blocks in
it cross between engines, read from vLLM's own specs: the kinds kvwire moves (refusing by
name what it does not), the state sizes of Mamba groups, DeepSeek-V4's groups of their own
block sizes, and stock's exchange rules (a window's tail, a state's running block, the
prompt's last tokens D computes). Separate from :mod:`~kvwire.integrations.vllm.geometry`,
which says where the blocks are: these are facts of the model's specs, the same in the
scheduler (which cuts the lists) as in the workers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvwire.errors import ConfigError
from kvwire.layout.geometry import RegionKind


def transfer_groups(kv_cache_config: Any) -> tuple[Any, ...]:
    """The KV-cache groups whose blocks cross between engines, in the order the block
    lists of ``kv_transfer_params`` carry them (vLLM leaves some groups out)."""
    return tuple(getattr(kv_cache_config, "transfer_groups", kv_cache_config.kv_cache_groups))


def is_kpool_tail(spec: Any) -> bool:
    """Whether ``spec`` is vLLM 0.31.0's ``KpoolTailSpec`` (Glm5Next's indexer tail: a
    ring of the last pool's raw keys, one block a request, laid over the bytes of its
    indexer's pooled keys; 0.32.0 makes it a ``CircularBufferSpec`` in rows)."""
    return type(spec).__name__ == "KpoolTailSpec"


def group_kinds(kv_cache_config: Any, block_size: int) -> tuple[RegionKind, ...]:
    """What each transfer group stores, refusing by name what kvwire does not move yet.

    A :class:`KVGeometry` describes one attention page for every attention group (one block
    size, one head count and head size), which is what vLLM's hybrid manager makes of
    attention layers that differ only in their window. The exception is MLA, whose pages
    are never sliced: a sparse MLA model (DeepSeek-V3.2) keeps its indexer's keys beside
    its latents in one group of per-layer specs (vLLM's ``UniformTypeKVCacheSpecs``), each
    layer its own page size, and every region moves whole. A state-space (Mamba) group's page
    is its state, padded by vLLM to the attention page so both share the slabs: it moves as
    one state of ``sum(ssm_sizes)`` bytes (:func:`ssm_sizes`). A chunked-local-attention
    group (Llama 4) has the attention page and, as stock exchanges it, the prompt's whole
    list, its chunks before the last one vLLM's null block: it moves as full attention
    does. So does an R-SWA group (``RSWASpec``, full attention whose blocks between the
    prompt and the decode window vLLM frees while decoding): when a prefill ends it holds
    the whole prompt, and stock moves it whole. A ring group (``CircularBufferSpec``: one
    block a request, a compressor's or an indexer's latest keys) with the attention page
    moves its block whole, as a state for the prompt's count (:attr:`RegionKind.RING`).
    Anything else (static sinks, rings of another page beside attention, groups whose
    pages vLLM resized or padded otherwise) would be planned with the wrong page, so it
    fails the engine's startup instead. So does a model whose every attention group has a
    window: no list then holds the whole prompt, which is where the planner places the
    others.

    Rows of several block sizes (DeepSeek-V4's, V4.1's, Qwen4Exp's, Glm5Next's in vLLM
    0.32.0) move whole pages, their rings and states too (a state group there is kind SSM
    whatever its state; between unequal TP sizes a state is sliced where its parts are
    known): :func:`row_block_sizes`. vLLM 0.31.0's Glm5Next keeps its MLA latents and
    indexer keys in one group of per-layer specs, its KDA states in the latents' slabs,
    and its indexer tail (:func:`is_kpool_tail`) in a group of its own, a ring over the
    keys' pages: the geometry finds each tail page inside its keys' region.
    """
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        RSWASpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    moved = (
        FullAttentionSpec,
        RSWASpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        SlidingWindowMLASpec,
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
    )
    groups = transfer_groups(kv_cache_config)
    ids = getattr(kv_cache_config, "transfer_group_ids", range(len(groups)))
    for group_id, group in zip(ids, groups, strict=True):
        if getattr(group, "host_resident", False):
            raise ConfigError(
                f"KV-cache group {group_id} is host-resident (vLLM's HiSparse): its blocks "
                "are a pool of their own, on the host; KVWireConnector moves the groups of "
                "the engine's one pool so far"
            )
    if row_block_sizes(kv_cache_config):
        layers = [_layer_specs(g.kv_cache_spec) for g in groups]
        partial = (SlidingWindowSpec, CircularBufferSpec, MambaSpec)
        if all(all(isinstance(s, partial) for s in group) for group in layers):
            raise ConfigError(
                "no KV-cache group is full attention: KVWireConnector needs a group that "
                "holds the whole prompt so far (every group has a sliding window, a ring or "
                "a state)"
            )
        rows = tuple(_row_kind(g, group) for g, group in zip(ids, layers, strict=True))
        states = [g for g, kind in zip(ids, rows, strict=True) if kind is RegionKind.SSM]
        if states:
            _check_conv_layout(states[0])
        return rows
    first: tuple[Any, ...] | None = None
    kinds = []
    attention_pages: set[int] = set()
    for group_id, group in zip(ids, groups, strict=True):
        spec = group.kv_cache_spec
        if all(is_kpool_tail(s) for s in _layer_specs(spec)):
            kinds.append(RegionKind.RING)  # over the keys' pages: the geometry checks them
            continue
        if type(spec) is UniformTypeKVCacheSpecs:
            attention_pages |= {int(s.page_size_bytes) for s in _layer_specs(spec)}
            spec = _replicated_pages(group_id, spec)
        if type(spec) is MambaSpec:
            _check_state_group(group_id, spec)
            kinds.append(RegionKind.SSM)
            continue
        if type(spec) not in moved:
            raise ConfigError(
                f"KV-cache group {group_id} is {type(spec).__name__}: KVWireConnector moves "
                "full-attention (R-SWA too), MLA, sliding-window, chunked-local, ring and "
                "Mamba groups so far"
            )
        size = int(spec.page_size_bytes)
        page = (spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype, size)
        padded = getattr(spec, "page_size_padded", None)
        if spec.block_size != block_size or padded is not None or page != (first or page):
            raise ConfigError(
                f"KV-cache group {group_id}'s pages (block size {spec.block_size}, "
                f"{spec.num_kv_heads} heads of {spec.head_size}, {size} bytes, padded to "
                f"{padded}) differ "
                f"from the engine's (block size {block_size}) or another group's: "
                "KVWireConnector moves groups of one page shape so far"
            )
        first = page
        attention_pages.add(int(spec.page_size_bytes))
        ring = type(spec) is CircularBufferSpec
        kinds.append(RegionKind.RING if ring else RegionKind.ATTENTION)
    attention = [g for g, k in zip(groups, kinds, strict=True) if k is RegionKind.ATTENTION]
    local = (SlidingWindowSpec, ChunkedLocalAttentionSpec)
    if not attention or all(isinstance(g.kv_cache_spec, local) for g in attention):
        raise ConfigError(
            "no KV-cache group is full attention: KVWireConnector needs a group that "
            "holds the whole prompt so far (every group has a sliding window, attention "
            "chunks or a state)"
        )
    # An indexer's pooled keys share a group with latents of another page, which the
    # scheduler's config shows by its first layer alone: the worker's geometry checks
    # each state's slab (a state view strided as no region there is, refused by name).
    pooled = any(
        getattr(s, "tokens_per_state", 1) > 1
        for g in groups
        for s in _layer_specs(g.kv_cache_spec)
        if not isinstance(s, MambaSpec)
    )
    for group_id, group, kind in zip(ids, groups, kinds, strict=True):
        state_page = int(group.kv_cache_spec.page_size_bytes)
        if kind is RegionKind.SSM and state_page not in attention_pages and not pooled:
            raise ConfigError(
                f"KV-cache group {group_id}'s state pages are {state_page} bytes and the "
                f"attention pages {sorted(attention_pages)}: KVWireConnector moves state "
                "groups only in slabs they share with attention (vLLM's hybrid manager pads "
                "them to one page)"
            )
    return tuple(kinds)


def _row_kind(group_id: int, layers: list[Any]) -> RegionKind:
    """What a group of rows holds: its layers are all rings, all states, or attention (a
    group mixing them would be placed by one rule, by token or by position, and is
    refused by name)."""
    from vllm.v1.kv_cache_interface import CircularBufferSpec, MambaSpec

    for spec_type, kind in ((CircularBufferSpec, RegionKind.RING), (MambaSpec, RegionKind.SSM)):
        count = sum(type(s) is spec_type for s in layers)
        if count == len(layers):
            return kind
        if count:
            raise ConfigError(
                f"KV-cache group {group_id} holds {spec_type.__name__} layers beside others: "
                "KVWireConnector places a group's blocks by one rule, a ring's or a state's "
                "by position, any other by token"
            )
    return RegionKind.ATTENTION


def _replicated_pages(group_id: int, spec: Any) -> Any:
    """The spec a group of per-layer specs is checked as: its first layer's, when every
    layer is MLA (a page moved whole, whatever its size; the regions carry each layer's own
    page). Layers of one kind but other heads or head sizes would need each its own slicing
    between unequal TP sizes, which one geometry does not describe. (DeepSeek-V4's groups
    of such specs are rows, :func:`row_block_sizes`, and never come here.)"""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    layers = spec.kv_cache_specs
    others = sorted({type(s).__name__ for s in layers.values() if type(s) is not MLAAttentionSpec})
    if others:
        raise ConfigError(
            f"KV-cache group {group_id} holds layers of several page shapes ({', '.join(others)}): "
            "KVWireConnector moves such a group only when every layer is MLA (pages moved whole)"
        )
    sizes = {int(s.block_size) for s in layers.values()}
    padded = {s.page_size_padded for s in layers.values()}
    if len(sizes) > 1 or padded != {None}:
        raise ConfigError(
            f"KV-cache group {group_id}'s MLA layers have block sizes {sorted(sizes)} and "
            f"padding {sorted(map(str, padded))}: KVWireConnector moves one block size, unpadded"
        )
    return next(iter(layers.values()))


def _layer_specs(spec: Any) -> list[Any]:
    """A group's per-layer specs (one, unless vLLM wrapped several)."""
    layers = getattr(spec, "kv_cache_specs", None)
    return list(layers.values()) if layers is not None else [spec]


def row_block_sizes(kv_cache_config: Any) -> tuple[int, ...]:
    """Per transfer group, its tokens per block when the groups are rows of one buffer
    (``KVGeometry.group_block_sizes``), else ``()``.

    DeepSeek-V4's caches keep one state per several tokens (``tokens_per_state``) or pad
    their pages to an ``alignment`` (vLLM sets these, and ``model_version``, for V4
    alone), in groups of four block sizes that vLLM lays over one block-outermost buffer:
    no page is tokens times content, so such a model moves whole rows, each group's list
    placed by its own block size. Every page there is an MLA layer's, the same on every TP
    rank (:func:`rows_replicated`). DeepSeek-V4.1 adds its compressor's ring
    (``CircularBufferSpec``, one block a request), the same on every rank too. Qwen4Exp's
    indexers keep compressed keys the same way beside GQA attention, GDN state and its
    per-layer embeddings' state (``MambaSpec``), all over one buffer of rows: rows each TP
    rank holds its own of."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        CircularBufferSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
    )

    groups = transfer_groups(kv_cache_config)
    layers = [spec for g in groups for spec in _layer_specs(g.kv_cache_spec)]
    if any(is_kpool_tail(spec) for spec in layers):
        return ()  # 0.31.0's Glm5Next: per-layer slabs (its tail's backend takes LBHNC only)
    if not any(
        isinstance(spec, AttentionSpec)  # a Mamba spec has no tokens a state (-1)
        and (
            spec.tokens_per_state != 1
            or getattr(spec, "alignment", None) is not None
            or getattr(spec, "model_version", None) is not None
        )
        for spec in layers
    ):
        return ()
    moved = (MLAAttentionSpec, SlidingWindowMLASpec, CircularBufferSpec, FullAttentionSpec)
    others = sorted({type(s).__name__ for s in layers if type(s) not in (*moved, MambaSpec)})
    if others:
        raise ConfigError(
            f"KV-cache groups with states of several tokens or aligned pages (DeepSeek-V4's "
            f"caches) beside {', '.join(others)}: KVWireConnector moves such groups as rows "
            "of MLA, full-attention and state pages and rings only"
        )
    return tuple(int(g.kv_cache_spec.block_size) for g in groups)


def rows_replicated(kv_cache_config: Any) -> bool:
    """Whether rows of several block sizes (:func:`row_block_sizes`) hold MLA pages and
    rings, the same bytes on every TP rank (``KVGeometry.is_mla``), and beside them at
    most TP-sharded states whose parts are known (:func:`ssm_parts`: Glm5Next's KDA in
    vLLM 0.32.0), each rank's slice of a state: such rows move between any TP sizes, a
    state sliced. GQA attention and a TP-replicated state are each rank's own rows."""
    from vllm.v1.kv_cache_interface import (
        CircularBufferSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
    )

    replicated = (MLAAttentionSpec, SlidingWindowMLASpec, CircularBufferSpec)
    groups = transfer_groups(kv_cache_config)
    specs = [spec for g in groups for spec in _layer_specs(g.kv_cache_spec)]
    states = [spec for spec in specs if type(spec) is MambaSpec]
    # One state of one kind, sharded by TP, which ssm_parts describes.
    shapes = {(tuple(s.shapes), tuple(s.dtypes), s.mamba_type, s.tp_replicated) for s in states}
    sliced = not states or (
        len(shapes) == 1 and not states[0].tp_replicated and bool(ssm_parts(kv_cache_config))
    )
    return sliced and all(type(spec) in (*replicated, MambaSpec) for spec in specs)


def layer_specs(kv_cache_config: Any) -> dict[str, Any]:
    """Per layer of the transfer groups, its own spec (a group of per-layer specs
    unwrapped); its ``page_size_bytes``, padded as vLLM pads it, is what a stock engine
    registers the layer's page with."""
    specs = {}
    for group in transfer_groups(kv_cache_config):
        per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None)
        for name in group.layer_names:
            specs[name] = per_layer[name] if per_layer is not None else group.kv_cache_spec
    return specs


def _check_state_group(group_id: int, spec: Any) -> None:
    """A Mamba group kvwire moves as stock does: one state sharded by TP (a replicated
    one is CSA-linear's), made of the conv state and the temporal state, which stock
    advertises as ``ssm_sizes``; a third array would be left behind."""
    if getattr(spec, "tp_replicated", False):
        raise ConfigError(
            f"KV-cache group {group_id} is a TP-replicated MambaSpec (CSA-linear's): "
            "KVWireConnector moves TP-sharded state so far"
        )
    if len(spec.shapes) != 2:
        raise ConfigError(
            f"KV-cache group {group_id}'s MambaSpec has {len(spec.shapes)} state arrays: "
            "KVWireConnector (as stock's ssm_sizes) moves a conv and a temporal state"
        )
    _check_conv_layout(group_id)
    kind = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    if kind not in _CONV_SPLITS:
        raise ConfigError(
            f"KV-cache group {group_id} is a {kind} MambaSpec: KVWireConnector moves "
            f"{', '.join(sorted(_CONV_SPLITS))} state (a stock engine the same)"
        )


def _check_conv_layout(group_id: int) -> None:
    """Conv states dim-first, as stock's transfer requires (it asserts so at startup):
    state-first and dim-first states are the same size, so nothing a peer advertises or
    hashes tells them apart, and a pair whose engines differ would move every state
    transposed and complete the request."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    if not is_conv_state_dim_first():
        raise ConfigError(
            f"KV-cache group {group_id}'s conv state is stored state-first (vLLM's default, "
            "VLLM_SSM_CONV_STATE_LAYOUT=SD): KVWireConnector, as stock, moves it only "
            "dim-first, where each TP rank's columns are one run; set "
            "VLLM_SSM_CONV_STATE_LAYOUT=DS on every engine of the deployment"
        )


def _mamba2_split(conv_columns: int, temporal: tuple[int, ...]) -> tuple[int, ...]:
    """x (heads x head dim), then B and C of equal width."""
    x = temporal[0] * temporal[1]
    return (x, (conv_columns - x) // 2, (conv_columns - x) // 2)


def _gdn_split(conv_columns: int, temporal: tuple[int, ...]) -> tuple[int, ...]:
    """q and k of equal width, then v (value heads x value dim)."""
    v = temporal[0] * temporal[1]
    return ((conv_columns - v) // 2, (conv_columns - v) // 2, v)


_CONV_SPLITS: dict[str, Any] = {
    "MAMBA1": lambda conv_columns, _temporal: (conv_columns,),
    "MAMBA2": _mamba2_split,
    "GDN_ATTN": _gdn_split,
}
"""Per Mamba kind, the column widths of its conv state's sub-projections on one rank,
from the rank's conv columns and temporal state shape: each is sharded by TP on its own,
so a rank of another TP size takes its slice of each."""


def _mamba_spec(kv_cache_config: Any) -> Any | None:
    """The first Mamba layer's spec of the transfer groups, or None: every TP-sharded
    Mamba layer of a model has one state shape, which stock advertises once. A
    TP-replicated state (Qwen4Exp's embeddings') is passed over, as stock passes it."""
    from vllm.v1.kv_cache_interface import MambaSpec

    layers = (s for g in transfer_groups(kv_cache_config) for s in _layer_specs(g.kv_cache_spec))
    states = [s for s in layers if type(s) is MambaSpec]
    return next((s for s in states if not s.tp_replicated), states[0] if states else None)


def _itemsize(dtype: torch.dtype) -> int:
    return int(torch.empty((), dtype=dtype).element_size())


def ssm_parts(kv_cache_config: Any) -> tuple[int, ...]:
    """This rank's bytes of each TP-sharded part of one Mamba layer's state, in page order
    (``KVGeometry.ssm_parts``): the conv state dim-first (``VLLM_SSM_CONV_STATE_LAYOUT=DS``,
    as stock's transfer requires), so each sub-projection's columns are one run, then the
    temporal state, sharded by its first (heads) axis. None for a kind of state kvwire
    does not slice (in rows, which then move whole between equal TP sizes only)."""
    spec = _mamba_spec(kv_cache_config)
    split = _CONV_SPLITS.get(getattr(spec.mamba_type, "name", "")) if spec is not None else None
    if spec is None or split is None or len(spec.shapes) != 2:
        return ()
    conv_shape, temporal = tuple(spec.shapes[0]), tuple(spec.shapes[1])
    row = math.prod(conv_shape[1:]) * _itemsize(spec.dtypes[0])
    columns = split(conv_shape[0], temporal)
    if sum(columns) != conv_shape[0] or min(columns) <= 0:
        if row_block_sizes(kv_cache_config):
            return ()  # rows move it whole, between equal TP sizes only
        raise ConfigError(
            f"a MambaSpec's conv state of {conv_shape[0]} columns does not split into "
            f"its sub-projections ({columns}) as its kind's do"
        )
    return (*(c * row for c in columns), ssm_sizes(kv_cache_config)[1])


def ssm_sizes(kv_cache_config: Any) -> tuple[int, int]:
    """(conv state bytes, temporal state bytes) of one layer's Mamba state on this rank,
    as a stock engine advertises them (0, 0 without a Mamba group). vLLM's spec already
    holds this rank's shard, so the sizes are its arrays' bytes."""
    spec = _mamba_spec(kv_cache_config)
    if spec is None:
        return (0, 0)
    conv, temporal = state_sizes(spec)
    return conv, temporal


def state_sizes(spec: Any) -> tuple[int, ...]:
    """Bytes of each array of a Mamba spec's state on this rank."""
    sizes = zip(spec.shapes, spec.dtypes, strict=True)
    return tuple(int(math.prod(shape) * _itemsize(dtype)) for shape, dtype in sizes)


@dataclass(frozen=True)
class Exchanged:
    """Which of a request's blocks in one transfer group cross between engines, as a stock
    engine exchanges them (so a stock peer reads what it expects).

    A sliding-window group's attention reaches back ``W`` tokens from the prompt's end, so
    only its last ``cdiv(W, block_size) + 1`` blocks matter (the extra one for a window that
    starts inside a block); vLLM's manager has already swapped older ones for its null
    block. A Mamba group's list ends in ``spec_slots`` scratch slots for speculative
    decoding, which never cross; of the rest only the running state (the last) does,
    unless vLLM 0.31 keeps a state per block position (``mamba_cache_mode`` "all"): 0.32
    sends the running state alone in every mode. A chunked-local-attention group crosses
    whole, the chunks no token attends to anymore vLLM's null block (id 0). An R-SWA group
    crosses whole too; once its request decodes, vLLM frees the blocks between the prompt
    and the decode window (``gaps``). A ring group's list is its one block (``ring``)."""

    tail: int = 0
    """The last blocks that cross; 0: all."""
    block_size: int = 0
    """Tokens per block of an attention group (DeepSeek-V4's groups differ); 0: the
    engine's."""
    spec_slots: int | None = None
    """A Mamba group's trailing scratch slots (``None``: not a Mamba group)."""
    positional: bool = False
    chunked: bool = False
    """A chunked-local-attention group: its list may lead with several null blocks."""
    gaps: bool = False
    """An R-SWA group: a conversation kept past its prompt has null blocks inside."""
    ring: bool = False
    """A ring group: one block, the latest tokens' rows, not the sequence."""

    def held(self, blocks: list[int]) -> list[int]:
        """The exchanged blocks P's own transfer holds: a chunked list without its leading
        null blocks (placeholders, and one block held twice). Once per finished prompt
        and group; a long prompt's list leads with thousands of them (measured, 7680 before
        512 real blocks: 153 us in numpy, 178 us with a generator; the conversion of the
        list is most of either)."""
        return past_placeholders(blocks) if self.chunked else blocks

    def __call__(self, blocks: list[int]) -> list[int]:
        if self.tail:
            return blocks[-self.tail :]
        if self.spec_slots is None or not blocks:
            return blocks
        if scratch := min(self.spec_slots, len(blocks) - 1):
            blocks = blocks[:-scratch]
        return blocks if self.positional else blocks[-1:]


def past_placeholders(blocks: list[int]) -> list[int]:
    """A list without its leading null blocks (vLLM's id 0): they stand for blocks a window
    or a chunk dropped, which stock's exchanged lists keep in place (a window's tail may
    start with one, a chunked list with many)."""
    real = np.flatnonzero(np.asarray(blocks, dtype=np.int64))
    return blocks[int(real[0]) :] if real.size else []


def exchanged(kv_cache_config: Any, vllm_config: Any) -> tuple[Exchanged, ...]:
    """Per transfer group, which of a request's blocks cross (:class:`Exchanged`)."""
    from vllm.distributed.kv_transfer.kv_connector import utils
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        MambaSpec,
        RSWASpec,
        SlidingWindowSpec,
    )

    # 0.32 clips a state list with this helper (the running state, in every mode); 0.31,
    # which lacks it, kept each position's state in mode "all".
    positional = getattr(vllm_config.cache_config, "mamba_cache_mode", "none") == "all" and (
        not hasattr(utils, "clip_ssm_state_blocks")
    )
    sizes = row_block_sizes(kv_cache_config)
    rules = []
    for group in transfer_groups(kv_cache_config):
        spec = group.kv_cache_spec
        size = int(spec.block_size) if sizes else 0
        if all(is_kpool_tail(s) for s in _layer_specs(spec)):
            rules.append(Exchanged(ring=True))
        elif isinstance(spec, SlidingWindowSpec):
            tail = -(-int(spec.sliding_window) // int(spec.block_size)) + 1
            rules.append(Exchanged(tail=tail, block_size=size))
        elif isinstance(spec, MambaSpec):
            rules.append(
                Exchanged(spec_slots=int(spec.num_speculative_blocks), positional=positional)
            )
        else:
            chunked = isinstance(spec, ChunkedLocalAttentionSpec)
            gaps = isinstance(spec, RSWASpec)
            ring = isinstance(spec, CircularBufferSpec)
            rules.append(Exchanged(block_size=size, chunked=chunked, gaps=gaps, ring=ring))
    return tuple(rules)


def prefill_backoff(kv_cache_config: Any, vllm_config: Any) -> int:
    """The prompt's trailing tokens P leaves for D to compute, as stock decides them: a
    Mamba layer's D needs the state before the last token to compute the last one itself,
    and a multi-token drafter's lookahead must not reach P's cache (its drafts there would
    never be verified)."""
    mamba = bool(getattr(kv_cache_config, "has_mamba_layers", False))
    lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0)
    return max(1 if mamba else 0, lookahead - 1)
