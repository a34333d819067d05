"""Which message classes make up each protocol version.

Versions are selected, not negotiated: both peers must run the same one, and the version
number is a compatibility factor, so a mismatch shows up as a hash mismatch at handshake.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwire.errors import ConfigError
from kvwire.wire import schemas
from kvwire.wire.params import (
    KVTransferParamsV13,
    KVTransferParamsV15,
    RemoteMetaV13,
    RemoteMetaV15,
    ReqMetaV13,
    ReqMetaV15,
)

DEFAULT_VERSION = 13
VLLM_RELEASES: dict[int, str] = {13: "0.31.0", 14: "0.32.0", 15: "0.33.0"}
"""The vLLM release that introduced each connector version kvwire speaks."""
SUPPORTED_VERSIONS: tuple[int, ...] = tuple(sorted(VLLM_RELEASES))


@dataclass(frozen=True)
class VersionSchemas:
    """One protocol version's message classes, by the names vLLM gives them (minus Nixl)."""

    connector_version: int
    vllm_version: str
    AgentMetadata: type[schemas.AgentMetadataV13] | type[schemas.AgentMetadataV14]
    KVTransferParams: type[KVTransferParamsV13]
    RemoteMeta: type[RemoteMetaV13]
    ReqMeta: type[ReqMetaV13]
    HandshakePayload: type[schemas.HandshakePayload] = schemas.HandshakePayload
    HandshakeRequest: type[schemas.HandshakeRequest] = schemas.HandshakeRequest
    ClockReply: type[schemas.ClockReply] = schemas.ClockReply
    Completion: type[schemas.Completion] = schemas.Completion
    Heartbeat: type[schemas.Heartbeat] = schemas.Heartbeat
    PushRegistration: type[schemas.PushRegistration] = schemas.PushRegistration


_PROTOCOLS: dict[int, VersionSchemas] = {
    13: VersionSchemas(13, VLLM_RELEASES[13], schemas.AgentMetadataV13, KVTransferParamsV13,
                 RemoteMetaV13, ReqMetaV13),
    14: VersionSchemas(14, VLLM_RELEASES[14], schemas.AgentMetadataV14, KVTransferParamsV13,
                 RemoteMetaV13, ReqMetaV13),
    15: VersionSchemas(15, VLLM_RELEASES[15], schemas.AgentMetadataV14, KVTransferParamsV15,
                 RemoteMetaV15, ReqMetaV15),
}  # fmt: skip


def protocol(version: int = DEFAULT_VERSION) -> VersionSchemas:
    """The message classes of connector ``version`` (13, 14 or 15)."""
    try:
        return _PROTOCOLS[version]
    except (KeyError, TypeError):
        supported = ", ".join(map(str, SUPPORTED_VERSIONS))
        raise ConfigError(
            f"unsupported protocol version {version!r} (kvwire speaks {supported})"
        ) from None
