"""What the handshake listener lets one peer, and all peers together, cost it.

Two kinds of limit. The connection limits bound what one TCP connection can make the
listener hold or wait for (``kvwire.sidechannel.server``): the largest frame and message,
the answers queued for it, the time to finish the ZMTP greeting, a message, or to do
anything at all, and how many connections there may be. The rate limits are token buckets
in front of the request handling: one per peer *address* and one for everything, so a
flood is answered with cheap refusals instead of work.

Buckets are keyed by the peer's IP address, not by its ZMQ routing identity: a ROUTER gives
every connection a fresh identity, so a limit per identity is a limit per connection, and a
flooder would only have to reconnect.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from kvwire.errors import ConfigError


@dataclass(frozen=True)
class RateLimit:
    """``rate`` requests per second on average, up to ``burst`` at once."""

    rate: float
    burst: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ConfigError(f"rate limit rate must be positive, got {self.rate!r}")
        if not (math.isfinite(self.burst) and self.burst >= 1):
            raise ConfigError(f"rate limit burst must be >= 1, got {self.burst!r}")


@dataclass(frozen=True)
class ListenerLimits:
    """Every bound the listener enforces; the defaults never touch a real engine's traffic.

    A real decode engine asks one listener for a handful of ranks when it first meets a
    prefill engine (a few requests per rank pair, twice that with authentication), so the
    per-peer default of 500 requests/s (burst 1,000) only ever stops a flood.
    """

    max_request_bytes: int = 1024
    """Largest frame of a request; a connection that sends a larger one is closed."""
    max_message_frames: int = 16
    """Frames of one message (a REQ request has two: the delimiter and the request)."""
    handshake_timeout_s: float = 5.0
    """A connection must finish the ZMTP greeting and READY within this. Reaps half-open
    connections and clients that trickle their greeting; a real client needs milliseconds."""
    message_timeout_s: float = 10.0
    """A message whose first byte has arrived must be complete within this (slow clients)."""
    idle_timeout_s: float = 60.0
    """A connection with nothing in flight is closed after this long. Handshake clients
    open a connection for one handshake; a REQ socket reconnects by itself if it needs to."""
    queued_per_peer: int = 16
    """Answers a connection may leave untaken before we stop reading from it. A REQ client
    has one request in flight; a DEALER that pipelines and never reads stalls only itself."""
    max_connections: int = 4096
    """Open connections in all. At the cap the oldest connection still in its greeting is
    closed to make room, so half-open floods cannot lock out real clients."""
    max_connections_per_peer: int = 512
    """Open connections from one address."""
    backlog: int = 4096
    """Pending TCP connections (listen(2) backlog, capped by the kernel's somaxconn). A
    small backlog overflows under a connection burst, and every SYN dropped then costs a
    legitimate client a one-second retransmit."""
    per_peer: RateLimit | None = field(default_factory=lambda: RateLimit(500.0, 1000.0))
    """Requests per peer IP address; None: unlimited."""
    total: RateLimit | None = field(default_factory=lambda: RateLimit(5000.0, 10000.0))
    """Requests from everyone together; None: unlimited."""
    max_tracked_peers: int = 4096
    """Peer buckets kept; the least recently seen is forgotten first."""

    def __post_init__(self) -> None:
        if self.max_request_bytes < 64:
            raise ConfigError("max_request_bytes below 64 cannot hold a handshake request")
        for name in ("handshake_timeout_s", "message_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be positive, got {value!r}")
        counts = ("max_message_frames", "queued_per_peer", "max_connections", "backlog",
                  "max_connections_per_peer", "max_tracked_peers")  # fmt: skip
        for name in counts:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")

    @classmethod
    def unlimited_rate(cls, **overrides: object) -> ListenerLimits:
        """These limits without either rate limit (tests and benchmarks)."""
        return cls(per_peer=None, total=None, **overrides)  # type: ignore[arg-type]


class TokenBucket:
    """Refills at ``limit.rate`` per second up to ``limit.burst``; each request takes one."""

    __slots__ = ("_burst", "_rate", "_stamp", "_tokens")

    def __init__(self, limit: RateLimit, now: float) -> None:
        self._rate = limit.rate
        self._burst = limit.burst
        self._tokens = limit.burst
        self._stamp = now

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self._stamp)
        self._tokens = min(self._burst, self._tokens + elapsed * self._rate)
        self._stamp = now

    def has_token(self, now: float) -> bool:
        self._refill(now)
        return self._tokens >= 1.0

    def take(self, now: float) -> bool:
        self._refill(now)
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


class RequestLimiter:
    """The per-peer and overall buckets; ``admit`` says whether a request gets served.

    Only the thread that owns the listener's socket calls it, so it takes no lock.
    """

    def __init__(self, limits: ListenerLimits) -> None:
        self._per_peer = limits.per_peer
        self._total_limit = limits.total
        self._total: TokenBucket | None = None
        self._max_peers = limits.max_tracked_peers
        self._peers: OrderedDict[str, TokenBucket] = OrderedDict()

    def admit(self, peer: str, now: float) -> bool:
        """Take a token from the peer's bucket and the overall one, or from neither.

        The peer's bucket is checked first so that a flooding peer, once refused, stops
        draining the overall budget that every other peer shares.
        """
        bucket = self._peer_bucket(peer, now)
        if bucket is not None and not bucket.has_token(now):
            return False
        if self._total_limit is not None:
            if self._total is None:
                self._total = TokenBucket(self._total_limit, now)
            if not self._total.take(now):
                return False
        if bucket is not None:
            bucket.take(now)
        return True

    def _peer_bucket(self, peer: str, now: float) -> TokenBucket | None:
        if self._per_peer is None:
            return None
        bucket = self._peers.get(peer)
        if bucket is None:
            if len(self._peers) >= self._max_peers:
                self._peers.popitem(last=False)
            bucket = self._peers[peer] = TokenBucket(self._per_peer, now)
        else:
            self._peers.move_to_end(peer)
        return bucket
