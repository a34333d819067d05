"""Transfer metrics: per request and in aggregate, as plain Python or Prometheus text.

The driver records as it goes, under the metrics' own lock. A reader holds that lock only
to copy the counters and the list of ended records (nothing changes a record once it has
ended) and turns them into dicts after letting go, so :meth:`Metrics.snapshot` does not
hold up recording for the time thousands of records take to convert, and a Prometheus
scrape reads the counters alone. Prometheus is optional: :meth:`Metrics.prometheus_text`
renders the exposition format with no dependency, and
:func:`kvwire.runtime.prometheus.register` plugs a collector into ``prometheus_client``
when that package is installed.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class RequestMetrics:
    """One request's transfer, as this rank saw it."""

    request_id: str
    role: str
    started: float
    first_post: float | None = None
    ended: float | None = None
    bytes: int = 0
    descriptors: int = 0
    transfers: int = 0
    post_s: float = 0.0
    """Time spent planning descriptors and posting (the caller-visible cost)."""
    outcome: str = "pending"
    reason: str = ""

    @property
    def transfer_s(self) -> float | None:
        """From the first post to the end of the request."""
        if self.first_post is None or self.ended is None:
            return None
        return self.ended - self.first_post

    @property
    def total_s(self) -> float | None:
        return None if self.ended is None else self.ended - self.started

    @property
    def gbps(self) -> float | None:
        span = self.transfer_s
        if not span or not self.bytes:
            return None
        return self.bytes / span / 1e9

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(transfer_s=self.transfer_s, total_s=self.total_s, gbps=self.gbps)
        return out


HANDSHAKE_FAILURE_KINDS = ("unreachable", "timeout", "incompatible", "transport", "error")
"""Why a handshake failed: the peer refused the connection or does not resolve, it did not
answer in time, its factors or geometry differ, the transport refused its metadata, or
anything else (a refusal, an undecodable answer)."""


@dataclass
class _Totals:
    bytes: int = 0
    descriptors: int = 0
    transfers_done: int = 0
    transfers_failed: int = 0
    post_s: float = 0.0
    transfer_s: float = 0.0
    requests_done: int = 0
    requests_failed: int = 0
    leases_expired: int = 0
    handshakes_ok: int = 0
    handshakes_failed: int = 0
    handshake_s: float = 0.0
    notifications_sent: int = 0
    notifications_received: int = 0
    notifications_dropped: int = 0
    peer_misbehaved: int = 0
    peers_lost: int = 0
    lease_queries: int = 0
    """Lease queries answered by a producer (``lease-query``; kvwire producers only)."""
    lease_queries_failed: int = 0
    lease_queries_skipped: int = 0
    """Not sent: one to the engine still out, or an authenticated side channel."""
    store_handshakes: int = 0
    """Handshakes served from the metadata store's cache (no ZMQ round trip)."""
    store_fallbacks: int = 0
    """Handshakes that went over ZMQ although a store is configured (unreachable, or the
    peer is not published)."""
    store_peers_dropped: int = 0
    """Peer engines whose agents were dropped because the store showed a restart or loss."""
    tables_prepared: int = 0
    """Peer ranks whose descriptor tables the transport prepared (requests made by index)."""
    tables_not_prepared: int = 0
    """... and those it refused to prepare (their requests post rows as usual)."""
    failures: dict[str, int] = field(default_factory=dict)
    """Failed requests by reason (``RequestFailure.reason``): each request counted once."""
    handshake_failures: dict[str, int] = field(default_factory=dict)
    """Failed handshakes by kind (``HANDSHAKE_FAILURE_KINDS``); not requests."""
    freed: dict[str, int] = field(default_factory=dict)


