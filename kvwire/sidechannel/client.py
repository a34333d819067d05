"""The handshake client: fetch the payloads of a peer's ranks over a REQ socket.

Like vLLM's client it asks one rank after another and estimates the clock offset to the
peer from the lowest-RTT sample (``offset = remote - (t_send + t_recv) / 2``). Unlike it,
a timeout is retried on a fresh socket (a REQ socket that missed its answer is stuck for
good) with exponential backoff, and every failure is a typed ``HandshakeError``.

``fetch_payloads`` returns raw payload bytes, so the same client serves ``kvwire probe``
(which wants to show a peer it cannot talk to) and the runtime (which decodes with the
local compatibility hash).

With a ``secret`` every rank is fetched through the authenticated handshake
(``kvwire.sidechannel.auth``) and a peer that does not prove it holds the same secret is a
``HandshakeAuthError``: the client never falls back to plain mode. A refusal for rate
limiting is retried like a timeout.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import zmq

from kvwire.config.retry import RetryPolicy
from kvwire.errors import (
    ConfigError,
    HandshakeAuthError,
    HandshakeError,
    HandshakeTimeoutError,
    PeerUnreachableError,
    WireDecodeError,
)
from kvwire.sidechannel.address import is_ipv6, tcp_endpoint
from kvwire.sidechannel.auth import ClientAuth, encode_proof
from kvwire.sidechannel.frames import AUTH_REASON, RATE_LIMITED_REASON, refusal_reason
from kvwire.wire.handshake import decode_clock_reply, encode_handshake_request
from kvwire.wire.leases import (
    MAX_LEASE_QUERY_SIZE,
    decode_lease_reply,
    encode_lease_query,
)
from kvwire.wire.schemas import MAX_LEASE_IDS, LeaseQuery


class _RateLimited(Exception):
    """The peer refused for rate limiting: worth another attempt after the backoff."""


@dataclass(frozen=True)
class RankReply:
    """One rank's answer: its payload and the clock sample taken with it."""

    pp_rank: int
    tp_rank: int
    payload: bytes
    remote_clock: float
    rtt: float
    offset: float
    """``remote_clock - midpoint of the local send and receive times``."""


@dataclass(frozen=True)
class PayloadReplies:
    """Every queried rank's answer and the best clock sample among them."""

    replies: dict[tuple[int, int], RankReply]
    clock_offset: float
    best_rtt: float
    attempts: int
    """Requests sent, retries included."""


