"""The listener's TCP side: accept, read, write and reap connections, within fixed bounds.

One thread, one ``selectors`` loop, non-blocking sockets. Each connection speaks ZMTP
through :class:`~kvwire.sidechannel.zmtp.ZmtpServerConnection`; every complete message goes
to a handler that returns the reply frames (or None). What one connection can cost is
fixed by :class:`~kvwire.sidechannel.limits.ListenerLimits`:

* connections: at most ``max_connections`` (the oldest one still in its greeting is closed
  to make room; if every connection is established, the new one is refused) and
  ``max_connections_per_peer`` per address;
* time: the greeting and READY within ``handshake_timeout_s``, a started message within
  ``message_timeout_s`` (slow clients), and nothing for ``idle_timeout_s`` (squatters);
* memory: one frame of ``max_request_bytes``, a message of ``max_message_frames`` frames,
  and ``queued_per_peer`` answers not yet taken by the peer, after which the connection is
  not read until it takes them (a client that pipelines and never reads stalls only itself).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvwire.sidechannel.limits import ListenerLimits
from kvwire.sidechannel.zmtp import (
    ConnectionLimits,
    Phase,
    ZmtpError,
    ZmtpServerConnection,
    message_frames,
)

Handler = Callable[[str, list[bytes]], list[bytes] | None]
"""``(peer address, message frames) -> reply frames or None``."""
Count = Callable[[str], None]

_RECV_BYTES = 8192
_ACCEPTS_PER_WAKE = 256
_SEND_PIECES = 64
_MESSAGES_PER_TURN = 4
"""Messages answered per connection per loop turn: a peer that pipelines hundreds of
requests in one read waits its turn like everyone else instead of taking the thread."""


@dataclass(eq=False)
class _Connection:
    ident: int
    sock: socket.socket
    peer: str
    zmtp: ZmtpServerConnection
    opened: float
    last_activity: float
    message_started: float | None = None
    out: collections.deque[tuple[memoryview, bool]] = field(default_factory=collections.deque)
    """Pieces to send; True marks the last piece of an answer."""
    pending_answers: int = 0
    events: int = 0
    backlogged: bool = False
    """Complete messages may still wait in its buffer (not read again until they are done)."""


class ConnectionServer:
    """Serve ZMTP clients on one listening socket until ``wake`` is readable."""

    def __init__(
        self,
        listening: socket.socket,
        wake: socket.socket,
        limits: ListenerLimits,
        handler: Handler,
        count: Count,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._listening = listening
        self._wake = wake
        self._limits = limits
        self._handler = handler
        self._count = count
        self._now = monotonic
        self._zmtp_limits = ConnectionLimits(
            max_frame_bytes=limits.max_request_bytes,
            max_message_frames=limits.max_message_frames,
            max_message_bytes=limits.max_message_frames * limits.max_request_bytes,
        )
        self._selector = selectors.DefaultSelector()
        self._conns: dict[int, _Connection] = {}
        self._greeting: collections.OrderedDict[int, _Connection] = collections.OrderedDict()
        """Connections still in their greeting, oldest first: the ones evicted at the cap."""
        self._per_peer: collections.Counter[str] = collections.Counter()
        self._backlog: dict[int, _Connection] = {}
        self._accept_paused = False
        self._ids = itertools.count()
        self._sweep_every = min(0.5, limits.handshake_timeout_s / 4, limits.message_timeout_s / 4)

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def run(self) -> None:
        self._listening.setblocking(False)
        self._wake.setblocking(False)
        self._selector.register(self._listening, selectors.EVENT_READ, None)
        self._selector.register(self._wake, selectors.EVENT_READ, None)
        next_sweep = self._now() + self._sweep_every
        try:
            while True:
                timeout = 0.0 if self._has_work() else max(0.0, next_sweep - self._now())
                for key, mask in self._selector.select(timeout):
                    if key.fileobj is self._wake:
                        return
                    if key.fileobj is self._listening:
                        self._accept()
                    else:
                        self._on_ready(key.data, mask)
                for conn in list(self._backlog.values()):
                    if conn.pending_answers < self._limits.queued_per_peer:
                        self._process(conn, b"")
                if self._now() >= next_sweep:
                    self._sweep()
                    next_sweep = self._now() + self._sweep_every
        finally:
            for conn in list(self._conns.values()):
                self._close(conn, None)
            self._selector.close()

    def _has_work(self) -> bool:
        """Whether a backlogged connection may be served now (not one stalled on output)."""
        queued = self._limits.queued_per_peer
        return any(c.pending_answers < queued for c in self._backlog.values())

    # -- connections ------------------------------------------------------------------

    def _accept(self) -> None:
        limits = self._limits
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                sock, address = self._listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._count("connections_refused")
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self._out_of_descriptors()
                return
            peer = str(address[0])
            if self._per_peer[peer] >= limits.max_connections_per_peer:
                self._count("connections_refused")
                sock.close()
                continue
            if len(self._conns) >= limits.max_connections and not self._evict_oldest_greeting():
                self._count("connections_refused")
                sock.close()
                continue
            self._open(sock, peer)

    def _evict_oldest_greeting(self) -> bool:
        """Close the oldest connection still in its greeting to make room; False if none."""
        if not self._greeting:
            return False
        _, oldest = self._greeting.popitem(last=False)
        self._close(oldest, "connections_evicted")
        return True

    def _out_of_descriptors(self) -> None:
        """The process has no descriptor for a new connection: make room by closing the
        oldest one still in its greeting, or stop accepting until the next sweep (the
        listening socket would otherwise stay readable and spin the loop)."""
        if not self._evict_oldest_greeting() and not self._accept_paused:
            self._selector.unregister(self._listening)
            self._accept_paused = True

    def _open(self, sock: socket.socket, peer: str) -> None:
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        now = self._now()
        ident = next(self._ids)
        conn = _Connection(ident, sock, peer, ZmtpServerConnection(self._zmtp_limits), now, now)
        self._conns[ident] = conn
        self._greeting[ident] = conn
        self._per_peer[peer] += 1
        self._count("connections_accepted")
        self._queue(conn, conn.zmtp.take_output(), answer=False)
        self._set_events(conn)
        self._flush(conn)

    def _close(self, conn: _Connection, why: str | None) -> None:
        if self._conns.pop(conn.ident, None) is None:
            return
        self._greeting.pop(conn.ident, None)
        self._backlog.pop(conn.ident, None)
        self._per_peer[conn.peer] -= 1
        if self._per_peer[conn.peer] <= 0:
            del self._per_peer[conn.peer]
        if conn.events:
            self._selector.unregister(conn.sock)
        conn.sock.close()
        conn.out.clear()
        if why is not None:
            self._count(why)

    def _sweep(self) -> None:
        """Close connections that have taken too long for their greeting or a message, or
        done nothing for too long."""
        if self._accept_paused:
            self._selector.register(self._listening, selectors.EVENT_READ, None)
            self._accept_paused = False
        now = self._now()
        limits = self._limits
        for conn in list(self._conns.values()):
            if conn.zmtp.phase is not Phase.OPEN:
                if now - conn.opened > limits.handshake_timeout_s:
                    self._close(conn, "connections_timed_out")
            elif conn.message_started is not None:
                if now - conn.message_started > limits.message_timeout_s:
                    self._close(conn, "connections_timed_out")
            elif not conn.out and now - conn.last_activity > limits.idle_timeout_s:
                self._close(conn, "connections_idle_closed")

    # -- I/O ---------------------------------------------------------------------------

    def _on_ready(self, conn: _Connection, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if mask & selectors.EVENT_READ and conn.ident in self._conns:
            self._read(conn)

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn, None)
            return
        if not data:
            self._close(conn, None)
            return
        self._process(conn, data)

    def _process(self, conn: _Connection, data: bytes) -> None:
        now = self._now()
        was_greeting = conn.zmtp.phase is not Phase.OPEN
        try:
            messages = conn.zmtp.receive(data, _MESSAGES_PER_TURN)
        except ZmtpError:  # the peer chose these bytes: counted, not logged
            self._close(conn, "connections_broken")
            return
        if was_greeting and conn.zmtp.phase is Phase.OPEN:
            self._greeting.pop(conn.ident, None)
        self._queue(conn, conn.zmtp.take_output(), answer=False)
        for frames in messages:
            reply = self._handler(conn.peer, frames)
            if reply is not None:
                self._queue(conn, message_frames(reply), answer=True)
        conn.backlogged = len(messages) == _MESSAGES_PER_TURN
        if conn.backlogged:
            self._backlog[conn.ident] = conn
        else:
            self._backlog.pop(conn.ident, None)
        if messages:
            conn.last_activity = now
        if conn.zmtp.in_message:
            if conn.message_started is None:
                conn.message_started = now
        else:
            conn.message_started = None
        self._flush(conn)

    def _queue(self, conn: _Connection, pieces: list[bytes], *, answer: bool) -> None:
        if not pieces:
            return
        last = len(pieces) - 1
        for i, piece in enumerate(pieces):
            conn.out.append((memoryview(piece), answer and i == last))
        if answer:
            conn.pending_answers += 1

    def _flush(self, conn: _Connection) -> None:
        while conn.out:
            buffers = [piece for piece, _ in itertools.islice(conn.out, _SEND_PIECES)]
            offered = sum(piece.nbytes for piece in buffers)
            try:
                sent = conn.sock.sendmsg(buffers)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close(conn, None)
                return
            self._consume(conn, sent)
            if sent < offered:
                break  # the kernel's buffer is full: wait until the socket is writable
        self._set_events(conn)

    @staticmethod
    def _consume(conn: _Connection, sent: int) -> None:
        while sent and conn.out:
            piece, ends_answer = conn.out[0]
            if sent < piece.nbytes:
                conn.out[0] = (piece[sent:], ends_answer)
                return
            sent -= piece.nbytes
            conn.out.popleft()
            if ends_answer:
                conn.pending_answers -= 1

    def _set_events(self, conn: _Connection) -> None:
        """Write while output waits; read unless the peer has too many answers untaken."""
        events = 0
        if conn.pending_answers < self._limits.queued_per_peer and not conn.backlogged:
            events |= selectors.EVENT_READ
        if conn.out:
            events |= selectors.EVENT_WRITE
        if events == conn.events:
            return
        if conn.events == 0:
            self._selector.register(conn.sock, events, conn)
        elif events == 0:
            self._selector.unregister(conn.sock)
        else:
            self._selector.modify(conn.sock, events, conn)
        conn.events = events