class Metrics:
    """Counters and recent per-request records of one Producer or Consumer."""

    def __init__(self, role: str, *, keep_requests: int = 10_000) -> None:
        self.role = role
        self._lock = threading.Lock()
        self._totals = _Totals()
        self._live: dict[str, RequestMetrics] = {}
        self._recent: collections.deque[RequestMetrics] = collections.deque(maxlen=keep_requests)
        self._first_post: float | None = None
        self._last_end: float | None = None

    # -- recording (driver side) ---------------------------------------------------------

    def request_started(self, request_id: str, now: float) -> None:
        with self._lock:
            if request_id not in self._live:
                self._live[request_id] = RequestMetrics(request_id, self.role, now)

    def transfer_posted(
        self, request_id: str, now: float, nbytes: int, ndescs: int, post_s: float
    ) -> None:
        with self._lock:
            rec = self._live.get(request_id)
            if rec is None:
                rec = self._live[request_id] = RequestMetrics(request_id, self.role, now)
            if rec.first_post is None:
                rec.first_post = now
            if self._first_post is None:
                self._first_post = now
            rec.bytes += nbytes
            rec.descriptors += ndescs
            rec.transfers += 1
            rec.post_s += post_s
            self._totals.post_s += post_s

    def transfer_ended(self, nbytes: int, ndescs: int, seconds: float, ok: bool) -> None:
        with self._lock:
            t = self._totals
            if ok:
                t.transfers_done += 1
                t.bytes += nbytes
                t.descriptors += ndescs
                t.transfer_s += seconds
            else:
                t.transfers_failed += 1

    def request_ended(self, request_id: str, now: float, outcome: str, reason: str = "") -> None:
        """``outcome``: ``done``/``failed`` (consumer) or ``freed`` (producer, reason why)."""
        with self._lock:
            rec = self._live.pop(request_id, None)
            if rec is None:
                rec = RequestMetrics(request_id, self.role, now)
            rec.ended = now
            rec.outcome = outcome
            rec.reason = reason
            self._recent.append(rec)
            self._last_end = now
            t = self._totals
            if outcome == "done":
                t.requests_done += 1
            elif outcome == "failed":
                t.requests_failed += 1
                t.failures[reason] = t.failures.get(reason, 0) + 1
            else:
                t.freed[reason] = t.freed.get(reason, 0) + 1
                if reason == "expired":
                    t.leases_expired += 1

    def handshake(self, ok: bool, seconds: float, kind: str = "") -> None:
        with self._lock:
            t = self._totals
            if ok:
                t.handshakes_ok += 1
                t.handshake_s += seconds
            else:
                t.handshakes_failed += 1
                key = kind if kind in HANDSHAKE_FAILURE_KINDS else "error"
                t.handshake_failures[key] = t.handshake_failures.get(key, 0) + 1

    def count(self, name: str, n: int = 1) -> None:
        """Bump one of the plain counters (``notifications_sent``, ``peers_lost``...)."""
        with self._lock:
            setattr(self._totals, name, getattr(self._totals, name) + n)

    # -- reading -----------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Every counter and the recent requests, as plain Python values."""
        with self._lock:
            totals = self._totals_locked()
            ended = list(self._recent)
            live = len(self._live)
        recent = [r.as_dict() for r in ended]
        return {"role": self.role, "totals": totals, "live_requests": live, "requests": recent}

    def _totals_locked(self) -> dict[str, Any]:
        """The counters alone (a scrape needs no per-request records); hold ``_lock``."""
        totals = asdict(self._totals)
        span = (
            self._last_end - self._first_post
            if self._first_post is not None and self._last_end is not None
            else None
        )
        totals["gbps"] = totals["bytes"] / span / 1e9 if span and totals["bytes"] else None
        totals["busy_s"] = span
        return totals

    def request(self, request_id: str) -> RequestMetrics | None:
        """The record of a request (live or recent)."""
        with self._lock:
            rec = self._live.get(request_id)
            if rec is not None:
                return rec
            for old in reversed(self._recent):
                if old.request_id == request_id:
                    return old
        return None

    def prometheus_text(self, prefix: str = "kvwire") -> str:
        """The counters in Prometheus' text exposition format (no dependency needed)."""
        return prometheus_text([self], prefix)

    def prometheus_families(
        self, prefix: str = "kvwire"
    ) -> list[tuple[str, str, str, list[tuple[str, dict[str, str], float]]]]:
        """``(name, type, help, [(suffix, labels, value)])`` for every metric family."""
        with self._lock:
            snap = self._totals_locked()
        role = {"role": self.role}
        fam: list[tuple[str, str, str, list[tuple[str, dict[str, str], float]]]] = [
            (f"{prefix}_transferred_bytes", "counter", "Bytes moved by completed transfers.",
             [("_total", role, snap["bytes"])]),
            (f"{prefix}_descriptors", "counter", "Descriptors of completed transfers.",
             [("_total", role, snap["descriptors"])]),
            (f"{prefix}_transfers", "counter", "Transfers that ended, by outcome.",
             [("_total", {**role, "outcome": "done"}, snap["transfers_done"]),
              ("_total", {**role, "outcome": "failed"}, snap["transfers_failed"])]),
            (f"{prefix}_transfer_seconds", "counter", "Time completed transfers were in flight.",
             [("_total", role, snap["transfer_s"])]),
            (f"{prefix}_post_seconds", "counter", "Time spent planning and posting transfers.",
             [("_total", role, snap["post_s"])]),
            (f"{prefix}_requests", "counter", "Requests that ended, by outcome.",
             [("_total", {**role, "outcome": "done"}, snap["requests_done"]),
              ("_total", {**role, "outcome": "failed"}, snap["requests_failed"])]),
            (f"{prefix}_failures", "counter", "Failed requests, by reason.",
             [("_total", {**role, "kind": k}, v) for k, v in sorted(snap["failures"].items())]),
            (f"{prefix}_leases_expired", "counter", "Producer leases that ran out.",
             [("_total", role, snap["leases_expired"])]),
            (f"{prefix}_handshakes", "counter", "Side-channel handshakes, by outcome.",
             [("_total", {**role, "outcome": "ok"}, snap["handshakes_ok"]),
              ("_total", {**role, "outcome": "failed"}, snap["handshakes_failed"])]),
            (f"{prefix}_handshake_failures", "counter", "Failed handshakes, by kind.",
             [("_total", {**role, "kind": k}, v)
              for k, v in sorted(snap["handshake_failures"].items())]),
            (f"{prefix}_notifications", "counter", "Notifications, by direction.",
             [("_total", {**role, "direction": "sent"}, snap["notifications_sent"]),
              ("_total", {**role, "direction": "received"}, snap["notifications_received"])]),
            (f"{prefix}_store_handshakes", "counter",
             "Handshakes with a metadata store configured, by where the metadata came from.",
             [("_total", {**role, "source": "store"}, snap["store_handshakes"]),
              ("_total", {**role, "source": "zmq"}, snap["store_fallbacks"])]),
            (f"{prefix}_store_peers_dropped", "counter",
             "Peer engines dropped because the metadata store showed a restart or a loss.",
             [("_total", role, snap["store_peers_dropped"])]),
            (f"{prefix}_prepared_tables", "counter",
             "Peer ranks' descriptor tables handed to the transport, by outcome.",
             [("_total", {**role, "outcome": "prepared"}, snap["tables_prepared"]),
              ("_total", {**role, "outcome": "refused"}, snap["tables_not_prepared"])]),
        ]  # fmt: skip
        return fam


