"""Pair local regions with a peer's and check, at handshake time, that the pair can move KV.

Two engines of the same model lay their caches out in the same region order, so regions pair
by index. When either side groups layers differently (a pipeline stage holding a slice of
the layers, or v13 rows that pack several layers' pages together), both advertise the layer
names of each region (v12) and regions pair by name instead; a packed member narrows its
region to the member's page (v13).

BlockRegion *names* (``region_names``, the first layer of each region) matter exactly where vLLM
0.31.0 looks at them (``_validate_remote_agent_handshake``): when regions pair by index and
the peer advertises names, they must equal ours, region by region. A peer that advertises
no names is paired by index unchecked; where both sides advertise members, the members say
which layers a region holds and the names are not compared (vLLM rewrites them after
aligning by members). A pipeline stage facing a peer that holds every layer takes the run
of the peer's regions whose names are ours (vLLM slices the same window by layer offset).

Every check that fails adds one line naming the region, the expected and the actual value;
all of them are raised together as one :class:`~kvwire.errors.IncompatiblePeerError`, so an
operator fixes a deployment in one round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvwire.errors import IncompatiblePeerError
from kvwire.layout.geometry import (
    MOVABLE_LAYOUTS,
    UNSUPPORTED_LAYOUTS,
    VALID_MEM_KINDS,
    BlockRegion,
    KVGeometry,
    KVLayout,
    RegionKind,
    RemoteGeometry,
    RemoteRegion,
    heads_per_rank,
    parse_layout,
)
from kvwire.wire.schemas import TransferMode

Mode = TransferMode | Literal["pull", "push"]
"""A transfer mode, as the enum or as its vLLM name."""


@dataclass(frozen=True)
class RegionView:
    """The part of one region's blocks a transfer touches: ``block_len`` bytes at
    ``base + b * stride`` for block ``b``."""

    index: int
    label: str
    base: int
    block_len: int
    stride: int
    num_blocks: int
    device_id: int
    group_id: int


@dataclass(frozen=True)
class RegionPair:
    """A local view and the remote view holding the same layers' KV."""

    local: RegionView
    remote: RegionView
    kind: RegionKind


@dataclass(frozen=True)
class PeerPolicy:
    """Which of vLLM's restrictions to enforce on top of what kvwire can actually move.

    kvwire moves any pair of HND/NHD layouts, TP sizes and block sizes that divide one
    another; ``vllm_strict`` rejects what vLLM 0.31.0 rejects (mixed layouts, head slicing of
    NHD, producer blocks larger than consumer blocks, block-size ratios when producer TP >
    consumer TP), for deployments that must behave exactly like vLLM.
    """

    vllm_strict: bool = False


class _Problems:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, where: str, expected: object, actual: object, note: str = "") -> None:
        tail = f" ({note})" if note else ""
        self.lines.append(f"{where}: expected {expected}, got {actual}{tail}")

    def raise_if_any(self) -> None:
        if self.lines:
            raise IncompatiblePeerError("incompatible KV geometry: " + "; ".join(self.lines))


def _view(
    index: int,
    region: BlockRegion | RemoteRegion,
    label: str,
    member: str | None,
    device_id: int,
    group_id: int,
) -> RegionView:
    """One side's region as a pair sees it: narrowed to a packed member when one is named."""
    offset, length = 0, region.block_len
    if member is not None and member in region.packed_members:
        offset, length = region.packed_members[member]
        label = f"{label}[{member}]"
    return RegionView(
        index=index,
        label=label,
        base=region.base_addr + offset,
        block_len=length,
        stride=region.block_stride,
        num_blocks=region.num_blocks,
        device_id=device_id,
        group_id=group_id,
    )


def _local_view(geometry: KVGeometry, index: int, member: str | None) -> RegionView:
    region = geometry.regions[index]
    return _view(
        index,
        region,
        geometry.region_label(index),
        member,
        geometry.region_device(index),
        region.group_id,
    )


def _remote_view(
    remote: RemoteGeometry, index: int, member: str | None, default_group: int
) -> RegionView:
    region = remote.regions[index]
    group = default_group if region.group_id is None else region.group_id
    return _view(index, region, region.label(index), member, remote.device_id, group)


