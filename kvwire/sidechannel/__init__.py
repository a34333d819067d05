"""The handshake side channel: a hardened listener that speaks ZMTP to REQ clients as a ZMQ
ROUTER would (without libzmq's unbounded buffering), and a retrying REQ client.

Wire-compatible with vLLM 0.31.0's NIXL connector: a vLLM decode worker can fetch
kvwire's metadata and kvwire can fetch a vLLM prefill engine's. Opt-in beyond vLLM: a
shared-secret authenticated handshake (``secret=``; the secret file is read by
:func:`kvwire.config.secret.load_secret`) and rate limits.
"""

from __future__ import annotations

from kvwire.sidechannel.address import parse_host_port, tcp_endpoint
from kvwire.sidechannel.client import (
    HandshakeClient,
    PayloadReplies,
    RankReply,
)
from kvwire.sidechannel.engine_handshake import PeerHandshake, fetch_agent_metadata
from kvwire.sidechannel.frames import ERROR_PREFIX, encode_refusal, refusal_reason
from kvwire.sidechannel.limits import ListenerLimits, RateLimit
from kvwire.sidechannel.listener import HandshakeListener, ListenerStats

__all__ = [
    "ERROR_PREFIX",
    "HandshakeClient",
    "HandshakeListener",
    "ListenerLimits",
    "ListenerStats",
    "PayloadReplies",
    "PeerHandshake",
    "RankReply",
    "RateLimit",
    "encode_refusal",
    "fetch_agent_metadata",
    "parse_host_port",
    "refusal_reason",
    "tcp_endpoint",
]
