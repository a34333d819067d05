"""``kvwire bench transport``: READ bandwidth and latency of a transport between processes.

For each transport named with ``--transport`` (default ``shm``) a peer agent process
(:class:`kvwire.peer.PeerAgent`, which the conformance suite uses too) registers the source
blocks, and this process READs them: 256 x 64 KiB and 32 x 2 MiB blocks scattered on both sides (so
nothing coalesces), plus one 4 KiB READ for latency. In the same run a single-process
numpy copy of the same bytes (warm pages) is the baseline every figure is compared with.
Results are named ``<transport>.read.<size>.GBps`` and ``<transport>.read.4KiB.us``, over
plain numpy memory on both sides: what a serving engine registers is its own tensors.
When the transport offers its own host allocator (``conformance_allocators``, e.g. shm's
peer-mappable segments) that memory is measured too, as
``<transport>.read.<size>.segment.GBps``. If the transport has a raw baseline module
(kvwire's own transports: :data:`RAW_BASELINES`; any other: the module its distribution
names in the ``kvwire.rawbench`` entry-point group, under the transport's name), its
``same_memory_reader(transport, peer, local, remote)`` (when it returns a callable) is the
raw library's READ of the very same blocks, timed in turns with the transport's as
``<transport>_raw.read.*`` with the paired ratio ``<transport>.read.<size>.vs_raw``;
otherwise its ``raw_baseline(quick) -> list[Result]`` adds the raw library's own figures.
If it has ``paired_benchmark(quick, memcpy_sample) -> list[Result]`` instead, that replaces
this module's measurement of the transport: it times the adapter and the raw library
against one target and the same memory, in turns (the only fair comparison on a shared
machine), calling ``memcpy_sample(label, nbytes)`` so the memcpy baseline is sampled
between its repetitions too.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import time
import uuid
from functools import partial
from typing import Any

import numpy as np

from kvwire.bench import mooncake, sweeps
from kvwire.bench.report import QUICK_REPEATS, Report, Result, bandwidth_in_turns, repeat
from kvwire.bench.sweeps import LATENCY_BYTES, SHAPES, scattered
from kvwire.errors import ConfigError, TransportError
from kvwire.transport import Transport, XferState, create, load, region_of_array


class _Memcpy:
    """The baseline: one numpy copy of the same bytes in one process, pages warm.

    Sampled between the transport's own repetitions, so both see the same machine load;
    which of the two goes first alternates, so neither always inherits the other's caches.
    """

    def __init__(self) -> None:
        self.buffers: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.samples: dict[str, list[float]] = {}

    def warm(self, label: str, nbytes: int) -> None:
        """Allocate (once) and copy without timing, so every page is in place."""
        if label not in self.buffers:
            src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
            self.buffers[label] = (src, np.ones_like(src))
        src, dst = self.buffers[label]
        np.copyto(dst, src)

    def sample(self, label: str, nbytes: int) -> None:
        if label not in self.buffers:
            self.warm(label, nbytes)
        src, dst = self.buffers[label]
        t0 = time.perf_counter()
        np.copyto(dst, src)
        self.samples.setdefault(label, []).append(nbytes / (time.perf_counter() - t0) / 1e9)

    def gbps(self, label: str) -> float:
        """Median GB/s over every sample taken so far."""
        return float(np.median(self.samples[label]))


def _read(local: Transport, peer: str, ldescs: np.ndarray, rdescs: np.ndarray) -> None:
    handle = local.read(peer, ldescs, rdescs)
    deadline = time.monotonic() + 60
    state = local.poll(handle)
    while state is XferState.PENDING and time.monotonic() < deadline:
        local.wait(0.001)
        state = local.poll(handle)
    local.release(handle)
    if state is not XferState.DONE:
        raise TransportError(f"benchmark READ ended {state.name}")


def _measure(name: str, allocator: str, quick: bool, memcpy: _Memcpy) -> dict[str, float]:
    from kvwire.peer.agent import PeerAgent  # the peer process; only the bench needs it
    from kvwire.peer.memory import allocate

    repeats = QUICK_REPEATS if quick else 30
    out: dict[str, float] = {}
    same_memory_reader = getattr(_rawbench(name), "same_memory_reader", None)
    peer = PeerAgent(name)
    local = create(name, f"kvwire-bench-{uuid.uuid4().hex[:8]}")
    try:
        regions = []
        for count, size, label in SHAPES:
            remote = peer.alloc(2 * count * size, allocator)
            peer.fill(remote["addr"], remote["nbytes"], seed=count)
            array = allocate(allocator, 2 * count * size)
            array[:] = 1  # touch every page before timing
            local.register([region_of_array(array)])
            regions.append((count, size, label, int(array.ctypes.data), remote["addr"], array))
        peer_name = local.add_peer(peer.metadata())
        shapes = [
            (
                count,
                size,
                label,
                scattered(la, count, size, np.random.default_rng(1)),
                scattered(ra, count, size, np.random.default_rng(2)),
            )
            for count, size, label, la, ra, _ in regions
        ]
        for _ in range(3):  # warm every page and mapping of both sides before any timing
            for count, size, label, ldescs, rdescs in shapes:
                memcpy.warm(label, count * size)
                _read(local, peer_name, ldescs, rdescs)
        for count, size, label, ldescs, rdescs in shapes:
            raw = None
            if same_memory_reader is not None:
                raw = same_memory_reader(local, peer_name, ldescs, rdescs)
            samples: list[float] = []
            raw_samples: list[float] = []
            nbytes = count * size
            if raw is None:
                for i in range(repeats):
                    # Alternate which goes first, so neither always runs on the other's
                    # leftovers.
                    if i % 2 == 0:
                        memcpy.sample(label, nbytes)
                    t0 = time.perf_counter()
                    _read(local, peer_name, ldescs, rdescs)
                    samples.append(nbytes / (time.perf_counter() - t0) / 1e9)
                    if i % 2 == 1:
                        memcpy.sample(label, nbytes)
            else:  # kvwire and the raw library reading the same blocks, in turns
                turns = bandwidth_in_turns(
                    {"kvwire": partial(_read, local, peer_name, ldescs, rdescs), "raw": raw},
                    nbytes,
                    label,
                    repeats,
                    memcpy.sample,
                )
                samples, raw_samples = turns["kvwire"], turns["raw"]
            out[label] = float(np.median(samples))
            out[f"{label}.min"], out[f"{label}.max"] = min(samples), max(samples)
            if raw_samples:
                out[f"{label}.raw"] = float(np.median(raw_samples))
                out[f"{label}.raw.min"], out[f"{label}.raw.max"] = (
                    min(raw_samples),
                    max(raw_samples),
                )
                pairs = [k / r for k, r in zip(samples, raw_samples, strict=True)]
                out[f"{label}.vs_raw"] = float(np.median(pairs))
                out[f"{label}.vs_raw.min"], out[f"{label}.vs_raw.max"] = min(pairs), max(pairs)
        _, _, _, laddr, raddr, _ = regions[0]
        one_l = np.array([[laddr, LATENCY_BYTES, 0]], dtype=np.int64)
        one_r = np.array([[raddr, LATENCY_BYTES, 0]], dtype=np.int64)
        timing = repeat(
            lambda: _read(local, peer_name, one_l, one_r), repeats=50 if quick else 300, warmup=10
        )
        out["latency_us"] = timing.median * 1e6
        raw_one = None
        if same_memory_reader is not None:
            raw_one = same_memory_reader(local, peer_name, one_l, one_r)
        if raw_one is not None:
            raw_timing = repeat(raw_one, repeats=50 if quick else 300, warmup=10)
            out["latency_us.raw"] = raw_timing.median * 1e6
    finally:
        local.close()
        peer.close()
    return out


RAW_BASELINES = {"nixl": "kvwire.bench.nixl_raw", "ucx": "kvwire.bench.ucx_raw"}
"""kvwire's own transports -> their raw-library baseline module, in this package: bench
tooling that imports the adapter, which must not import the bench back. Looked up first, so
an older install's entry points for these names (the modules once in the adapters) are never
loaded."""

RAWBENCH_GROUP = "kvwire.rawbench"
"""Entry points naming any other transport's raw-library baseline module (by transport name):
the extension point for third-party transports."""


def _rawbench(name: str) -> Any:
    """The raw baseline module of transport ``name`` (:data:`RAW_BASELINES`, else the
    ``kvwire.rawbench`` entry point ``name``), or None."""
    if name in RAW_BASELINES:
        return importlib.import_module(RAW_BASELINES[name])
    found = importlib.metadata.entry_points(group=RAWBENCH_GROUP, name=name)
    return next(iter(found)).load() if found else None


def _raw_baselines(name: str, quick: bool) -> list[Result]:
    module = _rawbench(name)
    if module is None or hasattr(module, "paired_benchmark"):
        return []  # none, or measured together with the adapter (see run)
    if getattr(module, "NATIVE", None) is not None and hasattr(module, "same_memory_reader"):
        return []  # the raw figure was sampled beside the adapter's (see _measure)
    results: list[Result] = module.raw_baseline(quick)
    return results


def _add_raw(report: Report, name: str, suffix: str, figures: dict[str, float]) -> None:
    """The raw library's figures over the same memory, sampled in turns with kvwire's
    (``same_memory_reader``): ``<name>_raw.read.*`` and kvwire's ``.vs_raw`` ratio, the
    median over back-to-back pairs (steadier than the ratio of medians under load)."""
    for _, _, label in SHAPES:
        if f"{label}.raw" not in figures:
            continue
        raw = figures[f"{label}.raw"]
        report.add(
            Result(
                f"{name}_raw.read.{label}{suffix}.GBps",
                raw,
                "GB/s",
                min=figures[f"{label}.raw.min"],
                max=figures[f"{label}.raw.max"],
            )
        )
        report.add(
            Result(
                f"{name}.read.{label}{suffix}.vs_raw",
                figures[f"{label}.vs_raw"],
                "x",
                baseline=f"{name}_raw.read.{label}{suffix}.GBps",
                ratio=figures[f"{label}.vs_raw"],
                min=figures[f"{label}.vs_raw.min"],
                max=figures[f"{label}.vs_raw.max"],
            )
        )
    if "latency_us.raw" in figures:
        report.add(Result(f"{name}_raw.read.4KiB{suffix}.us", figures["latency_us.raw"], "us"))


def run(args: argparse.Namespace) -> Report:

    names = list(getattr(args, "transport", None) or sweeps.installed_transports())
    quick = bool(getattr(args, "quick", False))
    memcpy = _Memcpy()
    measured: list[tuple[str, str, dict[str, float]]] = []
    paired: list[Result] = []
    for name in names:
        if ":" in name:
            raise ConfigError(f"bench transport wants an installed transport name, not {name!r}")
        paired_benchmark = getattr(_rawbench(name), "paired_benchmark", None)
        if paired_benchmark is not None:  # adapter and raw library in turns, one target
            paired.extend(paired_benchmark(quick, memcpy.sample))
            continue
        factory: Any = load(name)
        extra = list(getattr(factory, "conformance_allocators", ()))
        # The headline is plain memory, what engines register; the transport's own
        # allocator, where it has one, is reported beside it.
        for allocator in ["numpy", *extra[:1]]:
            suffix = "" if allocator == "numpy" else ".segment"
            measured.append((name, suffix, _measure(name, allocator, quick, memcpy)))
    report = Report("transport")
    for _, _, label in SHAPES:
        samples = memcpy.samples[label]
        report.add(
            Result(
                f"memcpy.{label}.GBps",
                memcpy.gbps(label),
                "GB/s",
                min=min(samples),
                max=max(samples),
            )
        )
    for name, suffix, figures in measured:
        for _, _, label in SHAPES:
            value = figures[label]
            report.add(
                Result(
                    f"{name}.read.{label}{suffix}.GBps",
                    value,
                    "GB/s",
                    baseline=f"memcpy.{label}.GBps",
                    ratio=value / memcpy.gbps(label),
                    min=figures[f"{label}.min"],
                    max=figures[f"{label}.max"],
                )
            )
        report.add(Result(f"{name}.read.4KiB{suffix}.us", figures["latency_us"], "us"))
        _add_raw(report, name, suffix, figures)
    report.results.extend(paired)
    for name in names:
        report.results.extend(_raw_baselines(name, quick))
    mooncake.add_baseline(report, quick)
    sweeps.run_sweeps(report, names, quick)
    return report
