"""``kvwire bench layerwise``: the transfer time a prefill leaves exposed, per mode.

A prefill process (:mod:`kvwire.bench.layerwise_peer`) computes a prompt layer by layer in
vLLM's chunked prefill (4k-token chunks), each layer's compute emulated by real CPU work
that writes the layer's KV values for the chunk into P's blocks and then runs a matrix
product sized to a set time; this process is D. Both hold one TP rank of Llama-3-70B — 80
layers, 8 KV heads of 128, bf16: 320 KiB per token for the whole model; TP 8 leaves one
head per rank, 40 KiB per token, 8 KiB per block and layer, 1.25 GiB per side at 32k
tokens — in plain memory, which the shm transport reaches with ``process_vm_writev`` /
``readv``. Block ids are drawn at random on both sides, as in a long-running engine's
fragmented cache. Three modes take turns on the same prompts:

* ``pull``: P computes, then ``prefill_finished``; the params go to D over a pipe (the
  proxy), and D READs the request;
* ``push``: D registered before P starts; P WRITEs the whole request after
  ``prefill_finished`` (``stream_layers`` off);
* ``stream``: the same with ``stream_layers`` on: P writes each computed layer's full
  blocks while the prompt is computed, the last layer with the completion.

*Exposed transfer time*: from the end of P's last layer's compute to D's engine thread
waking with the request done (both ``perf_counter``, CLOCK_MONOTONIC, one host). The
handshakes are excluded (a first request per mode makes them and faults every page in).

The emulated compute stands for a GPU's, which no copy slows down: P's engine thread runs
alone on the first CPU, every other thread of both sides (the runtimes', the transport's
copies) on the others (:func:`~kvwire.bench.layerwise_peer.pin_threads`), so every mode's
copy has the same core. A layer's compute for one chunk is sized in this run to
``plan.compute_factor`` (1) times the transfer of that layer's chunk, taken from the
fastest of :data:`PROBES` whole-request WRITEs of the largest prompt: the issue's
condition "a layer's compute takes at least as long as its transfer" at its edge. D
checks every byte of one request per mode and size, in an untimed first turn
(:mod:`kvwire.demo.content`); a wrong byte fails the suite.

Results (``<n>`` a prompt length, ``<mode>`` one of :data:`MODES`):
``layerwise.exposed_ms.<mode>.<n>``; ``layerwise.exposed_vs_push.<n>``, streaming's exposed
time over whole-request push's (median of the per-turn ratios: *smaller* is better; target
<= 0.2 at 32k), ``.pull_vs_push.<n>`` and ``.total_vs_push.<n>`` (streaming's whole
time, first layer to D done, over push's); ``.prefill_ms.<mode>.<n>`` and
``.total_ms.<mode>.<n>``; ``.stream_calls_ms.<n>``, the prefill's time inside the runtime's
chunk and layer calls while streaming; ``.stream_rounds.<n>``; the sizing
(``.layer_transfer_ms``, ``.layer_transfer_timed_ms``, ``.layer_compute_ms``); the bytes
checked (``.verified_MiB``); and the sweep ``layerwise.bytes_in_flight_<n>`` of the
largest prompt: KV computed on P and not yet on D over time, per mode.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvwire.bench import e2e
from kvwire.bench.e2e import label
from kvwire.bench.layerwise_peer import (
    BLAS_THREADS,
    MODES,
    REQUEST_INDEX,
    TRANSPORT,
    Timeline,
    cache_spec,
    config,
    pin_threads,
)
from kvwire.bench.report import Report, Result
from kvwire.demo.content import count_wrong_bytes, scribble
from kvwire.demo.models import BLOCK_TOKENS, CacheSpec
from kvwire.demo.worker import allocate
from kvwire.errors import TransportError
from kvwire.framing import FrameWriter, spawn
from kvwire.runtime import Consumer
from kvwire.sidechannel import HandshakeListener

TP_SIZE = 8
PROBES = 5
"""Whole-request WRITEs of the largest prompt timed to size the compute (the fastest
counts: the smallest compute, the hardest case for streaming)."""
NAMES = {"pull": "pull", "push": "whole-request push", "stream": "streaming push"}
GRID = 150
"""Points of the bytes-in-flight sweep."""


@dataclass(frozen=True)
class Plan:
    sizes: tuple[int, ...]
    """Prompt lengths (tokens), each a multiple of 16."""
    chunk: int
    """Tokens per prefill step."""
    layers: int = 80
    repeats: int = 5
    compute_factor: float = 1.0
    """A layer's compute for one chunk over the measured transfer of that layer's chunk."""

    def __post_init__(self) -> None:
        if any(n % BLOCK_TOKENS for n in (*self.sizes, self.chunk)):
            raise ValueError(
                f"prompt lengths and the chunk must be whole {BLOCK_TOKENS}-token blocks"
            )


FULL = Plan((4096, 32768), 4096)
QUICK = Plan((4096, 8192), 4096, repeats=2)


@dataclass
class Sample:
    """One request: its timestamps (perf_counter seconds) and what moved when."""

    mode: str
    tokens: int
    exposed: float
    """P's last layer computed -> D's engine thread wakes with the request done."""
    prefill: float
    """P's first layer started -> its last layer computed."""
    total: float
    """P's first layer started -> D's engine thread wakes with the request done."""
    calls: float
    """Of ``prefill``, the time spent in the runtime's chunk and layer calls."""
    t_start: float
    layer_s: list[float]
    computed: list[list[float]]
    """``[t, bytes]`` per layer and chunk computed on P."""
    transfers: list[list[float]]
    """``[t, +bytes]`` at each transfer's post, ``[t, -bytes]`` at its end."""
    rounds: int


