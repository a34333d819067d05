"""The connector benchmark's yardstick, run small against both connectors: every row it
reports carries its measurements and bytes checked, and its options refuse bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import bench_connector as bench
import pytest
from harness import Zygote

SCRIPT = Path(bench.__file__)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_both_connectors_measured_by_one_yardstick(zygote: Zygote, mode: str) -> None:
    """A small fragmented case (4 layers, 8 blocks) on stock's connector and on kvwire's:
    each row has D's time to KV, both engines' connector CPU and the descriptors the posting
    side handed NIXL, and D checked every byte."""
    case = bench.Case(mode, (1, 1), "fragmented", 256, 4)
    rows: list[dict[str, Any]] = [bench.run_pair(zygote, c, case) for c in bench.CONNECTORS]
    for row in rows:
        assert row["bytes_ok"] and row["bytes_checked"] == 256 * 4 * 8 * 2 * 128 * 2, row
        assert row["ttkv_ms"] > 0 and row["cpu_p_ms"] > 0 and row["cpu_d_ms"] > 0, row
        assert row["descriptors"] > 0, row
    (ratio,) = bench.ratios(rows)
    assert ratio["case"] == case.name and ratio["target_x"] == 0.7


@pytest.mark.parametrize(
    "args, message",
    [
        (["--layers-32k", "0"], "--layers-32k must be 1..80, got 0"),
        (["--layers-32k", "many"], "invalid int value"),
        (["--only", "no-such-case"], "no case name contains 'no-such-case'"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
