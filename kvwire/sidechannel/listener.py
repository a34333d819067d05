"""The handshake listener: serves each rank's encoded payload to REQ clients over ZMTP.

Wire-compatible with vLLM's listener (one ROUTER serves every (pp_rank, tp_rank) of an
engine, payloads encoded once, a clock reading with every answer): vLLM's and kvwire's REQ
clients cannot tell it from a libzmq ROUTER. It speaks ZMTP itself
(``kvwire.sidechannel.zmtp``) instead of using libzmq's ROUTER because libzmq buffers a
multipart message without bound until its last frame arrives, which lets any peer exhaust
the engine's memory; see ``docs/security.md``.

Nothing a peer sends can stop it: oversize, malformed and unknown-rank requests are answered
with a refusal (or dropped when they carry no REQ envelope to answer on) and counted;
frames above ``max_request_bytes`` close the connection before they are buffered; every
connection is bounded in time and memory by :class:`~kvwire.sidechannel.limits.
ListenerLimits` (``kvwire.sidechannel.server``); token buckets per peer address and overall
turn a flood into cheap refusals. With a ``secret`` the listener speaks only the
authenticated handshake (``kvwire.sidechannel.auth``).

The sockets live on one thread, the only one that touches them; ``close`` wakes it through
a socket pair and joins it, so shutdown is immediate and leaves no socket behind. An
unexpected error while answering a request is logged and counted, and the loop goes on.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvwire.errors import HandshakeError, WireDecodeError
from kvwire.logs import get_logger
from kvwire.sidechannel.auth import (
    CHALLENGE_PREFIX,
    AuthHello,
    AuthProof,
    AuthRefused,
    Challenger,
    read_auth_request,
)
from kvwire.sidechannel.frames import AUTH_REASON, RATE_LIMITED_REASON, encode_refusal
from kvwire.sidechannel.limits import ListenerLimits, RequestLimiter
from kvwire.sidechannel.server import ConnectionServer
from kvwire.wire.handshake import decode_handshake_request, encode_clock_reply
from kvwire.wire.leases import decode_lease_query, encode_lease_reply, is_lease_query
from kvwire.wire.schemas import LeaseReply

Payloads = Mapping[tuple[int, int], bytes]
LeaseSource = Callable[[Sequence[str]], list[float | None]]
"""A producer rank's lease table: per request id, the deadline its lease runs to in the
listener's clock, or None when the blocks are not held under a lease."""


@dataclass(frozen=True)
class ListenerStats:
    """What the listener has seen since it started."""

    served: int = 0
    refused_malformed: int = 0
    refused_unknown_rank: int = 0
    refused_oversize: int = 0
    dropped: int = 0
    """Messages with no REQ envelope (nothing to answer on)."""
    refused_rate_limited: int = 0
    refused_auth: int = 0
    """Plain requests to a listener with a secret, hellos to one without, failed proofs."""
    leases_answered: int = 0
    """Lease queries answered (the ``lease-query`` extension; kvwire consumers only)."""
    challenges: int = 0
    """Challenges issued (authenticated mode); each is half of a handshake, not a refusal."""
    internal_errors: int = 0
    """Requests whose handling raised unexpectedly (a bug; the listener carried on)."""
    connections_accepted: int = 0
    connections_refused: int = 0
    """Turned away at accept: the per-address cap, or every slot held by an established
    connection."""
    connections_evicted: int = 0
    """Closed while still in their greeting to make room for a new connection."""
    connections_timed_out: int = 0
    """Closed for not finishing the greeting or a started message in time."""
    connections_idle_closed: int = 0
    connections_broken: int = 0
    """Closed for breaking ZMTP or a size limit (a frame or message too large)."""
    connections_open: int = 0
    """At the time of the snapshot (a gauge, not a count)."""

    @property
    def rejected(self) -> int:
        return (
            self.refused_malformed
            + self.refused_unknown_rank
            + self.refused_oversize
            + self.dropped
            + self.refused_rate_limited
            + self.refused_auth
        )


