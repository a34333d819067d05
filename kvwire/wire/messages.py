"""``encode`` and ``decode`` for every message class, whatever its framing.

Most messages are a plain msgpack Struct, but notifications carry text or a prefix, the
handshake request is a tagged array and the clock reply a bare float. These two functions
hide that, so code above the wire layer never touches msgspec.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from kvwire.errors import WireEncodeError
from kvwire.wire.codec import (
    DEFAULT_MAX_NOTIFICATION_SIZE,
    DEFAULT_MAX_SIZE,
    decode_struct,
    encode_struct,
)
from kvwire.wire.handshake import (
    MAX_CLOCK_REPLY_SIZE,
    MAX_REQUEST_SIZE,
    decode_clock_reply,
    decode_handshake_request,
    encode_clock_reply,
    encode_handshake_request,
)
from kvwire.wire.notifications import (
    decode_completion,
    decode_heartbeat,
    decode_push_registration,
    encode_completion,
    encode_heartbeat,
    encode_push_registration,
)
from kvwire.wire.params import KVTransferParamsV13, KVTransferParamsV15, parse_kv_transfer_params
from kvwire.wire.schemas import (
    ClockReply,
    Completion,
    HandshakeRequest,
    Heartbeat,
    PushRegistration,
)

T = TypeVar("T")


def encode(msg: Any) -> bytes:
    """The wire bytes of any kvwire message.

    ``kv_transfer_params`` views encode as a msgpack map of the keys that are set. The
    dispatch is one dict lookup on the exact type: encode sits on the handshake path, and an
    isinstance chain over unions cost more than msgspec's own encoding of small messages.
    """
    special = _SPECIAL_ENCODERS.get(type(msg))
    if special is not None:
        return special(msg)
    if isinstance(msg, KVTransferParamsV13):
        return encode_struct(msg.as_dict())
    if not isinstance(msg, msgspec.Struct):
        raise WireEncodeError(f"not a kvwire message: {type(msg).__name__}")
    return encode_struct(msg)


# Message classes whose framing is not a plain msgpack Struct.
_SPECIAL_ENCODERS: dict[type, Callable[[Any], bytes]] = {
    Completion: lambda m: encode_completion(m.request_id, m.count),
    Heartbeat: lambda m: encode_heartbeat(m.request_ids),
    PushRegistration: encode_push_registration,
    HandshakeRequest: lambda m: encode_handshake_request(m.pp_rank, m.tp_rank),
    ClockReply: lambda m: encode_clock_reply(m.timestamp),
}


def decode(
    data: bytes | bytearray | memoryview, type_: type[T], *, max_size: int | None = None
) -> T:
    """Decode ``data`` as message class ``type_``; anything malformed is a WireDecodeError.

    ``max_size`` defaults to a limit that fits the kind (tiny for handshake requests and
    clock replies, 4 MiB for notifications, 16 MiB otherwise).
    """
    special = _SPECIAL_DECODERS.get(type_)
    if special is None:
        limit = DEFAULT_MAX_SIZE if max_size is None else max_size
        return decode_struct(data, type_, max_size=limit)
    decoder, default_limit = special
    result: T = decoder(data, default_limit if max_size is None else max_size)
    return result


def _clock_reply(data: bytes | bytearray | memoryview, max_size: int) -> ClockReply:
    return ClockReply(timestamp=decode_clock_reply(data, max_size=max_size))


# Message classes whose framing is not a plain msgpack Struct: (decoder, default size limit).
_SPECIAL_DECODERS: dict[Any, tuple[Callable[[Any, int], Any], int]] = {
    Completion: (lambda d, n: decode_completion(d, max_size=n), DEFAULT_MAX_NOTIFICATION_SIZE),
    Heartbeat: (lambda d, n: decode_heartbeat(d, max_size=n), DEFAULT_MAX_NOTIFICATION_SIZE),
    PushRegistration: (
        lambda d, n: decode_push_registration(d, max_size=n),
        DEFAULT_MAX_NOTIFICATION_SIZE,
    ),
    HandshakeRequest: (lambda d, n: decode_handshake_request(d, max_size=n), MAX_REQUEST_SIZE),
    ClockReply: (_clock_reply, MAX_CLOCK_REPLY_SIZE),
    KVTransferParamsV13: (
        lambda d, n: parse_kv_transfer_params(d, version=13, max_size=n),
        DEFAULT_MAX_SIZE,
    ),
    KVTransferParamsV15: (
        lambda d, n: parse_kv_transfer_params(d, version=15, max_size=n),
        DEFAULT_MAX_SIZE,
    ),
}
