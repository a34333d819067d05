"""The demo's progress bar and its closing summary (a table, or JSON for machines)."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

GIB = 1 << 30


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def counted(counts: Mapping[str, int]) -> str:
    """``"a 3, b 1"`` in name order, or ``"none"``: how every summary lists its tallies."""
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def render(head: str, rows: Sequence[tuple[str, str]]) -> str:
    """A summary as the commands print it: a head line, then aligned ``label  value`` rows."""
    width = max(len(k) for k, _ in rows)
    return "\n".join([head, *(f"  {k:<{width}}  {v}" for k, v in rows)]) + "\n"


class Progress:
    """A one-line bar on stderr, redrawn at most every 1/10 s and when done."""

    def __init__(self, total: int, stream: TextIO | None = None, *, enabled: bool = True) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self._last = -1.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_tenth = -1

    def update(
        self, done: int, failed: int, gib: float, now: float, *, final: bool = False
    ) -> None:
        if not self.enabled:
            return
        if self._tty:
            if not final and now - self._last < 0.1:
                return
        else:  # a log file: one line per tenth, no carriage returns
            tenth = 10 * done // self.total if self.total else 10
            if tenth == self._last_tenth or (tenth == 10 and not final):
                return
            self._last_tenth = tenth
        self._last = now
        width = 30
        filled = int(width * done / self.total) if self.total else width
        bar = "#" * filled + "." * (width - filled)
        line = f"\r  [{bar}] {done}/{self.total} requests  {gib:6.2f} GiB"
        if failed:
            line += f"  {failed} failed"
        if not self._tty:
            line = line.lstrip("\r") + "\n"
        elif final:
            line += "\n"
        self.stream.write(line)
        self.stream.flush()


@dataclass
class Summary:
    model: str
    layers: int
    mode: str
    transport: str
    p_tp: int
    d_tp: int
    tokens: int
    requests: int
    done: int = 0
    failed: int = 0
    bytes_checked: int = 0
    bytes_wrong: int = 0
    wall_s: float = 0.0
    ttkv_s: list[float] = field(default_factory=list)
    memcpy_gbps: float | None = None
    handshakes: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    transfer_gbps: float | None = None

    @property
    def verified(self) -> bool:
        return self.failed == 0 and self.bytes_wrong == 0 and self.done == self.requests

    @property
    def gbps(self) -> float | None:
        return (
            self.bytes_checked / self.wall_s / 1e9 if self.wall_s and self.bytes_checked else None
        )

    def as_dict(self) -> dict[str, Any]:
        p50 = percentile(self.ttkv_s, 50)
        p99 = percentile(self.ttkv_s, 99)
        return {
            "model": self.model,
            "layers": self.layers,
            "mode": self.mode,
            "transport": self.transport,
            "p_tp": self.p_tp,
            "d_tp": self.d_tp,
            "tokens_per_request": self.tokens,
            "requests": self.requests,
            "done": self.done,
            "failed": self.failed,
            "failures": self.failures,
            "bytes_moved": self.bytes_checked,
            "gib_moved": self.bytes_checked / GIB,
            "bytes_wrong": self.bytes_wrong,
            "verified": self.verified,
            "wall_s": self.wall_s,
            "gbps": self.gbps,
            "transfer_gbps": self.transfer_gbps,
            "time_to_kv_p50_ms": None if p50 is None else p50 * 1e3,
            "time_to_kv_p99_ms": None if p99 is None else p99 * 1e3,
            "memcpy_gbps": self.memcpy_gbps,
            "handshakes": self.handshakes,
        }

    def table(self) -> str:
        d = self.as_dict()

        def num(value: float | None, fmt: str, unit: str) -> str:
            return "n/a" if value is None else f"{value:{fmt}} {unit}"

        rows = [
            ("requests", f"{self.requests} ({self.done} done, {self.failed} failed)"),
            ("KV moved", f"{d['gib_moved']:.3f} GiB ({self.tokens} tokens x {self.layers} layers"
                         " per request)"),
            ("throughput", num(d["gbps"], ".2f", "GB/s (wall clock, prefill included)")),
            ("transfer rate", num(d["transfer_gbps"], ".2f", "GB/s (bytes / time each transfer"
                                  " was in flight)")),
            ("time-to-KV p50", num(d["time_to_kv_p50_ms"], ".1f", "ms")),
            ("time-to-KV p99", num(d["time_to_kv_p99_ms"], ".1f", "ms")),
            ("memcpy baseline", num(d["memcpy_gbps"], ".2f", "GB/s (one process, same bytes)")),
            ("handshakes", str(self.handshakes)),
            ("bytes verified", f"{self.bytes_checked - self.bytes_wrong} of {self.bytes_checked}"
                               f" -> {'OK' if self.verified else 'FAILED'}"),
        ]  # fmt: skip
        if self.failures:
            rows.insert(1, ("failures", ", ".join(f"{k}: {v}" for k, v in self.failures.items())))
        head = (
            f"kvwire demo: {self.model} ({self.layers} layers), {self.mode} over "
            f"{self.transport}, P TP={self.p_tp} -> D TP={self.d_tp}"
        )
        return render(head, rows)
