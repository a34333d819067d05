"""The handshake client: fetch the payloads of a peer's ranks over a REQ socket.

Like vLLM's client it asks one rank after another and estimates the clock offset to the
peer from the lowest-RTT sample (``offset = remote - (t_send + t_recv) / 2``). Unlike it,
a timeout is retried on a fresh socket (a REQ socket that missed its answer is stuck for
good) with exponential backoff, and every failure is a typed ``HandshakeError``.

``fetch_payloads`` returns raw payload bytes, so the same client serves ``kvwire probe``
(which wants to show a peer it cannot talk to) and the runtime (which decodes with the
local compatibility hash).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import zmq

from kvwire.errors import ConfigError, HandshakeError, HandshakeTimeoutError, WireDecodeError
from kvwire.sidechannel.address import is_ipv6, tcp_endpoint
from kvwire.sidechannel.frames import decode_clock, encode_request, refusal_reason


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


@dataclass(frozen=True)
class RetryPolicy:
    """How long to wait for an answer and how to retry a missing one."""

    timeout: float = 5.0
    retries: int = 2
    backoff: float = 0.1
    backoff_max: float = 2.0

    def __post_init__(self) -> None:
        if self.timeout <= 0 or self.retries < 0 or self.backoff < 0 or self.backoff_max < 0:
            raise ConfigError(f"invalid handshake retry policy: {self}")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based)."""
        return float(min(self.backoff_max, self.backoff * (2 ** (attempt - 1))))


class HandshakeClient:
    """Fetch handshake payloads from listeners; one instance may serve many peers.

    Owns a ZMQ context; ``close`` releases it. Thread-safe in the sense that each call
    uses its own socket.
    """

    def __init__(
        self,
        policy: RetryPolicy | None = None,
        *,
        max_reply_bytes: int = 64 << 20,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.policy = policy or RetryPolicy()
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

        Raises ``HandshakeTimeoutError`` when a rank stays silent through every retry and
        ``HandshakeError`` when the peer refuses or answers with something that is not a
        handshake answer.
        """
        wanted = list(dict.fromkeys(ranks))
        if not wanted:
            raise ConfigError("a handshake needs at least one rank to ask")
        endpoint = tcp_endpoint(host, port)
        replies: dict[tuple[int, int], RankReply] = {}
        attempts = 0
        sock = self._open(endpoint)
        try:
            for pp_rank, tp_rank in wanted:
                for attempt in range(self.policy.retries + 1):
                    if attempt:
                        sock.close(linger=0)
                        self._sleep(self.policy.delay(attempt))
                        sock = self._open(endpoint)
                    attempts += 1
                    reply = self._ask(sock, pp_rank, tp_rank)
                    if reply is not None:
                        replies[(pp_rank, tp_rank)] = self._check(endpoint, reply)
                        break
                else:
                    raise HandshakeTimeoutError(
                        f"no handshake answer from {endpoint} for rank "
                        f"(pp={pp_rank}, tp={tp_rank}) after {self.policy.retries + 1} "
                        f"attempts of {self.policy.timeout:g} s"
                    )
        finally:
            sock.close(linger=0)
        best = min(replies.values(), key=lambda r: r.rtt)
        return PayloadReplies(replies, best.offset, best.rtt, attempts)

    def _open(self, endpoint: str) -> zmq.Socket[bytes]:
        if self._ctx is None:
            raise HandshakeError("handshake client is closed")
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_reply_bytes)
        timeout_ms = max(1, int(self.policy.timeout * 1000))
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
        if is_ipv6(endpoint[len("tcp://") :].rsplit(":", 1)[0]):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
        return sock

    def _ask(self, sock: zmq.Socket[bytes], pp_rank: int, tp_rank: int) -> RankReply | None:
        t_send = self._clock()
        try:
            sock.send(encode_request(pp_rank, tp_rank))
            frames = sock.recv_multipart()
        except zmq.Again:
            return None
        t_recv = self._clock()
        if len(frames) != 2:
            raise HandshakeError(f"handshake answer has {len(frames)} frames, expected 2")
        payload, clock_frame = frames
        reason = refusal_reason(payload)
        if reason is not None:
            raise HandshakeError(
                f"peer refused handshake for rank ({pp_rank}, {tp_rank}): {reason}"
            )
        try:
            remote = decode_clock(clock_frame)
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
