"""The message classes of every protocol version kvwire speaks, as msgspec Structs.

Field names, order, types and defaults *are* the wire format: msgspec writes a Struct as a
msgpack map keyed by field name, every field present, in declaration order, exactly as it
writes vLLM's dataclasses. A new version therefore gets a new class whenever a field is added
anywhere but the end; classes that did not change are shared between versions.

Structs instead of dataclasses because they decode faster and validate types on the way in;
``frozen`` because a decoded message is a fact about the peer and must not be edited in place
(use :func:`msgspec.structs.replace`); ``gc=False`` where instances only hold primitives and
containers of primitives, which cannot form reference cycles.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import msgspec


class TransferMode(str, enum.Enum):
    """Who moves the bytes: the consumer READs (pull, vLLM's ``NixlConnector``) or the
    producer WRITEs (push, ``NixlPushConnector``). A ``str`` so it equals, hashes and
    encodes as the name vLLM uses."""

    PULL = "pull"
    PUSH = "push"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


INT64_MAX = (1 << 63) - 1
"""The cap on every count, id and rank a peer sends: kvwire computes with int64 arrays, and
JSON params (unlike msgpack) can carry integers of any size, which then could not even be
re-encoded."""
NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
# Caps on the outer length of nested lists and maps from peers. Without them a message
# within the size limit could cost 64x its size in memory (a one-byte empty msgpack array
# becomes a 56-byte Python list) and seconds of CPU; real engines stay far below these.
MAX_KV_GROUPS = 1024
MAX_REGIONS = 1 << 16
MAX_FACTORS = 64
MAX_FEATURES = 32

FeatureName = Annotated[str, msgspec.Meta(max_length=64)]
PUSH_RELEASE = "push-release"
"""A push producer that accepts a registration with no blocks as "free this request now".
vLLM's push producer fails on one (it indexes the first block group) and keeps the blocks
until the lease, so a consumer sends it only to producers that name this feature."""
LEASE_QUERY = "lease-query"
"""A pull producer whose listener answers :class:`LeaseQuery`: which lease deadline it
holds right now for a consumer's requests. vLLM has no such message (its listener would
refuse it), so a consumer asks only producers that name this feature; the answers are the
only evidence on which a consumer lets a READ run past the expiry the params stated."""
FEATURES: tuple[str, ...] = (PUSH_RELEASE, LEASE_QUERY)
"""What this kvwire understands beyond vLLM's protocol, announced in every ``kvwire`` hello."""

BlockIds = Annotated[list[list[NonNegInt]], msgspec.Meta(max_length=MAX_KV_GROUPS)]
"""Block ids per KV-cache group: one list per group."""

MemType = Literal["DRAM", "VRAM", "BLK", "OBJ", "FILE"]
"""A region's memory type: NIXL's five segment types, the only strings vLLM can pass on to
NIXL for a region (its platforms name ``VRAM`` or ``DRAM``). Decoded by lookup, a literal
costs no string allocation per region (measured in docs/benchmarks.md: about half the time
of ``str``), and anything else is refused at decode."""


RegionMembers = Annotated[list[list[str]], msgspec.Meta(max_length=MAX_REGIONS)]


class _AgentMetadataHead(msgspec.Struct, frozen=True, gc=False):
    """The fields every version's ``NixlAgentMetadata`` starts with, in wire order.

    Not a message by itself: msgspec writes a subclass's own fields after its base's, so each
    version's class adds the fields that follow ``pcp_size`` in that version.
    """

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[MemType] | None = None
    dcp_size: int = 1
    pcp_size: int = 1


class AgentMetadataV13(_AgentMetadataHead, frozen=True, gc=False):
    """What a rank publishes about its KV cache (vLLM 0.31.0 ``NixlAgentMetadata``)."""

    region_members: RegionMembers = []
    packed_member_layouts: dict[str, tuple[int, int]] = {}


class AgentMetadataV14(_AgentMetadataHead, frozen=True, gc=False):
    """v13 plus ``ple_block_len``, inserted before ``region_members`` (vLLM 0.32.0).

    A sibling of :class:`AgentMetadataV13` rather than its subclass: msgspec appends subclass
    fields at the end, and vLLM put the new field in the middle, so the byte order differs.
    """

    ple_block_len: int | None = None
    region_members: RegionMembers = []
    packed_member_layouts: dict[str, tuple[int, int]] = {}


AnyAgentMetadata = AgentMetadataV13 | AgentMetadataV14