class HandshakeListener:
    """Serve pre-encoded handshake payloads on ``host:port`` (port 0 picks a free one).

    ``clock`` must be the clock of the process that stamps lease deadlines: the client
    derives its clock offset to us from it. ``limits`` bound what peers may cost
    (``max_request_bytes``, when given, overrides the one in ``limits``). With ``secret``
    (see :func:`~kvwire.config.secret.load_secret`) only clients holding the same secret
    get a payload; without it the listener is vLLM's, byte for byte.
    """

    def __init__(
        self,
        payloads: Payloads,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_request_bytes: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        limits: ListenerLimits | None = None,
        secret: bytes | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        limits = limits or ListenerLimits()
        if max_request_bytes is not None:  # replace() re-validates, as ListenerLimits() does
            limits = dataclasses.replace(limits, max_request_bytes=max_request_bytes)
        self.limits = limits
        self._payloads: dict[tuple[int, int], bytes] = dict(payloads)
        self._leases: dict[tuple[int, int], LeaseSource] = {}
        self._host = host
        self._requested_port = port
        self._clock = clock
        self._monotonic = monotonic
        self._limiter = RequestLimiter(limits)
        self._challenger = Challenger(secret, clock=monotonic) if secret is not None else None
        self._log = get_logger(__name__, listener=f"{host}:{port}")
        self._lock = threading.Lock()
        self._counts = {f.name: 0 for f in dataclasses.fields(ListenerStats)}
        self._thread: threading.Thread | None = None
        self._port: int | None = None
        self._wake: socket.socket | None = None
        """Our end of the socket pair that stops the serving thread."""
        self._server: ConnectionServer | None = None

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> HandshakeListener:
        """Bind and start serving; returns self once the socket is bound."""
        if self._thread is not None:
            raise HandshakeError("listener already started")
        listening = self._bind()
        self._port = int(listening.getsockname()[1])
        self._wake, their_end = socket.socketpair()
        self._server = ConnectionServer(
            listening, their_end, self.limits, self._answer, self._count,
            monotonic=self._monotonic,
        )  # fmt: skip
        self._thread = threading.Thread(
            target=self._serve,
            args=(self._server, listening, their_end),
            name="kvwire-handshake-listener",
            daemon=True,
        )
        self._thread.start()
        self._log = get_logger(__name__, listener=f"{self._host}:{self._port}")
        return self

    def _bind(self) -> socket.socket:
        host: str | None = self._host.strip("[]")
        if host in ("", "*"):
            host = None  # every interface
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                host, self._requested_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            listening = socket.socket(family, kind, proto)
        except OSError as exc:
            raise HandshakeError(
                f"cannot listen on {self._host}:{self._requested_port}: {exc}"
            ) from exc
        try:
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listening.bind(address)
            listening.listen(self.limits.backlog)
        except OSError as exc:
            listening.close()
            raise HandshakeError(
                f"cannot listen on {self._host}:{self._requested_port}: {exc.strerror or exc}"
            ) from exc
        return listening

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving and release the socket; safe to call twice."""
        thread, self._thread = self._thread, None
        wake, self._wake = self._wake, None
        if thread is not None and wake is not None:
            wake.send(b"x")
            thread.join(timeout)
            if thread.is_alive():
                self._log.error("handshake listener thread did not stop within %.1f s", timeout)
        if wake is not None:
            wake.close()

    def __enter__(self) -> HandshakeListener:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- queries -------------------------------------------------------------------

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        if self._port is None:
            raise HandshakeError("listener is not started")
        return self._port

    @property
    def authenticated(self) -> bool:
        """Whether this listener requires the shared-secret handshake."""
        return self._challenger is not None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> ListenerStats:
        server = self._server
        with self._lock:
            counts = dict(self._counts)
        counts["connections_open"] = server.open_connections if server is not None else 0
        return ListenerStats(**counts)

    def set_payloads(self, payloads: Payloads) -> None:
        """Replace the served payloads (after a re-registration); takes effect at once."""
        new = dict(payloads)
        with self._lock:
            self._payloads = new

    def set_lease_source(self, key: tuple[int, int], source: LeaseSource | None) -> None:
        """Answer lease queries for rank ``key`` (``(pp_rank, tp_rank)``) from ``source``
        (a producer's :meth:`~kvwire.runtime.Producer.lease_deadlines`), or stop (None).
        The source runs on the listener's thread and must use the listener's clock. A rank
        without one refuses lease queries, which costs its consumers only the extension."""
        with self._lock:
            if source is None:
                self._leases.pop(key, None)
            else:
                self._leases[key] = source

    # -- the serving thread ------------------------------------------------------------

    def _serve(
        self, server: ConnectionServer, listening: socket.socket, wake: socket.socket
    ) -> None:
        try:
            server.run()
        except Exception:
            self._log.exception("handshake listener stopped by an unexpected error")
            raise
        finally:
            listening.close()
            wake.close()

    def _answer(self, peer: str, message: list[bytes]) -> list[bytes] | None:
        """The answer to one message from ``peer`` (None: nothing to answer on)."""
        try:
            return self._answer_request(peer, message)
        except Exception:  # a bug must cost one request, never the listener
            self._count("internal_errors")
            self._log.exception("unexpected error answering a handshake request")
            return None

    def _answer_request(self, peer: str, message: list[bytes]) -> list[bytes] | None:
        # A REQ peer's message is [b"", body...]; the answer goes back the same way.
        if len(message) < 2 or message[0] != b"":
            self._count("dropped")
            return None
        if not self._limiter.admit(peer, self._monotonic()):
            return self._refuse("refused_rate_limited", RATE_LIMITED_REASON)
        body = message[1:]
        size = sum(len(f) for f in body)
        if size > self.limits.max_request_bytes:
            return self._refuse("refused_oversize", f"request of {size} bytes")
        if len(body) != 1:
            return self._refuse("refused_malformed", f"{len(body)} frames, not 1")
        data = body[0]
        if is_lease_query(data):
            return self._answer_lease_query(data)
        try:
            auth = read_auth_request(data)
            request = decode_handshake_request(data) if auth is None else None
        except WireDecodeError as exc:
            return self._refuse("refused_malformed", str(exc))
        if auth is not None:
            return self._answer_auth(auth)
        if self._challenger is not None:
            return self._refuse(
                "refused_auth",
                f"{AUTH_REASON} required: this listener serves only the kvwire "
                "authenticated handshake (shared secret)",
            )
        assert request is not None
        return self._payload_answer((request.pp_rank, request.tp_rank), None)

    def _answer_lease_query(self, data: bytes) -> list[bytes]:
        """kvwire's ``lease-query``: the deadlines the rank's producer holds right now.
        Not served with a secret: the extension is not authenticated yet, and a forged
        answer could keep a consumer reading blocks that were given away."""
        if self._challenger is not None:
            return self._refuse("refused_auth", f"{AUTH_REASON}: lease queries are not served")
        try:
            query = decode_lease_query(data)
        except WireDecodeError as exc:
            return self._refuse("refused_malformed", str(exc))
        key = (query.pp_rank, query.tp_rank)
        with self._lock:
            source = self._leases.get(key)
        if source is None:
            return self._refuse("refused_unknown_rank", f"no lease table for rank {key} here")
        deadlines = source(query.request_ids)
        answer = encode_lease_reply(LeaseReply(deadlines=deadlines[: len(query.request_ids)]))
        clock = encode_clock_reply(self._clock())
        self._count("leases_answered")
        return [b"", answer, clock]

    def _answer_auth(self, msg: AuthHello | AuthProof) -> list[bytes]:
        challenger = self._challenger
        if challenger is None:
            why = f"{AUTH_REASON} is not enabled on this listener (it runs without a secret)"
            return self._refuse("refused_auth", why)
        if isinstance(msg, AuthHello):
            self._count("challenges")
            return [
                b"",
                CHALLENGE_PREFIX + challenger.challenge(),
                encode_clock_reply(self._clock()),
            ]
        try:
            challenger.accept(msg)
        except AuthRefused as exc:
            return self._refuse("refused_auth", str(exc))
        return self._payload_answer((msg.pp_rank, msg.tp_rank), msg)

    def _payload_answer(self, key: tuple[int, int], proof: AuthProof | None) -> list[bytes]:
        with self._lock:
            payload = self._payloads.get(key)
        if payload is None:
            return self._refuse("refused_unknown_rank", f"no rank {key} here")
        clock = encode_clock_reply(self._clock())
        self._count("served")
        if proof is None:
            return [b"", payload, clock]
        assert self._challenger is not None
        sealed, tag = self._challenger.seal(proof, payload, clock)
        return [b"", sealed, clock, tag]

    def _refuse(self, kind: str, why: str) -> list[bytes]:
        self._count(kind)
        self._log.debug("handshake request refused (%s): %s", kind, why)
        return [b"", encode_refusal(why), encode_clock_reply(self._clock())]

    def _count(self, kind: str) -> None:
        with self._lock:
            self._counts[kind] += 1
