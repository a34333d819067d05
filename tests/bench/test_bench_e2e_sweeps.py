"""Smoke tests of the ``e2e`` suite and the transport sweeps in --quick mode.

Shapes and invariants only, never timings: the numbers are for ``kvwire bench`` to print.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import numpy as np
import pytest

from kvwire.bench import e2e, sweeps
from kvwire.bench.report import Report

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def quick_args() -> argparse.Namespace:
    return argparse.Namespace(suites=[], json=True, quick=True, transport=None, plot=None)


def check_sweep(sweep: dict[str, Any]) -> None:
    n = len(sweep["x"])
    assert n >= 2 and sweep["x"] == sorted(sweep["x"])
    assert sweep["xlabel"] and sweep["ylabel"]
    for curve in [sweep["y"], sweep["y_min"], sweep["y_max"], *sweep.get("series", {}).values()]:
        assert len(curve) == n and all(math.isfinite(v) and v > 0 for v in curve)
    spread = zip(sweep["y_min"], sweep["y"], sweep["y_max"], strict=True)
    assert all(lo <= y <= hi for lo, y, hi in spread)


def results_of(report: Report) -> dict[str, dict[str, Any]]:
    doc = json.loads(report.to_json())
    names = [r["name"] for r in doc["results"]]
    assert len(names) == len(set(names)), "result names must be unique"
    for r in doc["results"]:
        assert math.isfinite(r["value"]) and r["value"] > 0, r
        if "min" in r:
            assert r["min"] <= r["value"] <= r["max"], r
    return {r["name"]: r for r in doc["results"]}


def test_e2e_quick_reports_every_prompt_length_beside_memcpy() -> None:
    report = e2e.run(quick_args())
    results = results_of(report)
    for tokens in e2e.PROMPTS_QUICK:
        name = f"e2e.ttkv_{e2e.label(tokens)}"
        assert results[f"{name}.ms"]["baseline"].startswith("memcpy of the same")
        assert f"{name}.memcpy_ms" in results
        ratio = results[f"{name}.ratio_vs_memcpy"]
        assert ratio["ratio"] == ratio["value"] and ratio["unit"] == "x"
    headline = results["e2e.ttkv_4k.ratio_vs_memcpy"]
    assert headline["ratio"] == headline["value"]
    parts = ("prefill_call", "hop", "add_request", "post", "in_flight", "wake", "block_copy")
    for part in parts:
        assert f"e2e.ttkv_4k.{part}_ms" in results
    # The parts of the request are pieces of its time-to-KV (block_copy is a baseline).
    total = results["e2e.ttkv_4k.ms"]["max"]
    assert results["e2e.ttkv_4k.in_flight_ms"]["value"] <= total
    assert results["e2e.ttkv_4k.post_ms"]["value"] <= results["e2e.ttkv_4k.add_request_ms"]["max"]
    assert "e2e.ttkv_4k_contiguous.ratio_vs_memcpy" in results
    assert "e2e.glibc_nt.ttkv_4k.ratio_vs_memcpy" in results  # the tuned child ran
    sweep = report.sweeps["e2e.ttkv_vs_prompt"]
    check_sweep(sweep)
    assert sweep["x"] == [float(t) for t in e2e.PROMPTS_QUICK]
    assert "numpy memcpy of the same bytes" in sweep["series"]


def test_transport_sweeps_quick_over_shm() -> None:
    report = Report("transport")
    sweeps.run_sweeps(report, ["shm"], quick=True)
    results = results_of(report)
    for size in sweeps.BLOCK_SIZES_QUICK:
        assert f"shm.bw.{sweeps.size_label(size)}.GBps" in results
    assert results["shm.post.100k.coalesced.us"]["baseline"].startswith("uncoalesced")
    for k in (1, 64):
        assert f"shm.inflight.{k}.GBps" in results
    for shape in ("1to8", "8to1"):
        assert results[f"shm.tp.{shape}.GBps"]["baseline"].startswith("shm.tp.1to1")
    expected = {
        "transport.bandwidth_vs_block_size": list(sweeps.BLOCK_SIZES_QUICK),
        "transport.post_time_vs_descriptors": list(sweeps.DESC_COUNTS_QUICK),
        "transport.concurrency": list(sweeps.IN_FLIGHT_QUICK),
        "transport.tp_fanout": [p / d for p, d in sweeps.TP_SHAPES],
    }
    assert set(report.sweeps) == set(expected)
    for name, xs in expected.items():
        check_sweep(report.sweeps[name])
        assert report.sweeps[name]["x"] == [float(x) for x in xs]
    assert "shm, coalesced" in report.sweeps["transport.post_time_vs_descriptors"]["series"]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 8), (8, 1)])
def test_tp_pairs_move_the_whole_request_once(p_tp: int, d_tp: int) -> None:
    """Every D byte of the request is written by exactly one READ, whatever the fan-out."""
    blocks = 4
    lbase, rbase = 1 << 40, 1 << 44
    pairs = sweeps.tp_pairs(p_tp, d_tp, lbase, rbase, blocks)
    assert len(pairs) == max(p_tp, d_tp)
    local = np.concatenate([ld for ld, _ in pairs])
    per_block_layer = 8 * 16 * 512  # 8 heads x 16 tokens x (K|V of 128 bf16)
    assert int(local[:, 1].sum()) == blocks * sweeps.TP_LAYERS * per_block_layer
    order = np.argsort(local[:, 0])
    starts, ends = local[order, 0], local[order, 0] + local[order, 1]
    assert (starts[1:] >= ends[:-1]).all(), "two READs write the same bytes"
