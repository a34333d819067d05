"""kvwire: the KV-cache transfer protocol of disaggregated LLM serving, as a library.

Speaks vLLM's NIXL connector protocol (versions 13-15) byte for byte; transports are
pluggable adapters found through the ``kvwire.transports`` entry-point group.

The names an engine needs first (the README's example) come first: :class:`Producer` and
:class:`Consumer` (``kvwire.runtime``), :class:`KVWireConfig`, :class:`KVGeometry` and
:class:`BlockRegion` (``kvwire.layout``) and :class:`CompatFactors`; then the wire API and
the errors. docs/architecture.md maps every package and what it may import.
"""

from __future__ import annotations

from kvwire.config import KVWireConfig
from kvwire.errors import (
    ConfigError,
    DescriptorError,
    HandshakeAuthError,
    HandshakeError,
    HandshakeTimeoutError,
    IncompatiblePeerError,
    KVWireError,
    LocalProtocolError,
    PeerUnreachableError,
    ProtocolError,
    RegistrationError,
    RemoteProtocolError,
    TransferFailedError,
    TransportClosedError,
    TransportError,
    TransportUnavailableError,
    UnknownPeerError,
    WireDecodeError,
    WireEncodeError,
)
from kvwire.layout import BlockRegion, KVGeometry
from kvwire.runtime import Consumer, Producer
from kvwire.wire import (
    AgentMetadata,
    ClockReply,
    Completion,
    HandshakePayload,
    HandshakeRequest,
    Heartbeat,
    KVTransferParams,
    Notification,
    PushRegistration,
    RemoteMeta,
    ReqMeta,
    VersionSchemas,
    decode,
    decode_clock_reply,
    decode_handshake,
    decode_handshake_payload,
    decode_handshake_request,
    decode_notification,
    encode,
    encode_clock_reply,
    encode_completion,
    encode_handshake_payload,
    encode_handshake_request,
    encode_heartbeat,
    encode_notification,
    encode_push_registration,
    parse_kv_transfer_params,
    protocol,
)
from kvwire.wire.compat import CompatFactors, SpeculativeFactors, compatibility_hash, explain
from kvwire.wire.schemas import TransferMode

__version__ = "0.1.0"

__all__ = [
    # what an engine embeds (README)
    "Producer",
    "Consumer",
    "KVWireConfig",
    "KVGeometry",
    "BlockRegion",
    "TransferMode",
    # wire
    "AgentMetadata",
    "ClockReply",
    "Completion",
    "HandshakePayload",
    "HandshakeRequest",
    "Heartbeat",
    "KVTransferParams",
    "Notification",
    "VersionSchemas",
    "PushRegistration",
    "RemoteMeta",
    "ReqMeta",
    "decode",
    "decode_clock_reply",
    "decode_handshake",
    "decode_handshake_payload",
    "decode_handshake_request",
    "decode_notification",
    "encode",
    "encode_clock_reply",
    "encode_completion",
    "encode_handshake_payload",
    "encode_handshake_request",
    "encode_heartbeat",
    "encode_notification",
    "encode_push_registration",
    "parse_kv_transfer_params",
    "protocol",
    # compat
    "CompatFactors",
    "SpeculativeFactors",
    "compatibility_hash",
    "explain",
    # errors
    "ConfigError",
    "DescriptorError",
    "HandshakeAuthError",
    "HandshakeError",
    "HandshakeTimeoutError",
    "PeerUnreachableError",
    "IncompatiblePeerError",
    "KVWireError",
    "LocalProtocolError",
    "ProtocolError",
    "RegistrationError",
    "RemoteProtocolError",
    "TransferFailedError",
    "TransportClosedError",
    "TransportError",
    "TransportUnavailableError",
    "UnknownPeerError",
    "WireDecodeError",
    "WireEncodeError",
    "__version__",
]
