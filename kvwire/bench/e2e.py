"""``kvwire bench e2e``: time-to-KV of one request through the real runtime, beside memcpy.

A prefill process (:mod:`kvwire.bench.e2e_peer`, a kvwire ``Producer``) and this process
(a ``Consumer``) hold Llama-3-8B caches — 32 layers, 8 KV heads of 128, bf16, 16-token
blocks: 128 KiB per token, 64 KiB per block and layer — in plain memory, as an engine's
own tensors (the shm transport reaches it with ``process_vm_readv``), and move one request
at a time in pull mode:

    P: prefill_finished -> params -> D: add_request -> READ -> D: get_finished lists it

*Time-to-KV* runs from just before P's ``prefill_finished`` to the moment D's engine
thread wakes with the request done (both clocks are ``perf_counter``, CLOCK_MONOTONIC,
shared by the processes of one host). It includes the hop of the params from P to D over a
pipe (the proxy's part) but not the one-time handshake: every prompt length is warmed up
first. Block ids are drawn at random on both sides, as in a long-running engine's
fragmented cache, so almost nothing coalesces and the copy is one 64 KiB span per block
and layer. D checks a marker byte at both ends of every block it received.

The baseline, sampled between the requests: a numpy copy of the same number of bytes in
this process from warm memory to warm memory, in chunks of at most 512 MiB.

Results: ``e2e.ttkv_<n>.ms`` and ``e2e.ttkv_<n>.ratio_vs_memcpy`` (kvwire's time over
memcpy's: *smaller* is better, target <= 1.5 at 4k) per prompt length, plus the 4k
request's breakdown ``e2e.ttkv_4k.<part>_ms`` (see :func:`_breakdown`). The same run
with both caches in the shm transport's peer-mappable segments (``kvwire_shm.allocate``,
copied with ``memmove`` through a mapping) is reported as ``e2e.segment.*``; and with
glibc tuned to bypass the cache from 64 KiB up as ``e2e.glibc_nt.*``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvwire.bench.e2e_peer import marker
from kvwire.bench.report import Report, Result
from kvwire.config import KVWireConfig
from kvwire.demo.engines import blocks_for
from kvwire.demo.models import BLOCK_TOKENS, CacheSpec, preset
from kvwire.demo.worker import allocate
from kvwire.errors import KVWireError, TransportError
from kvwire.framing import FrameWriter, close_pipes, read_frame, spawn, wait_or_kill
from kvwire.runtime import Consumer

MODEL = "llama-3-8b"
TRANSPORT = "shm"
HEADLINE = 4096
PROMPTS_FULL = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
PROMPTS_QUICK = (128, 512, 1024, 2048, 4096)
MEMCPY_CHUNK = 512 << 20
MEMORY = ("plain", "segment")
"""Where both engines keep their caches: plain memory (``np.empty``, as an engine's own
tensors; the headline), or the shm transport's peer-mappable segments."""
NT_TUNABLE = "glibc.cpu.x86_non_temporal_threshold=0x10000"
"""Lets glibc's memmove bypass the cache from 64 KiB up (see the module docstring)."""


class BenchPeerError(KVWireError):
    """The bench's prefill process failed or answered with an error."""


def label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


