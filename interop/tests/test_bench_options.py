"""The benchmarks inside vLLM refuse bad options with one line and exit 2, before they
start an engine."""

from __future__ import annotations

import subprocess
import sys
from types import ModuleType

import bench_connector
import bench_layerwise
import pytest

CASES = [
    (bench_connector, ["--layers-32k", "0"], "--layers-32k must be 1..80, got 0"),
    (bench_connector, ["--layers-32k", "many"], "invalid int value"),
    (bench_connector, ["--only", "no-such-case"], "no case name contains 'no-such-case'"),
    (bench_layerwise, ["--repeats", "0"], "--repeats must be 1..50, got 0"),
    (bench_layerwise, ["--repeats", "two"], "invalid int value"),
    (bench_layerwise, ["--factor", "0"], "--factor must be 0.1..10, got 0"),
    (bench_layerwise, ["--factor", "nan"], "--factor must be 0.1..10, got nan"),
]


@pytest.mark.parametrize(
    "script, args, message", CASES, ids=[f"{s.__name__}:{'='.join(a)}" for s, a, _ in CASES]
)
def test_bad_options_are_one_line_and_exit_2(
    script: ModuleType, args: list[str], message: str
) -> None:
    done = subprocess.run(
        [sys.executable, str(script.__file__), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
