"""Where a vLLM worker's KV blocks are, in kvwire's terms: the regions and geometry a
worker registers and advertises, read from the per-layer tensors vLLM hands the connector.

Separate from the connector because it is the one part that must agree byte for byte with a
stock NixlConnector engine's registration (docs/vllm.md, "Proven here"); the connector only
calls :func:`layer_geometry`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvwire.config import KVWireConfig
from kvwire.errors import ConfigError
from kvwire.layout.geometry import (
    SHARED_GROUP_ID,
    BlockRegion,
    KVGeometry,
    RegionKind,
    parse_layout,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def attn_backend_name(vllm_config: VllmConfig) -> str:
    """The attention backend vLLM chose (a factor of the compatibility hash)."""
    from vllm.distributed.kv_transfer.kv_connector import utils

    backends = utils.get_current_attn_backends(vllm_config)
    return str(backends[0].get_name())


def _one_run(page: torch.Tensor) -> bool:
    """Whether a page's elements fill one gap-free span, in whatever order the layout
    nests its axes (LBNHC's page is [N, H, C] in memory but viewed as [H, N, C])."""
    expected = 1
    for size, stride in sorted(zip(page.shape, page.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _spans(view: torch.Tensor, num_blocks: int) -> list[tuple[int, int, int]]:
    """Where one layer's blocks are, as (address, bytes per block, bytes between blocks),
    chosen as a stock NixlConnector engine chooses them, so a mixed pair agrees region
    for region:

    * a page that is one run in the view's own order (LBHNC, BLHNC): the layer's pages;
    * otherwise, storage made of whole block rows (BLNHC): the rows, every layer of a
      block in one span, shared by all layers;
    * otherwise a page that is one run in memory order (LBNHC): the layer's pages.

    The other layouts are refused by name before this (:func:`parse_layout`).
    """
    stride = int(view.stride(0)) * view.element_size()
    page = int(view[0].nbytes)
    if view[0].is_contiguous():
        return [(int(view.data_ptr()), page, stride)]
    storage = view.untyped_storage()
    if 0 <= storage.nbytes() - num_blocks * stride < stride:
        return [(int(storage.data_ptr()), stride, stride)]
    if _one_run(view[0]):
        return [(int(view.data_ptr()), page, stride)]
    raise ConfigError("a block's page is not one span")


def layer_order(name: str) -> tuple[tuple[int, int | str], ...]:
    """Where a layer's region goes in the list a worker registers: model-layer order, the
    digits of a name compared as numbers (``layers.2`` before ``layers.10``), then by cache
    name, as a stock engine orders them. vLLM's allocation order may differ (a sparse MLA
    model allocates every latent before the first indexer cache), and a stock peer pairs
    regions by index."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name)
    )


def kernel_ratio(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> int:
    """Kernel blocks per block vLLM hands out ids for: an attention backend that cannot use
    the engine's block size gets the largest it supports that divides it, and every layer's
    view then has that many times the blocks (a stock engine reads the same ratio from the
    backends; kvwire reads it from the views it registers)."""
    ratios = set()
    for name, view in kv_caches.items():
        if view.dim() < 2 or view.shape[0] % num_blocks or not view.shape[0]:
            raise ConfigError(
                f"layer {name}: its view {tuple(view.shape)} does not have vLLM's "
                f"{num_blocks} blocks, or a whole number of kernel blocks per block, first"
            )
        ratios.add(view.shape[0] // num_blocks)
    if len(ratios) > 1:
        raise ConfigError(
            f"the layers' views split a block into different numbers of kernel blocks "
            f"({sorted(ratios)}): KVWireConnector needs one kernel block size"
        )
    return ratios.pop() if ratios else 1


def layer_regions(
    kv_caches: dict[str, torch.Tensor],
    num_blocks: int,
    layout: str,
    group_of: Mapping[str, int] | None = None,
    state_layers: frozenset[str] = frozenset(),
) -> list[BlockRegion]:
    """The worker's regions, read from each layer's own view of ``num_blocks`` region
    blocks (kernel blocks: :func:`kernel_ratio` times vLLM's block count).

    vLLM backs every layer of a cache group with one allocation, so a view's storage alone
    says nothing about its layer. Layers whose spans coincide (block rows) share a region,
    which names where each layer's page sits in a row: a kvwire peer then pairs layer by
    layer and can slice pages by heads and tokens, and a peer that knows only the rows is
    held to equal shards (:mod:`kvwire.layout.alignment`).

    ``group_of`` names each layer's KV-cache group (vLLM's transfer groups). Under the
    hybrid manager layer ``j`` of every group lives in the same slab, so views of
    different groups start at one address: that region is every group's (group -1), as
    stock advertises it, and a block id there belongs to whichever group holds it.

    ``state_layers`` (Mamba) only mark the slab they live in as theirs too: vLLM pads
    their state to the attention page, so the slab is registered once, by its attention
    layer, as stock registers it.
    """
    spans: dict[int, tuple[str, int, int, torch.Tensor]] = {}
    rows: dict[int, dict[str, tuple[int, int]]] = {}
    groups: dict[int, int] = {}
    states: dict[int, str] = {}
    first: dict[int, str] = {}
    """Per span, the first layer of any kind on it, in stock's order."""
    for name in sorted(kv_caches, key=layer_order):
        view = kv_caches[name]
        group = group_of.get(name, 0) if group_of is not None else 0
        if name in state_layers:
            states.setdefault(int(view.data_ptr()), name)
            first.setdefault(int(view.data_ptr()), name)
            continue
        if view.dim() < 2 or view.shape[0] != num_blocks:
            raise ConfigError(
                f"layer {name}: its view {tuple(view.shape)} has not {num_blocks} blocks first"
            )
        try:
            found = _spans(view, num_blocks)
        except ConfigError as exc:
            raise ConfigError(f"layer {name}: in KV cache layout {layout}, {exc}") from None
        page = int(view[0].nbytes)
        for base, block_len, stride in found:
            first.setdefault(base, name)
            spans.setdefault(base, (name, block_len, stride, view))
            if groups.setdefault(base, group) != group:
                groups[base] = SHARED_GROUP_ID
            if block_len > page:
                rows.setdefault(base, {})[name] = (int(view.data_ptr()) - base, page)
    for base, name in states.items():
        if base not in spans:
            raise ConfigError(
                f"layer {name}: its state is in a slab no attention layer shares: "
                "KVWireConnector moves state groups only beside attention so far"
            )
        groups[base] = SHARED_GROUP_ID
    regions = []
    # A region is where the first layer (in stock's order) of any kind on it puts it, and
    # is named after that layer, a state layer's too, as stock names it.
    order = {base: i for i, base in enumerate(first)}
    for base in sorted(spans, key=order.__getitem__):
        _, block_len, stride, view = spans[base]
        name = first[base]
        on_device = view.device.type != "cpu"
        packed = rows.get(base, {})
        regions.append(
            BlockRegion(
                base_addr=base,
                block_len=block_len,
                block_stride=stride,
                num_blocks=num_blocks,
                group_id=groups[base],
                mem_kind="VRAM" if on_device else "DRAM",
                device_id=max(view.get_device(), 0) if on_device else None,
                name=name,
                members=tuple(packed),
                packed_members=packed,
            )
        )
    return regions


def row_regions(
    kv_caches: dict[str, torch.Tensor],
    num_blocks: int,
    layout: str,
    group_of: Mapping[str, int],
) -> list[BlockRegion]:
    """The worker's one region when its groups have several block sizes: vLLM lays them
    over one buffer of rows, a row per block id as wide as the widest group's pages, and
    no layer's page is a span of the block it owns (pages are padded past their content),
    so the rows are what moves, registered once and shared by every group, as stock
    registers them."""
    names = sorted(kv_caches, key=layer_order)
    first = kv_caches[names[0]]
    storage = first.untyped_storage()
    base = int(storage.data_ptr())
    stride = int(first.stride(0)) * first.element_size()
    for name in names:
        view = kv_caches[name]
        offset = int(view.data_ptr()) - base
        span = sum((n - 1) * s for n, s in zip(view.shape[1:], view.stride()[1:], strict=True))
        if (
            int(view.untyped_storage().data_ptr()) != base
            or int(view.stride(0)) * view.element_size() != stride
            or view.shape[0] != num_blocks
            or offset < 0
            or offset + (span + 1) * view.element_size() > stride
            or not 0 <= storage.nbytes() - num_blocks * stride < stride
        ):
            raise ConfigError(
                f"layer {name}: in KV cache layout {layout}, groups of several block sizes "
                f"are moved as rows of one buffer ({num_blocks} rows of {stride} bytes from "
                f"{names[0]}'s), and this layer's view is not inside them"
            )
    on_device = first.device.type != "cpu"
    groups = {group_of[name] for name in names}
    return [
        BlockRegion(
            base_addr=base,
            block_len=stride,
            num_blocks=num_blocks,
            group_id=groups.pop() if len(groups) == 1 else SHARED_GROUP_ID,
            mem_kind="VRAM" if on_device else "DRAM",
            device_id=max(first.get_device(), 0) if on_device else None,
            name=names[0],
        )
    ]


def transfer_groups(kv_cache_config: Any) -> tuple[Any, ...]:
    """The KV-cache groups whose blocks cross between engines, in the order the block
    lists of ``kv_transfer_params`` carry them (vLLM leaves some groups out)."""
    return tuple(getattr(kv_cache_config, "transfer_groups", kv_cache_config.kv_cache_groups))


def group_kinds(kv_cache_config: Any, block_size: int) -> tuple[RegionKind, ...]:
    """What each transfer group stores, refusing by name what kvwire does not move yet.

    A :class:`KVGeometry` describes one attention page for every attention group (one block
    size, one head count and head size), which is what vLLM's hybrid manager makes of
    attention layers that differ only in their window. The exception is MLA, whose pages
    are never sliced: a sparse MLA model (DeepSeek-V3.2) keeps its indexer's keys beside
    its latents in one group of per-layer specs (vLLM's ``UniformTypeKVCacheSpecs``), each
    layer its own page size, and every region moves whole. A state-space (Mamba) group's page
    is its state, padded by vLLM to the attention page so both share the slabs: it moves as
    one state of ``sum(ssm_sizes)`` bytes (:func:`ssm_sizes`). Anything else (rings,
    chunked local attention, groups whose pages vLLM resized or padded otherwise) would be
    planned with the wrong page, so it fails the engine's startup instead. So does a model
    whose every attention group has a window: no list then holds the whole prompt, which is
    where the planner places the others.
    """
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    moved = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, SlidingWindowMLASpec)
    groups = transfer_groups(kv_cache_config)
    ids = getattr(kv_cache_config, "transfer_group_ids", range(len(groups)))
    if row_block_sizes(kv_cache_config):
        windowed = (_layer_specs(g.kv_cache_spec) for g in groups)
        if all(all(isinstance(s, SlidingWindowSpec) for s in layers) for layers in windowed):
            raise ConfigError(
                "no KV-cache group is full attention: KVWireConnector needs a group that "
                "holds the whole prompt so far (every group has a sliding window)"
            )
        return (RegionKind.ATTENTION,) * len(groups)
    first: tuple[Any, ...] | None = None
    kinds = []
    attention_page = 0
    for group_id, group in zip(ids, groups, strict=True):
        spec = group.kv_cache_spec
        if type(spec) is UniformTypeKVCacheSpecs:
            spec = _replicated_pages(group_id, spec)
        if type(spec) is MambaSpec:
            _check_state_group(group_id, spec)
            kinds.append(RegionKind.SSM)
            continue
        if type(spec) not in moved:
            raise ConfigError(
                f"KV-cache group {group_id} is {type(spec).__name__}: KVWireConnector moves "
                "full-attention, MLA, sliding-window and Mamba groups so far"
            )
        page = (spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype)
        padded = getattr(spec, "page_size_padded", None)
        if spec.block_size != block_size or padded is not None or page != (first or page):
            raise ConfigError(
                f"KV-cache group {group_id}'s pages (block size {spec.block_size}, "
                f"{spec.num_kv_heads} heads of {spec.head_size}, padded to {padded}) differ "
                f"from the engine's (block size {block_size}) or another group's: "
                "KVWireConnector moves groups of one page shape so far"
            )
        first = page
        attention_page = int(spec.page_size_bytes)
        kinds.append(RegionKind.ATTENTION)
    attention = [g for g, k in zip(groups, kinds, strict=True) if k is RegionKind.ATTENTION]
    if not attention or all(isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in attention):
        raise ConfigError(
            "no KV-cache group is full attention: KVWireConnector needs a group that "
            "holds the whole prompt so far (every group has a sliding window or a state)"
        )
    for group_id, group, kind in zip(ids, groups, kinds, strict=True):
        state_page = int(group.kv_cache_spec.page_size_bytes)
        if kind is RegionKind.SSM and state_page != attention_page:
            raise ConfigError(
                f"KV-cache group {group_id}'s state pages are {state_page} bytes and the "
                f"attention pages {attention_page}: KVWireConnector moves state groups only "
                "in slabs they share with attention (vLLM's hybrid manager pads them to one page)"
            )
    return tuple(kinds)


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
    rank; a row holding head-sharded pages would not be."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec, SlidingWindowMLASpec

    groups = transfer_groups(kv_cache_config)
    layers = [spec for g in groups for spec in _layer_specs(g.kv_cache_spec)]
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
    moved = (MLAAttentionSpec, SlidingWindowMLASpec)
    others = sorted({type(s).__name__ for s in layers if type(s) not in moved})
    if others:
        raise ConfigError(
            f"KV-cache groups with states of several tokens or aligned pages (DeepSeek-V4's "
            f"caches) beside {', '.join(others)}: KVWireConnector moves such groups as rows "
            "of MLA pages only"
        )
    return tuple(int(g.kv_cache_spec.block_size) for g in groups)


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
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    if not is_conv_state_dim_first():
        raise ConfigError(
            f"KV-cache group {group_id}'s conv state is stored state-first (vLLM's default, "
            "VLLM_SSM_CONV_STATE_LAYOUT=SD): KVWireConnector, as stock, moves it only "
            "dim-first, where each TP rank's columns are one run; set "
            "VLLM_SSM_CONV_STATE_LAYOUT=DS on every engine of the deployment"
        )
    kind = getattr(spec.mamba_type, "name", str(spec.mamba_type))
    if kind not in _CONV_SPLITS:
        raise ConfigError(
            f"KV-cache group {group_id} is a {kind} MambaSpec: KVWireConnector moves "
            f"{', '.join(sorted(_CONV_SPLITS))} state (a stock engine the same)"
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
    """The first transfer group's MambaSpec (every Mamba layer of a model has one state
    shape, which stock advertises once), or None."""
    from vllm.v1.kv_cache_interface import MambaSpec

    specs = (g.kv_cache_spec for g in transfer_groups(kv_cache_config))
    return next((s for s in specs if type(s) is MambaSpec), None)


def _itemsize(dtype: torch.dtype) -> int:
    return int(torch.empty((), dtype=dtype).element_size())


def ssm_parts(kv_cache_config: Any) -> tuple[int, ...]:
    """This rank's bytes of each TP-sharded part of one Mamba layer's state, in page order
    (``KVGeometry.ssm_parts``): the conv state dim-first (``VLLM_SSM_CONV_STATE_LAYOUT=DS``,
    as stock's transfer requires), so each sub-projection's columns are one run, then the
    temporal state, sharded by its first (heads) axis."""
    spec = _mamba_spec(kv_cache_config)
    if spec is None:
        return ()
    conv_shape, temporal = tuple(spec.shapes[0]), tuple(spec.shapes[1])
    split = _CONV_SPLITS[getattr(spec.mamba_type, "name", "")]
    row = math.prod(conv_shape[1:]) * _itemsize(spec.dtypes[0])
    columns = split(conv_shape[0], temporal)
    if sum(columns) != conv_shape[0] or min(columns) <= 0:
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
    conv, temporal = (
        math.prod(shape) * _itemsize(dtype)
        for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
    )
    return int(conv), int(temporal)


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
    sends the running state alone in every mode."""

    tail: int = 0
    """The last blocks that cross; 0: all."""
    block_size: int = 0
    """Tokens per block of an attention group (DeepSeek-V4's groups differ); 0: the
    engine's."""
    spec_slots: int | None = None
    """A Mamba group's trailing scratch slots (``None``: not a Mamba group)."""
    positional: bool = False

    def __call__(self, blocks: list[int]) -> list[int]:
        if self.tail:
            return blocks[-self.tail :]
        if self.spec_slots is None or not blocks:
            return blocks
        if scratch := min(self.spec_slots, len(blocks) - 1):
            blocks = blocks[:-scratch]
        return blocks if self.positional else blocks[-1:]


def exchanged(kv_cache_config: Any, vllm_config: Any) -> tuple[Exchanged, ...]:
    """Per transfer group, which of a request's blocks cross (:class:`Exchanged`)."""
    from vllm.distributed.kv_transfer.kv_connector import utils
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

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
        if isinstance(spec, SlidingWindowSpec):
            tail = -(-int(spec.sliding_window) // int(spec.block_size)) + 1
            rules.append(Exchanged(tail=tail, block_size=size))
        elif isinstance(spec, MambaSpec):
            rules.append(
                Exchanged(spec_slots=int(spec.num_speculative_blocks), positional=positional)
            )
        else:
            rules.append(Exchanged(block_size=size))
    return tuple(rules)


def prefill_backoff(kv_cache_config: Any, vllm_config: Any) -> int:
    """The prompt's trailing tokens P leaves for D to compute, as stock decides them: a
    Mamba layer's D needs the state before the last token to compute the last one itself,
    and a multi-token drafter's lookahead must not reach P's cache (its drafts there would
    never be verified)."""
    mamba = bool(getattr(kv_cache_config, "has_mamba_layers", False))
    lookahead = int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0)
    return max(1 if mamba else 0, lookahead - 1)


def layer_geometry(
    kv_caches: dict[str, torch.Tensor],
    kv_cache_config: Any,
    config: KVWireConfig,
    vllm_config: Any,
) -> KVGeometry:
    """The worker's geometry: its layer regions and the facts a peer checks them by."""
    model = vllm_config.model_config
    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    layout_name = str(getattr(layout, "name", layout))
    parse_layout(layout_name)  # kvwire's rule refuses a layout it cannot move, by name
    num_blocks = int(kv_cache_config.num_blocks)
    group_of = {
        name: index
        for index, group in enumerate(transfer_groups(kv_cache_config))
        for name in group.layer_names
    }
    kinds = group_kinds(kv_cache_config, int(vllm_config.cache_config.block_size))
    sizes = row_block_sizes(kv_cache_config)
    moved = {name: view for name, view in kv_caches.items() if name in group_of}
    states = frozenset(n for n in moved if kinds[group_of[n]] is RegionKind.SSM)
    ratio = kernel_ratio({n: v for n, v in moved.items() if n not in states}, num_blocks)
    if sizes:
        regions = row_regions(moved, num_blocks * ratio, layout_name, group_of)
    else:
        regions = layer_regions(moved, num_blocks * ratio, layout_name, group_of, states)
    return KVGeometry(
        regions=regions,
        physical_blocks_per_logical=ratio,
        group_kinds=kinds,
        group_block_sizes=sizes,
        ssm_sizes=ssm_sizes(kv_cache_config),
        ssm_parts=ssm_parts(kv_cache_config),
        kv_cache_layout=layout_name,
        # vLLM's engine core sets the configured block size to the smallest group's when
        # the groups differ (4 for V4, in the scheduler and in an in-process worker);
        # stock advertises the groups' least common multiple, and so does kvwire.
        block_size=math.lcm(*sizes) if sizes else int(vllm_config.cache_config.block_size),
        total_kv_heads=1 if model.use_mla or sizes else model.get_total_num_kv_heads(),
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        is_mla=bool(model.use_mla) or bool(sizes),  # rows hold MLA pages alone
        attn_backend_name=attn_backend_name(vllm_config),
        num_blocks=num_blocks * ratio,
    )
