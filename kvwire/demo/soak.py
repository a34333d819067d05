"""A real-process soak: the demo's P and D engines for a fixed time, with ranks killed.

The proxy loop of :mod:`kvwire.demo.run` runs for ``seconds``; with chaos on, a rank of P
or D is SIGKILLed at random moments (exponential gaps) and restarted after a short
downtime, as a crashed worker would be. Admission pauses while a rank is down (a real
engine stops scheduling onto a dead worker); requests already in flight end however the
runtime ends them. At the end the soak drains and checks what must hold after any number
of crashes: every delivered byte is right, P holds no block (its leases freed whatever a
dead peer never acknowledged), D got every block back, and no request is stuck.
"""

from __future__ import annotations

import random
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TextIO

from kvwire.demo.engines import DecodeEngine, EngineOptions, PrefillEngine, RequestResult
from kvwire.demo.run import DemoOptions
from kvwire.demo.summary import GIB, counted, render
from kvwire.errors import ConfigError

KILLED = "killed"
"""The reason a request fails on a decode rank that was killed before it reported."""


@dataclass(frozen=True)
class SoakOptions:
    seconds: float = 600.0
    chaos: bool = True
    kill_every_s: float = 6.0
    """Mean gap between two kills (exponentially distributed, at least 1 s)."""
    downtime_s: tuple[float, float] = (0.2, 2.0)
    """A killed rank is restarted after a uniform draw from this range."""
    seed: int = 0
    demo: DemoOptions = field(
        default_factory=lambda: DemoOptions(
            layers=4, tokens=512, concurrency=8, p_tp=2, d_tp=2, lease_s=5.0, progress=False
        )
    )
    report_every_s: float = 10.0

    def validate(self) -> None:
        if not self.seconds > 0:
            raise ConfigError(f"--seconds must be positive, got {self.seconds}")
        if not self.kill_every_s > 0:
            raise ConfigError(f"--kill-every must be positive, got {self.kill_every_s}")
        low, high = self.downtime_s
        if not 0 <= low <= high:
            raise ConfigError(f"downtime range {self.downtime_s} is not 0 <= low <= high")
        self.demo.validate()

    @property
    def drain_s(self) -> float:
        """How long the end may wait for in-flight requests and leases: past one lease."""
        return self.demo.lease_s + 30.0


@dataclass
class SoakSummary:
    seconds: float
    transport: str
    mode: str
    p_tp: int
    d_tp: int
    chaos: bool
    requests: int = 0
    done: int = 0
    failed: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    """Kills injected: ``prefill_kill``, ``decode_kill``."""
    restarts: int = 0
    bytes_verified: int = 0
    bytes_wrong: int = 0
    stuck: int = 0
    prefill_blocks_held: int = 0
    """Blocks P's ranks still hold after the drain (leaked)."""
    prefill_requests_held: int = 0
    decode_blocks_missing: int = 0
    """Blocks D's pool did not get back after the drain (leaked)."""
    freed_reasons: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0
    drain_s: float = 0.0

    @property
    def leaks(self) -> int:
        return self.prefill_blocks_held + self.prefill_requests_held + self.decode_blocks_missing

    @property
    def ok(self) -> bool:
        return self.bytes_wrong == 0 and self.leaks == 0 and self.stuck == 0 and self.done > 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "transport": self.transport,
            "mode": self.mode,
            "p_tp": self.p_tp,
            "d_tp": self.d_tp,
            "chaos": self.chaos,
            "requests": self.requests,
            "done": self.done,
            "failed": self.failed,
            "failures": dict(self.failures),
            "faults_injected": sum(self.faults.values()),
            "faults": dict(self.faults),
            "restarts": self.restarts,
            "bytes_verified": self.bytes_verified,
            "gib_verified": self.bytes_verified / GIB,
            "bytes_wrong": self.bytes_wrong,
            "leaks": self.leaks,
            "prefill_blocks_held": self.prefill_blocks_held,
            "prefill_requests_held": self.prefill_requests_held,
            "decode_blocks_missing": self.decode_blocks_missing,
            "stuck": self.stuck,
            "prefill_freed": dict(self.freed_reasons),
            "wall_s": self.wall_s,
            "drain_s": self.drain_s,
            "ok": self.ok,
        }

    def table(self) -> str:
        failures, faults, freed = map(counted, (self.failures, self.faults, self.freed_reasons))
        rows = [
            ("requests", f"{self.requests} ({self.done} done, {self.failed} failed)"),
            ("failures", failures),
            ("faults injected", f"{sum(self.faults.values())} ({faults}); "
                                f"{self.restarts} restarts"),
            ("bytes verified", f"{self.bytes_verified} ({self.bytes_verified / GIB:.2f} GiB), "
                               f"{self.bytes_wrong} wrong"),
            ("P freed", freed),
            ("leaks", f"{self.leaks} (P blocks held {self.prefill_blocks_held}, P requests "
                      f"held {self.prefill_requests_held}, D blocks missing "
                      f"{self.decode_blocks_missing})"),
            ("stuck", str(self.stuck)),
            ("wall", f"{self.wall_s:.1f} s (drain {self.drain_s:.1f} s)"),
            ("result", "OK" if self.ok else "FAILED"),
        ]  # fmt: skip
        head = (
            f"kvwire soak: {self.seconds:g} s, {self.mode} over {self.transport}, "
            f"P TP={self.p_tp} -> D TP={self.d_tp}, chaos {'on' if self.chaos else 'off'}"
        )
        return render(head, rows)