def _needs_name_routing(local: KVGeometry, remote: RemoteGeometry) -> bool:
    local_members = [r.members for r in local.regions]
    if not remote.advertises_members or not any(local_members):
        return False
    if any(r.packed_members for r in local.regions) or any(
        r.packed_members for r in remote.regions
    ):
        return True
    return local_members != [r.members for r in remote.regions]


def _stage_window(local: KVGeometry, remote: RemoteGeometry) -> int | None:
    """Where a pipeline stage's regions start among a peer's that cover more layers.

    vLLM slices the peer's regions at the stage's layer offset and then requires the names
    in that window to be ours; kvwire has no layer offset, so it finds the window by those
    same names. None when the names do not place it (or it is not that situation).
    """
    count = len(local.regions)
    if local.pp_size == 1 or len(remote.regions) <= count:
        return None
    ours = [r.name for r in local.regions]
    theirs = [r.name for r in remote.regions]
    if not all(ours) or any(name is None for name in theirs):
        return None
    starts = [
        start
        for start in range(len(theirs) - count + 1)
        if theirs[start] == ours[0] and theirs[start : start + count] == ours
    ]
    return starts[0] if len(starts) == 1 else None


def _pair_by_index(
    local: KVGeometry, remote: RemoteGeometry, policy: PeerPolicy, problems: _Problems
) -> list[tuple[RegionView, RegionView]]:
    offset = 0
    if len(local.regions) != len(remote.regions):
        window = _stage_window(local, remote)
        if window is None:
            note = "regions pair by index when layer names are not advertised by both sides"
            if local.pp_size > 1 and len(remote.regions) > len(local.regions):
                note = (
                    "a pipeline stage finds its layers among the peer's regions by region "
                    "names or members, and the peer's do not contain ours in order"
                )
            problems.add("region count", len(local.regions), len(remote.regions), note)
            return []
        offset = window
    # Members, when both sides advertise them, already matched region by region (or the
    # regions would pair by name): they, not the names, say which layers a region holds.
    # vLLM still compares names there unless the local side is a pipeline stage.
    members_decide = (
        remote.advertises_members
        and any(r.members for r in local.regions)
        and (local.pp_size > 1 or not policy.vllm_strict)
    )
    pairs = []
    for i, region in enumerate(local.regions):
        j = i + offset
        remote_name = remote.regions[j].name
        if (
            not members_decide
            and region.name
            and remote_name is not None
            and remote_name != region.name
        ):
            problems.add(
                f"region {i} name",
                repr(region.name),
                repr(remote_name),
                "regions pair by index, and the peer names this one differently",
            )
        pairs.append((_local_view(local, i, None), _remote_view(remote, j, None, region.group_id)))
    return pairs


def _pair_by_name(
    local: KVGeometry, remote: RemoteGeometry, problems: _Problems
) -> list[tuple[RegionView, RegionView]]:
    owner: dict[str, int] = {}
    for j, remote_region in enumerate(remote.regions):
        for member in remote_region.members:
            if member in owner:
                problems.add(
                    f"remote layer {member!r}",
                    f"one region, got regions {owner[member]} and",
                    j,
                )
            owner[member] = j
    local_layers = {m for r in local.regions for m in r.members}
    unowned = sorted(local_layers - set(owner))
    if unowned and remote.pp_size == 1:
        problems.add("remote layers", f"every local layer including {unowned}", "none")
    extra = sorted(set(owner) - local_layers)
    if extra and local.pp_size == 1:
        problems.add("local layers", f"every remote layer including {extra}", "none")
    pairs: list[tuple[RegionView, RegionView]] = []
    for i, region in enumerate(local.regions):
        if not region.members:
            problems.add(f"region {local.region_label(i)} members", "layer names", "none")
            continue
        # A packed local row pairs member by member; a plain region pairs as one unit.
        units = list(region.members) if region.packed_members else [region.members[0]]
        for unit in units:
            if unit not in owner:
                continue
            j = owner[unit]
            if not region.packed_members:
                strays = [m for m in region.members if owner.get(m, j) != j]
                if strays:
                    problems.add(
                        f"region {local.region_label(i)} layers {list(region.members)}",
                        f"all in remote region {j}",
                        f"{strays} elsewhere",
                    )
                    continue
                if remote.regions[j].packed_members and len(region.members) > 1:
                    problems.add(
                        f"region {local.region_label(i)}",
                        "one layer per region when the remote packs rows",
                        f"{len(region.members)} layers",
                    )
                    continue
            remote_member = unit if unit in remote.regions[j].packed_members else None
            local_member = unit if region.packed_members else None
            pairs.append(
                (
                    _local_view(local, i, local_member),
                    _remote_view(remote, j, remote_member, region.group_id),
                )
            )
    if not pairs and not problems.lines:
        problems.add("shared layers", "at least one", "none")
    return pairs


