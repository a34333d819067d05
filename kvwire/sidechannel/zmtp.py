"""The server half of ZMTP 3 (NULL mechanism) as a REQ/DEALER peer sees a ROUTER, sans-IO.

Why not libzmq's ROUTER: libzmq buffers every frame of a multipart message until the last
one arrives, and ZMQ_MAXMSGSIZE bounds a frame, not a message. A peer that sends frames
with the MORE flag and never a last one makes the listener allocate without end (the
measurement, and its setup, are in ``docs/security.md``), and nothing in libzmq's API can
see or stop it. Parsing the few ZMTP rules a handshake needs ourselves lets every
connection be bounded: the frame size, the frames and bytes of one message, the time to
finish the greeting, to finish a message and between messages.

What is spoken (RFC 23/ZMTP 3.0 and 37/ZMTP 3.1, the subset a REQ or DEALER client uses):
the 64-byte greeting (version 3.x, mechanism NULL), a READY command each way (Socket-Type
must be REQ or DEALER; we say ROUTER), then frames: message frames (flags MORE/LONG),
commands (PING is answered with PONG, other commands are ignored, ERROR ends the
connection). ZMTP 1.0/2.0 peers (libzmq before 3.0) and security mechanisms other than
NULL are refused, as vLLM's and kvwire's clients never use them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import Enum

SIGNATURE_HEAD = 0xFF
SIGNATURE_TAIL = 0x7F
GREETING_BYTES = 64
_FLAG_MORE = 0x01
_FLAG_LONG = 0x02
_FLAG_COMMAND = 0x04
_LONG = struct.Struct(">Q")
_PROP_LEN = struct.Struct(">I")
_CLIENT_TYPES = frozenset({b"REQ", b"DEALER"})
_MAX_COMMAND_BYTES = 1024
"""Commands a REQ peer sends (READY, PING) are a few dozen bytes."""


class ZmtpError(Exception):
    """The peer broke ZMTP or a limit; the connection is closed. The message says which."""


def server_greeting() -> bytes:
    """Our greeting: ZMTP 3.1, mechanism NULL, as-server set."""
    return (
        bytes([SIGNATURE_HEAD]) + b"\x00" * 8 + bytes([SIGNATURE_TAIL])
        + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x01" + b"\x00" * 31
    )  # fmt: skip


def _command(name: bytes, body: bytes) -> bytes:
    data = bytes([len(name)]) + name + body
    if len(data) < 256:
        return bytes([_FLAG_COMMAND, len(data)]) + data
    return bytes([_FLAG_COMMAND | _FLAG_LONG]) + _LONG.pack(len(data)) + data


def _properties(props: dict[bytes, bytes]) -> bytes:
    return b"".join(
        bytes([len(name)]) + name + _PROP_LEN.pack(len(value)) + value
        for name, value in props.items()
    )


def ready_command() -> bytes:
    """Our READY: a ROUTER, with the empty Identity property libzmq's ROUTER also sends."""
    return _command(b"READY", _properties({b"Socket-Type": b"ROUTER", b"Identity": b""}))


def message_frames(frames: list[bytes]) -> list[bytes]:
    """The wire pieces of one message (headers and bodies; bodies are not copied)."""
    pieces: list[bytes] = []
    last = len(frames) - 1
    for i, body in enumerate(frames):
        more = _FLAG_MORE if i < last else 0
        if len(body) < 256:
            pieces.append(bytes([more, len(body)]))
        else:
            pieces.append(bytes([more | _FLAG_LONG]) + _LONG.pack(len(body)))
        if body:
            pieces.append(body)
    return pieces


def parse_properties(data: bytes) -> dict[bytes, bytes]:
    """The metadata of a READY command; malformed metadata is a ``ZmtpError``."""
    props: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(data):
        name_len = data[pos]
        name = data[pos + 1 : pos + 1 + name_len]
        pos += 1 + name_len
        if len(name) != name_len or name_len == 0 or pos + 4 > len(data):
            raise ZmtpError("READY metadata is truncated")
        (value_len,) = _PROP_LEN.unpack_from(data, pos)
        pos += 4
        if pos + value_len > len(data):
            raise ZmtpError("READY metadata value is truncated")
        props[name.lower()] = data[pos : pos + value_len]
        pos += value_len
    return props


class Phase(Enum):
    GREETING = "greeting"
    READY = "ready"
    """Greeting done, waiting for the peer's READY."""
    OPEN = "open"


@dataclass(frozen=True)
class ConnectionLimits:
    max_frame_bytes: int
    """Largest message frame (a request is one small frame)."""
    max_message_frames: int
    max_message_bytes: int


