"""Notifications between agents: length-prefixed frames over abstract Unix stream sockets.

Every agent listens on an abstract-namespace address (no file to clean up) named in its
metadata. A sender connects once per peer and opens with a hello frame carrying its name;
after that each frame is one notification. A stream per sender keeps them in send order,
and the kernel closing a dead process's sockets is how a vanished peer shows up.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import struct
import threading
import uuid
from collections.abc import Callable

_HEADER = struct.Struct("<I")
MAX_MESSAGE = 64 << 20
SEND_TIMEOUT_S = 30.0


def frame(payload: bytes) -> bytes:
    return _HEADER.pack(len(payload)) + payload


class _Inbound:
    """Reassembles frames from one accepted connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.sender: str | None = None

    def frames(self) -> list[bytes]:
        out: list[bytes] = []
        while len(self.buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self.buf)
            if n > MAX_MESSAGE:
                raise ValueError("oversize notification frame")
            if len(self.buf) < _HEADER.size + n:
                break
            out.append(bytes(self.buf[_HEADER.size : _HEADER.size + n]))
            del self.buf[: _HEADER.size + n]
        return out


class NotifyHub:
    """The receiving end: one listener and one thread that files incoming notifications."""

    def __init__(self, owner: str, on_message: Callable[[str, bytes], None]) -> None:
        self.address = f"\0kvwire-shm-{os.getpid()}-{uuid.uuid4().hex}".encode()
        self._on_message = on_message
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._listener.bind(self.address)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._conns: dict[int, _Inbound] = {}
        self._stop = False
        self._thread = threading.Thread(
            target=self._loop, name=f"kvwire-shm-notify-{owner}", daemon=True
        )
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop:
            for key, _ in self._selector.select():
                obj = key.fileobj
                if obj is self._listener:
                    self._accept()
                elif obj == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                else:
                    self._receive(key.data)

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        conn = _Inbound(sock)
        self._conns[sock.fileno()] = conn
        self._selector.register(sock, selectors.EVENT_READ, conn)

    def _drop(self, conn: _Inbound) -> None:
        self._selector.unregister(conn.sock)
        self._conns.pop(conn.sock.fileno(), None)
        conn.sock.close()

    def _receive(self, conn: _Inbound) -> None:
        try:
            data = conn.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        conn.buf += data
        try:
            frames = conn.frames()
        except ValueError:
            self._drop(conn)
            return
        for payload in frames:
            if conn.sender is None:
                conn.sender = payload.decode("utf-8", "replace")
            else:
                self._on_message(conn.sender, payload)

    def close(self) -> None:
        self._stop = True
        os.write(self._wake_w, b"x")
        self._thread.join()
        for conn in list(self._conns.values()):
            self._drop(conn)
        self._selector.close()
        self._listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


def connect(address: bytes, sender: str) -> socket.socket:
    """An outbound channel to a peer's hub, already introduced with our name."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(SEND_TIMEOUT_S)
        sock.connect(address)
        sock.sendall(frame(sender.encode()))
    except OSError:
        sock.close()
        raise
    return sock