def _check_globals(
    local: KVGeometry, remote: RemoteGeometry, mode: Mode, policy: PeerPolicy, problems: _Problems
) -> None:
    remote_layout: KVLayout | None = None
    try:
        remote_layout = parse_layout(remote.kv_cache_layout, who="remote")
    except IncompatiblePeerError:
        name = remote.kv_cache_layout
        why = UNSUPPORTED_LAYOUTS.get(name) if isinstance(name, str) else None
        got = f"{name} ({why})" if why else repr(name)
        problems.add("kv_cache_layout", f"one of {', '.join(MOVABLE_LAYOUTS)}", got)
    lk, rk = local.kernel_block_size, remote.kernel_block_size
    if rk <= 0 or remote.physical_blocks_per_logical <= 0:
        problems.add(
            "block_size",
            "positive kernel block size and blocks per logical block",
            f"{rk} and {remote.physical_blocks_per_logical}",
        )
    elif max(lk, rk) % min(lk, rk):
        problems.add("kernel block size", f"a divisor or multiple of {lk}", rk)
    elif (local.group_block_sizes or local.has_rings) and (
        rk,
        remote.physical_blocks_per_logical,
    ) != (lk, local.physical_blocks_per_logical):
        lp = local.physical_blocks_per_logical
        problems.add(
            "block_size",
            f"{lk} in blocks of {lp} kernel block{'s' * (lp > 1)}",
            f"{rk} in blocks of {remote.physical_blocks_per_logical}",
            f"the groups' blocks hold {list(local.group_block_sizes)} tokens, moved as whole "
            "rows, which pair only with rows of the same block sizes"
            if local.group_block_sizes
            else "a ring group's block is the model's ring, one page each side (all its "
            "kernel blocks), which pairs only with pages of the same block and kernel sizes",
        )
    lt, rt, heads = local.tp_size, remote.tp_size, local.total_kv_heads
    tp_ok = rt > 0 and max(lt, rt) % min(lt, rt) == 0
    if not tp_ok:
        problems.add("tp_size", f"a divisor or multiple of {lt}", rt)
    elif not 0 <= remote.tp_rank < rt:
        problems.add("tp_rank", f"in [0, {rt})", remote.tp_rank)
    elif max(rt, heads) % min(rt, heads):
        problems.add("tp_size", f"a divisor or multiple of {heads} KV heads", rt)
    elif lt != rt and local.group_block_sizes and not local.is_mla:
        problems.add(
            "tp_size", lt, rt,
            "rows holding head-sharded pages move whole, only between equal TP sizes",
        )  # fmt: skip
    elif lt != rt and local.ple_block_len is not None:
        problems.add(
            "tp_size", lt, rt,
            "the TP-replicated state's page (ple_block_len) moves whole, only between equal "
            "TP sizes",
        )  # fmt: skip
    elif (
        local.has_rings
        and local.physical_blocks_per_logical > 1
        and not local.is_mla
        and (lt != rt or remote_layout is not local.layout)
    ):
        problems.add(
            "tp_size and kv_cache_layout", f"{lt} and {local.layout.value}",
            f"{rt} and {remote.kv_cache_layout}",
            "a ring of head-sharded pages in kernel blocks moves whole, only between equal "
            "TP sizes and one layout",
        )  # fmt: skip
    if None not in (local.ple_block_len, remote.ple_block_len) and (
        local.ple_block_len != remote.ple_block_len
    ):
        problems.add(
            "ple_block_len", local.ple_block_len, remote.ple_block_len,
            "the TP-replicated state's page moves whole",
        )  # fmt: skip
    ld, rd = local.dcp_size, remote.dcp_size
    if rd <= 0 or max(ld, rd) % min(ld, rd):
        problems.add("dcp_size", f"a divisor or multiple of {ld}", rd, "vLLM rule")
    elif rd != ld:
        # vLLM accepts sizes that divide; moving between them is a token gather kvwire's
        # planner does not do, so the side that plans the transfer refuses by name.
        problems.add("dcp_size", ld, rd, "kvwire plans DCP transfers only between equal sizes")
    if local.has_ssm and tp_ok:
        _check_state_shards(local, remote, problems)
    if not policy.vllm_strict or remote_layout is None or not tp_ok:
        return
    split = any(local.kind_of(i) is RegionKind.ATTENTION for i in range(len(local.regions)))
    if split and remote_layout is not local.layout:
        problems.add("kv_cache_layout", local.layout.value, remote_layout.value, "vLLM rule")
    hetero_tp = lt != rt and not (lt > heads and rt > heads)
    tokens_first = [x.value for x in (local.layout, remote_layout) if not x.heads_first]
    if split and hetero_tp and tokens_first:
        problems.add(
            "kv_cache_layout", "heads before tokens for heterogeneous TP", tokens_first[0],
            "vLLM rule",
        )  # fmt: skip
    producer_k, consumer_k = (rk, lk) if mode == "pull" else (lk, rk)
    producer_tp, consumer_tp = (rt, lt) if mode == "pull" else (lt, rt)
    if producer_k > consumer_k:
        problems.add(
            "kernel block size",
            f"producer <= consumer {consumer_k}",
            producer_k,
            "vLLM rule",
        )
    if producer_k != consumer_k and producer_tp > consumer_tp and split:
        problems.add(
            "kernel block size",
            f"equal sizes when producer TP {producer_tp} > consumer TP {consumer_tp}",
            f"{producer_k} vs {consumer_k}",
            "vLLM rule",
        )


