"""The prefill process of ``kvwire bench layerwise``: a prompt computed layer by layer.

Run as ``python -m kvwire.bench.layerwise_peer`` by :mod:`kvwire.bench.layerwise`;
commands arrive as demo frames (:mod:`kvwire.framing`) on stdin, answers leave on stdout.
One cache (one TP rank of Llama-3-70B) is registered by three ``Producer`` s, one per
mode (``pull``, ``push``: whole-request push, ``stream``: streaming push), each with its
own agent and handshake listener, so the modes take turns in one process.

``init`` {layers, num_blocks, tp_size, engine_id} -> {ports: {mode: port}}.
``work`` {seconds, chunk, tokens} -> {rows, row_s, write_s, step_s}: size a layer's
compute for one chunk (its KV write, then :class:`Burn`) to ``seconds``.
``params`` {mode, rid, blocks, tokens} -> {params}: what D registers with (push modes).
``prefill`` {mode, rid, blocks, tokens, chunk} -> {params, t_start, t_last, calls_s,
computed, layer_s}: scribble the prompt's blocks, wait for D's registration (push modes),
then compute the prompt in chunks of ``chunk`` tokens, layer by layer: each layer writes its
KV values for the chunk into the blocks and then burns CPU for the sized time; the engine
calls go to the runtime as vLLM's connector makes them. ``t_last`` is the end of the last
layer's compute, ``calls_s`` the time the loop spent in the runtime's calls (the prefill's
share of the streaming), ``computed`` one ``[t, bytes]`` per layer and chunk.
``finish`` {mode, rid} -> {transfers, stream_rounds}: wait until the runtime freed the
request, then every transfer's ``[t, +bytes]`` at its post and ``[t, -bytes]`` at its end.
Clock: ``time.perf_counter`` (CLOCK_MONOTONIC, shared by the processes of one host).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvwire.config import KVWireConfig
from kvwire.demo.content import blocks_view, expected, scribble
from kvwire.demo.models import CacheSpec, preset, vllm_layer_name
from kvwire.demo.worker import allocate
from kvwire.framing import FrameWriter, commands, read_frame
from kvwire.runtime import Producer
from kvwire.runtime.metrics import Metrics
from kvwire.sidechannel import HandshakeListener

MODEL = "llama-3-70b"
TRANSPORT = "shm"
MODES = ("pull", "push", "stream")
"""Pull (D reads after P finished), whole-request push, streaming push."""
REQUEST_INDEX = 7
"""Every request's KV values are those of request 7 (:mod:`kvwire.demo.content`); both
sides scribble the blocks before each request, so stale values cannot pass the check."""
BLAS_THREADS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""The prefill's emulated compute is one thread, as the engine thread that drives a GPU."""


def cache_spec(layers: int, num_blocks: int, tp_size: int) -> CacheSpec:
    """One rank (rank 0 of ``tp_size``) of Llama-3-70B's cache, ``layers`` layers."""
    return CacheSpec(preset(MODEL), layers, num_blocks, 0, tp_size)


def config(engine_id: str, mode: str, port: int, spec: CacheSpec) -> KVWireConfig:
    """The configuration of either side of ``mode`` (both sides hash the same factors)."""
    wire_mode = "pull" if mode == "pull" else "push"
    return KVWireConfig(
        engine_id=engine_id,
        mode=wire_mode,
        stream_layers=mode == "stream",
        tp_rank=spec.tp_rank,
        tp_size=spec.tp_size,
        side_channel_port=port,
        compat=spec.compat(wire_mode),
    )


class Timeline:
    """Every transfer a runtime posts and ends, seen through its metrics: ``[t, +bytes]``
    at the post, ``[t, -bytes]`` at the end (when the runtime saw it land)."""

    def __init__(self, metrics: Metrics) -> None:
        self.events: list[list[float]] = []
        posted, ended = metrics.transfer_posted, metrics.transfer_ended

        def on_posted(request_id: str, now: float, nbytes: int, ndescs: int, post_s: float) -> None:
            self.events.append([now, float(nbytes)])
            posted(request_id, now, nbytes, ndescs, post_s)

        def on_ended(nbytes: int, ndescs: int, seconds: float, ok: bool) -> None:
            self.events.append([time.perf_counter(), -float(nbytes)])
            ended(nbytes, ndescs, seconds, ok)

        metrics.transfer_posted = on_posted  # type: ignore[method-assign]
        metrics.transfer_ended = on_ended  # type: ignore[method-assign]

    def take(self) -> list[list[float]]:
        events, self.events = self.events, []
        return events


