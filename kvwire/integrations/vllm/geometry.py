"""Where a vLLM worker's KV blocks are, in kvwire's terms: the regions and geometry a
worker registers and advertises, read from the per-layer tensors vLLM hands the connector.

Separate from the connector because it is the one part that must agree byte for byte with a
stock NixlConnector engine's registration (docs/vllm.md, "Proven here"); the connector only
calls :func:`layer_geometry`.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    """
    spans: dict[int, tuple[str, int, int, torch.Tensor]] = {}
    rows: dict[int, dict[str, tuple[int, int]]] = {}
    groups: dict[int, int] = {}
    for name, view in kv_caches.items():
        if view.dim() < 2 or view.shape[0] != num_blocks:
            raise ConfigError(
                f"layer {name}: its view {tuple(view.shape)} has not {num_blocks} blocks first"
            )
        try:
            found = _spans(view, num_blocks)
        except ConfigError as exc:
            raise ConfigError(f"layer {name}: in KV cache layout {layout}, {exc}") from None
        page = int(view[0].nbytes)
        group = group_of.get(name, 0) if group_of is not None else 0
        for base, block_len, stride in found:
            spans.setdefault(base, (name, block_len, stride, view))
            if groups.setdefault(base, group) != group:
                groups[base] = SHARED_GROUP_ID
            if block_len > page:
                rows.setdefault(base, {})[name] = (int(view.data_ptr()) - base, page)
    regions = []
    for base, (name, block_len, stride, view) in spans.items():
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


def transfer_groups(kv_cache_config: Any) -> tuple[Any, ...]:
    """The KV-cache groups whose blocks cross between engines, in the order the block
    lists of ``kv_transfer_params`` carry them (vLLM leaves some groups out)."""
    return tuple(getattr(kv_cache_config, "transfer_groups", kv_cache_config.kv_cache_groups))


def group_kinds(kv_cache_config: Any, block_size: int) -> tuple[RegionKind, ...]:
    """What each transfer group stores, refusing by name what kvwire does not move yet.

    A :class:`KVGeometry` describes one page for every group (one block size, one head
    count and head size), which is what vLLM's hybrid manager makes of attention layers
    that differ only in their window. Anything else (state-space groups, rings, chunked
    local attention, groups whose pages vLLM resized or padded to share a pool) would be
    planned with the wrong page, so it fails the engine's startup instead. So does a model
    whose every group has a window: no list then holds the whole prompt, which is where
    the planner places the others.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    moved = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec)
    groups = transfer_groups(kv_cache_config)
    ids = getattr(kv_cache_config, "transfer_group_ids", range(len(groups)))
    first: tuple[Any, ...] | None = None
    for group_id, group in zip(ids, groups, strict=True):
        spec = group.kv_cache_spec
        if type(spec) not in moved:
            raise ConfigError(
                f"KV-cache group {group_id} is {type(spec).__name__}: KVWireConnector moves "
                "full-attention, MLA and sliding-window groups so far"
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
    if groups and all(type(g.kv_cache_spec) is SlidingWindowSpec for g in groups):
        raise ConfigError(
            "every KV-cache group has a sliding window: KVWireConnector needs a group that "
            "holds the whole prompt so far"
        )
    return tuple(RegionKind.ATTENTION for _ in groups)


def exchanged_tails(kv_cache_config: Any) -> tuple[int, ...]:
    """Per transfer group, how many of a request's last blocks cross between engines; 0 is
    all of them.

    A sliding-window group's attention reaches back ``W`` tokens from the prompt's end, so
    only its last ``cdiv(W, block_size) + 1`` blocks matter (the extra one for a window
    that starts inside a block); vLLM's manager has already swapped older ones for its null
    block. A stock peer exchanges exactly that tail, so kvwire does too.
    """
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    tails = []
    for group in transfer_groups(kv_cache_config):
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            tails.append(-(-int(spec.sliding_window) // int(spec.block_size)) + 1)
        else:
            tails.append(0)
    return tuple(tails)


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
    moved = {name: view for name, view in kv_caches.items() if name in group_of}
    ratio = kernel_ratio(moved, num_blocks)
    return KVGeometry(
        regions=layer_regions(moved, num_blocks * ratio, layout_name, group_of),
        physical_blocks_per_logical=ratio,
        group_kinds=group_kinds(kv_cache_config, int(vllm_config.cache_config.block_size)),
        kv_cache_layout=layout_name,
        block_size=int(vllm_config.cache_config.block_size),
        total_kv_heads=1 if model.use_mla else model.get_total_num_kv_heads(),
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        is_mla=bool(model.use_mla),
        attn_backend_name=attn_backend_name(vllm_config),
        num_blocks=num_blocks * ratio,
    )
