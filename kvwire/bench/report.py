"""The one result format every benchmark suite prints.

``{"suite": ..., "machine": {...}, "results": [{"name", "value", "unit", "baseline",
"ratio", "min", "max"}]}``: every figure travels with the baseline measured in the same run,
so a reader never compares numbers from different days or machines.

A report may also carry **sweeps**: how a measure grows with the work, for ``--plot`` to
draw. ``Report.sweeps`` maps a sweep name (``"<suite>.<what>"``, unique across suites; it
becomes the PNG's file name) to::

    {
        "x": [1, 10, 100],            # the swept quantity, ascending
        "y": [5.1e5, 4.9e5, 4.2e5],   # the measure (median of the repetitions) at each x
        "xlabel": "live requests",    # axis titles, units included
        "ylabel": "events/s",
        "label": "kvwire",            # optional: legend entry of "y"
        "y_min": [...], "y_max": [...],  # optional: spread of "y" over repetitions
        "series": {"dict insert+pop": [...]},  # optional: more curves over the same x
        "title": "...",               # optional
    }

Every list has one value per ``x``. The plotter needs nothing else, so a new suite's sweeps
plot without new code; build them with :meth:`Report.add_sweep`, which checks the shape.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from typing import Any


@dataclass
class Result:
    name: str
    value: float
    unit: str
    baseline: str | None = None
    ratio: float | None = None
    min: float | None = None
    max: float | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "value": self.value, "unit": self.unit}
        for key in ("baseline", "ratio", "min", "max"):
            val = getattr(self, key)
            if val is not None:
                out[key] = val
        return out


@dataclass
class Report:
    suite: str
    results: list[Result] = field(default_factory=list)
    sweeps: dict[str, Any] = field(default_factory=dict)

    def add(self, result: Result) -> Result:
        self.results.append(result)
        return result

    def add_sweep(
        self,
        name: str,
        x: Sequence[float],
        y: Sequence[float],
        *,
        xlabel: str,
        ylabel: str,
        label: str | None = None,
        y_min: Sequence[float] | None = None,
        y_max: Sequence[float] | None = None,
        series: Mapping[str, Sequence[float]] | None = None,
        title: str | None = None,
    ) -> dict[str, Any]:
        """Record a sweep in the format the module docstring describes."""
        n = len(x)
        columns: dict[str, Sequence[float]] = {"y": y}
        if y_min is not None:
            columns["y_min"] = y_min
        if y_max is not None:
            columns["y_max"] = y_max
        for key, values in (series or {}).items():
            columns[f"series {key!r}"] = values
        for key, values in columns.items():
            if len(values) != n:
                raise ValueError(f"sweep {name!r}: {key} has {len(values)} values for {n} x")
        sweep: dict[str, Any] = {
            "x": [float(v) for v in x],
            "y": [float(v) for v in y],
            "xlabel": xlabel,
            "ylabel": ylabel,
        }
        if label is not None:
            sweep["label"] = label
        if y_min is not None:
            sweep["y_min"] = [float(v) for v in y_min]
        if y_max is not None:
            sweep["y_max"] = [float(v) for v in y_max]
        if series:
            sweep["series"] = {k: [float(v) for v in vals] for k, vals in series.items()}
        if title is not None:
            sweep["title"] = title
        self.sweeps[name] = sweep
        return sweep

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "suite": self.suite,
            "machine": machine_info(),
            "results": [r.as_dict() for r in self.results],
        }
        if self.sweeps:
            out["sweeps"] = self.sweeps
        return out

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def to_table(self) -> str:
        rows = [("name", "value", "min-max", "unit", "baseline", "ratio")]
        for r in self.results:
            spread = "" if r.min is None or r.max is None else f"{r.min:.3g}-{r.max:.3g}"
            rows.append(
                (
                    r.name,
                    f"{r.value:.4g}",
                    spread,
                    r.unit,
                    r.baseline or "",
                    "" if r.ratio is None else f"{r.ratio:.3g}",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [f"suite: {self.suite}"]
        for i, row in enumerate(rows):
            lines.append("  ".join(cell.ljust(widths[j]) for j, cell in enumerate(row)))
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _version(dist: str) -> str | None:
    try:
        return importlib_metadata.version(dist)
    except importlib_metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """Where the figures were measured; enough to tell two runs apart."""
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "versions": {
            name: _version(name)
            for name in ("kvwire", "numpy", "msgspec", "pyzmq", "nixl-cu12", "libucx-cu12")
        },
    }


@dataclass
class Timing:
    """Median and spread of repeated measurements, warm-up excluded."""

    median: float
    min: float
    max: float
    samples: tuple[float, ...] = ()
    """Every measurement in order, for pairing with a contender timed in turns."""


def repeat(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1) -> Timing:
    """Time ``fn`` ``repeats`` times after ``warmup`` untimed calls (seconds per call)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return Timing(statistics.median(samples), min(samples), max(samples))


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for a timed section, as ``timeit`` does.

    A collection's cost grows with every tracked object in the process (numpy, torch and the
    rest of the engine), not with the code under test, and it lands on whichever batch
    happens to trip the threshold: left on, it makes timings bimodal.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def cpu_clock() -> float:
    """This process's CPU time in seconds (``time.process_time``).

    For a single-threaded, CPU-bound loop it equals wall time on an idle machine, and on a
    shared one it leaves out the time the scheduler gave to other processes.
    """
    return time.process_time()


