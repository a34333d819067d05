"""The listener's ZMTP parser, byte by byte: what it accepts, answers and refuses.

Interop with real libzmq clients is covered by every other test in this directory (they
all use pyzmq REQ or DEALER sockets); here are the edges a libzmq client never produces.
"""

from __future__ import annotations

import struct

import pytest

from kvwire.sidechannel.zmtp import (
    ConnectionLimits,
    Phase,
    ZmtpError,
    ZmtpServerConnection,
    message_frames,
    parse_properties,
    ready_command,
    server_greeting,
)

LIMITS = ConnectionLimits(max_frame_bytes=1024, max_message_frames=4, max_message_bytes=2048)
GREETING = b"\xff" + b"\x00" * 8 + b"\x7f\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32


def _ready(socket_type: bytes) -> bytes:
    body = b"\x05READY\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return b"\x04" + bytes([len(body)]) + body


def _open(socket_type: bytes = b"REQ") -> ZmtpServerConnection:
    conn = ZmtpServerConnection(LIMITS)
    assert conn.take_output() == [server_greeting()]
    assert conn.receive(GREETING + _ready(socket_type)) == []
    assert conn.take_output() == [ready_command()]
    assert conn.phase is Phase.OPEN and conn.peer_socket_type == socket_type
    return conn


def test_a_request_byte_by_byte_and_pipelined() -> None:
    conn = ZmtpServerConnection(LIMITS)
    wire = GREETING + _ready(b"DEALER") + b"".join(message_frames([b"", b"hello"]))
    got: list[list[bytes]] = []
    for i in range(len(wire)):  # one byte at a time: the parser never needs more at once
        got += conn.receive(wire[i : i + 1])
    assert got == [[b"", b"hello"]] and not conn.in_message
    burst = b"".join(message_frames([b"", bytes([i])])) * 10
    assert len(conn.receive(burst, limit=4)) == 4
    assert len(conn.receive(b"", limit=100)) == 6  # the rest waited in the buffer


def test_long_frames_and_answers_round_trip() -> None:
    conn = _open()
    body = b"x" * 1000
    assert conn.receive(b"".join(message_frames([b"", body]))) == [[b"", body]]
    pieces = message_frames([b"", b"y" * 300, b"z"])
    assert (
        pieces[0] == b"\x01\x00" and pieces[1][:1] == b"\x03" and pieces[-2:] == [b"\x00\x01", b"z"]
    )


def test_ping_is_answered_and_unknown_commands_ignored() -> None:
    conn = _open()
    ping = b"\x04PING\x00\x0acontext"
    assert conn.receive(b"\x04" + bytes([len(ping)]) + ping) == []
    assert conn.take_output() == [b"\x04\x0c\x04PONGcontext"]
    sub = b"\x09SUBSCRIBEtopic"
    assert conn.receive(b"\x04" + bytes([len(sub)]) + sub) == []
    assert conn.take_output() == []


@pytest.mark.parametrize(
    ("wire", "why"),
    [
        (b"GET / HTTP/1.1\r\n", "bad signature"),
        (b"\xff" + b"\x00" * 8 + b"\x00", "ZMTP 1.0"),
        (GREETING[:10] + b"\x02", "version 2"),
        (GREETING[:12] + b"CURVE".ljust(20, b"\x00") + b"\x00" * 32, "mechanism"),
        (GREETING + _ready(b"PUB"), "cannot talk"),
        (GREETING + b"\x04\x06\x05HELLO", "expected READY"),
        (GREETING + b"\x00\x01x", "before the peer's READY"),
        (GREETING + _ready(b"REQ") + b"\x02" + struct.pack(">Q", 1 << 30), "claims 1073741824"),
        (GREETING + _ready(b"REQ") + b"\x02" + struct.pack(">Q", (1 << 64) - 1), "claims"),
        (GREETING + _ready(b"REQ") + b"\x01\x00" * 5, "more than 4 frames"),
        (GREETING + _ready(b"REQ") + (b"\x03" + struct.pack(">Q", 1000) + b"a" * 1000) * 3,
         "more than 2048 bytes"),
        (GREETING + _ready(b"REQ") + b"\x08\x00", "reserved bits"),
        (GREETING + _ready(b"REQ") + _ready(b"REQ"), "second READY"),
        (GREETING + b"\x04\x02\x09R", "malformed command"),
        (GREETING + b"\x04\x07\x05READY\x03", "truncated"),
    ],
)  # fmt: skip
def test_violations_close_the_connection(wire: bytes, why: str) -> None:
    conn = ZmtpServerConnection(LIMITS)
    with pytest.raises(ZmtpError, match=why):
        conn.receive(wire)


def test_what_a_connection_holds_is_bounded() -> None:
    """A message never finished keeps at most its frames; a frame over the limit is refused
    from its header, before its bytes arrive."""
    conn = _open()
    conn.receive(b"\x01\x00" + b"\x03" + struct.pack(">Q", 1000) + b"a" * 500)
    assert conn.in_message
    assert len(conn._buffer) <= 9 + LIMITS.max_frame_bytes
    with pytest.raises(ZmtpError, match="claims 1025"):
        _open().receive(b"\x02" + struct.pack(">Q", 1025))


def test_properties_parse_and_refuse_truncation() -> None:
    data = b"\x0bSocket-Type\x00\x00\x00\x03REQ\x08Identity\x00\x00\x00\x00"
    assert parse_properties(data) == {b"socket-type": b"REQ", b"identity": b""}
    for cut in (1, 5, 14, len(data) - 5):
        with pytest.raises(ZmtpError):
            parse_properties(data[:cut])
