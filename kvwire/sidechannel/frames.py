"""The frames of the side-channel handshake, as bytes.

The request and the clock frame are the wire core's (``kvwire.wire``); this module adds the
one thing vLLM lacks: a refusal. It keeps the two-frame answer shape so a REQ client is
never left waiting, and its first frame starts with a prefix no msgpack map can start with,
so a vLLM client fails to decode it as a payload (a clean error) while a kvwire client reads
the reason.
"""

from __future__ import annotations

from kvwire.errors import WireDecodeError
from kvwire.wire.handshake import (
    GET_META_MSG,
    decode_clock_reply,
    decode_handshake_request,
    encode_clock_reply,
    encode_handshake_request,
)

GET_META_TAG = GET_META_MSG
ERROR_PREFIX = b"KVWIRE_ERROR:"
AUTH_REASON = "authentication"
"""Refusal reasons that start with this are about authentication (``HandshakeAuthError``)."""
RATE_LIMITED_REASON = "rate limited"
"""Refusal reasons that start with this are worth retrying after a backoff."""
MAX_RANK = 1 << 20
"""No engine has a million ranks; anything larger is a malformed request, not a lookup."""


def encode_request(pp_rank: int, tp_rank: int) -> bytes:
    """The single frame a REQ client sends to ask for one rank's payload."""
    return encode_handshake_request(pp_rank, tp_rank)


def decode_request(data: bytes) -> tuple[int, int]:
    """``(pp_rank, tp_rank)`` of a request frame; anything else is a ``WireDecodeError``."""
    request = decode_handshake_request(data)
    if request.pp_rank >= MAX_RANK or request.tp_rank >= MAX_RANK:
        raise WireDecodeError(
            f"handshake request names rank ({request.pp_rank}, {request.tp_rank})"
        )
    return request.pp_rank, request.tp_rank


def encode_clock(now: float) -> bytes:
    """The second reply frame: the listener's clock reading as a msgpack float."""
    return encode_clock_reply(now)


def decode_clock(data: bytes) -> float:
    return decode_clock_reply(data)


def encode_refusal(reason: str) -> bytes:
    return ERROR_PREFIX + reason.encode("utf-8", "replace")[:512]


def refusal_reason(frame: bytes) -> str | None:
    """The reason of a refusal frame, or None when the frame is a payload."""
    if frame.startswith(ERROR_PREFIX):
        return frame[len(ERROR_PREFIX) :].decode("utf-8", "replace")
    return None
