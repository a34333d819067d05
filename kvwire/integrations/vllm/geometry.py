"""Where a vLLM worker's KV blocks are, in kvwire's terms: the regions and geometry a
worker registers and advertises, read from the per-layer tensors vLLM hands the connector.

Separate from the connector because it is the one part that must agree byte for byte with a
stock NixlConnector engine's registration (docs/vllm.md, "Proven here"); the connector only
calls :func:`layer_geometry`. What the groups hold is :mod:`~kvwire.integrations.vllm.groups`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from kvwire.config import KVWireConfig
from kvwire.errors import ConfigError
from kvwire.integrations.vllm.groups import (
    group_kinds,
    is_kpool_tail,
    layer_specs,
    row_block_sizes,
    rows_replicated,
    ssm_parts,
    ssm_sizes,
    state_sizes,
    transfer_groups,
)
from kvwire.layout.geometry import (
    SHARED_GROUP_ID,
    BlockRegion,
    KVGeometry,
    RegionKind,
    parse_layout,
    token_group_sizes,
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


def _region(
    view: torch.Tensor, base: int, block_len: int, stride: int, num_blocks: int, group: int,
    name: str, packed: dict[str, tuple[int, int]] | None = None, extent: int = 0,
) -> BlockRegion:  # fmt: skip
    """A region of ``view``'s memory, on its device or the host."""
    on_device = view.device.type != "cpu"
    return BlockRegion(
        base_addr=base,
        block_len=block_len,
        block_stride=stride,
        num_blocks=num_blocks,
        group_id=group,
        mem_kind="VRAM" if on_device else "DRAM",
        device_id=max(view.get_device(), 0) if on_device else None,
        name=name,
        members=tuple(packed or ()),
        packed_members=packed or {},
        extent=extent,
    )


def layer_order(name: str) -> tuple[tuple[int, int | str], ...]:
    """Where a layer's region goes in the list a worker registers: model-layer order, the
    digits of a name compared as numbers (``layers.2`` before ``layers.10``), then by cache
    name, as a stock engine orders them. vLLM's allocation order may differ (a sparse MLA
    model allocates every latent before the first indexer cache), and a stock peer pairs
    regions by index."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name)
    )


def kernel_ratio(
    kv_caches: Mapping[str, torch.Tensor], num_blocks: int, pooled: frozenset[str] = frozenset()
) -> int:
    """Kernel blocks per block vLLM hands out ids for: an attention backend that cannot use
    the engine's block size gets the largest it supports that divides it, and every layer's
    view then has that many times the blocks (a stock engine reads the same ratio from the
    backends; kvwire reads it from the views it registers). A ``pooled`` layer's view of
    whole blocks, each one run, splits into as many kernel pages as the others have: an
    indexer's pooled keys (one head, a key per several tokens, token-major) beside split
    latents, vLLM 0.31.0's Glm5Next, which a stock engine splits so too."""
    ratios: dict[int, str] = {}
    whole: dict[str, torch.Tensor] = {}
    for name, view in kv_caches.items():
        if view.dim() < 2 or view.shape[0] % num_blocks or not view.shape[0]:
            raise ConfigError(
                f"layer {name}: its view {tuple(view.shape)} does not have vLLM's "
                f"{num_blocks} blocks, or a whole number of kernel blocks per block, first"
            )
        ratio = view.shape[0] // num_blocks
        if ratio == 1 and view.is_contiguous() and name in pooled:
            whole[name] = view
        else:
            ratios.setdefault(ratio, name)
    if len(ratios) > 1:
        raise ConfigError(
            f"the layers' views split a block into different numbers of kernel blocks "
            f"({sorted(ratios)}): KVWireConnector needs one kernel block size"
        )
    ratio = next(iter(ratios), 1)
    for name, view in whole.items():
        if view[0].numel() % ratio:
            raise ConfigError(
                f"layer {name}: its blocks of {view[0].numel()} values do not split into "
                f"the {ratio} kernel blocks per block of layer {ratios[ratio]}"
            )
    return ratio


