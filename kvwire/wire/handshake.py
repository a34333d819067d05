"""The side-channel handshake's messages and its two-phase decode.

Phase 1 decodes only the envelope (hash + opaque metadata bytes); the hash is compared
before phase 2 decodes the metadata with this version's schema. A peer on another version
or configuration is thus refused with :class:`IncompatiblePeerError`, which names both
versions and the differing factors whenever they can be known: a kvwire peer states them in
the payload's ``kvwire`` field, and for a plain vLLM peer the common single-factor changes
(version, vLLM release, transfer mode) are recognised by recomputing the hash.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any, Literal, overload

import msgspec

from kvwire.errors import IncompatiblePeerError, WireDecodeError, WireEncodeError
from kvwire.wire.codec import (
    DECODE_FAILURES,
    DEFAULT_MAX_SIZE,
    decode_struct,
    decoder_for,
    encode_struct,
)
from kvwire.wire.compat import CompatFactors, compatibility_hash, explain, format_differences
from kvwire.wire.schemas import (
    FEATURES,
    AgentMetadataV13,
    AgentMetadataV14,
    AnyAgentMetadata,
    HandshakePayload,
    HandshakeRequest,
    KVWireHello,
)
from kvwire.wire.versions import DEFAULT_VERSION, SUPPORTED_VERSIONS, VLLM_RELEASES, protocol

GET_META_MSG = b"get_meta_msg"
MAX_REQUEST_SIZE = 64
"""A handshake request is 17 bytes or so; anything much larger is not one."""
MAX_RANK = 1 << 20
"""No engine has a million ranks: a larger one is a malformed request, not a lookup."""
MAX_CLOCK_REPLY_SIZE = 16
_MAX_DETAIL = 2000


def encode_handshake_request(pp_rank: int, tp_rank: int) -> bytes:
    """``msgpack([b"get_meta_msg", pp_rank, tp_rank])`` (the tag as msgpack bin)."""
    for name, rank in (("pp_rank", pp_rank), ("tp_rank", tp_rank)):
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < MAX_RANK:
            raise WireEncodeError(f"{name} must be an int in [0, {MAX_RANK}), got {rank!r}")
    return encode_struct((GET_META_MSG, pp_rank, tp_rank))


def decode_handshake_request(
    data: bytes | bytearray | memoryview, *, max_size: int = MAX_REQUEST_SIZE
) -> HandshakeRequest:
    """The (pp_rank, tp_rank) a consumer asks for; a wrong tag or shape is a WireDecodeError."""
    tag, pp_rank, tp_rank = decode_struct(
        data, tuple[bytes, int, int], max_size=max_size, what="handshake request"
    )
    if tag != GET_META_MSG:
        raise WireDecodeError(f"handshake request: unknown tag {tag[:32]!r}")
    if not (0 <= pp_rank < MAX_RANK and 0 <= tp_rank < MAX_RANK):
        raise WireDecodeError(f"handshake request: rank ({pp_rank}, {tp_rank}) out of range")
    return HandshakeRequest(pp_rank=pp_rank, tp_rank=tp_rank)


def encode_clock_reply(timestamp: float) -> bytes:
    """The producer's clock (``perf_counter()``) as a bare msgpack float64."""
    if isinstance(timestamp, bool) or not isinstance(timestamp, int | float):
        raise WireEncodeError(f"clock reply must be a float, got {timestamp!r}")
    if not math.isfinite(timestamp):
        raise WireEncodeError(f"clock reply must be finite, got {timestamp!r}")
    return encode_struct(float(timestamp))


def decode_clock_reply(
    data: bytes | bytearray | memoryview, *, max_size: int = MAX_CLOCK_REPLY_SIZE
) -> float:
    """The producer's clock; NaN or infinity would poison every lease, so they are refused."""
    value = decode_struct(data, float, max_size=max_size, what="clock reply")
    if not math.isfinite(value):
        raise WireDecodeError(f"clock reply is not finite: {value!r}")
    return value


def encode_handshake_payload(
    metadata: AnyAgentMetadata | bytes,
    *,
    compatibility_hash: str,
    factors: CompatFactors | None = None,
    lease_s: float | None = None,
) -> bytes:
    """The listener's answer frame: the hash and the encoded metadata.

    Without ``factors`` the bytes are exactly vLLM's. With them, the payload also carries
    kvwire's ``kvwire`` field (our version and factors), which vLLM skips and a kvwire
    consumer uses to explain a mismatch, and ``lease_s`` (a pull producer's lease). Encode
    once per rank and reuse the bytes.
    """
    inner = metadata if isinstance(metadata, bytes) else encode_struct(metadata)
    hello = None
    if factors is not None:
        hello = KVWireHello(
            connector_version=factors.nixl_connector_version,
            factors=factors.as_dict(),
            features=list(FEATURES),
            lease_s=lease_s,
        )
    return encode_struct(
        HandshakePayload(
            compatibility_hash=compatibility_hash, agent_metadata_bytes=inner, kvwire=hello
        )
    )


