"""Running the demo: the proxy loop between a prefill and a decode engine, and its numbers.

The proxy does what a disaggregated-serving router does: send the prompt to P, take the
``kv_transfer_params`` from P's answer, hand the request and params to D. Up to
``concurrency`` requests are in flight on D at once.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvwire.config import MAX_SECONDS
from kvwire.demo.engines import DecodeEngine, EngineOptions, PrefillEngine, blocks_for
from kvwire.demo.models import CacheSpec, preset
from kvwire.demo.summary import GIB, Progress, Summary
from kvwire.errors import ConfigError

MAX_ENGINE_BYTES = 16 * GIB
"""Most KV memory one demo engine allocates (summed over its ranks)."""


@dataclass(frozen=True)
class DemoOptions:
    model: str = "llama-3-8b"
    layers: int = 8
    tokens: int = 1024
    requests: int = 64
    concurrency: int = 8
    mode: str = "pull"
    transport: str = "shm"
    p_tp: int = 1
    d_tp: int = 1
    lease_s: float = 30.0
    progress: bool = True
    secret: bytes | None = field(default=None, repr=False)
    """Both engines' handshake secret (``--secret-file``); None: plain handshakes."""

    def validate(self) -> None:
        """Every value checked before any process starts (a bad one is a ConfigError)."""
        for flag, value, low, high in (
            ("--tokens", self.tokens, 1, 1 << 20),
            ("--requests", self.requests, 1, 10_000_000),
            ("--concurrency", self.concurrency, 1, 1024),
            ("--layers", self.layers, 1, 1024),
            ("--p-tp", self.p_tp, 1, 64),
            ("--d-tp", self.d_tp, 1, 64),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"{flag} must be an integer from {low} to {high}, got {value!r}")
        if self.mode not in ("pull", "push"):
            raise ConfigError(f"--mode must be pull or push, got {self.mode!r}")
        if not (isinstance(self.lease_s, (int, float)) and 0 < self.lease_s <= MAX_SECONDS):
            raise ConfigError(f"--lease must be a number of seconds in (0, {MAX_SECONDS:g}]")
        for tp in (self.p_tp, self.d_tp):
            spec = CacheSpec(preset(self.model), self.layers, self.num_blocks, 0, tp)
            if spec.total_bytes * tp > MAX_ENGINE_BYTES:
                raise ConfigError(
                    f"the demo would allocate {spec.total_bytes * tp / GIB:.1f} GiB of KV cache "
                    f"per engine (at most {MAX_ENGINE_BYTES / GIB:g}); lower --tokens, "
                    "--concurrency or --layers"
                )

    @property
    def num_blocks(self) -> int:
        """Pool per engine: every in-flight request, twice over, so P never waits on D."""
        return blocks_for(self.tokens) * self.concurrency * 2

    def engine(self, role: str, tp: int, host: str = "127.0.0.1") -> EngineOptions:
        return EngineOptions(
            model=self.model,
            layers=self.layers,
            tp=tp,
            num_blocks=self.num_blocks,
            mode=self.mode,
            transport=self.transport,
            engine_id=f"{role}-{uuid.uuid4().hex[:8]}",
            host=host,
            lease_s=self.lease_s,
            secret=self.secret,
        )


class Prefiller(Protocol):
    def prefill(self, rid: str, index: int, num_tokens: int) -> dict[str, Any]: ...
    def stats(self) -> list[dict[str, Any]]: ...


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """Best single-process copy rate of ``nbytes`` between warm buffers."""
    nbytes = max(nbytes, 1 << 20)
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def request_bytes(options: DemoOptions) -> int:
    """Whole-model KV bytes one request moves (summed over every D rank)."""
    spec = CacheSpec(preset(options.model), options.layers, 1, 0, options.d_tp)
    per_rank = spec.layers * spec.block_len * blocks_for(options.tokens)
    return per_rank * options.d_tp


def drive(
    options: DemoOptions,
    prefill: Prefiller,
    decode: DecodeEngine,
    *,
    on_result: Callable[[Any], None] | None = None,
) -> Summary:
    """Push ``options.requests`` requests through P and D; verify and summarise."""
    summary = Summary(
        model=options.model, layers=options.layers, mode=options.mode,
        transport=options.transport, p_tp=options.p_tp, d_tp=options.d_tp,
        tokens=options.tokens, requests=options.requests,
    )  # fmt: skip
    summary.memcpy_gbps = memcpy_gbps(request_bytes(options))
    progress = Progress(options.requests, enabled=options.progress)
    run_tag = uuid.uuid4().hex[:6]
    t0 = time.perf_counter()

    def take(results: list[Any]) -> None:
        for res in results:
            if res.ok:
                summary.done += 1
            else:
                summary.failed += 1
                for reason in res.reasons:
                    summary.failures[reason] = summary.failures.get(reason, 0) + 1
            summary.bytes_checked += res.checked_bytes
            summary.bytes_wrong += res.wrong_bytes
            if res.ok:  # time to KV is a success's figure; failures are counted above
                summary.ttkv_s.append(res.time_to_kv)
            if on_result is not None:
                on_result(res)
        progress.update(summary.done + summary.failed, summary.failed,
                        summary.bytes_checked / GIB, time.perf_counter())  # fmt: skip

    for index in range(options.requests):
        while decode.inflight >= options.concurrency or not decode.can_take(options.tokens):
            take(decode.poll(1.0))
        rid = f"demo-{run_tag}-{index}"
        params = prefill.prefill(rid, index, options.tokens)
        decode.submit(rid, index, params, options.tokens)
        take(decode.poll(0.0))
    idle_deadline = time.monotonic() + options.lease_s + 30
    while decode.inflight and time.monotonic() < idle_deadline:
        take(decode.poll(1.0))
    summary.wall_s = time.perf_counter() - t0
    summary.failed += decode.inflight  # stuck requests count as failed
    progress.update(summary.done + summary.failed, summary.failed,
                    summary.bytes_checked / GIB, time.perf_counter(), final=True)  # fmt: skip
    _rates(summary, options, prefill, decode)
    return summary


def _rates(
    summary: Summary, options: DemoOptions, prefill: Prefiller, decode: DecodeEngine
) -> None:
    """Transfer rate and handshake count from the ranks that post (D pulls, P pushes)."""
    if options.mode == "pull":
        ranks = [s["metrics"] for s in decode.stats().values()]
    else:
        ranks = [s["metrics"] for s in prefill.stats()]
    nbytes = sum(int(m["bytes"]) for m in ranks)
    seconds = sum(float(m["transfer_s"]) for m in ranks)
    summary.transfer_gbps = nbytes / seconds / 1e9 if nbytes and seconds else None
    summary.handshakes = sum(int(m["handshakes_ok"]) for m in ranks)


def run_local(options: DemoOptions) -> Summary:
    """P and D engines on this host, each with its own rank processes."""
    options.validate()
    prefill = PrefillEngine(options.engine("prefill", options.p_tp))
    decode = DecodeEngine(options.engine("decode", options.d_tp))
    try:
        prefill.start()
        decode.start()
        return drive(options, prefill, decode)
    finally:
        decode.close()
        prefill.close()


def log(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