class Burn:
    """A layer's emulated compute: one single-threaded float32 matrix product of
    ``rows`` x 128 by 128 x 128, sized to a time. One BLAS call, which releases the GIL
    throughout, as an engine thread waiting on its GPU does."""

    WIDTH = 128
    ROWS = 128 * 1024
    """The largest product (a 64 MiB operand: tens of ms here); the measured layer times
    show a compute capped by it."""

    def __init__(self) -> None:
        rng = np.random.default_rng(3)
        self.a = rng.random((self.ROWS, self.WIDTH), dtype=np.float32)
        self.b = rng.random((self.WIDTH, self.WIDTH), dtype=np.float32)
        self.out = np.empty_like(self.a)
        self.rows = 0

    def __call__(self) -> None:
        if self.rows:
            np.matmul(self.a[: self.rows], self.b, out=self.out[: self.rows])

    def row_s(self) -> float:
        """Seconds per row of the product here now (median of a few timed products)."""
        self.rows = 8192
        self()  # warm
        samples = []
        for _ in range(7):
            t0 = time.perf_counter()
            self()
            samples.append((time.perf_counter() - t0) / self.rows)
        return statistics.median(samples)

    def size(self, seconds: float, row_s: float) -> None:
        self.rows = min(self.ROWS, max(0, round(seconds / row_s)))


def pin_threads(cpus: list[int], engine: int | None, threads: set[int] | None = None) -> bool:
    """Put thread ``engine`` (which computes) on the first of ``cpus`` and ``threads``
    (default: every other thread of this process: the runtime's, the transport's copies)
    on the rest: the compute stands for a GPU's, which no copy slows down, and each side's
    copies get the same one core. False (nothing pinned) with fewer than 2 CPUs."""
    if len(cpus) < 2:
        return False
    tasks = {int(task) for task in os.listdir("/proc/self/task")}
    for tid in tasks if threads is None else tasks & threads:
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(tid, {cpus[0]} if tid == engine else set(cpus[1:]))
    return True