def decode_handshake_payload(
    data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_SIZE
) -> HandshakePayload:
    """Phase 1 only: the envelope, with the metadata still opaque bytes."""
    return decode_struct(data, HandshakePayload, max_size=max_size, what="handshake payload")


def check_peer(
    payload: HandshakePayload,
    *,
    local_hash: str | None,
    version: int = DEFAULT_VERSION,
    local_factors: CompatFactors | None = None,
) -> None:
    """Refuse a peer whose hash differs from ``local_hash`` (``None``: do not check).

    Raises :class:`IncompatiblePeerError` carrying both hashes, both versions when the
    remote one can be known, and the differing factors when they can be known.
    """
    hello = payload.kvwire
    remote_version = peer_version(payload)
    if local_hash is None or payload.compatibility_hash == local_hash:
        if local_hash is not None and remote_version not in (None, version):
            _refuse(payload, local_hash, version, remote_version, {})
        return
    differing: dict[str, tuple[Any, Any]] = {}
    if local_factors is not None and hello is not None and hello.factors is not None:
        differing = explain(local_factors, hello.factors)
    elif local_factors is not None:
        guess = _guess_remote_factors(local_factors, payload.compatibility_hash)
        if guess is not None:
            differing = explain(local_factors, guess)
            remote_version = remote_version or guess.nixl_connector_version
    _refuse(payload, local_hash, version, remote_version, differing)


# Looked up on every handshake, so kept out of protocol()'s error handling.
_METADATA_TYPES: dict[int, type[AnyAgentMetadata]] = {
    v: protocol(v).AgentMetadata for v in SUPPORTED_VERSIONS
}
# The fast path of decode_handshake: both phases' decoders built once, looked up by version.
_PAYLOAD_DECODER = decoder_for(HandshakePayload)
_METADATA_DECODERS: dict[int, msgspec.msgpack.Decoder[Any]] = {
    v: decoder_for(t) for v, t in _METADATA_TYPES.items()
}


@overload
def decode_handshake(
    data: bytes | bytearray | memoryview,
    *,
    local_hash: str | None,
    version: Literal[13] = ...,
    local_factors: CompatFactors | None = ...,
    max_size: int = ...,
) -> AgentMetadataV13: ...


@overload
def decode_handshake(
    data: bytes | bytearray | memoryview,
    *,
    local_hash: str | None,
    version: Literal[14, 15],
    local_factors: CompatFactors | None = ...,
    max_size: int = ...,
) -> AgentMetadataV14: ...


@overload
def decode_handshake(
    data: bytes | bytearray | memoryview,
    *,
    local_hash: str | None,
    version: int,
    local_factors: CompatFactors | None = ...,
    max_size: int = ...,
) -> AnyAgentMetadata: ...


def decode_handshake(
    data: bytes | bytearray | memoryview,
    *,
    local_hash: str | None,
    version: int = DEFAULT_VERSION,
    local_factors: CompatFactors | None = None,
    max_size: int = DEFAULT_MAX_SIZE,
) -> AnyAgentMetadata:
    """Two-phase decode of a handshake payload into this version's ``AgentMetadata``.

    ``local_hash=None`` skips the hash check (vLLM's ``enforce_handshake_compat=false``).
    ``local_factors``, when given, lets the error name the factors that differ.
    Returns ``protocol(version).AgentMetadata``.
    """
    # Fast path for the common case, a well-formed payload of a peer whose hash matches:
    # prebuilt decoders, no per-call dispatch (docs/benchmarks.md). Any other case (another
    # input type, a size over the limit, a hash to explain, bad bytes) falls through to the
    # full path, which repeats the work and raises the precise error. Both paths enforce the
    # same limits: size, schema, nesting.
    decoder = _METADATA_DECODERS.get(version)
    if decoder is not None and type(data) is bytes and len(data) <= max_size:
        try:
            payload = _PAYLOAD_DECODER.decode(data)
            inner = payload.agent_metadata_bytes
            if len(inner) <= max_size and (
                local_hash is None
                or (payload.compatibility_hash == local_hash and payload.kvwire is None)
            ):
                metadata: AnyAgentMetadata = decoder.decode(inner)
                return metadata
        except DECODE_FAILURES:
            pass
    md_type: type[AnyAgentMetadata] = (
        _METADATA_TYPES.get(version) or protocol(version).AgentMetadata
    )
    payload = decode_handshake_payload(data, max_size=max_size)
    if local_hash is not None and (
        payload.compatibility_hash != local_hash or payload.kvwire is not None
    ):
        check_peer(payload, local_hash=local_hash, version=version, local_factors=local_factors)
    return decode_struct(
        payload.agent_metadata_bytes, md_type, max_size=max_size, what="agent metadata"
    )


