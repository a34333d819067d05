"""The connector benchmark's yardstick, run small against both connectors: every row it
reports carries its measurements and bytes checked (its bad options: test_bench_options.py)."""

from __future__ import annotations

from typing import Any

import bench_connector as bench
import pytest
from harness import Zygote


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