class Prefill:
    """The engine: one cache, a producer per mode, the layer loop."""

    def __init__(self, init: dict[str, Any]) -> None:
        self.cpus = sorted(os.sched_getaffinity(0))
        self.spec = cache_spec(int(init["layers"]), int(init["num_blocks"]), int(init["tp_size"]))
        self.buffer = allocate(TRANSPORT, self.spec.total_bytes, own=False)
        self.view = blocks_view(self.spec, self.buffer)
        self.burn = Burn()
        self.want: dict[int, npt.NDArray[np.uint16]] = {}
        self.listeners: dict[str, HandshakeListener] = {}
        self.producers: dict[str, Producer] = {}
        self.timelines: dict[str, Timeline] = {}
        self.rounds: dict[str, int] = {}
        """Each producer's stream rounds before its request in progress."""
        geometry = self.spec.geometry(int(self.buffer.ctypes.data))
        for mode in MODES:
            listener = self.listeners[mode] = HandshakeListener({}).start()
            cfg = config(f"{init['engine_id']}-{mode}", mode, listener.port, self.spec)
            producer = self.producers[mode] = Producer(cfg, TRANSPORT)
            producer.register_kv_caches(geometry)
            listener.set_payloads({(0, 0): producer.handshake_payload()})
            self.timelines[mode] = Timeline(producer.metrics)
        self.pinned = pin_threads(self.cpus, threading.get_native_id())

    def close(self) -> None:
        for producer in self.producers.values():
            producer.close()
        for listener in self.listeners.values():
            listener.close()

    def values(self, tokens: int) -> npt.NDArray[np.uint16]:
        """The prompt's KV as computed: ``[layers, blocks, heads, tokens, elements]``."""
        if tokens not in self.want:
            self.want[tokens] = expected(
                self.spec, REQUEST_INDEX, -(-tokens // self.spec.block_tokens)
            )
        return self.want[tokens]

    def size_work(self, seconds: float, chunk: int, tokens: int) -> dict[str, Any]:
        """Size a layer's compute of a ``chunk``-token chunk (its KV write into random
        blocks, then :class:`Burn`) to take ``seconds`` here now, timed as a whole."""
        spec, want = self.spec, self.values(tokens)
        nblocks = -(-chunk // spec.block_tokens)
        index = np.random.default_rng(5).permutation(spec.num_blocks)[:nblocks]
        layers = min(spec.layers, 16)

        def step_s() -> float:
            steps = []
            for layer in range(layers):
                t0 = time.perf_counter()
                self.view[layer, index] = want[layer, :nblocks]
                self.burn()
                steps.append(time.perf_counter() - t0)
            return statistics.median(steps)

        pin_threads(self.cpus, threading.get_native_id())
        row_s = self.burn.row_s()
        self.burn.rows = 0
        step_s()  # warm
        write_s = step_s()
        self.burn.size(seconds - write_s, row_s)
        for _ in range(3):  # the product may run slower beside the writes: correct
            self.burn.size(seconds - step_s() + self.burn.rows * row_s, row_s)
        return {"rows": self.burn.rows, "row_s": row_s, "write_s": write_s, "step_s": step_s()}

    def params(self, cmd: dict[str, Any]) -> dict[str, Any]:
        producer = self.producers[cmd["mode"]]
        blocks, tokens = [int(b) for b in cmd["blocks"]], int(cmd["tokens"])
        return producer.kv_transfer_params(cmd["rid"], [blocks], num_tokens=tokens)

    def prefill(self, cmd: dict[str, Any]) -> dict[str, Any]:
        mode, rid = cmd["mode"], str(cmd["rid"])
        producer = self.producers[mode]
        blocks, tokens, chunk = [int(b) for b in cmd["blocks"]], int(cmd["tokens"]), cmd["chunk"]
        want, spec = self.values(tokens), self.spec
        index = np.asarray(blocks, dtype=np.int64)
        scribble(spec, self.buffer, blocks)
        pin_threads(self.cpus, threading.get_native_id())  # threads started since
        self.rounds[mode] = producer.machine_stats()["stream_rounds"]
        if mode != "pull":
            _wait(lambda: producer.pending_registrations() >= 1, f"{rid}: D's registration")
        per_block_layer = spec.block_len
        bounds = [*range(0, tokens, int(chunk)), tokens]
        computed: list[list[float]] = []
        layer_s: list[float] = []
        names = [vllm_layer_name(layer) for layer in range(spec.layers)]
        calls = 0.0
        t_start = t_last = time.perf_counter()
        for start, stop in itertools.pairwise(bounds):
            b0, b1 = start // spec.block_tokens, -(-stop // spec.block_tokens)
            t0 = time.perf_counter()
            producer.chunk_scheduled(rid, [blocks[:b1]], num_tokens=stop, prompt_tokens=tokens)
            calls += time.perf_counter() - t0
            for layer, name in enumerate(names):
                t0 = time.perf_counter()
                self.view[layer, index[b0:b1]] = want[layer, b0:b1]
                self.burn()
                t_last = time.perf_counter()
                layer_s.append(t_last - t0)
                computed.append([t_last, float((b1 - b0) * per_block_layer)])
                producer.layer_computed(name, [rid])
                calls += time.perf_counter() - t_last
        params = producer.prefill_finished(rid, [blocks], num_tokens=tokens)
        return {"params": params, "t_start": t_start, "t_last": t_last, "calls_s": calls,
                "computed": computed, "layer_s": layer_s}  # fmt: skip

    def finish(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Wait until the runtime freed the request; its transfers' timeline."""
        mode, rid = cmd["mode"], str(cmd["rid"])
        producer = self.producers[mode]
        freed: list[str] = []

        def done() -> bool:
            freed.extend(f.reason for f in producer.get_finished() if f.request_id == rid)
            return bool(freed)

        _wait(done, f"{rid}: freed")
        if freed != ["sent"]:
            raise RuntimeError(f"{mode} request {rid} was freed {freed}, not sent")
        return {
            "transfers": self.timelines[mode].take(),
            "stream_rounds": producer.machine_stats()["stream_rounds"] - self.rounds[mode],
        }


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.0002)


def main() -> int:
    """Serve the commands of the module docstring until ``exit``; a failed one is answered
    with its error and ends the process."""
    out = FrameWriter(sys.stdout.buffer)
    sys.stdout = sys.stderr  # only frames on the real stdout
    init = read_frame(sys.stdin.buffer)
    prefill = None if init is None else Prefill(init)
    if prefill is None:
        return 1
    ops: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
        "work": lambda cmd: prefill.size_work(
            float(cmd["seconds"]), int(cmd["chunk"]), int(cmd["tokens"])
        ),
        "params": lambda cmd: {"params": prefill.params(cmd)},
        "prefill": prefill.prefill,
        "finish": prefill.finish,
    }
    try:
        ports = {mode: listener.port for mode, listener in prefill.listeners.items()}
        out.send({"ok": True, "ports": ports, "pinned": prefill.pinned})
        for cmd in commands(sys.stdin.buffer):
            try:
                answer = ops[cmd["op"]](cmd)
            except Exception as exc:  # the bench reports it and stops
                out.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                break
            out.send({"ok": True, **answer})
    finally:
        prefill.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
