"""The one result format every benchmark suite prints.

``{"suite": ..., "machine": {...}, "results": [{"name", "value", "unit", "baseline",
"ratio", "min", "max"}]}``: every figure travels with the baseline measured in the same run,
so a reader never compares numbers from different days or machines.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
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
        rows = [("name", "value", "unit", "baseline", "ratio")]
        for r in self.results:
            rows.append(
                (
                    r.name,
                    f"{r.value:.4g}",
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
