"""The frames of the side-channel handshake, as bytes.

The request and the clock frame are the wire core's (``kvwire.wire.handshake``); this module
adds the one thing vLLM lacks: a refusal. It keeps the two-frame answer shape so a REQ client is
never left waiting, and its first frame starts with a prefix no msgpack map can start with,
so a vLLM client fails to decode it as a payload (a clean error) while a kvwire client reads
the reason.
"""

from __future__ import annotations

ERROR_PREFIX = b"KVWIRE_ERROR:"
AUTH_REASON = "authentication"
"""Refusal reasons that start with this are about authentication (``HandshakeAuthError``)."""
RATE_LIMITED_REASON = "rate limited"
"""Refusal reasons that start with this are worth retrying after a backoff."""


def encode_refusal(reason: str) -> bytes:
    return ERROR_PREFIX + reason.encode("utf-8", "replace")[:512]


def refusal_reason(frame: bytes) -> str | None:
    """The reason of a refusal frame, or None when the frame is a payload."""
    if frame.startswith(ERROR_PREFIX):
        return frame[len(ERROR_PREFIX) :].decode("utf-8", "replace")
    return None