def _ring_holder(
    name: str, view: torch.Tensor, spans: Mapping[int, tuple[str, int, int, torch.Tensor]],
    num_blocks: int,
) -> int:  # fmt: skip
    """The region a ring layer laid over another layer's pages lies in (its base): one
    whose logical blocks, its kernel blocks abutting, hold the ring's pages."""
    base = int(view.data_ptr())
    blocks = int(view.shape[0]) if view.dim() >= 2 else 0
    found = spans.get(base)
    if found is not None and blocks and num_blocks % blocks == 0:
        _, block_len, stride, _ = found
        logical = block_len * (num_blocks // blocks)
        row = int(view.stride(0)) * view.element_size()
        fits = int(view[0].nbytes) <= logical and _one_run(view[0])
        if stride == block_len and row == logical and fits:
            return base
    raise ConfigError(
        f"layer {name}: a ring over another layer's pages ({tuple(view.shape)} at "
        f"{base:#x}) must lie inside the logical blocks of a region registered there"
    )


def _check_state_slab(
    name: str, view: torch.Tensor, slab: tuple[str, int, int, torch.Tensor], num_blocks: int
) -> None:
    """A state's pages are its slab's logical blocks: a state view of whole blocks, strided
    as the slab's kernel blocks of one block together (vLLM pads the state page to the
    attention page it shares the slab with)."""
    _, block_len, stride, _ = slab
    blocks = int(view.shape[0]) if view.dim() >= 2 else 0
    row = int(view.stride(0)) * view.element_size() if blocks else 0
    if not blocks or num_blocks % blocks or row != stride * (num_blocks // blocks):
        raise ConfigError(
            f"layer {name}: its state pages ({tuple(view.shape)}, {row} bytes apart) are "
            f"not its slab's blocks ({num_blocks} of {block_len} bytes, {stride} apart): "
            "KVWireConnector moves state groups only in slabs they share with attention, "
            "one page a block (vLLM's hybrid manager pads them to one page)"
        )


def layer_regions(
    kv_caches: dict[str, torch.Tensor],
    num_blocks: int,
    layout: str,
    group_of: Mapping[str, int] | None = None,
    state_layers: frozenset[str] = frozenset(),
    allocation_order: bool = False,
    ring_layers: frozenset[str] = frozenset(),
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

    ``allocation_order``: regions in the order vLLM allocated the layers (``kv_caches``'),
    not in model-layer order: a stock engine registers a model with ring groups so.

    ``ring_layers`` lie over another layer's pages in its region (vLLM 0.31.0's Glm5Next
    tail over its indexer keys), each a logical block's kernel pages: the region, named
    and advertised as its own layer's, as stock registers it, then names every group it
    holds (``BlockRegion.groups``), and so does every region, the ring held by none but
    those it lies in.
    """
    spans: dict[int, tuple[str, int, int, torch.Tensor]] = {}
    rows: dict[int, dict[str, tuple[int, int]]] = {}
    groups: dict[int, int] = {}
    held: dict[int, set[int]] = {}
    states: dict[int, str] = {}
    first: dict[int, str] = {}
    """Per span, the first layer of any kind on it, in stock's order."""
    names = list(kv_caches) if allocation_order else sorted(kv_caches, key=layer_order)
    for name in names:
        view = kv_caches[name]
        group = group_of.get(name, 0) if group_of is not None else 0
        if name in ring_layers:
            continue
        held.setdefault(int(view.data_ptr()), set()).add(group)
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
        _check_state_slab(name, kv_caches[name], spans[base], num_blocks)
        groups[base] = SHARED_GROUP_ID
    for name in ring_layers:
        base = _ring_holder(name, kv_caches[name], spans, num_blocks)
        held[base].add(group_of.get(name, 0) if group_of is not None else 0)
    regions = []
    # A region is where the first layer (in stock's order) of any kind on it puts it, and
    # is named after that layer, a state layer's too, as stock names it.
    order = {base: i for i, base in enumerate(first)}
    for base in sorted(spans, key=order.__getitem__):
        _, block_len, stride, view = spans[base]
        packed = rows.get(base, {})
        region = _region(
            view, base, block_len, stride, num_blocks, groups[base], first[base], packed
        )
        regions.append(replace(region, groups=tuple(sorted(held[base]))) if ring_layers else region)
    return regions


@dataclass
class _Address:
    """The layers' pages that start at one address of the rows, as :func:`page_regions`
    gathers them in allocation order."""

    name: str
    """The first layer there, which names the region (as stock names it)."""
    view: torch.Tensor
    stride: int
    group: int
    advertised: int
    """What stock advertises: the last MLA page registered there, else the first page."""
    pages: list[tuple[int, bool]] = field(default_factory=list)
    """(bytes, whether stock moves it apart from the region: a state) per page."""

    def region(self, base: int, num_blocks: int) -> BlockRegion:
        """Stock's region where stock moves every page there, else one as long as the
        longest page (which a stock peer's differs from); either moves the longest."""
        longest = max(page for page, _ in self.pages)
        covered = all(page <= self.advertised or apart for page, apart in self.pages)
        block_len = self.advertised if covered else longest
        return _region(
            self.view, base, block_len, self.stride, num_blocks, self.group, self.name,
            extent=longest,
        )  # fmt: skip


def page_regions(
    kv_caches: dict[str, torch.Tensor],
    num_blocks: int,
    group_of: Mapping[str, int],
    specs: Mapping[str, Any],
    moved_apart: Callable[[Any], bool],
) -> list[BlockRegion]:
    """The worker's regions when its groups are rows of several block sizes and one is a
    ring (DeepSeek-V4.1, Qwen4Exp), as a stock engine registers them then: each layer's
    page apart, in the order vLLM allocated the layers, at its view's address for its
    spec's page bytes (padded) with the row as its stride.

    Pages at one address are one region, shared (-1) when layers of several groups start
    there. A row is one group's block, so the region moves the longest page there (its
    ``extent``). It advertises what stock advertises, the last MLA page registered there
    (else the first page), where stock moves every page there with it: a page no longer,
    or one stock moves apart (``moved_apart``: :func:`states_moved_apart`). Otherwise
    stock leaves a page's tail behind (measured between two stock engines of DeepSeek-V4.1
    whose first layer compresses: 228,852 of 1,683,232 bytes D read were left, the request
    completed; vLLM 0.31.0's Qwen4Exp moves 5,120 of its embeddings' 18,432), and the
    region advertises its longest page: a stock peer's region then differs, and the pair
    is refused at the handshake, by name."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    at: dict[int, _Address] = {}
    for name, view in kv_caches.items():
        spec = specs[name]
        page = int(spec.page_size_bytes)
        base = int(view.data_ptr())
        stride = int(view.stride(0)) * view.element_size()
        if view.dim() < 2 or view.shape[0] != num_blocks or page > stride:
            raise ConfigError(
                f"layer {name}: its view {tuple(view.shape)} is not {num_blocks} rows of at "
                f"least its page ({page} bytes, rows of {stride})"
            )
        found = at.setdefault(base, _Address(name, view, stride, group_of[name], page))
        if found.pages and isinstance(spec, MLAAttentionSpec | SlidingWindowMLASpec):
            found.advertised = page
        found.pages.append((page, moved_apart(spec)))
        if found.group != group_of[name]:
            found.group = SHARED_GROUP_ID
    return [found.region(base, num_blocks) for base, found in at.items()]


def replicated_state_len(specs: Mapping[str, Any], version: int) -> int | None:
    """Metadata v14's ``ple_block_len``: the page of the one TP-replicated state (Qwen4Exp's
    per-layer embeddings'), which a stock engine from that version moves apart with its
    own length; None before v14 or without exactly one such layer (stock refuses several)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    replicated = [s for s in specs.values() if isinstance(s, MambaSpec) and s.tp_replicated]
    if version < 14 or len(replicated) != 1:
        return None
    return int(replicated[0].page_size_bytes)


def states_moved_apart(ssm: tuple[int, int], ple_block_len: int | None) -> Callable[[Any], bool]:
    """Whether a stock engine moves a layer's page apart from its region's advertised
    length: a TP-sharded state whose arrays are the advertised ``ssm`` (stock moves every
    state region by those sizes), or the replicated one ``ple_block_len`` names."""
    from vllm.v1.kv_cache_interface import MambaSpec

    def apart(spec: Any) -> bool:
        if not isinstance(spec, MambaSpec):
            return False
        if spec.tp_replicated:
            return ple_block_len is not None
        return state_sizes(spec) == ssm

    return apart


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
    groups = {group_of[name] for name in names}
    group = groups.pop() if len(groups) == 1 else SHARED_GROUP_ID
    return [_region(first, base, stride, stride, num_blocks, group, names[0])]


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
    specs = layer_specs(kv_cache_config)
    tails = frozenset(n for n, spec in specs.items() if is_kpool_tail(spec))
    if tails and parse_layout(layout_name).block_outermost:
        raise ConfigError(
            f"KV cache layout {layout_name} with vLLM 0.31.0's Glm5Next tail (KpoolTailSpec), "
            "whose backend takes LBHNC only: KVWireConnector moves it as vLLM lays it there"
        )
    own = {n: v for n, v in moved.items() if n not in states | tails}
    pooled = frozenset(n for n in own if getattr(specs.get(n), "tokens_per_state", 1) > 1)
    ratio = kernel_ratio(own, num_blocks, pooled)
    for name in pooled:  # a pooled view of whole blocks, as its kernel pages
        if ratio > 1 and moved[name].shape[0] == num_blocks:
            moved[name] = moved[name].reshape(num_blocks * ratio, -1)
    rings = RegionKind.RING in kinds
    if rings and ratio != 1 and not tails:
        raise ConfigError(
            f"a ring group (CircularBufferSpec) with kernel blocks of "
            f"{int(vllm_config.cache_config.block_size) // ratio} tokens, {ratio} a block: a "
            "ring's one block is the model's ring, which KVWireConnector moves unsplit; run "
            "a backend that takes the whole block"
        )
    if rings and not sizes and layout_name == "BLNHC":
        raise ConfigError(
            f"KV cache layout {layout_name} with a ring group (CircularBufferSpec): a stock "
            "engine registers each layer's page of such a model as one span, which in this "
            "layout it is not; KVWireConnector moves rings in the other layouts"
        )
    ple_block_len = None
    if sizes and rings:
        ple_block_len = replicated_state_len(specs, config.version)
        apart = states_moved_apart(ssm_sizes(kv_cache_config), ple_block_len)
        regions = page_regions(moved, num_blocks, group_of, specs, apart)
    elif sizes:
        regions = row_regions(moved, num_blocks * ratio, layout_name, group_of)
    else:
        n = num_blocks * ratio
        regions = layer_regions(
            moved, n, layout_name, group_of, states, allocation_order=rings and not tails,
            ring_layers=tails,
        )  # fmt: skip
    # Rows of MLA pages are every rank's (one head); rows of GQA pages or states its own.
    replicated = rows_replicated(kv_cache_config) if sizes else bool(model.use_mla)
    return KVGeometry(
        regions=regions,
        physical_blocks_per_logical=ratio,
        group_kinds=kinds,
        group_block_sizes=sizes,
        ple_block_len=ple_block_len,
        ssm_sizes=ssm_sizes(kv_cache_config),
        ssm_parts=ssm_parts(kv_cache_config),
        kv_cache_layout=layout_name,
        # vLLM's engine core sets the configured block size to the smallest group's when
        # the groups differ (4 for V4, in the scheduler and in an in-process worker);
        # stock advertises the least common multiple of the groups of tokens (a ring's
        # or a state's block holds none), and so does kvwire.
        block_size=(
            math.lcm(*token_group_sizes(sizes, kinds))
            if sizes
            else int(vllm_config.cache_config.block_size)
        ),
        total_kv_heads=1 if replicated else model.get_total_num_kv_heads(),
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        is_mla=replicated,
        attn_backend_name=attn_backend_name(vllm_config),
        num_blocks=num_blocks * ratio,
    )