def _check_state_shards(local: KVGeometry, remote: RemoteGeometry, problems: _Problems) -> None:
    """A peer's state sizes are ours scaled by the TP sizes (each part sharded evenly);
    between unequal sizes only states in slabs move (a region of states alone holds
    whole pages, which do not slice)."""
    lt, rt = local.tp_size, remote.tp_size
    wanted = tuple(size * lt / rt for size in local.ssm_sizes)
    uneven = [part for part in local.state_parts if (part * lt) % rt]
    if uneven or tuple(remote.ssm_sizes) != wanted:
        problems.add(
            "ssm_sizes",
            f"{tuple(f'{x:g}' for x in wanted)} (ours {tuple(local.ssm_sizes)} at TP {lt}, "
            f"scaled to the peer's TP {rt})",
            tuple(remote.ssm_sizes),
            "every part of a state must shard evenly across TP ranks; a model that "
            "replicates part of its state on every rank does not scale",
        )
    if lt != rt and local.group_block_sizes and RegionKind.SSM not in local.group_kinds:
        return  # rows of pages every rank holds alike (others refused above)
    if lt != rt and any(local.kind_of(i) is RegionKind.SSM for i in range(len(local.regions))):
        problems.add("tp_size", lt, rt, "a region of whole SSM pages moves only between equal TP")
    elif lt != rt and not local.ssm_parts:
        problems.add(
            "tp_size", lt, rt,
            "a state moves between unequal TP sizes only with its TP-sharded parts (ssm_parts)",
        )  # fmt: skip