def peer_features(payload: HandshakePayload) -> frozenset[str]:
    """The protocol additions a kvwire peer announces; empty for a plain vLLM peer."""
    hello = payload.kvwire
    return frozenset(hello.features or ()) if hello is not None else frozenset()


def peer_lease(payload: HandshakePayload) -> float | None:
    """The lease a kvwire pull producer announces; ``None`` for any other peer."""
    return payload.kvwire.lease_s if payload.kvwire is not None else None


def peer_version(payload: HandshakePayload) -> int | None:
    """The version a kvwire peer states in its payload; ``None`` for a plain vLLM peer."""
    return payload.kvwire.connector_version if payload.kvwire is not None else None


# Values a vLLM peer plausibly differs in, tried one factor at a time to name the factor
# behind a bare hash mismatch (vLLM sends only the digest).
_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "float32")
_DTYPES = ("torch.bfloat16", "torch.float16", "torch.float32")
_BACKENDS = (
    "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "CPU_ATTN", "FLEX_ATTENTION", "ROCM_ATTN",
    "ROCM_AITER_FA", "FLASHMLA", "FLASH_ATTN_MLA", "FLASHINFER_MLA", "TRITON_MLA", "CUTLASS_MLA",
)  # fmt: skip


def _single_factor_changes(local: CompatFactors) -> Iterator[CompatFactors]:
    """Every candidate peer that differs from ``local`` in exactly one plausible way."""
    replace = msgspec.structs.replace
    yield replace(local, is_hma_enabled=not local.is_hma_enabled)
    if local.speculative_config is not None:
        yield replace(local, speculative_config=None)
    for cache_dtype in _CACHE_DTYPES:
        yield replace(local, cache_dtype=cache_dtype)
    for dtype in _DTYPES:
        yield replace(local, dtype=dtype)
    for backend in _BACKENDS:
        yield replace(local, attn_backend_name=backend)
    modes = ("pull", "push")
    for ver, mode in itertools.product(SUPPORTED_VERSIONS, modes):
        for release in dict.fromkeys((local.vllm_version, VLLM_RELEASES[ver])):
            yield replace(
                local, nixl_connector_version=ver, vllm_version=release, transfer_mode=mode
            )


def _guess_remote_factors(local: CompatFactors, remote_hash: str) -> CompatFactors | None:
    """The one plausible change of our factors that gives a plain vLLM peer's hash, if any.

    Run only after a mismatch (33 candidates; a miss took 0.27 ms here), so a vLLM peer's
    bare "hash mismatch" still names the factor.
    """
    for candidate in _single_factor_changes(local):
        if candidate != local and compatibility_hash(candidate) == remote_hash:
            return candidate
    return None


def _version_hint(payload: HandshakePayload) -> str:
    """What a plain vLLM peer's metadata reveals about its version, without trusting it.

    Only the key set is read (values stay undecoded), so this cannot fail on a schema change.
    """
    try:
        keys = decode_struct(
            payload.agent_metadata_bytes, dict[str, msgspec.Raw], what="agent metadata"
        )
    except WireDecodeError:
        return "unknown"
    if "ple_block_len" in keys:
        return "unknown, 14 or later (its metadata has ple_block_len)"
    if "packed_member_layouts" in keys:
        return "unknown, 13 or a later one with the v13 metadata schema"
    return "unknown, older than 13"


def _refuse(
    payload: HandshakePayload,
    local_hash: str,
    version: int,
    remote_version: int | None,
    differing: dict[str, tuple[Any, Any]],
) -> None:
    remote_hash = payload.compatibility_hash
    if remote_version is not None and remote_version != version:
        head = f"peer speaks protocol version {remote_version}, we speak version {version}"
    else:
        theirs = str(remote_version) if remote_version is not None else _version_hint(payload)
        head = f"compatibility hash mismatch (our version {version}, peer version {theirs})"
    detail = f"; differing factors: {format_differences(differing)}" if differing else ""
    if len(detail) > _MAX_DETAIL:  # the peer chose these values: keep the message one line
        detail = detail[:_MAX_DETAIL] + "..."
    raise IncompatiblePeerError(
        f"incompatible peer: {head}; local hash {local_hash[:16]}, remote hash "
        f"{remote_hash[:16]}{detail}",
        local_hash=local_hash,
        remote_hash=remote_hash,
        differing=differing,
        local_version=version,
        remote_version=remote_version,
    )