class ZmtpServerConnection:
    """One accepted connection's protocol state: bytes in, messages and bytes out.

    ``receive(data)`` returns the complete messages (lists of frames) in ``data`` and may
    queue bytes to send (``take_output``); a violation raises ``ZmtpError`` and the caller
    closes the connection. The unparsed tail it keeps is at most one frame header plus one
    frame, so what a connection holds is bounded by the limits whatever the peer sends.
    """

    def __init__(self, limits: ConnectionLimits) -> None:
        self._limits = limits
        self.phase = Phase.GREETING
        self._buffer = bytearray()
        self._partial: list[bytes] = []
        self._partial_bytes = 0
        self._output: list[bytes] = [server_greeting()]
        self.peer_socket_type = b""

    @property
    def in_message(self) -> bool:
        """Whether some frames of a message have arrived but not its last one."""
        return bool(self._partial) or bool(self._buffer)

    def take_output(self) -> list[bytes]:
        out, self._output = self._output, []
        return out

    def receive(self, data: bytes, limit: int = 1 << 30) -> list[list[bytes]]:
        """The complete messages in what has arrived, at most ``limit`` of them; the rest
        stays buffered for the next call (with no new data: ``receive(b"", limit)``)."""
        self._buffer += data
        messages: list[list[bytes]] = []
        while len(messages) < limit:
            if self.phase is Phase.GREETING:
                if not self._greeting():
                    return messages
                continue
            frame = self._next_frame()
            if frame is None:
                return messages
            flags, body = frame
            if flags & _FLAG_COMMAND:
                self._on_command(body)
            elif self.phase is not Phase.OPEN:
                raise ZmtpError("message before the peer's READY")
            else:
                message = self._on_frame(flags, body)
                if message is not None:
                    messages.append(message)
        return messages

    # -- the greeting ----------------------------------------------------------------------

    def _greeting(self) -> bool:
        buf = self._buffer
        if buf and buf[0] != SIGNATURE_HEAD:
            raise ZmtpError("not a ZMTP 3 peer (bad signature)")
        if len(buf) >= 10 and not buf[9] & 0x01:
            raise ZmtpError("not a ZMTP 3 peer (ZMTP 1.0 signature)")
        if len(buf) >= 11 and buf[10] < 3:
            raise ZmtpError(f"ZMTP version {buf[10]} is not supported (3.x only)")
        if len(buf) < GREETING_BYTES:
            return False
        mechanism = bytes(buf[12:32]).rstrip(b"\x00")
        if mechanism != b"NULL":
            raise ZmtpError(f"security mechanism {mechanism[:20]!r} is not supported")
        del buf[:GREETING_BYTES]
        self.phase = Phase.READY
        self._output.append(ready_command())
        return True

    # -- frames ------------------------------------------------------------------------

    def _next_frame(self) -> tuple[int, bytes] | None:
        buf = self._buffer
        if len(buf) < 2:
            return None
        flags = buf[0]
        if flags & ~(_FLAG_MORE | _FLAG_LONG | _FLAG_COMMAND):
            raise ZmtpError(f"frame flags {flags:#04x} have reserved bits set")
        if flags & _FLAG_LONG:
            if len(buf) < 9:
                return None
            (size,) = _LONG.unpack_from(buf, 1)
            start = 9
        else:
            size, start = buf[1], 2
        limit = _MAX_COMMAND_BYTES if flags & _FLAG_COMMAND else self._limits.max_frame_bytes
        if size > limit:
            raise ZmtpError(f"a frame claims {size} bytes, more than the {limit} allowed")
        if len(buf) < start + size:
            return None
        body = bytes(buf[start : start + size])
        del buf[: start + size]
        return flags, body

    def _on_frame(self, flags: int, body: bytes) -> list[bytes] | None:
        self._partial.append(body)
        self._partial_bytes += len(body)
        if len(self._partial) > self._limits.max_message_frames:
            raise ZmtpError(f"a message of more than {self._limits.max_message_frames} frames")
        if self._partial_bytes > self._limits.max_message_bytes:
            raise ZmtpError(f"a message of more than {self._limits.max_message_bytes} bytes")
        if flags & _FLAG_MORE:
            return None
        message, self._partial, self._partial_bytes = self._partial, [], 0
        return message

    def _on_command(self, body: bytes) -> None:
        if not body or len(body) < 1 + body[0]:
            raise ZmtpError("malformed command")
        name, data = body[1 : 1 + body[0]], body[1 + body[0] :]
        if self.phase is Phase.READY:
            if name != b"READY":
                raise ZmtpError(f"expected READY, got command {name[:16]!r}")
            socket_type = parse_properties(data).get(b"socket-type", b"")
            if socket_type not in _CLIENT_TYPES:
                raise ZmtpError(f"a {socket_type[:16]!r} socket cannot talk to a ROUTER here")
            self.peer_socket_type = socket_type
            self.phase = Phase.OPEN
        elif name == b"PING":
            # PING = TTL (2 bytes) + context (up to 16 bytes), answered by PONG + context.
            self._output.append(_command(b"PONG", data[2:18]))
        elif name == b"ERROR":
            raise ZmtpError("peer sent ERROR")
        elif name == b"READY":
            raise ZmtpError("a second READY")
        # Anything else (PONG, SUBSCRIBE, ...) means nothing to a ROUTER: ignored.