class ChaosDecodeEngine(DecodeEngine):
    """The demo's decode engine, plus killing and restarting a rank.

    A killed rank's report on every request in flight is "failed" at once: its memory is
    gone, so the engine must recompute those blocks. The request still ends only when
    every surviving rank has reported, because their reads may still be writing into the
    request's blocks; only then do the blocks go back to the pool.
    """

    def __init__(self, options: EngineOptions) -> None:
        super().__init__(options)
        self._down: set[int] = set()
        self._stale_eofs: Counter[int] = Counter()
        self._ready: list[RequestResult] = []

    @property
    def healthy(self) -> bool:
        return not self._down

    def kill_rank(self, rank: int) -> None:
        process = self._ranks[rank]
        process.kill()
        if process._reader is not None:
            process._reader.join(10.0)  # its end-of-stream is queued before any new frame
        self._stale_eofs[rank] += 1
        self._down.add(rank)
        for rid, req in list(self._inflight.items()):
            if rank not in req.reports:
                report = {"rid": rid, "ok": False, "reason": KILLED, "invalid": [req.blocks]}
                result = self._record(rank, report)
                if result is not None:
                    self._ready.append(result)

    def restart_rank(self, rank: int) -> None:
        self._ranks[rank] = self._spawn(rank)
        self._down.discard(rank)
        self._publish()

    def poll(self, timeout: float) -> list[RequestResult]:
        ready, self._ready = self._ready, []
        return ready + super().poll(0.0 if ready else timeout)

    def _on_event(self, rank: int, msg: dict[str, Any] | None) -> RequestResult | None:
        """Skips what a killed rank still sent: its end of stream, and any report it had
        queued before dying (kill_rank already counted it as failed)."""
        if msg is None and self._stale_eofs[rank]:
            self._stale_eofs[rank] -= 1
            return None
        if msg is not None and msg.get("event") == "finished" and rank in self._down:
            return None
        return super()._on_event(rank, msg)

    def blocks_missing(self) -> int:
        return self._pool.capacity - self._pool.free


class _Chaos:
    """When to kill which rank, and when to bring it back (deterministic per seed)."""

    def __init__(self, options: SoakOptions, start: float) -> None:
        self._rng = random.Random(options.seed)
        self._options = options
        self.next_kill = start + self._gap()
        self.down: tuple[str, int] | None = None
        self.restart_at = 0.0

    def _gap(self) -> float:
        return max(1.0, self._rng.expovariate(1.0 / self._options.kill_every_s))

    def victim(self) -> tuple[str, int]:
        demo = self._options.demo
        role = self._rng.choice(("prefill", "decode"))
        return role, self._rng.randrange(demo.p_tp if role == "prefill" else demo.d_tp)

    def downtime(self) -> float:
        return self._rng.uniform(*self._options.downtime_s)

    def rearm(self, now: float) -> None:
        self.next_kill = now + self._gap()


def _emit(stream: TextIO, text: str) -> None:
    stream.write(text + "\n")
    stream.flush()


def soak(options: SoakOptions, *, stream: TextIO | None = None) -> SoakSummary:
    """Run the soak and return its summary (progress lines go to ``stream``)."""
    options.validate()
    out = stream if stream is not None else sys.stderr
    demo = options.demo
    summary = SoakSummary(
        seconds=options.seconds, transport=demo.transport, mode=demo.mode,
        p_tp=demo.p_tp, d_tp=demo.d_tp, chaos=options.chaos,
    )  # fmt: skip
    prefill = PrefillEngine(demo.engine("prefill", demo.p_tp))
    decode = ChaosDecodeEngine(demo.engine("decode", demo.d_tp))
    try:
        prefill.start()
        decode.start()
        _run(options, prefill, decode, summary, out)
    finally:
        decode.close()
        prefill.close()
    return summary