class HandshakeClient:
    """Fetch handshake payloads from listeners; one instance may serve many peers.

    Owns a ZMQ context; ``close`` releases it. Thread-safe in the sense that each call
    uses its own socket. ``secret`` switches to the authenticated handshake.
    """

    def __init__(
        self,
        policy: RetryPolicy | None = None,
        *,
        max_reply_bytes: int = 64 << 20,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        secret: bytes | None = None,
    ) -> None:
        self.policy = policy or RetryPolicy()
        self._auth = ClientAuth(secret) if secret is not None else None
        self._max_reply_bytes = max_reply_bytes
        self._clock = clock
        self._sleep = sleep
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = zmq.Context()

    def close(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.term()

    def __enter__(self) -> HandshakeClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def fetch_payloads(
        self, host: str, port: int, ranks: Iterable[tuple[int, int]]
    ) -> PayloadReplies:
        """Ask ``host:port`` for each ``(pp_rank, tp_rank)`` in turn.

        Raises ``HandshakeTimeoutError`` when a rank stays silent through every retry,
        ``HandshakeAuthError`` when authentication fails either way (we lack the peer's
        secret, or the peer does not prove it has ours), and ``HandshakeError`` when the
        peer refuses or answers with something that is not a handshake answer.
        """
        wanted = list(dict.fromkeys(ranks))
        if not wanted:
            raise ConfigError("a handshake needs at least one rank to ask")
        endpoint = tcp_endpoint(host, port)
        ipv6 = is_ipv6(host)
        replies: dict[tuple[int, int], RankReply] = {}
        attempts = 0
        sock = self._open(endpoint, ipv6)
        try:
            for pp_rank, tp_rank in wanted:
                why = "no handshake answer from"
                for attempt in range(self.policy.retries + 1):
                    if attempt:
                        sock.close(linger=0)
                        self._sleep(self.policy.delay(attempt))
                        sock = self._open(endpoint, ipv6)
                    attempts += 1
                    reply = None
                    try:
                        if not replies:  # a peer that answered once is known to be there
                            self._dial(host, port, endpoint)
                        reply = self._ask(sock, pp_rank, tp_rank)
                    except _RateLimited:
                        why = "rate limited by"
                    if reply is not None:
                        replies[(pp_rank, tp_rank)] = self._check(endpoint, reply)
                        break
                else:
                    error = HandshakeError if why.startswith("rate") else HandshakeTimeoutError
                    raise error(
                        f"{why} {endpoint} for rank (pp={pp_rank}, tp={tp_rank}) after "
                        f"{self.policy.retries + 1} attempts of {self.policy.timeout:g} s"
                    )
        finally:
            sock.close(linger=0)
        best = min(replies.values(), key=lambda r: r.rtt)
        return PayloadReplies(replies, best.offset, best.rtt, attempts)

    def query_leases(
        self, host: str, port: int, rank: tuple[int, int], request_ids: Sequence[str]
    ) -> list[float | None]:
        """Ask a kvwire producer's listener (one that announced ``lease-query``) which
        lease deadline ``rank`` holds for each id, in the producer's clock; None where it
        holds none (and for an id too long to ask about). One attempt, no retry: the
        consumer asks again at its next heartbeat. A silent peer is a
        ``HandshakeTimeoutError``, a refusal or a bad answer a ``HandshakeError``.
        """
        if self._auth is not None:
            raise HandshakeAuthError("lease queries are not authenticated; not sent")
        answers: dict[str, float | None] = {}
        sock = self._open(tcp_endpoint(host, port), is_ipv6(host))
        try:
            for chunk in _query_chunks(request_ids):
                frames = self._roundtrip(sock, encode_lease_query(LeaseQuery(*rank, chunk)))
                if frames is None:
                    raise HandshakeTimeoutError(
                        f"no lease answer from {tcp_endpoint(host, port)} within "
                        f"{self.policy.timeout:g} s"
                    )
                if len(frames) != 2:
                    raise HandshakeError(f"lease answer has {len(frames)} frames, expected 2")
                reason = refusal_reason(frames[0])
                if reason is not None:
                    raise HandshakeError(f"peer refused the lease query: {reason}")
                try:
                    deadlines = decode_lease_reply(frames[0]).deadlines
                except WireDecodeError as exc:
                    raise HandshakeError(str(exc)) from None
                if len(deadlines) != len(chunk):
                    raise HandshakeError(
                        f"lease answer has {len(deadlines)} deadlines for {len(chunk)} ids"
                    )
                answers.update(zip(chunk, deadlines, strict=True))
        finally:
            sock.close(linger=0)
        return [answers.get(rid) for rid in request_ids]

    def _dial(self, host: str, port: int, endpoint: str) -> None:
        """A refusal is final: the peer's kernel says nothing listens, and waiting for a
        restarted engine is the engine's choice (the next request handshakes again)."""
        try:
            dial(host, port, self.policy.timeout)
        except ConnectionRefusedError:
            raise PeerUnreachableError(
                f"connection refused by {endpoint} (nothing listens there)"
            ) from None

    def _open(self, endpoint: str, ipv6: bool) -> zmq.Socket[bytes]:
        if self._ctx is None:
            raise HandshakeError("handshake client is closed")
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_reply_bytes)
        timeout_ms = max(1, int(self.policy.timeout * 1000))
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
        if ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
        return sock

    def _ask(self, sock: zmq.Socket[bytes], pp_rank: int, tp_rank: int) -> RankReply | None:
        """One rank's answer; None when the peer stayed silent (the socket is then spent)."""
        if self._auth is not None:
            return self._ask_authenticated(self._auth, sock, pp_rank, tp_rank)
        t_send = self._clock()
        frames = self._roundtrip(sock, encode_handshake_request(pp_rank, tp_rank))
        if frames is None:
            return None
        t_recv = self._clock()
        if len(frames) != 2:
            raise HandshakeError(f"handshake answer has {len(frames)} frames, expected 2")
        payload, clock_frame = frames
        _raise_refusal(payload, pp_rank, tp_rank)
        return self._reply(pp_rank, tp_rank, payload, clock_frame, t_send, t_recv)

    def _ask_authenticated(
        self, auth: ClientAuth, sock: zmq.Socket[bytes], pp_rank: int, tp_rank: int
    ) -> RankReply | None:
        frames = self._roundtrip(sock, auth.hello(pp_rank, tp_rank))
        if frames is None:
            return None
        if len(frames) != 2:
            raise HandshakeAuthError(f"answer to the hello has {len(frames)} frames, expected 2")
        _raise_refusal(frames[0], pp_rank, tp_rank)
        challenge = auth.challenge_of(frames[0])
        if challenge is None:
            raise HandshakeAuthError(
                f"peer answered rank ({pp_rank}, {tp_rank}) without authenticating (a vLLM "
                "listener or kvwire without a secret); its metadata was not used"
            )
        proof = auth.prove(pp_rank, tp_rank, challenge)
        t_send = self._clock()
        frames = self._roundtrip(sock, encode_proof(proof))
        if frames is None:
            return None
        t_recv = self._clock()
        if len(frames) == 2:
            _raise_refusal(frames[0], pp_rank, tp_rank)
        if len(frames) != 3:
            raise HandshakeAuthError(f"authenticated answer has {len(frames)} frames, expected 3")
        sealed, clock_frame, tag = frames
        payload = auth.open(proof, sealed, clock_frame, tag)
        return self._reply(pp_rank, tp_rank, payload, clock_frame, t_send, t_recv)

    @staticmethod
    def _roundtrip(sock: zmq.Socket[bytes], request: bytes) -> list[bytes] | None:
        try:
            sock.send(request)
            return sock.recv_multipart()
        except zmq.Again:
            return None

    @staticmethod
    def _reply(
        pp_rank: int, tp_rank: int, payload: bytes, clock_frame: bytes, t_send: float,
        t_recv: float,
    ) -> RankReply:  # fmt: skip
        try:
            remote = decode_clock_reply(clock_frame)
        except WireDecodeError as exc:
            raise HandshakeError(str(exc)) from None
        return RankReply(
            pp_rank,
            tp_rank,
            payload,
            remote_clock=remote,
            rtt=t_recv - t_send,
            offset=remote - (t_send + t_recv) / 2,
        )

    @staticmethod
    def _check(endpoint: str, reply: RankReply) -> RankReply:
        if not reply.payload:
            raise HandshakeError(f"{endpoint} sent an empty handshake payload")
        return reply