class _Prefill:
    """The prefill process, request/answer over its stdin/stdout."""

    def __init__(self, init: dict[str, Any]) -> None:
        self.proc = spawn("kvwire.bench.e2e_peer")
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._out = FrameWriter(self.proc.stdin)
        self._in = self.proc.stdout
        self.port = int(self.call(init)["port"])

    def call(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            self._out.send(message)
        except OSError as exc:
            raise BenchPeerError(f"bench prefill process is gone: {exc}") from None
        answer = read_frame(self._in)
        if answer is None:
            raise BenchPeerError(f"bench prefill process exited ({self.proc.poll()})")
        if not answer.get("ok"):
            raise BenchPeerError(f"bench prefill process: {answer.get('error')}")
        return answer

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._out.send({"op": "exit"})
        wait_or_kill(self.proc, 30)
        close_pipes(self.proc)


@dataclass
class Sample:
    """One request's timestamps (perf_counter seconds) and what the runtime recorded."""

    ttkv: float
    prefill_call: float
    hop: float
    add_request: float
    post: float
    in_flight: float
    wake: float
    memcpy: float
    block_copy: float | None = None
    """The headline only: one memmove per 64 KiB block of the same blocks, same process."""


@dataclass
class _Bench:
    spec: CacheSpec
    buffer: npt.NDArray[np.uint8]
    consumer: Consumer
    prefill: _Prefill
    scratch: npt.NDArray[np.uint8]
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(7))
    serial: int = 0

    def memcpy(self, nbytes: int) -> float:
        """Seconds to copy ``nbytes`` of warm memory (the D cache) into warm scratch."""
        t0 = time.perf_counter()
        done = 0
        while done < nbytes:
            n = min(nbytes - done, self.scratch.shape[0])
            np.copyto(self.scratch[:n], self.buffer[done : done + n])
            done += n
        return time.perf_counter() - t0

    def block_copy(self, d_blocks: npt.NDArray[np.int64]) -> float:
        """Seconds to copy the request's blocks out of the D cache one memmove per block
        (in C, no interpreter per block) into shuffled 64 KiB slots of the scratch buffer:
        the floor of any block-by-block copy of this request on this machine."""
        spec = self.spec
        base = int(self.buffer.ctypes.data)
        src = (
            np.arange(spec.layers)[:, None] * spec.region_bytes + d_blocks[None, :] * spec.block_len
        )
        src = src.reshape(-1) + base
        slots = self.rng.permutation(self.scratch.shape[0] // spec.block_len)[: src.shape[0]]
        dst = slots.astype(np.int64) * spec.block_len + int(self.scratch.ctypes.data)
        n = src.shape[0]
        d, s, ln = dst.tolist(), src.tolist(), [spec.block_len] * n
        t0 = time.perf_counter()
        collections.deque(map(ctypes.memmove, d, s, ln), maxlen=0)
        return time.perf_counter() - t0

    def request(self, tokens: int, *, contiguous: bool = False) -> Sample:
        """Move one request of ``tokens`` tokens; check every block's markers.

        Block ids are random on both sides, or with ``contiguous`` the first ones in order
        (a fresh engine's allocation: every layer's blocks coalesce into one span).
        """
        nblocks = blocks_for(tokens)
        total = self.spec.num_blocks
        if contiguous:
            p_blocks = d_blocks = np.arange(nblocks, dtype=np.int64)
        else:
            p_blocks = self.rng.permutation(total)[:nblocks].astype(np.int64)
            d_blocks = self.rng.permutation(total)[:nblocks].astype(np.int64)
        view = self.buffer.reshape(self.spec.layers, total, self.spec.block_len)
        view[:, d_blocks, 0] = 0
        view[:, d_blocks, -1] = 0
        self.serial += 1
        rid = f"e2e-{tokens}-{self.serial}"
        answer = self.prefill.call(
            {"op": "prefill", "rid": rid, "blocks": p_blocks.tolist(), "num_tokens": tokens}
        )
        t_recv = time.perf_counter()
        self.consumer.add_request(rid, answer["params"], [d_blocks.tolist()])
        t_added = time.perf_counter()
        deadline = time.monotonic() + 120
        while True:
            self.consumer.wait_finished(1.0)
            fin = self.consumer.get_finished()
            if rid in fin.done or rid in fin.failed:
                break
            if time.monotonic() > deadline:
                raise TransportError(f"e2e request {rid} did not finish in 120 s")
        t_done = time.perf_counter()
        if rid in fin.failed:
            failure = fin.failed[rid]
            raise TransportError(f"e2e request {rid} failed: {failure.reason} {failure.detail}")
        want = marker(self.spec.layers, p_blocks)
        if not (
            np.array_equal(view[:, d_blocks, 0], want)
            and np.array_equal(view[:, d_blocks, -1], want)
        ):
            raise TransportError(f"e2e request {rid}: wrong bytes landed")
        rec = self.consumer.metrics.request(rid)
        assert rec is not None and rec.first_post is not None and rec.ended is not None
        nbytes = nblocks * self.spec.layers * self.spec.block_len
        return Sample(
            ttkv=t_done - answer["t_start"],
            prefill_call=answer["t_return"] - answer["t_start"],
            hop=t_recv - answer["t_return"],
            add_request=t_added - t_recv,
            post=rec.post_s,
            in_flight=rec.ended - rec.first_post,
            wake=t_done - rec.ended,
            memcpy=self.memcpy(nbytes),
            block_copy=self.block_copy(d_blocks) if nbytes <= self.scratch.shape[0] else None,
        )


def _spec(max_tokens: int) -> CacheSpec:
    model = preset(MODEL)
    return CacheSpec(model, model.num_layers, blocks_for(max_tokens), 0, 1)


@contextlib.contextmanager
def _bench(max_tokens: int, memory: str) -> Iterator[_Bench]:
    """Both engines with caches for ``max_tokens`` tokens in ``memory`` (see MEMORY), the
    handshake done."""
    spec = _spec(max_tokens)
    engine_id = f"bench-prefill-{uuid.uuid4().hex[:6]}"
    init = {"model": MODEL, "layers": spec.layers, "num_blocks": spec.num_blocks,
            "transport": TRANSPORT, "engine_id": engine_id, "memory": memory}  # fmt: skip
    buffer = allocate(TRANSPORT, spec.total_bytes, own=memory == "segment")
    scratch = np.ones(min(spec.total_bytes, MEMCPY_CHUNK), dtype=np.uint8)
    prefill = _Prefill(init)
    consumer: Consumer | None = None
    try:
        consumer = Consumer(
            KVWireConfig(engine_id="bench-decode", compat=spec.compat("pull")), TRANSPORT
        )
        consumer.register_kv_caches(spec.geometry(int(buffer.ctypes.data)))
        bench = _Bench(spec, buffer, consumer, prefill, scratch)
        bench.request(BLOCK_TOKENS)  # the one-time handshake
        bench.request(max_tokens)  # fault in every page of D's mapping of P's cache
        yield bench
    finally:
        if consumer is not None:
            consumer.close()
        prefill.close()


def _med(values: list[float]) -> float:
    return statistics.median(values)


def _breakdown(report: Report, prefix: str, samples: list[Sample]) -> None:
    """Where the headline request's time goes, median per part (milliseconds).

    ``prefill_call``: P's ``prefill_finished`` (machine + params). ``hop``: the params from
    P to D over a pipe (the proxy). ``add_request``: D's call, which parses the params,
    builds the descriptors and posts the READ, and returns when this thread gets the GIL
    back from the transport's copy; ``post`` is the runtime's own record of the descriptor
    build plus the transport's ``read``. ``in_flight``: from the post to the runtime
    seeing the transfer done (the copy, the completion notification to P, the driver's
    wake-up). ``wake``: from there to the engine thread returning from
    ``wait_finished``. ``block_copy``: not part of time-to-KV — the same blocks copied in
    this process with one memmove each, the floor of any block-by-block copy.
    """
    for part in ("prefill_call", "hop", "add_request", "post", "in_flight", "wake", "block_copy"):
        values = [v * 1e3 for s in samples if (v := getattr(s, part)) is not None]
        if values:
            report.add(
                Result(
                    f"{prefix}.ttkv_4k.{part}_ms", _med(values), "ms",
                    min=min(values), max=max(values),
                )
            )  # fmt: skip


CONTIGUOUS = "contiguous"
"""Key of the headline's samples with in-order blocks (random blocks are keyed by length)."""


def measure(quick: bool, memory: str = "plain") -> dict[str, list[Sample]]:
    """Samples per prompt length (and the headline with contiguous blocks), this process
    being D and one prefill process P, both caches in ``memory``."""
    prompts = PROMPTS_QUICK if quick else PROMPTS_FULL
    repeats = 3 if quick else 5
    headline_repeats = 9 if quick else 15
    out: dict[str, list[Sample]] = {}
    with _bench(max(prompts), memory) as bench:
        for tokens in prompts:
            bench.request(tokens)  # warm-up at this size
            n = headline_repeats if tokens == HEADLINE else repeats
            out[str(tokens)] = [bench.request(tokens) for _ in range(n)]
        bench.request(HEADLINE, contiguous=True)
        out[CONTIGUOUS] = [
            bench.request(HEADLINE, contiguous=True) for _ in range(headline_repeats)
        ]
    return out


def _measure_tuned(quick: bool) -> dict[str, list[Sample]] | None:
    """:func:`measure` again in a fresh process run with :data:`NT_TUNABLE` set."""
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = ":".join(filter(None, [env.get("GLIBC_TUNABLES"), NT_TUNABLE]))
    cmd = [sys.executable, "-m", "kvwire.bench.e2e", *(["--quick"] if quick else [])]
    proc = subprocess.run(cmd, env=env, capture_output=True, timeout=900, check=False)
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        sys.stderr.write(f"kvwire bench e2e: the {NT_TUNABLE} run failed: {tail[0]}\n")
        return None
    raw = json.loads(proc.stdout)
    return {k: [Sample(**s) for s in v] for k, v in raw.items()}


def _point(report: Report, name: str, samples: list[Sample], nbytes: int, note: str) -> float:
    """One request size's results; returns its median time-to-KV in ms."""
    ttkv = [s.ttkv * 1e3 for s in samples]
    copy = [s.memcpy * 1e3 for s in samples]
    ratios = [s.ttkv / s.memcpy for s in samples]
    memcpy_line = f"memcpy of the same {nbytes / 2**20:.0f} MiB{note}: {_med(copy):.3g} ms"
    report.add(Result(f"{name}.ms", _med(ttkv), "ms", baseline=memcpy_line,
                      min=min(ttkv), max=max(ttkv)))  # fmt: skip
    report.add(Result(f"{name}.memcpy_ms", _med(copy), "ms", min=min(copy), max=max(copy)))
    ratio = _med(ratios)
    report.add(Result(f"{name}.ratio_vs_memcpy", ratio, "x", baseline=memcpy_line,
                      ratio=ratio, min=min(ratios), max=max(ratios)))  # fmt: skip
    return _med(ttkv)


def _add(report: Report, prefix: str, samples: dict[str, list[Sample]], note: str) -> list[float]:
    """Every result of one run; returns the median time-to-KV per prompt length (ms)."""
    lengths = [int(k) for k in samples if k.isdigit()]
    spec = _spec(max(lengths))
    per_token = spec.layers * spec.block_len // BLOCK_TOKENS
    medians = [
        _point(report, f"{prefix}.ttkv_{label(t)}", samples[str(t)], t * per_token, note)
        for t in lengths
    ]
    head = samples.get(str(HEADLINE))
    if head:
        nbytes = HEADLINE * per_token
        gbps = [nbytes / s.ttkv / 1e9 for s in head]
        report.add(
            Result(f"{prefix}.ttkv_4k.GBps", _med(gbps), "GB/s", min=min(gbps), max=max(gbps))
        )
        _breakdown(report, prefix, head)
        if CONTIGUOUS in samples:
            _point(report, f"{prefix}.ttkv_4k_contiguous", samples[CONTIGUOUS], nbytes, note)
    return medians


def run(args: argparse.Namespace) -> Report:
    quick = bool(getattr(args, "quick", False))
    report = Report("e2e")
    samples = measure(quick)
    segment = measure(quick, "segment")
    tuned = _measure_tuned(quick)
    lengths = [int(k) for k in samples if k.isdigit()]
    ys = _add(report, "e2e", samples, "")
    memcpy_ms = [_med([s.memcpy * 1e3 for s in samples[str(t)]]) for t in lengths]
    series = {
        "numpy memcpy of the same bytes": memcpy_ms,
        "kvwire, caches in kvwire_shm.allocate segments": _add(report, "e2e.segment", segment, ""),
    }
    if tuned is not None:
        series["kvwire, glibc NT threshold 64 KiB"] = _add(
            report, "e2e.glibc_nt", tuned, ", same tuning"
        )
        series["memcpy, glibc NT threshold 64 KiB"] = [
            _med([s.memcpy * 1e3 for s in tuned[str(t)]]) for t in lengths
        ]
    ttkv = [[s.ttkv * 1e3 for s in samples[str(t)]] for t in lengths]
    report.add_sweep(
        "e2e.ttkv_vs_prompt",
        lengths,
        ys,
        xlabel="prompt tokens (Llama-3-8B, 128 KiB/token)",
        ylabel="time-to-KV (ms)",
        label="kvwire over shm (P finished -> D done)",
        y_min=[min(t) for t in ttkv],
        y_max=[max(t) for t in ttkv],
        series=series,
        title="End-to-end time-to-KV vs prompt length",
    )
    return report


def main() -> int:
    """Measure and print the samples as JSON (the tuned run of :func:`run`)."""
    parser = argparse.ArgumentParser(prog="python -m kvwire.bench.e2e")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    samples = measure(args.quick)
    sys.stdout.write(json.dumps({k: [asdict(s) for s in v] for k, v in samples.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
