"""kvwire's wire format: vLLM NIXL connector messages (versions 13-15), byte for byte.

The names exported here without a version suffix are version 13's (vLLM 0.31.0); use
:func:`protocol` for another version's classes.
"""

from __future__ import annotations

from kvwire.wire.codec import DEFAULT_MAX_NOTIFICATION_SIZE, DEFAULT_MAX_SIZE
from kvwire.wire.handshake import (
    GET_META_MSG,
    check_peer,
    decode_clock_reply,
    decode_handshake,
    decode_handshake_payload,
    decode_handshake_request,
    encode_clock_reply,
    encode_handshake_payload,
    encode_handshake_request,
    peer_version,
)
from kvwire.wire.leases import (
    LEASE_QUERY_TAG,
    decode_lease_query,
    decode_lease_reply,
    encode_lease_query,
    encode_lease_reply,
)
from kvwire.wire.messages import decode, encode
from kvwire.wire.notifications import (
    HEARTBEAT_PREFIX,
    PUSH_REG_PREFIX,
    decode_completion,
    decode_heartbeat,
    decode_notification,
    decode_push_registration,
    encode_completion,
    encode_heartbeat,
    encode_notification,
    encode_push_registration,
)
from kvwire.wire.params import (
    KVTransferParamsV13,
    KVTransferParamsV15,
    RemoteMetaV13,
    RemoteMetaV15,
    ReqMetaV13,
    ReqMetaV15,
    parse_kv_transfer_params,
)
from kvwire.wire.schemas import (
    AgentMetadataV13,
    AgentMetadataV14,
    ClockReply,
    Completion,
    HandshakePayload,
    HandshakeRequest,
    Heartbeat,
    KVWireHello,
    LeaseQuery,
    LeaseReply,
    Notification,
    PushRegistration,
)
from kvwire.wire.versions import (
    DEFAULT_VERSION,
    SUPPORTED_VERSIONS,
    VLLM_RELEASES,
    VersionSchemas,
    protocol,
)

AgentMetadata = AgentMetadataV13
KVTransferParams = KVTransferParamsV13
RemoteMeta = RemoteMetaV13
ReqMeta = ReqMetaV13

__all__ = [
    "DEFAULT_MAX_NOTIFICATION_SIZE",
    "DEFAULT_MAX_SIZE",
    "DEFAULT_VERSION",
    "GET_META_MSG",
    "HEARTBEAT_PREFIX",
    "LEASE_QUERY_TAG",
    "PUSH_REG_PREFIX",
    "SUPPORTED_VERSIONS",
    "VLLM_RELEASES",
    "AgentMetadata",
    "AgentMetadataV13",
    "AgentMetadataV14",
    "ClockReply",
    "Completion",
    "HandshakePayload",
    "HandshakeRequest",
    "Heartbeat",
    "KVTransferParams",
    "KVTransferParamsV13",
    "KVTransferParamsV15",
    "KVWireHello",
    "LeaseQuery",
    "LeaseReply",
    "Notification",
    "VersionSchemas",
    "PushRegistration",
    "RemoteMeta",
    "RemoteMetaV13",
    "RemoteMetaV15",
    "ReqMeta",
    "ReqMetaV13",
    "ReqMetaV15",
    "check_peer",
    "decode",
    "decode_clock_reply",
    "decode_completion",
    "decode_handshake",
    "decode_handshake_payload",
    "decode_handshake_request",
    "decode_heartbeat",
    "decode_lease_query",
    "decode_lease_reply",
    "decode_notification",
    "decode_push_registration",
    "encode",
    "encode_clock_reply",
    "encode_completion",
    "encode_handshake_payload",
    "encode_handshake_request",
    "encode_heartbeat",
    "encode_lease_query",
    "encode_lease_reply",
    "encode_notification",
    "encode_push_registration",
    "parse_kv_transfer_params",
    "peer_version",
    "protocol",
]
