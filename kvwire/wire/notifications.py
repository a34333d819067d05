"""The three notification kinds carried next to the data plane, and how to tell them apart.

They share one channel, so the first bytes decide: ``PUSH_REG:`` (binary msgpack follows),
then UTF-8 text starting with ``HB:``, and anything else is a completion. Because the kinds
are told apart by prefix, kvwire refuses to *encode* a completion whose request id would be
read back as another kind, and a heartbeat id containing the ',' separator.
"""

from __future__ import annotations

import re
from typing import TypeVar

from kvwire.errors import WireDecodeError, WireEncodeError
from kvwire.wire.codec import (
    DEFAULT_MAX_NOTIFICATION_SIZE,
    check_size,
    decode_struct,
    encode_struct,
)
from kvwire.wire.schemas import Completion, Heartbeat, Notification, PushRegistration

N = TypeVar("N", Completion, Heartbeat, PushRegistration)

PUSH_REG_PREFIX = b"PUSH_REG:"
HEARTBEAT_PREFIX = "HB:"
HEARTBEAT_SEPARATOR = ","

# A count is a plain decimal number: no sign, spaces, '_' or non-ASCII digits (all of which
# Python's int() would accept), and small enough to be a world size.
_COUNT = re.compile(r"[0-9]{1,9}")


def encode_completion(request_id: str, count: int) -> bytes:
    """``f"{request_id}:{count}"``; ``count`` is the sender's world size (>= 1)."""
    _check_completion(request_id, count)
    return f"{request_id}:{count}".encode()


def encode_heartbeat(request_ids: tuple[str, ...] | list[str]) -> bytes:
    """``"HB:" + ",".join(ids)``; ids must be non-empty and free of ','."""
    for rid in request_ids:
        if not isinstance(rid, str) or not rid:
            raise WireEncodeError(f"heartbeat request id must be a non-empty str, got {rid!r}")
        if HEARTBEAT_SEPARATOR in rid:
            raise WireEncodeError(f"heartbeat request id {rid!r} contains ','")
    return (HEARTBEAT_PREFIX + HEARTBEAT_SEPARATOR.join(request_ids)).encode()


def encode_push_registration(registration: PushRegistration) -> bytes:
    """``b"PUSH_REG:" + msgpack(map)`` with the registration's fields in vLLM's order."""
    return PUSH_REG_PREFIX + encode_struct(registration)


def encode_notification(msg: Notification) -> bytes:
    """Encode any notification kind."""
    if isinstance(msg, Completion):
        return encode_completion(msg.request_id, msg.count)
    if isinstance(msg, Heartbeat):
        return encode_heartbeat(msg.request_ids)
    if isinstance(msg, PushRegistration):
        return encode_push_registration(msg)
    raise WireEncodeError(f"not a notification: {type(msg).__name__}")


def decode_notification(
    data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_NOTIFICATION_SIZE
) -> Notification:
    """Decode one notification of whichever kind it is."""
    check_size(data, max_size, "notification")
    raw = bytes(data)
    if raw.startswith(PUSH_REG_PREFIX):
        return decode_struct(
            raw[len(PUSH_REG_PREFIX) :],
            PushRegistration,
            max_size=max_size,
            what="PUSH_REG notification",
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise WireDecodeError("notification is not valid UTF-8") from None
    if text.startswith(HEARTBEAT_PREFIX):
        return _parse_heartbeat(text[len(HEARTBEAT_PREFIX) :])
    return _parse_completion(text)


def decode_completion(
    data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_NOTIFICATION_SIZE
) -> Completion:
    """Decode bytes that must be a completion notification."""
    return _expect(decode_notification(data, max_size=max_size), Completion)


def decode_heartbeat(
    data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_NOTIFICATION_SIZE
) -> Heartbeat:
    """Decode bytes that must be a heartbeat notification."""
    return _expect(decode_notification(data, max_size=max_size), Heartbeat)


def decode_push_registration(
    data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_NOTIFICATION_SIZE
) -> PushRegistration:
    """Decode bytes that must be a PUSH_REG notification."""
    return _expect(decode_notification(data, max_size=max_size), PushRegistration)


def _expect(msg: Notification, kind: type[N]) -> N:
    if not isinstance(msg, kind):
        raise WireDecodeError(f"expected a {kind.__name__} notification, got {type(msg).__name__}")
    return msg


def _parse_heartbeat(payload: str) -> Heartbeat:
    if not payload:
        return Heartbeat(request_ids=())
    ids = tuple(payload.split(HEARTBEAT_SEPARATOR))
    if "" in ids:  # one C-level scan, not a Python loop over every id
        raise WireDecodeError("heartbeat notification has an empty request id")
    return Heartbeat(request_ids=ids)


def _parse_completion(text: str) -> Completion:
    request_id, sep, count = text.rpartition(":")
    if not sep:
        raise WireDecodeError("completion notification has no ':' before its count")
    if not request_id:
        raise WireDecodeError("completion notification has an empty request id")
    if not _COUNT.fullmatch(count) or int(count) < 1:
        raise WireDecodeError(f"completion notification has a bad count {count[:32]!r}")
    return Completion(request_id=request_id, count=int(count))


def _check_completion(request_id: str, count: int) -> None:
    if not isinstance(request_id, str) or not request_id:
        raise WireEncodeError(f"completion request id must be a non-empty str, got {request_id!r}")
    if request_id.startswith(HEARTBEAT_PREFIX) or request_id.encode().startswith(PUSH_REG_PREFIX):
        raise WireEncodeError(
            f"completion request id {request_id!r} would be read back as another notification"
        )
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 999_999_999:
        raise WireEncodeError(f"completion count must be an int in [1, 999999999], got {count!r}")
