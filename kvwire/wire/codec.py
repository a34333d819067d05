"""Bounded msgpack encoding and decoding of wire messages.

Every decoder here checks the size first and turns every way bytes can be wrong (truncated,
mistyped, out of range, nested too deep) into :class:`~kvwire.errors.WireDecodeError`, so a
caller handles one exception type and never sees msgspec's. Decoders are built once per type
and cached: building one costs more than decoding a small message.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from kvwire.errors import WireDecodeError, WireEncodeError

T = TypeVar("T")

DEFAULT_MAX_SIZE = 16 * 1024 * 1024
"""Largest message any decoder accepts unless told otherwise (16 MiB).

Agent metadata grows with the number of regions and the transport's blob; 16 MiB is far
above anything a real engine sends and far below what would hurt a listener.
"""

DEFAULT_MAX_NOTIFICATION_SIZE = 4 * 1024 * 1024
"""Largest notification accepted unless told otherwise (4 MiB: ~100k heartbeat ids)."""

# Everything msgspec (or the interpreter underneath it) raises for bad input.
DECODE_FAILURES = (
    msgspec.DecodeError,
    msgspec.ValidationError,
    RecursionError,
    MemoryError,
    OverflowError,
    ValueError,
    TypeError,
)

_encoder = msgspec.msgpack.Encoder()


def encode_struct(msg: Any) -> bytes:
    """msgpack-encode ``msg`` with msgspec's defaults (the bytes vLLM produces)."""
    try:
        return _encoder.encode(msg)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireEncodeError(f"cannot encode {type(msg).__name__}: {exc}") from None


_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def decoder_for(type_: Any) -> msgspec.msgpack.Decoder[Any]:
    """The one cached decoder of ``type_``, for a caller that runs it without the checks below."""
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders.setdefault(type_, msgspec.msgpack.Decoder(type_))
    return decoder


def check_size(data: bytes | bytearray | memoryview, max_size: int, what: str) -> None:
    """Refuse input over ``max_size`` bytes before spending any work on it."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireDecodeError(f"{what}: expected bytes, got {type(data).__name__}")
    if len(data) > max_size:
        raise WireDecodeError(f"{what}: {len(data)} bytes exceeds the limit of {max_size}")


def decode_struct(
    data: bytes | bytearray | memoryview,
    type_: type[T],
    *,
    max_size: int = DEFAULT_MAX_SIZE,
    what: str | None = None,
) -> T:
    """Decode msgpack ``data`` as ``type_``; any failure is a :class:`WireDecodeError`.

    This is the hot path of every handshake, so the happy path does only the size check and
    the decode; labels for error messages are built only on failure.
    """
    decoder = _decoders.get(type_) or decoder_for(type_)
    try:
        if len(data) > max_size:
            raise WireDecodeError(f"{len(data)} bytes exceeds the limit of {max_size}")
        result: T = decoder.decode(data)
    except DECODE_FAILURES as exc:
        label = what or _type_name(type_)
        given = type(data).__name__
        if given not in ("bytes", "bytearray", "memoryview"):
            raise WireDecodeError(f"{label}: expected bytes, got {given}") from None
        raise WireDecodeError(f"{label}: {_one_line(exc)}") from None
    return result


def decode_untyped(
    data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_SIZE, what: str = "msgpack"
) -> Any:
    """Decode msgpack without a schema (for inspection only), bounded like the rest."""
    return decode_struct(data, Any, max_size=max_size, what=what)


def convert(obj: Any, type_: type[T], *, what: str | None = None) -> T:
    """Validate already-decoded builtins (a JSON dict, say) as ``type_``."""
    label = what or _type_name(type_)
    try:
        return msgspec.convert(obj, type_)
    except DECODE_FAILURES as exc:
        raise WireDecodeError(f"{label}: {_one_line(exc)}") from None


def _type_name(type_: Any) -> str:
    return str(getattr(type_, "__name__", type_))


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())