def repeat_interleaved(
    fns: Mapping[str, Callable[[], object]],
    *,
    repeats: int = 5,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Timing]:
    """Like :func:`repeat` for several contenders, taking turns within each repetition.

    On a shared machine the load drifts over seconds; alternating the contenders exposes
    each to the same drift, so their ratio is steadier than that of two separate runs.
    ``clock`` may be :func:`cpu_clock` for single-threaded code on a busy machine.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            samples[name].append(clock() - t0)
    return {
        name: Timing(statistics.median(s), min(s), max(s), tuple(s)) for name, s in samples.items()
    }


QUICK_REPEATS = 25
"""Samples per shape of a transport READ with ``--quick`` (the generic bench's and a raw
baseline's turns alike). Single samples on a shared 2-core machine vary up to 2x (thread
wake-ups), so a median wants more than a handful; one sample is a READ of 16 or 64 MiB
(about 1 and 5 ms here, and a memcpy as long beside it), so 25 add well under a second per
transport."""

MemcpySampler = Callable[[str, int], None]
"""``sample(label, nbytes)``: time one memcpy of ``nbytes`` (the transport bench's baseline)."""


def bandwidth_in_turns(
    contenders: Mapping[str, Callable[[], None]],
    nbytes: int,
    label: str,
    repeats: int,
    memcpy: MemcpySampler,
) -> dict[str, list[float]]:
    """GB/s samples per contender reading the same blocks, timed in turns (order alternating
    every repetition), each right after a memcpy of the same size.

    The memcpy in between is what makes the turns fair: the second of two back-to-back
    reads of one set of blocks finds them in cache, so without it whichever contender
    always went second would win by the cache, not by its code.
    """
    names = list(contenders)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            memcpy(label, nbytes)
            t0 = time.perf_counter()
            contenders[name]()
            samples[name].append(nbytes / (time.perf_counter() - t0) / 1e9)
    return samples


def paired_ratio(slow: Timing, fast: Timing) -> Timing:
    """``slow / fast`` per repetition of :func:`repeat_interleaved`: median, min and max.

    Each repetition's two contenders ran back to back under the same load, so their ratio
    is the fair one; the spread of these ratios is the honest spread of the comparison.
    """
    if not slow.samples or len(slow.samples) != len(fast.samples):
        raise ValueError("paired_ratio needs two timings from one repeat_interleaved call")
    ratios = [s / f for s, f in zip(slow.samples, fast.samples, strict=True)]
    return Timing(statistics.median(ratios), min(ratios), max(ratios), tuple(ratios))