def _check_pair(
    local: KVGeometry,
    remote: RemoteGeometry,
    pair: RegionPair,
    problems: _Problems,
) -> None:
    lv, rv, kind = pair.local, pair.remote, pair.kind
    region = remote.regions[rv.index]
    where = f"region {lv.label} <-> remote {rv.label}"
    if region.block_stride < region.block_len:
        problems.add(
            f"remote region {rv.label} block_stride", f">= {region.block_len}", region.block_stride
        )
    split = remote.physical_blocks_per_logical > 1
    if split and region.block_stride != region.block_len and local.holds_ring(lv.index):
        problems.add(
            f"remote region {rv.label} block_stride", region.block_len, region.block_stride,
            "a ring's block is its kernel blocks, moved as one span: they must abut",
        )  # fmt: skip
    if region.mem_kind not in VALID_MEM_KINDS:
        problems.add(f"remote region {rv.label} mem type", "VRAM or DRAM", repr(region.mem_kind))
    if region.num_blocks < 0:
        problems.add(f"remote region {rv.label} num_blocks", ">= 0", region.num_blocks)
    if kind is RegionKind.SSM or local.group_block_sizes:
        if rv.block_len != lv.block_len:
            what = "SSM pages" if kind is RegionKind.SSM else "rows of several block sizes"
            problems.add(f"{where} block_len", lv.block_len, rv.block_len, f"{what} move whole")
        extent = local.regions[lv.index].extent
        if region.block_stride < extent:
            problems.add(
                f"{where} block_stride", f">= {extent}", region.block_stride,
                "the longest page at this address moves whole",
            )  # fmt: skip
        return
    if remote.kernel_block_size <= 0 or remote.tp_size <= 0:
        return
    local_heads = local.heads_in_region(lv.index)
    content = lv.block_len // (local_heads * local.kernel_block_size)
    remote_heads = (
        1 if kind is RegionKind.REPLICATED else heads_per_rank(remote.tp_size, local.total_kv_heads)
    )
    expected = remote_heads * remote.kernel_block_size * content
    if rv.block_len != expected:
        problems.add(
            f"{where} block_len",
            expected,
            rv.block_len,
            f"{remote_heads} heads x {remote.kernel_block_size} tokens x {content} bytes",
        )
        return
    rows = local.regions[lv.index].packed_members
    whole_rows = len(rows) > 1 and lv.block_len == local.regions[lv.index].block_len
    if whole_rows and (remote_heads, remote.kernel_block_size) != (
        local_heads,
        local.kernel_block_size,
    ):
        # The sizes above agree (a row scales with heads and tokens like a page), but a row
        # is every layer's page in turn: slicing it by heads or tokens cuts across layers.
        problems.add(
            f"{where} heads x kernel tokens",
            f"{local_heads} x {local.kernel_block_size}",
            f"{remote_heads} x {remote.kernel_block_size}",
            f"the region is whole block rows of {len(rows)} layers and the peer advertises no "
            "per-layer pages (vLLM registers BLNHC so), which move only between equal shards",
        )


def validate_peer(
    local: KVGeometry,
    remote: RemoteGeometry,
    *,
    mode: Mode = "pull",
    policy: PeerPolicy | None = None,
) -> tuple[RegionPair, ...]:
    """Check a peer's geometry against ours and pair the regions.

    ``mode`` says who produces: in ``"pull"`` the local side is the consumer (D), in
    ``"push"`` the producer (P). Raises :class:`IncompatiblePeerError` listing every problem.
    """
    policy = policy or PeerPolicy()
    problems = _Problems()
    _check_globals(local, remote, mode, policy, problems)
    if _needs_name_routing(local, remote):
        views = _pair_by_name(local, remote, problems)
    else:
        views = _pair_by_index(local, remote, policy, problems)
    pairs = tuple(RegionPair(lv, rv, local.kind_of(lv.index)) for lv, rv in views)
    for pair in pairs:
        _check_pair(local, remote, pair, problems)
    problems.raise_if_any()
    return pairs


def check_producer(consumer: KVGeometry, producer: RemoteGeometry) -> None:
    """What a consumer that posts nothing (pushed to) checks of its producer: the pairing a
    pulling consumer would make, the bytes flowing the same way, so a producer that writes
    by its own rules (vLLM's) cannot end a request done with bytes that are not its own.
    A producer of another pipeline split is left to its own plan: only the stage side
    finds its window among a peer's regions (:func:`_stage_window`), and from here a
    stage's fewer regions would be refused though its plan pairs them. Raises
    :class:`IncompatiblePeerError` listing every problem."""
    if producer.pp_size == consumer.pp_size:
        validate_peer(consumer, producer, mode="pull")