def _run(
    options: SoakOptions,
    prefill: PrefillEngine,
    decode: ChaosDecodeEngine,
    summary: SoakSummary,
    out: TextIO,
) -> None:
    demo = options.demo
    tag = uuid.uuid4().hex[:6]
    t0 = time.monotonic()
    end = t0 + options.seconds
    chaos = _Chaos(options, t0) if options.chaos else None
    next_report = t0 + options.report_every_s

    def take(results: list[RequestResult]) -> None:
        for res in results:
            if res.ok:
                summary.done += 1
            else:
                summary.failed += 1
                summary.failures.update(res.reasons)
            summary.bytes_verified += res.checked_bytes - res.wrong_bytes
            summary.bytes_wrong += res.wrong_bytes

    while (now := time.monotonic()) < end:
        if chaos is not None:
            _inject(chaos, prefill, decode, summary, now, out)
        if now >= next_report:
            next_report = now + options.report_every_s
            _emit(out, _progress_line(summary, now - t0, decode.inflight))
        admit = (chaos is None or chaos.down is None) and decode.healthy
        if not admit or decode.inflight >= demo.concurrency or not decode.can_take(demo.tokens):
            take(decode.poll(0.05))
            continue
        index = summary.requests
        rid = f"soak-{tag}-{index}"
        params = prefill.prefill(rid, index, demo.tokens)
        summary.requests += 1
        decode.submit(rid, index, params, demo.tokens)
        take(decode.poll(0.0))

    if chaos is not None and chaos.down is not None:
        _restart(chaos.down, prefill, decode, summary, out)
    _drain(options, prefill, decode, summary, take)
    summary.wall_s = time.monotonic() - t0
    _emit(out, _progress_line(summary, summary.wall_s, decode.inflight) + " (drained)")


def _inject(
    chaos: _Chaos,
    prefill: PrefillEngine,
    decode: ChaosDecodeEngine,
    summary: SoakSummary,
    now: float,
    out: TextIO,
) -> None:
    if chaos.down is not None:
        if now >= chaos.restart_at:
            _restart(chaos.down, prefill, decode, summary, out)
            chaos.down = None
            chaos.rearm(now)
        return
    if now < chaos.next_kill:
        return
    role, rank = chaos.victim()
    if role == "prefill":
        prefill.kill_rank(rank)
    else:
        decode.kill_rank(rank)
    summary.faults[f"{role}_kill"] += 1
    chaos.down = (role, rank)
    chaos.restart_at = now + chaos.downtime()
    _emit(out, f"  kill {role} rank {rank} (in flight on D: {decode.inflight})")


def _restart(
    victim: tuple[str, int],
    prefill: PrefillEngine,
    decode: ChaosDecodeEngine,
    summary: SoakSummary,
    out: TextIO,
) -> None:
    role, rank = victim
    if role == "prefill":
        prefill.restart_rank(rank)
    else:
        decode.restart_rank(rank)
    summary.restarts += 1
    _emit(out, f"  restarted {role} rank {rank}")


def _drain(
    options: SoakOptions,
    prefill: PrefillEngine,
    decode: ChaosDecodeEngine,
    summary: SoakSummary,
    take: Any,
) -> None:
    """Wait (bounded) for every request in flight and every held block, then count leaks."""
    start = time.monotonic()
    deadline = start + options.drain_s
    while decode.inflight and time.monotonic() < deadline:
        take(decode.poll(0.5))
    summary.stuck = decode.inflight
    while prefill.held_requests() and time.monotonic() < deadline:
        prefill.reclaim()
        time.sleep(0.1)  # the ranks' leases run on their own clocks; ask again shortly
    summary.drain_s = time.monotonic() - start
    summary.prefill_requests_held = prefill.held_requests()
    summary.prefill_blocks_held = sum(int(rank["held"]) for rank in prefill.stats())
    summary.decode_blocks_missing = decode.blocks_missing()
    summary.freed_reasons.update(prefill.freed_reasons)


def _progress_line(summary: SoakSummary, elapsed: float, inflight: int) -> str:
    kills = sum(summary.faults.values())
    failed = f"{summary.failed} failed"
    if summary.failures:
        failed += " (" + ", ".join(f"{k} {v}" for k, v in sorted(summary.failures.items())) + ")"
    return (
        f"[{elapsed:7.1f} s] {summary.requests} requests: {summary.done} done, {failed}, "
        f"{inflight} in flight; {kills} kills; {summary.bytes_verified / GIB:.2f} GiB verified"
    )
