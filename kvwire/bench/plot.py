"""``kvwire bench --plot DIR``: one PNG per sweep, whatever suite recorded it.

The plotter knows only the sweep format of :mod:`kvwire.bench.report` (x, y, axis labels,
optional extra series and spread), so a suite that records a new sweep gets its chart with
no code here. matplotlib is imported only when a chart is drawn, so kvwire itself never
depends on it; it comes with the ``dev`` extra.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from kvwire.bench.report import Report
from kvwire.errors import ConfigError

LOG_SPAN = 20.0
"""An axis whose positive values span more than this factor is drawn on a log scale."""


def require_matplotlib() -> ModuleType:
    """``matplotlib.pyplot`` on the non-interactive backend, or a ConfigError saying how."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib: pip install matplotlib (or the kvwire[dev] extra)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def file_name(sweep_name: str) -> str:
    """The PNG's name: the sweep's name with anything unsafe in a path replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", sweep_name).strip("._") + ".png"


def wants_log(values: Iterable[float]) -> bool:
    """True when the values are all positive and span more than :data:`LOG_SPAN`."""
    vals = [v for v in values if math.isfinite(v)]
    if not vals or min(vals) <= 0:
        return False
    return max(vals) / min(vals) > LOG_SPAN


def sweep_problem(entry: object) -> str | None:
    """Why ``entry`` is not a drawable sweep (see :mod:`kvwire.bench.report`), or None."""
    if not isinstance(entry, Mapping):
        return "not a mapping"
    missing = [key for key in ("x", "y", "xlabel", "ylabel") if key not in entry]
    if missing:
        return f"missing {', '.join(missing)}"
    n = len(entry["x"])
    curves = {"y": entry["y"], **(entry.get("series") or {})}
    for key in ("y_min", "y_max"):
        if key in entry:
            curves[key] = entry[key]
    for key, values in curves.items():
        if len(values) != n:
            return f"{key} has {len(values)} values for {n} x"
    return None


def write_plots(
    reports: Iterable[Report],
    directory: str | Path,
    *,
    warn: Callable[[str], object] = lambda line: sys.stderr.write(line + "\n"),
) -> list[Path]:
    """Draw every sweep of ``reports`` into ``directory`` (created if missing); the paths.

    An entry of ``Report.sweeps`` that is not in the sweep format is skipped with a line
    through ``warn`` rather than failing a run that already spent minutes measuring.
    """
    sweeps: dict[str, Mapping[str, Any]] = {}
    for report in reports:
        for name, entry in report.sweeps.items():
            problem = sweep_problem(entry)
            if problem is None:
                sweeps[name] = entry
            else:
                warn(f"kvwire bench: not plotting {report.suite} sweep {name!r}: {problem}")
    if not sweeps:
        return []
    plt = require_matplotlib()
    out_dir = Path(directory)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--plot: cannot create {str(out_dir)!r}: {exc.strerror}") from None
    written = []
    for name, sweep in sweeps.items():
        path = out_dir / file_name(name)
        _draw(plt, name, sweep, path)
        written.append(path)
    return written


def _draw(plt: Any, name: str, sweep: Mapping[str, Any], path: Path) -> None:
    x: Sequence[float] = sweep["x"]
    y: Sequence[float] = sweep["y"]
    series: Mapping[str, Sequence[float]] = sweep.get("series") or {}
    fig, ax = plt.subplots(figsize=(7.0, 4.2), dpi=110)
    try:
        ax.plot(x, y, marker="o", linewidth=2, label=sweep.get("label") or "kvwire")
        y_min, y_max = sweep.get("y_min"), sweep.get("y_max")
        if y_min is not None and y_max is not None:
            ax.fill_between(x, y_min, y_max, alpha=0.2, linewidth=0)
        for label, values in series.items():
            ax.plot(x, values, marker=".", linestyle="--", label=label)
        if wants_log(x):
            ax.set_xscale("log")
        all_y = [*y, *(v for values in series.values() for v in values)]
        if wants_log(all_y):
            ax.set_yscale("log")
        ax.set_xlabel(sweep["xlabel"])
        ax.set_ylabel(sweep["ylabel"])
        ax.set_title(sweep.get("title") or name, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