# Values a compatibility factor can take: scalars, or one level of nesting for the
# speculative-decoding sub-factors. Spelled out so decoding a peer's factors stays bounded.
FactorScalar = str | int | float | bool | None
FactorValue = (
    FactorScalar
    | list[int]
    | Annotated[dict[str, FactorScalar | list[int]], msgspec.Meta(max_length=MAX_FACTORS)]
)


class KVWireHello(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """kvwire's addition to the handshake payload, invisible to vLLM.

    vLLM's decoder skips map keys it does not know, so a kvwire producer can say which
    protocol version it speaks and which factors went into its hash. A kvwire consumer then
    explains a hash mismatch factor by factor instead of only reporting two digests.
    """

    connector_version: int
    factors: Annotated[dict[str, FactorValue], msgspec.Meta(max_length=MAX_FACTORS)] | None = None
    features: Annotated[list[FeatureName], msgspec.Meta(max_length=MAX_FEATURES)] | None = None
    """Protocol additions this peer understands beyond vLLM's (see :data:`FEATURES`). A
    consumer uses one only with a producer that named it, so vLLM peers never see them."""
    lease_s: Annotated[float, msgspec.Meta(gt=0.0, le=1e9)] | None = None
    """A pull producer's lease: a consumer whose expiry margin is not below it could start
    no READ, and says so at the handshake instead of failing every request."""


class HandshakePayload(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """The side-channel answer: a hash to check before the metadata is even decoded.

    ``kvwire`` is absent unless set, so a plain payload is byte-identical to vLLM's.
    """

    compatibility_hash: str
    agent_metadata_bytes: bytes
    kvwire: KVWireHello | None = None


class HandshakeRequest(msgspec.Struct, frozen=True, gc=False):
    """D asking P's listener for one rank's metadata.

    On the wire this is the msgpack array ``[b"get_meta_msg", pp_rank, tp_rank]`` (the tag is
    msgpack bin); the codec writes and checks the tag.
    """

    pp_rank: NonNegInt
    tp_rank: NonNegInt


MAX_LEASE_IDS = 64
"""Request ids per lease query: a query must fit the listener's 1 KiB request limit, and a
consumer splits a longer list over several queries."""
LeaseIds = Annotated[
    list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta(max_length=MAX_LEASE_IDS)
]
LeaseDeadlines = Annotated[list[float | None], msgspec.Meta(max_length=MAX_LEASE_IDS)]


class LeaseQuery(msgspec.Struct, frozen=True, gc=False):
    """D asking P's listener which lease deadline rank ``(pp_rank, tp_rank)`` holds now
    for each of ``request_ids`` (P's ids, as in ``remote_request_id``).

    On the wire the msgpack array ``[b"kvwire_lease_q", pp_rank, tp_rank, [ids...]]``
    (the tag as msgpack bin, like the handshake request's); the codec writes and checks it.
    """

    pp_rank: NonNegInt
    tp_rank: NonNegInt
    request_ids: LeaseIds


class LeaseReply(msgspec.Struct, frozen=True, gc=False):
    """P's answer to a :class:`LeaseQuery`: per asked id, in order, the deadline its lease
    runs to in P's clock (the clock the clock-reply frame samples), or None when P does not
    hold the blocks under a lease (unknown, freed, expired or quarantined).

    On the wire the bare msgpack array of those values."""

    deadlines: LeaseDeadlines


class ClockReply(msgspec.Struct, frozen=True, gc=False):
    """The second reply frame: the producer's ``perf_counter()``, a bare msgpack float."""

    timestamp: float


class PushRegistration(msgspec.Struct, frozen=True, gc=False):
    """D announcing, in push mode, where P should WRITE a request's blocks.

    Sent as ``b"PUSH_REG:" + msgpack(map)``; field order is vLLM's.
    """

    request_id: str
    decode_engine_id: str
    decode_host: str
    decode_port: Port
    decode_tp_size: PositiveInt
    local_block_ids: BlockIds
    remote_engine_id: str
    remote_host: str
    remote_port: Port
    remote_tp_size: PositiveInt
    remote_pp_size: PositiveInt


class Completion(msgspec.Struct, frozen=True, gc=False):
    """``f"{request_id}:{count}"``: one consumer rank is done with a request's blocks.

    ``count`` is the sender's world size; the receiver frees once it has seen enough of them.
    The id may itself contain ':' (the count follows the last one).
    """

    request_id: str
    count: int


class Heartbeat(msgspec.Struct, frozen=True, gc=False):
    """``"HB:" + ",".join(ids)``: the consumer still wants these leases kept alive."""

    request_ids: tuple[str, ...]


Notification = Completion | Heartbeat | PushRegistration