@dataclass
class Measured:
    plan: Plan
    spec: CacheSpec
    transfer_s: float
    """One layer's chunk written, from the fastest whole-request WRITE of the probes."""
    compute_s: float
    """The compute sized for one layer's chunk (the samples hold what each took)."""
    samples: list[Sample] = field(default_factory=list)
    verified: dict[str, int] = field(default_factory=dict)
    """Bytes checked per ``mode.size``."""


class _Prefill(e2e._Prefill):
    """The prefill process, request/answer over its stdin/stdout (as the e2e suite's)."""

    def __init__(self, init: dict[str, Any]) -> None:
        self.proc = spawn("kvwire.bench.layerwise_peer", env=BLAS_THREADS)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._out = FrameWriter(self.proc.stdin)
        self._in = self.proc.stdout
        self.ports: dict[str, int] = self.call(init)["ports"]


@dataclass
class _Bench:
    plan: Plan
    spec: CacheSpec
    buffer: npt.NDArray[np.uint8]
    consumers: dict[str, Consumer]
    timelines: dict[str, Timeline]
    prefill: _Prefill
    pool: ThreadPoolExecutor
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(11))
    serial: int = 0

    def request(self, mode: str, tokens: int, *, verify: bool = False) -> tuple[Sample, int]:
        """Compute and move one prompt of ``tokens`` tokens in ``mode``; with ``verify``
        check every byte D received (raise if one is wrong). The sample and bytes checked."""
        spec, consumer = self.spec, self.consumers[mode]
        nblocks = -(-tokens // spec.block_tokens)
        p_blocks = self.rng.permutation(spec.num_blocks)[:nblocks].tolist()
        d_blocks = self.rng.permutation(spec.num_blocks)[:nblocks].tolist()
        scribble(spec, self.buffer, d_blocks)
        self.serial += 1
        rid = f"lw-{mode}-{tokens}-{self.serial}"
        order = {"mode": mode, "rid": rid, "blocks": p_blocks, "tokens": tokens}
        prefill = {**order, "op": "prefill", "chunk": self.plan.chunk}
        if mode == "pull":
            answer = self.prefill.call(prefill)
            consumer.add_request(rid, answer["params"], [d_blocks], num_tokens=tokens)
            t_done = _wait_done(consumer, rid)
        else:
            params = self.prefill.call({**order, "op": "params"})["params"]
            consumer.add_request(rid, params, [d_blocks], num_tokens=tokens)
            pending = self.pool.submit(self.prefill.call, prefill)
            t_done = _wait_done(consumer, rid, pending)
            answer = pending.result()
        end = self.prefill.call({"op": "finish", "mode": mode, "rid": rid})
        checked = 0
        if verify:
            wrong, checked = count_wrong_bytes(spec, self.buffer, REQUEST_INDEX, d_blocks)
            if wrong:
                raise TransportError(
                    f"layerwise {mode} request {rid}: {wrong} of {checked} bytes wrong at D"
                )
        rounds = int(end["stream_rounds"])
        sample = Sample(
            mode=mode,
            tokens=tokens,
            exposed=t_done - answer["t_last"],
            prefill=answer["t_last"] - answer["t_start"],
            total=t_done - answer["t_start"],
            calls=answer["calls_s"],
            t_start=answer["t_start"],
            layer_s=answer["layer_s"],
            computed=answer["computed"],
            transfers=end["transfers"] + self.timelines[mode].take(),
            rounds=rounds,
        )
        return sample, checked


def _wait_done(
    consumer: Consumer, rid: str, prefill: Future[Any] | None = None, timeout: float = 120.0
) -> float:
    """The moment the engine thread wakes with ``rid`` done (raises if it failed, or if
    the ``prefill`` running meanwhile did)."""
    deadline = time.monotonic() + timeout
    while True:
        if prefill is not None and prefill.done() and prefill.exception() is not None:
            prefill.result()  # raises the prefill process's error
        consumer.wait_finished(0.5)
        finished = consumer.get_finished()
        t_done = time.perf_counter()
        if rid in finished.done:
            return t_done
        if rid in finished.failed:
            failure = finished.failed[rid]
            raise TransportError(
                f"layerwise request {rid} failed: {failure.reason} {failure.detail}"
            )
        if time.monotonic() > deadline:
            raise TransportError(f"layerwise request {rid} did not finish in {timeout:.0f} s")


@contextlib.contextmanager
def _bench(plan: Plan) -> Iterator[_Bench]:
    """D's cache and a consumer per mode, and the prefill process, handshakes not yet made."""
    max_tokens = max(plan.sizes)
    spec = cache_spec(plan.layers, max_tokens // BLOCK_TOKENS, TP_SIZE)
    engine = f"lw-{uuid.uuid4().hex[:6]}"
    buffer = allocate(TRANSPORT, spec.total_bytes, own=False)
    prefill = _Prefill(
        {
            "op": "init",
            "layers": spec.layers,
            "num_blocks": spec.num_blocks,
            "tp_size": TP_SIZE,
            "engine_id": f"{engine}-prefill",
        }
    )
    listeners: list[HandshakeListener] = []
    consumers: dict[str, Consumer] = {}
    pool = ThreadPoolExecutor(1, thread_name_prefix="lw-prefill-call")
    before = _threads()
    try:
        geometry = spec.geometry(int(buffer.ctypes.data))
        timelines = {}
        for mode in MODES:
            listener = HandshakeListener({}).start()
            listeners.append(listener)
            consumer = Consumer(
                config(f"{engine}-decode-{mode}", mode, listener.port, spec), TRANSPORT
            )
            consumers[mode] = consumer
            consumer.register_kv_caches(geometry)
            listener.set_payloads({(0, 0): consumer.handshake_payload()})
            timelines[mode] = Timeline(consumer.metrics)
        # D's runtime threads copy (pull) on the cores P's transfers use, never on P's
        # compute core (see layerwise_peer.pin_threads).
        pin_threads(sorted(os.sched_getaffinity(0)), None, _threads() - before)
        yield _Bench(plan, spec, buffer, consumers, timelines, prefill, pool)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for consumer in consumers.values():
            consumer.close()
        prefill.close()
        for listener in listeners:
            listener.close()


def _threads() -> set[int]:
    return {int(task) for task in os.listdir("/proc/self/task")}


def _write_span(sample: Sample) -> float:
    """First post to last end of a sample's transfers (seconds)."""
    times = [t for t, _ in sample.transfers]
    return max(times) - min(times)


def measure(plan: Plan, progress: Callable[[str], object] = lambda line: None) -> Measured:
    """Warm up, size the compute from the whole-request WRITE, check every byte of one
    request per mode and size, then time every mode and size in turns, ``plan.repeats``
    times (the mode that goes first rotates)."""
    largest = max(plan.sizes)
    layer_chunks = plan.layers * -(-largest // plan.chunk)
    with _bench(plan) as bench:
        for mode in MODES:  # the handshakes; every page faulted in on both sides
            bench.request(mode, largest)
        probes = [_write_span(bench.request("push", largest)[0]) for _ in range(PROBES)]
        transfer_s = min(probes) / layer_chunks
        compute_s = plan.compute_factor * transfer_s
        work = bench.prefill.call(
            {"op": "work", "seconds": compute_s, "chunk": plan.chunk, "tokens": largest}
        )
        progress(
            f"layerwise: one layer's {plan.chunk}-token chunk writes in {transfer_s * 1e3:.3f} ms "
            f"(the fastest of {PROBES} whole-request WRITEs of {label(largest)} tokens / "
            f"{layer_chunks}); its compute is sized to {compute_s * 1e3:.3f} ms: its KV write, "
            f"{work['write_s'] * 1e3:.3f} ms, and a {work['rows']} x 128 x 128 product"
        )
        measured = Measured(plan, bench.spec, transfer_s, compute_s)
        for tokens in plan.sizes:
            for mode in MODES:
                _, checked = bench.request(mode, tokens, verify=True)
                measured.verified[f"{mode}.{label(tokens)}"] = checked
            progress(f"layerwise: {label(tokens)} tokens: every byte right in each mode")
        for rep in range(plan.repeats):
            for tokens in plan.sizes:
                line = []
                for mode in MODES[rep % 3 :] + MODES[: rep % 3]:
                    sample, _ = bench.request(mode, tokens)
                    measured.samples.append(sample)
                    exposed, prefill = sample.exposed * 1e3, sample.prefill * 1e3
                    line.append(f"{mode} {exposed:.2f} (prefill {prefill:.1f})")
                progress(
                    f"layerwise: turn {rep + 1}/{plan.repeats}, {label(tokens)} tokens, "
                    f"exposed ms: {', '.join(line)}"
                )
    return measured


def _med(values: list[float]) -> float:
    return statistics.median(values)


def _in_flight(sample: Sample, grid: npt.NDArray[np.float64]) -> list[float]:
    """KV computed on P and not yet on D at each ``grid`` time (seconds since the prefill
    started), in MiB: computed bytes so far minus bytes whose transfer ended."""
    comp = np.asarray(sample.computed, dtype=np.float64).reshape(-1, 2)
    ends = np.asarray([e for e in sample.transfers if e[1] < 0], dtype=np.float64).reshape(-1, 2)
    comp = comp[np.argsort(comp[:, 0])]
    ends = ends[np.argsort(ends[:, 0])]
    t = grid + sample.t_start
    made = np.concatenate([[0.0], np.cumsum(comp[:, 1])])[np.searchsorted(comp[:, 0], t, "right")]
    landed = np.concatenate([[0.0], np.cumsum(-ends[:, 1])])[
        np.searchsorted(ends[:, 0], t, "right")
    ]
    return [float(v) for v in (made - landed) / 2**20]


def _of(measured: Measured, mode: str, tokens: int) -> list[Sample]:
    return [s for s in measured.samples if (s.mode, s.tokens) == (mode, tokens)]


def _ms(samples: list[Sample], what: str) -> list[float]:
    return [getattr(s, what) * 1e3 for s in samples]


def _add(out: Report, name: str, values: list[float], unit: str, **kw: Any) -> None:
    """The median of ``values`` with their range."""
    out.add(Result(name, _med(values), unit, min=min(values), max=max(values), **kw))


def _per_turn(out: Report, name: str, mine: list[float], push: list[float]) -> float:
    """``mine / push`` per turn (the modes of a turn ran back to back, under the same
    load); returns the median."""
    ratios = [a / b for a, b in zip(mine, push, strict=True)]
    _add(out, name, ratios, "x", ratio=_med(ratios),
         baseline=f"whole-request push: {_med(push):.3g} ms")  # fmt: skip
    return _med(ratios)


def report(measured: Measured) -> Report:
    """The figures of :func:`measure` (see the module docstring)."""
    plan, spec = measured.plan, measured.spec
    out = Report("layerwise")
    largest = max(plan.sizes)
    layer_chunks = plan.layers * -(-largest // plan.chunk)
    transfer_ms = measured.transfer_s * 1e3
    out.add(Result("layerwise.layer_transfer_ms", transfer_ms, "ms",
                   baseline=f"fastest of {PROBES} whole-request WRITEs of {label(largest)} "
                   f"tokens / {layer_chunks}"))  # fmt: skip
    timed = [_write_span(s) * 1e3 / layer_chunks for s in _of(measured, "push", largest)]
    basis = f"the timed whole-request WRITEs of {label(largest)} tokens / {layer_chunks}"
    _add(out, "layerwise.layer_transfer_timed_ms", timed, "ms", baseline=basis)
    layer_ms = [v * 1e3 for s in measured.samples for v in s.layer_s]
    _add(out, "layerwise.layer_compute_ms", layer_ms, "ms", ratio=_med(layer_ms) / _med(timed),
         baseline=f"sized to {measured.compute_s * 1e3:.3g} ms; ratio: over "
         "layer_transfer_timed_ms")  # fmt: skip
    per_token = spec.layers * spec.block_len // spec.block_tokens
    for tokens in plan.sizes:
        size = label(tokens)
        of = {mode: _of(measured, mode, tokens) for mode in MODES}
        for what in ("exposed", "prefill", "total"):
            for mode in MODES:
                _add(out, f"layerwise.{what}_ms.{mode}.{size}", _ms(of[mode], what), "ms",
                     baseline=NAMES[mode])  # fmt: skip
        push = _ms(of["push"], "exposed")
        _per_turn(out, f"layerwise.exposed_vs_push.{size}", _ms(of["stream"], "exposed"), push)
        _per_turn(out, f"layerwise.pull_vs_push.{size}", _ms(of["pull"], "exposed"), push)
        push_total = _ms(of["push"], "total")
        _per_turn(out, f"layerwise.total_vs_push.{size}", _ms(of["stream"], "total"), push_total)
        _add(out, f"layerwise.stream_calls_ms.{size}", _ms(of["stream"], "calls"), "ms",
             baseline="of prefill_ms.stream: in chunk_scheduled and layer_computed")  # fmt: skip
        rounds = [float(s.rounds) for s in of["stream"]]
        _add(out, f"layerwise.stream_rounds.{size}", rounds, "rounds")
        out.add(Result(f"layerwise.request_MiB.{size}", tokens * per_token / 2**20, "MiB"))
    verified = sum(measured.verified.values()) / 2**20
    out.add(Result("layerwise.verified_MiB", verified, "MiB",
                   baseline="every byte of one request per mode and size; none wrong"))  # fmt: skip
    _sweep(out, measured)
    return out


def _sweep(out: Report, measured: Measured) -> None:
    """KV computed on P, not yet on D, over the largest prompt's last turn, per mode."""
    tokens = max(measured.plan.sizes)
    last = {s.mode: s for s in measured.samples if s.tokens == tokens}
    span = max(max(t for t, _ in s.transfers) - s.t_start for s in last.values())
    grid = np.linspace(0.0, span * 1.02, GRID)
    ends = ", ".join(f"{m} {last[m].prefill * 1e3:.0f} ms" for m in ("push", "stream"))
    out.add_sweep(
        f"layerwise.bytes_in_flight_{label(tokens)}",
        [float(x) for x in grid * 1e3],
        _in_flight(last["stream"], grid),
        xlabel=f"ms since P started the prefill (its last layer ends: {ends})",
        ylabel="KV computed on P, not yet on D (MiB)",
        label=NAMES["stream"],
        series={NAMES[m]: _in_flight(last[m], grid) for m in ("push", "pull")},
        title=f"Bytes in flight over a {label(tokens)}-token prefill "
        f"(Llama-3-70B, one TP-{TP_SIZE} rank)",
    )


def side_by_side(out: Report, measured: Measured) -> str:
    """The three modes per prompt length, one row each (the command prints it)."""
    results = {r.name: r.value for r in out.results}
    spec = measured.spec
    per_token = spec.layers * spec.block_len // spec.block_tokens
    lines = [
        f"layerwise: Llama-3-70B, one TP-{TP_SIZE} rank ({spec.layers} layers, "
        f"{per_token // 1024} KiB/token), {measured.plan.chunk}-token chunks; one layer's chunk "
        f"computes in {results['layerwise.layer_compute_ms']:.3g} ms and writes in "
        f"{results['layerwise.layer_transfer_ms']:.3g} ms",
        f"{'':>7} {'exposed ms: last layer -> D has the KV':<42}  "
        "total ms: first layer -> D has the KV",
        f"{'tokens':>7} " + " ".join(f"{m:>9}" for m in MODES) + f" {'stream/push':>11}  "
        + " ".join(f"{m:>9}" for m in MODES) + f" {'stream/push':>11}",
    ]  # fmt: skip
    for tokens in measured.plan.sizes:
        size = label(tokens)
        exposed = " ".join(f"{results[f'layerwise.exposed_ms.{m}.{size}']:>9.2f}" for m in MODES)
        total = " ".join(f"{results[f'layerwise.total_ms.{m}.{size}']:>9.1f}" for m in MODES)
        ratio = results[f"layerwise.exposed_vs_push.{size}"]
        whole = results[f"layerwise.total_vs_push.{size}"]
        lines.append(f"{size:>7} {exposed} {ratio:>11.3f}  {total} {whole:>11.3f}")
    return "\n".join(lines)


def _progress(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def run(args: argparse.Namespace) -> Report:
    plan = QUICK if getattr(args, "quick", False) else FULL
    measured = measure(plan, _progress)
    out = report(measured)
    _progress(side_by_side(out, measured))
    return out
