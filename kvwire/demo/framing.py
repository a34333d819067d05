"""Length-prefixed msgpack frames over a byte stream: the demo's scheduler <-> rank pipe.

Rank processes are plain subprocesses talking over stdin/stdout, so nothing is pickled and
a rank can be killed like any real worker.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Mapping
from typing import IO, Any

import msgspec

from kvwire.errors import WireDecodeError

_HEADER = struct.Struct("<I")
MAX_FRAME = 64 << 20
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(dict[str, Any])


def write_frame(stream: IO[bytes], message: Mapping[str, Any]) -> None:
    """One message as one frame; for a stream only one thread writes to."""
    body = _encoder.encode(message)
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


class FrameWriter:
    """Thread-safe writer of one frame per message."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def send(self, message: Mapping[str, Any]) -> None:
        with self._lock:
            write_frame(self._stream, message)


def read_frame(stream: IO[bytes]) -> dict[str, Any] | None:
    """The next message, or None at end of stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME:
        raise WireDecodeError(f"demo frame of {size} bytes exceeds {MAX_FRAME}")
    body = stream.read(size)
    if len(body) < size:
        return None
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireDecodeError(f"bad demo frame: {exc}") from None