def combined_totals(metrics: Sequence[Metrics]) -> dict[str, Any]:
    """One rank's counters over the runtimes it runs (a producer and a consumer, vLLM's
    ``kv_both``): every counter summed, and the rate and busy span of the runtime that
    moved the most bytes. Only one side moves bytes in a mode, and rates do not add."""
    totals = [one.snapshot()["totals"] for one in metrics]
    if not totals:
        raise ValueError("combined_totals needs at least one Metrics")
    out = dict(max(totals, key=lambda t: int(t["bytes"])))
    for counter in fields(_Totals):
        values = [t[counter.name] for t in totals]
        if isinstance(values[0], dict):
            keys = set().union(*values)
            out[counter.name] = {k: sum(v.get(k, 0) for v in values) for k in sorted(keys)}
        else:
            out[counter.name] = sum(values)
    return out


def prometheus_text(metrics: Sequence[Metrics], prefix: str = "kvwire") -> str:
    """Several runtimes' counters as one exposition (a rank that runs a producer and a
    consumer serves both, each sample labelled with its role): each family once."""
    families: dict[str, tuple[str, str, list[tuple[str, dict[str, str], float]]]] = {}
    for one in metrics:
        for name, kind, help_text, samples in one.prometheus_families(prefix):
            families.setdefault(name, (kind, help_text, []))[2].extend(samples)
    lines: list[str] = []
    for name, (kind, help_text, samples) in families.items():
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for suffix, labels, value in samples:
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            label_part = f"{{{label_text}}}" if label_text else ""
            lines.append(f"{name}{suffix}{label_part} {float(value)!r}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
