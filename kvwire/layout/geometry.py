"""What a rank's KV cache looks like in memory, described once by the engine.

A KV cache is a list of *regions*: one registered tensor (or one view of a shared tensor)
holding ``num_blocks`` equally spaced blocks. Block ``b`` of a region starts at
``base_addr + b * block_stride`` and its first ``block_len`` bytes are the payload. Inside an
attention block the bytes are ``heads x tokens x content`` (vLLM's ``LBHNC``) or
``tokens x heads x content`` (``LBNHC``), where *content* is everything one head stores for one
token (K and V packed side by side when they share a region, the key alone when they do
not). Replicated (MLA) regions hold the same bytes on every TP rank; SSM regions hold one
state page per logical block.

:class:`KVGeometry` is the local description; it produces the geometry fields of
``AgentMetadata``. :class:`RemoteGeometry` is what a peer's ``AgentMetadata`` tells us, plus
the TP/PP coordinates that travel in ``kv_transfer_params``. The model-level facts a peer does
not advertise (total KV heads, MLA) are covered by the compatibility hash, so the local
geometry supplies them when the two are paired.

Why one module of ~640 lines: the local description and a peer's advertised one are two
readings of the same facts (a region, its blocks, the layout's order inside a page), built
from and checked against one another; split, each half would import the other's rules.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence, Sized
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvwire.errors import ConfigError, IncompatiblePeerError
from kvwire.layout.topology import head_range

SHARED_GROUP_ID = -1
"""``region_group_ids`` value of a region whose blocks every KV-cache group indexes."""

VALID_MEM_KINDS = ("VRAM", "DRAM")


class KVLayout(str, enum.Enum):
    """A KV cache's physical layout, by the name vLLM puts in ``kv_cache_layout``.

    vLLM (0.31.0 to 0.33.0) sends the name of its ``KVCacheLayout`` enum: a stride permutation
    of the logical axes layer, block, head, token, content. vLLM refuses a non-MLA peer whose
    name differs from its own, so the name is part of the protocol, not a description. What
    kvwire's descriptor math needs from it is the order inside one layer's page of a block,
    :attr:`heads_first`; where the page sits (one region per layer, or every layer's page in
    one block row, the block-outermost ``BL..`` layouts) is what the regions' base addresses
    and strides describe. ``HND``/``NHD`` are kvwire's short names for the common two.
    """

    LBHNC = "LBHNC"
    """Layer-outermost, heads before tokens in a block (vLLM's default, forced on CUDA)."""
    LBNHC = "LBNHC"
    """Layer-outermost, tokens before heads in a block."""
    BLHNC = "BLHNC"
    """Block-outermost (every layer's page in one block row), heads before tokens."""
    BLNHC = "BLNHC"
    """Block-outermost, tokens before heads."""
    HND = "LBHNC"
    NHD = "LBNHC"

    @property
    def heads_first(self) -> bool:
        """One head's tokens are contiguous in a block, so TP head slices are too."""
        return self.value[2] == "H"

    @property
    def block_outermost(self) -> bool:
        return self.value[0] == "B"


MOVABLE_LAYOUTS: tuple[str, ...] = tuple(m.value for m in KVLayout if m.name == m.value)
"""The vLLM layout names kvwire moves, in the order errors list them."""

UNSUPPORTED_LAYOUTS = {
    "LHBNC": "heads outside blocks: a block's bytes are not one span per region",
    "BHLNC": "heads outside layers: a layer's page of a block is not one span",
}
"""vLLM layout names kvwire knows and cannot move, with the reason they are refused."""


class RegionKind(str, enum.Enum):
    """How a region's bytes are spread across tensor-parallel ranks."""

    ATTENTION = "attention"
    """Heads are sharded across TP ranks (capped at one head per rank)."""
    REPLICATED = "replicated"
    """Every TP rank holds the same bytes (MLA latent caches); read once, never sliced."""
    SSM = "ssm"
    """One state page per logical block; never split by tokens."""
    RING = "ring"
    """A group's kind only (:attr:`KVGeometry.group_kinds`): one block per request holding
    a ring of the latest tokens' rows (vLLM's ``CircularBufferSpec``: a compressor's or an
    indexer's keys still being gathered), overwritten as tokens are computed. Its page
    has the attention page's shape, so it is sliced across TP as its region is; it pairs
    by position, not by token, and like a state it is for one token count."""

    @property
    def by_position(self) -> bool:
        """A ring's or a state's blocks pair by position from their list's end, never by
        token: each is one running page, whatever its block size."""
        return self in (RegionKind.RING, RegionKind.SSM)


def token_group_sizes(
    group_block_sizes: Sequence[int], group_kinds: Sequence[RegionKind]
) -> list[int]:
    """The block sizes of the groups of tokens among groups of their own block sizes (a
    ring's or a state's block holds none of the prompt): a geometry's ``block_size`` is a
    multiple of each, and vLLM advertises their least common multiple."""
    return [
        size
        for g, size in enumerate(group_block_sizes)
        if not (g < len(group_kinds) and RegionKind(group_kinds[g]).by_position)
    ]


def parse_layout(value: str | KVLayout, *, who: str = "local") -> KVLayout:
    """The layout named by ``value`` (a vLLM name, or ``HND``/``NHD``).

    An unknown or unsupported name is an incompatible peer (or a bad local setting), never a
    crash; the message names what kvwire accepts.
    """
    if isinstance(value, KVLayout):
        return value
    layout = KVLayout.__members__.get(value) if isinstance(value, str) else None
    if layout is not None:
        return layout
    known = ", ".join(MOVABLE_LAYOUTS)
    why = UNSUPPORTED_LAYOUTS.get(value) if isinstance(value, str) else None
    reason = f"{value} is not supported ({why})" if why else f"got {value!r}"
    raise IncompatiblePeerError(f"{who} kv_cache_layout: expected one of {known}; {reason}")


def rank_heads(tp_rank: int, tp_size: int, total_kv_heads: int) -> npt.NDArray[np.int64]:
    """:func:`kvwire.layout.topology.head_range` as an array, for index arithmetic."""
    heads = head_range(tp_rank, tp_size, total_kv_heads)
    return np.arange(heads.start, heads.stop, dtype=np.int64)


def heads_per_rank(tp_size: int, total_kv_heads: int) -> int:
    """``max(1, total_kv_heads // tp_size)``: the GQA cap on heads stored per rank."""
    return max(1, total_kv_heads // tp_size)


def _region_label(index: int, name: str | None) -> str:
    """How error messages name a region, on either side of a pair."""
    return f"{index} ({name})" if name else str(index)


@dataclass(frozen=True)
class BlockRegion:
    """One registered span of equally spaced KV blocks.

    ``num_blocks`` counts *kernel* blocks for attention regions and logical blocks for SSM
    regions. ``members`` names the model layers whose KV lives here (v12); a region that
    packs several layers' pages into one row lists them in ``packed_members`` as
    ``layer -> (byte offset inside the block, bytes per page)`` (v13).
    """

    base_addr: int
    block_len: int
    num_blocks: int
    block_stride: int = 0
    """Bytes from one block to the next; 0 means ``block_len`` (blocks abut)."""
    group_id: int = 0
    mem_kind: str = "VRAM"
    name: str = ""
    members: tuple[str, ...] = ()
    packed_members: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    kind: RegionKind = RegionKind.ATTENTION
    device_id: int | None = None
    """Device of this region's descriptors; ``None`` takes the geometry's ``device_id``."""
    extent: int = 0
    """Bytes of a block this region moves, where that is more than the ``block_len`` it
    advertises (0: ``block_len``). Rows only (``KVGeometry.group_block_sizes``): pages of
    several groups start at one address, and a vLLM engine advertises the region as one
    of them (the last MLA page registered there), moving the longer ones, a state's,
    apart; a kvwire engine advertises the same and moves the longest page there whole.
    A peer's extent is ours: the model and its allocation are the same on both sides."""
    groups: tuple[int, ...] = ()
    """The KV-cache groups whose pages this region holds, where that is not what
    ``group_id`` says (empty: its group, or every group when it is shared). Never
    advertised, and a peer's are ours, as its ``extent`` is. A vLLM 0.31.0 engine lays
    Glm5Next's indexer tail (a group of its own) over the bytes of the indexer's keys and
    advertises that region as the keys' group, and the slabs its hybrid manager shares
    among the latents and the states hold no tail."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(int(g) for g in self.groups))
        if self.block_stride == 0:
            object.__setattr__(self, "block_stride", self.block_len)
        if self.extent == 0:
            object.__setattr__(self, "extent", self.block_len)
        object.__setattr__(self, "members", tuple(self.members))
        object.__setattr__(
            self,
            "packed_members",
            {k: (int(v[0]), int(v[1])) for k, v in dict(self.packed_members).items()},
        )
        label = self.name or f"at {self.base_addr:#x}"
        if self.base_addr < 0 or self.block_len <= 0 or self.num_blocks < 0:
            raise ConfigError(
                f"region {label}: needs base_addr >= 0, block_len > 0, num_blocks >= 0, "
                f"got {self.base_addr}, {self.block_len}, {self.num_blocks}"
            )
        if self.block_stride < self.block_len:
            raise ConfigError(
                f"region {label}: block_stride {self.block_stride} < block_len {self.block_len}"
            )
        if not self.block_len <= self.extent <= self.block_stride:
            raise ConfigError(
                f"region {label}: extent {self.extent} must lie between block_len "
                f"{self.block_len} and block_stride {self.block_stride}"
            )
        if self.mem_kind not in VALID_MEM_KINDS:
            raise ConfigError(
                f"region {label}: mem_kind must be VRAM or DRAM, got {self.mem_kind!r}"
            )
        if self.groups and (
            min(self.groups) < 0
            or len(set(self.groups)) != len(self.groups)
            or self.group_id not in (SHARED_GROUP_ID, *self.groups)
        ):
            raise ConfigError(
                f"region {label}: groups {list(self.groups)} must be distinct group ids and "
                f"include its group {self.group_id}"
            )
        for member, (offset, page) in self.packed_members.items():
            if not 0 <= offset < offset + page <= self.block_len:
                raise ConfigError(
                    f"region {label}: packed member {member!r} (offset {offset}, page {page}) "
                    f"escapes block_len {self.block_len}"
                )


@dataclass(frozen=True)
class KVGeometry:
    """The local KV cache of one rank, as an engine describes it once at registration.

    ``block_size`` is the *logical* block size the scheduler hands out ids for; the kernel
    stores ``physical_blocks_per_logical`` smaller blocks per logical block, so region
    blocks hold ``block_size // physical_blocks_per_logical`` tokens.
    """

    regions: Sequence[BlockRegion]
    kv_cache_layout: KVLayout | str = KVLayout.HND
    block_size: int = 16
    physical_blocks_per_logical: int = 1
    total_kv_heads: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    pcp_size: int = 1
    is_mla: bool = False
    """Every attention region is replicated (the model uses MLA)."""
    ssm_sizes: tuple[int, int] = (0, 0)
    """(conv state bytes, SSM state bytes) per logical block, advertised for SSM models."""
    ssm_parts: tuple[int, ...] = ()
    """This rank's bytes of each part of a layer's state, in page order, each sharded across
    TP ranks in rank order (so unequal TP sizes move a rank's slice of every part): vLLM's
    conv state dim-first, its sub-projections (Mamba2 x, B, C; GDN q, k, v; Mamba1 x), then
    the temporal state. Empty: the conv state and the temporal state are one part each."""
    group_kinds: tuple[RegionKind, ...] = ()
    """What each KV-cache group stores, by group index. It matters for *shared* regions
    (``group_id`` -1), which hold a page of every group, as vLLM's hybrid KV cache manager
    lays them out (all groups' tensors in one allocation, a block id owned by one group at a
    time): each group's blocks there are moved as that group's kind, an SSM group's as the
    state at the start of its page (``sum(ssm_sizes)`` bytes) at logical block ids, a ring
    group's (:attr:`RegionKind.RING`) as its one block, sliced as the region is. Empty:
    every group has its regions' kind."""
    group_block_sizes: tuple[int, ...] = ()
    """Tokens per block of each KV-cache group, by group index, where the groups' block
    sizes differ (DeepSeek-V4: windowed latents in 64-token blocks, compressed ones in 256,
    compressor states in 4 or 8, all over one buffer). vLLM then lays every group's pages
    over one row per block id, as wide as the widest group's, and the row, not any page, is
    what moves: such a geometry's regions are whole rows moved whole, and each group's list
    is placed in the prompt by its own block size. ``block_size`` is the least common
    multiple of the token groups' (what stock advertises; a ring's or a state's block, one
    a request, holds no tokens of the prompt: Qwen4Exp's states have blocks of the model's
    whole length). Empty: every group's blocks hold ``block_size``.

    A row of MLA pages and rings (``is_mla``) is the same on every TP rank and moves from
    one producer rank between any TP sizes; a state group's row beside them (Glm5Next's
    KDA) is each rank's own, sliced between unequal TP sizes by ``ssm_parts``. A row
    holding head-sharded pages or a TP-replicated state (Qwen4Exp's GQA attention and
    embedding state beside its GDN states and indexers' rings) is each rank's own, so it
    moves whole only between equal TP sizes, rank to rank. A state group's (``group_kinds``
    SSM) or a ring's blocks there pair by position, its running state or its ring, never
    by token."""
    ple_block_len: int | None = None
    """What metadata v14 (vLLM 0.32.0) advertises as ``ple_block_len``: the bytes of the one
    TP-replicated state page (Qwen4Exp's per-layer embeddings'), which a vLLM engine moves
    apart from its region's advertised page. None: no such page, or an older version."""
    device_id: int = 0
    attn_backend_name: str = "FLASH_ATTN"
    num_blocks: int | None = None
    """Kernel blocks per attention region; ``None`` takes the largest attention region."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "regions", tuple(self.regions))
        object.__setattr__(self, "kv_cache_layout", parse_layout(self.kv_cache_layout))
        object.__setattr__(self, "group_kinds", tuple(RegionKind(k) for k in self.group_kinds))
        state_slabs = RegionKind.SSM in self.group_kinds and not self.group_block_sizes
        if state_slabs and sum(self.ssm_sizes) <= 0:
            raise ConfigError("a geometry with an SSM group needs its ssm_sizes")
        if any(r.kind is RegionKind.RING for r in self.regions):
            raise ConfigError("ring is a KV-cache group's kind (group_kinds), not a region's")
        self._check_split_rings()
        parts = tuple(int(p) for p in self.ssm_parts)
        object.__setattr__(self, "ssm_parts", parts)
        ends = np.cumsum(parts).tolist()
        if parts and (min(parts) <= 0 or ends[-1] != sum(self.ssm_sizes) or (
            self.ssm_sizes[0] not in ends
        )):  # fmt: skip
            raise ConfigError(
                f"ssm_parts {parts} must be positive and split ssm_sizes "
                f"{tuple(self.ssm_sizes)} (conv, temporal) into consecutive parts"
            )
        if not self.regions:
            raise ConfigError("a KV geometry needs at least one region")
        if self.ple_block_len is not None and self.ple_block_len <= 0:
            raise ConfigError(f"ple_block_len must be positive, got {self.ple_block_len}")
        if self.block_size <= 0 or self.physical_blocks_per_logical <= 0:
            raise ConfigError("block_size and physical_blocks_per_logical must be positive")
        self._check_group_block_sizes()
        if self.block_size % self.physical_blocks_per_logical:
            raise ConfigError(
                f"block_size {self.block_size} is not a multiple of "
                f"physical_blocks_per_logical {self.physical_blocks_per_logical}"
            )
        for rank, size, what in (
            (self.tp_rank, self.tp_size, "tp"),
            (self.pp_rank, self.pp_size, "pp"),
            (self.dcp_rank, self.dcp_size, "dcp"),
        ):
            if size <= 0 or not 0 <= rank < size:
                raise ConfigError(f"{what}_rank {rank} is outside {what}_size {size}")
        if self.total_kv_heads <= 0:
            raise ConfigError(f"total_kv_heads must be positive, got {self.total_kv_heads}")
        big, small = max(self.tp_size, self.total_kv_heads), min(self.tp_size, self.total_kv_heads)
        if big % small:
            raise ConfigError(
                f"tp_size {self.tp_size} and total_kv_heads {self.total_kv_heads} "
                "must divide one another"
            )
        widened = [r.name or hex(r.base_addr) for r in self.regions if r.extent != r.block_len]
        if widened and not self.group_block_sizes:
            raise ConfigError(
                f"regions {widened} move more than their block_len: only rows of several "
                "block sizes (group_block_sizes) have pages of several lengths at one address"
            )
        seen: dict[str, int] = {}
        for index, region in enumerate(self.regions):
            for member in region.members:
                if member in seen:
                    raise ConfigError(
                        f"layer {member!r} is a member of regions {seen[member]} and {index}"
                    )
                seen[member] = index
            missing = set(region.packed_members) - set(region.members)
            if missing:
                raise ConfigError(
                    f"region {self.region_label(index)}: packed members {sorted(missing)} "
                    "are not listed in members"
                )
            if self.kind_of(index) is RegionKind.SSM or self.group_block_sizes:
                continue
            if region.packed_members:
                pages = [page for _, page in region.packed_members.values()]
            else:
                pages = [region.block_len]
            unit = self.heads_in_region(index) * self.kernel_block_size
            for page in pages:
                if page % unit:
                    raise ConfigError(
                        f"region {self.region_label(index)}: block_len {page} is not a multiple "
                        f"of heads x kernel tokens = {unit}"
                    )

    def _check_split_rings(self) -> None:
        """A ring's block in regions of kernel blocks is all of its kernel blocks, moved as
        one span: they must abut."""
        if self.physical_blocks_per_logical == 1:
            return
        apart = [
            self.region_label(i)
            for i, region in enumerate(self.regions)
            if region.block_stride != region.block_len and self.holds_ring(i)
        ]
        if apart:
            raise ConfigError(
                f"regions {apart} hold a ring group's pages in kernel blocks that do not "
                "abut: a ring's block is its kernel blocks, moved as one span"
            )

    def holds(self, index: int, group: int) -> bool:
        """Whether region ``index`` holds pages of group ``group``
        (:attr:`BlockRegion.groups`)."""
        region = self.regions[index]
        if region.groups:
            return group in region.groups
        return region.group_id in (group, SHARED_GROUP_ID)

    def holds_ring(self, index: int) -> bool:
        """Whether region ``index`` holds pages of a ring group."""
        rings = (g for g, kind in enumerate(self.group_kinds) if kind is RegionKind.RING)
        return any(self.holds(index, g) for g in rings)

    def _check_group_block_sizes(self) -> None:
        sizes = tuple(int(size) for size in self.group_block_sizes)
        object.__setattr__(self, "group_block_sizes", sizes)
        if not sizes:
            return
        problems = []
        tokens = token_group_sizes(sizes, self.group_kinds)
        if min(sizes) <= 0 or any(self.block_size % size for size in tokens):
            problems.append(f"each must divide block_size {self.block_size}")
        if self.physical_blocks_per_logical != 1:
            problems.append("a group's block is not split into kernel blocks")
        if self.group_kinds and len(self.group_kinds) != len(sizes):
            problems.append(f"one per group of group_kinds ({len(self.group_kinds)})")
        if any(self.kind_of(i) is RegionKind.SSM for i in range(len(self.regions))):
            problems.append("a row is every group's: its regions are attention regions")
        if problems:
            raise ConfigError(
                f"group_block_sizes {sizes}: " + "; ".join(problems) + " (whole rows per block id)"
            )

    @property
    def layout(self) -> KVLayout:
        return KVLayout(self.kv_cache_layout)

    def group_block_size(self, group: int) -> int:
        """Tokens per block of group ``group`` (:attr:`group_block_sizes`, else
        ``block_size``)."""
        return self.group_block_sizes[group] if self.group_block_sizes else self.block_size

    def tokens_held(self, block_ids: Sequence[Sized]) -> int:
        """Tokens a request's lists reach from the prompt's start: the furthest-reaching
        group's (a full-attention group's, the whole prompt), each by its own block size.
        A state's or a ring's list reaches no token: it is one running page, which a
        block size larger than the prompt's would otherwise stretch past its end."""
        kinds = self.group_kinds
        return max(
            (
                len(ids) * self.group_block_size(g)
                for g, ids in enumerate(block_ids)
                if not (g < len(kinds) and kinds[g].by_position)
            ),
            default=0,
        )

    @property
    def kernel_block_size(self) -> int:
        """Tokens per region block (what vLLM advertises as ``block_size``)."""
        return self.block_size // self.physical_blocks_per_logical

    @property
    def heads(self) -> npt.NDArray[np.int64]:
        """Global KV head ids this rank stores, in storage order."""
        return rank_heads(self.tp_rank, self.tp_size, self.total_kv_heads)

    def kind_of(self, index: int) -> RegionKind:
        """BlockRegion ``index``'s kind; MLA models replicate every attention region."""
        kind = self.regions[index].kind
        if kind is RegionKind.ATTENTION and self.is_mla:
            return RegionKind.REPLICATED
        return kind

    def group_kind(self, group: int, index: int) -> RegionKind:
        """What group ``group``'s pages in region ``index`` hold."""
        if group < len(self.group_kinds) and self.group_kinds[group] is RegionKind.SSM:
            return RegionKind.SSM
        return self.kind_of(index)

    @property
    def state_parts(self) -> tuple[int, ...]:
        """:attr:`ssm_parts`, or the conv and temporal states as one part each."""
        return self.ssm_parts or tuple(int(x) for x in self.ssm_sizes if x)

    @property
    def has_rings(self) -> bool:
        return RegionKind.RING in self.group_kinds

    @property
    def has_ssm(self) -> bool:
        kinds = (self.kind_of(i) for i in range(len(self.regions)))
        return RegionKind.SSM in self.group_kinds or RegionKind.SSM in kinds

    @property
    def replicated_whole(self) -> bool:
        """Every page is the same on every TP rank (MLA without a TP-sharded state beside
        it: vLLM 0.31.0's Glm5Next keeps KDA states in its latents' slabs), so a consumer
        reads each request from one producer rank."""
        return self.is_mla and not self.has_ssm

    def heads_in_region(self, index: int) -> int:
        if self.kind_of(index) is not RegionKind.ATTENTION:
            return 1
        return heads_per_rank(self.tp_size, self.total_kv_heads)

    def region_label(self, index: int) -> str:
        return _region_label(index, self.regions[index].name)

    def region_device(self, index: int) -> int:
        device = self.regions[index].device_id
        return self.device_id if device is None else device

    def layer_ends(self) -> dict[str, int]:
        """Per layer, how many leading regions are complete once it is computed (layers
        compute in the order they first appear in the regions): what a streaming producer
        may write. A region is named by its packed members, else its name (K and V views of
        one layer share it); an unnamed region is its own layer, ``"#index"``."""
        order: dict[str, int] = {}
        last: list[int] = []
        for index, region in enumerate(self.regions):
            names = region.members or (region.name or f"#{index}",)
            positions = [order.setdefault(name, len(order)) for name in names]
            last.append(max(positions))
        reach = np.maximum.accumulate(np.array(last, dtype=np.int64)) if last else last
        return {
            name: int(np.searchsorted(reach, position, side="right"))
            for name, position in order.items()
        }

    def streamed_regions(self) -> int:
        """How many leading regions a streaming producer writes before the prompt ends: all
        but the last layer's, which goes with the completion (0: the layout streams
        nothing early, e.g. one region row shared by every layer)."""
        total = len(self.regions)
        return max((end for end in self.layer_ends().values() if end < total), default=0)

    def advertised_num_blocks(self) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        counts = [
            r.num_blocks
            for i, r in enumerate(self.regions)
            if self.kind_of(i) is not RegionKind.SSM
        ]
        return max(counts or [r.num_blocks for r in self.regions])

    def agent_metadata_fields(self) -> dict[str, Any]:
        """Every geometry field of ``AgentMetadata`` (all but ``engine_id`` and the blob).

        ``AgentMetadata(engine_id=..., agent_metadata=blob, **geometry.agent_metadata_fields())``
        builds the message; ``block_size`` is the kernel block size, as vLLM advertises it.
        """
        regions = self.regions
        members = [list(r.members) for r in regions]
        packed: dict[str, tuple[int, int]] = {}
        for r in regions:
            packed.update(r.packed_members)
        return {
            "kv_caches_base_addr": [r.base_addr for r in regions],
            "device_id": self.device_id,
            "num_blocks": self.advertised_num_blocks(),
            "block_lens": [r.block_len for r in regions],
            "block_strides": [r.block_stride for r in regions],
            "kv_cache_layout": self.layout.value,
            "block_size": self.kernel_block_size,
            "ssm_sizes": (int(self.ssm_sizes[0]), int(self.ssm_sizes[1])),
            "attn_backend_name": self.attn_backend_name,
            "physical_blocks_per_logical_kv_block": self.physical_blocks_per_logical,
            "region_num_blocks": [r.num_blocks for r in regions],
            "region_group_ids": [r.group_id for r in regions],
            # vLLM compares a peer's names with its own layer names when it pairs regions
            # by index, and skips the check when there are none: advertise made-up names
            # and no vLLM peer would accept us.
            "region_names": [r.name for r in regions] if all(r.name for r in regions) else None,
            "region_mem_types": [r.mem_kind for r in regions],
            "dcp_size": self.dcp_size,
            "pcp_size": self.pcp_size,
            "region_members": members if any(members) else [],
            "packed_member_layouts": packed,
            **({"ple_block_len": self.ple_block_len} if self.ple_block_len is not None else {}),
        }


class AgentMetadataLike(Protocol):
    """The ``AgentMetadata`` fields geometry reads (any wire version has them)."""

    @property
    def engine_id(self) -> str: ...
    @property
    def kv_caches_base_addr(self) -> Sequence[int]: ...
    @property
    def device_id(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_lens(self) -> Sequence[int]: ...
    @property
    def block_strides(self) -> Sequence[int]: ...
    @property
    def kv_cache_layout(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def ssm_sizes(self) -> Sequence[int]: ...
    @property
    def attn_backend_name(self) -> str: ...
    @property
    def physical_blocks_per_logical_kv_block(self) -> int: ...
    @property
    def region_num_blocks(self) -> Sequence[int] | None: ...
    @property
    def region_group_ids(self) -> Sequence[int] | None: ...
    @property
    def region_names(self) -> Sequence[str] | None: ...
    @property
    def region_mem_types(self) -> Sequence[str] | None: ...
    @property
    def dcp_size(self) -> int: ...
    @property
    def pcp_size(self) -> int: ...
    @property
    def region_members(self) -> Sequence[Sequence[str]]: ...
    @property
    def packed_member_layouts(self) -> Mapping[str, Sequence[int]]: ...


@dataclass(frozen=True)
class RemoteRegion:
    """One region as a peer advertised it; its kind comes from the local region it pairs."""

    base_addr: int
    block_len: int
    block_stride: int
    num_blocks: int
    group_id: int | None
    mem_kind: str
    name: str | None
    members: tuple[str, ...]
    packed_members: Mapping[str, tuple[int, int]]

    def label(self, index: int) -> str:
        return _region_label(index, self.name)


@dataclass(frozen=True)
class RemoteGeometry:
    """A peer rank's KV cache, read back from its ``AgentMetadata``.

    ``tp_rank``/``tp_size``/``pp_rank``/``pp_size`` are not in the metadata: the runtime
    knows them from the handshake target and ``kv_transfer_params``.
    """

    engine_id: str
    regions: tuple[RemoteRegion, ...]
    kv_cache_layout: str
    kernel_block_size: int
    physical_blocks_per_logical: int
    num_blocks: int
    device_id: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dcp_size: int = 1
    pcp_size: int = 1
    ssm_sizes: tuple[int, int] = (0, 0)
    attn_backend_name: str = ""
    advertises_members: bool = False
    ple_block_len: int | None = None
    """Metadata v14's: the peer's TP-replicated state page (None: not advertised)."""

    @property
    def block_size(self) -> int:
        """The peer's logical block size (kernel block size x blocks per logical block)."""
        return self.kernel_block_size * self.physical_blocks_per_logical

    @classmethod
    def from_agent_metadata(
        cls,
        md: AgentMetadataLike,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
    ) -> RemoteGeometry:
        """Read a peer's geometry; lists whose lengths disagree are an incompatible peer."""
        bases = [int(a) for a in md.kv_caches_base_addr]
        count = len(bases)
        if count == 0:
            raise IncompatiblePeerError("remote regions: expected at least one, got 0")

        def per_region(name: str, values: Sequence[Any] | None, default: Any) -> list[Any]:
            if values is None:
                return [default] * count
            if len(values) != count:
                raise IncompatiblePeerError(
                    f"remote {name}: expected {count} entries (one per region), got {len(values)}"
                )
            return list(values)

        lens = per_region("block_lens", md.block_lens, None)
        strides = per_region("block_strides", md.block_strides, None)
        nums = per_region("region_num_blocks", md.region_num_blocks, int(md.num_blocks))
        groups = per_region("region_group_ids", md.region_group_ids, None)
        names = per_region("region_names", md.region_names, None)
        kinds = per_region("region_mem_types", md.region_mem_types, "VRAM")
        members_raw = list(md.region_members or [])
        members = per_region("region_members", members_raw or None, [])
        packed_all = {
            str(k): (int(v[0]), int(v[1])) for k, v in dict(md.packed_member_layouts).items()
        }
        regions = []
        for i in range(count):
            member_names = tuple(str(m) for m in members[i])
            regions.append(
                RemoteRegion(
                    base_addr=bases[i],
                    block_len=int(lens[i]),
                    block_stride=int(strides[i]),
                    num_blocks=int(nums[i]),
                    group_id=None if groups[i] is None else int(groups[i]),
                    mem_kind=str(kinds[i]),
                    name=None if names[i] is None else str(names[i]),
                    members=member_names,
                    packed_members={m: packed_all[m] for m in member_names if m in packed_all},
                )
            )
        for i, region in enumerate(regions):
            for member, (offset, page) in region.packed_members.items():
                if not 0 <= offset < offset + page <= region.block_len:
                    raise IncompatiblePeerError(
                        f"remote region {region.label(i)} packed layer {member!r}: expected "
                        f"0 <= offset < offset + page <= {region.block_len}, "
                        f"got offset {offset} page {page}"
                    )
        unplaced = set(packed_all) - {m for r in regions for m in r.members}
        if unplaced:
            raise IncompatiblePeerError(
                f"remote packed_member_layouts: expected every packed layer in region_members, "
                f"got unlisted {sorted(unplaced)}"
            )
        ple = getattr(md, "ple_block_len", None)  # v14 on
        ssm = tuple(int(x) for x in md.ssm_sizes)
        if len(ssm) != 2:
            raise IncompatiblePeerError(f"remote ssm_sizes: expected 2 values, got {len(ssm)}")
        return cls(
            engine_id=str(md.engine_id),
            regions=tuple(regions),
            kv_cache_layout=str(md.kv_cache_layout),
            kernel_block_size=int(md.block_size),
            physical_blocks_per_logical=int(md.physical_blocks_per_logical_kv_block),
            num_blocks=int(md.num_blocks),
            device_id=int(md.device_id),
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            dcp_size=int(md.dcp_size),
            pcp_size=int(md.pcp_size),
            ssm_sizes=(ssm[0], ssm[1]),
            attn_backend_name=str(md.attn_backend_name),
            advertises_members=bool(members_raw),
            ple_block_len=None if ple is None else int(ple),
        )

    @classmethod
    def from_local(cls, geometry: KVGeometry, *, engine_id: str = "") -> RemoteGeometry:
        """How a peer sees ``geometry`` (tests and in-process pairs skip the wire this way)."""
        fields = geometry.agent_metadata_fields()
        md = SimpleNamespace(engine_id=engine_id, **fields)
        return cls.from_agent_metadata(
            md,
            tp_rank=geometry.tp_rank,
            tp_size=geometry.tp_size,
            pp_rank=geometry.pp_rank,
            pp_size=geometry.pp_size,
        )
