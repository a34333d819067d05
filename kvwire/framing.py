"""Length-prefixed msgpack frames between kvwire's own processes: the one framing.

The demo's ranks, the reference engine's processes, the benchmarks' peers and the
conformance suite's peer agent are plain subprocesses talking over pipes or a socketpair,
so nothing is pickled and a child can be killed like any real worker. Every such channel
frames a message as a 4-byte little-endian length and the body; streams
(:func:`write_frame`/:func:`read_frame`, msgpack maps) and sockets
(:func:`send_frame`/:func:`receive_frame`, bytes the caller encodes) share the header.
:func:`spawn`, :func:`wait_or_kill` and :func:`close_pipes` are the life cycle every child
shares. Tooling only: the protocol core never imports this module.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
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
        raise WireDecodeError(f"frame of {size} bytes exceeds {MAX_FRAME}")
    body = stream.read(size)
    if len(body) < size:
        return None
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireDecodeError(f"bad frame: {exc}") from None


def commands(stream: IO[bytes]) -> Iterator[dict[str, Any]]:
    """A child's command frames until end of stream or ``{"op": "exit"}``."""
    while (message := read_frame(stream)) is not None and message["op"] != "exit":
        yield message


def spawn(module: str, *args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``python -m module args``: stdin and stdout piped for the protocol, stderr inherited
    for its logs, environment this one's plus ``env``. The child runs in its own process
    group, so Ctrl-C interrupts the parent alone and the parent ends its children in order
    (a child whose parent vanished sees its stdin close and exits)."""
    child_env = {**os.environ, **(env or {})}
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=child_env,
        process_group=0,  # a terminal's Ctrl-C reaches only the parent, which stops us
    )
    assert proc.stdin is not None and proc.stdout is not None
    return proc


def wait_or_kill(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Wait for a child that was told to exit; SIGKILL it if it has not within ``timeout``."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def close_pipes(proc: subprocess.Popen[bytes]) -> None:
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def send_frame(sock: socket.socket, payload: bytes) -> None:
    """One already-encoded message as one frame on a socket."""
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        part = sock.recv_into(view[got:], min(n - got, 1 << 22))
        if not part:
            raise EOFError("frame channel closed")
        got += part
    return bytes(buf)


def receive_frame(sock: socket.socket, limit: int | None = None) -> bytes:
    """The next frame's body; EOFError when the channel closed. ``limit`` (bytes) refuses a
    larger frame with a WireDecodeError before reading it; None trusts the sender (a child
    of this process on a socketpair)."""
    (n,) = _HEADER.unpack(_exact(sock, _HEADER.size))
    if limit is not None and n > limit:
        raise WireDecodeError(f"frame of {n} bytes exceeds {limit}")
    return _exact(sock, n)