def _query_chunks(request_ids: Sequence[str]) -> Iterator[list[str]]:
    """Distinct ids in queries that fit the listener's request limit (an id that cannot
    fit at all is left out: it stays unconfirmed)."""
    room = MAX_LEASE_QUERY_SIZE - 32  # the tag, the ranks and the array headers
    chunk: list[str] = []
    used = 0
    for rid in dict.fromkeys(request_ids):
        size = len(rid.encode("utf-8", "replace")) + 5
        if size > room:
            continue
        if chunk and (used + size > room or len(chunk) == MAX_LEASE_IDS):
            yield chunk
            chunk, used = [], 0
        chunk.append(rid)
        used += size
    if chunk:
        yield chunk


def _raise_refusal(frame: bytes, pp_rank: int, tp_rank: int) -> None:
    """Raise the error a refusal frame stands for; return when the frame is not one."""
    reason = refusal_reason(frame)
    if reason is None:
        return
    if reason.startswith(RATE_LIMITED_REASON):
        raise _RateLimited(reason)
    error = HandshakeAuthError if reason.startswith(AUTH_REASON) else HandshakeError
    raise error(f"peer refused handshake for rank ({pp_rank}, {tp_rank}): {reason}")


def dial(host: str, port: int, timeout: float) -> None:
    """Open and close one plain TCP connection to ``host:port``.

    ZMQ retries a refused or unresolvable peer silently until a receive times out; this
    tells the three apart at once. Raises ``PeerUnreachableError`` for a name that does not
    resolve or a connection that fails, ``HandshakeTimeoutError`` when connecting takes
    longer than ``timeout``, and lets ``ConnectionRefusedError`` through for the caller to
    retry or report (a peer that is starting refuses for a moment)."""
    endpoint = tcp_endpoint(host, port)
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM
        )[0]
    except (socket.gaierror, UnicodeError) as exc:
        why = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise PeerUnreachableError(f"cannot resolve host {host!r} ({why})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(address)
        except ConnectionRefusedError:
            raise
        except TimeoutError:
            raise HandshakeTimeoutError(
                f"timed out connecting to {endpoint} after {timeout:g} s"
            ) from None
        except OSError as exc:
            raise PeerUnreachableError(
                f"cannot connect to {endpoint}: {exc.strerror or exc}"
            ) from None
