"""Smoke test of the ``layerwise`` bench suite at a tiny size (8 layers, 2k tokens).

Shapes, keys and the byte check only, never timings: the numbers are for ``kvwire bench``.
"""

from __future__ import annotations

import json
import math

import pytest

from kvwire.bench import layerwise
from kvwire.bench.layerwise_peer import MODES
from kvwire.cli import main
from kvwire.demo.content import Memory, count_wrong_bytes, scribble
from kvwire.demo.models import CacheSpec
from kvwire.errors import TransportError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TINY = layerwise.Plan((512, 2048), 512, layers=8, repeats=2)


def test_cli_reports_the_three_modes_side_by_side(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(layerwise, "QUICK", TINY)
    assert main(["bench", "layerwise", "--quick", "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # stdout is the JSON alone; progress goes to stderr
    assert doc["suite"] == "layerwise"
    results = {r["name"]: r for r in doc["results"]}
    assert len(results) == len(doc["results"]), "result names must be unique"
    for r in doc["results"]:
        assert math.isfinite(r["value"]) and r["value"] >= 0, r
        if "min" in r:
            assert r["min"] <= r["value"] <= r["max"], r
    for size in ("512", "2k"):
        for mode in MODES:
            for what in ("exposed", "prefill", "total"):
                assert f"layerwise.{what}_ms.{mode}.{size}" in results
        for name in ("exposed_vs_push", "pull_vs_push", "total_vs_push"):
            ratio = results[f"layerwise.{name}.{size}"]
            assert ratio["unit"] == "x" and ratio["ratio"] == ratio["value"]
            assert ratio["baseline"].startswith("whole-request push:")
        assert results[f"layerwise.stream_rounds.{size}"]["value"] >= 1
    for name in ("layer_transfer_ms", "layer_transfer_timed_ms", "layer_compute_ms"):
        assert results[f"layerwise.{name}"]["value"] > 0
    # Every byte of one request per mode and size was checked at D (a wrong one fails).
    request_mib = sum(results[f"layerwise.request_MiB.{s}"]["value"] for s in ("512", "2k"))
    assert results["layerwise.verified_MiB"]["value"] == pytest.approx(3 * request_mib)
    sweep = doc["sweeps"]["layerwise.bytes_in_flight_2k"]
    assert sweep["x"] == sorted(sweep["x"]) and len(sweep["x"]) == layerwise.GRID
    assert set(sweep["series"]) == {"whole-request push", "pull"}
    for curve in (sweep["y"], *sweep["series"].values()):
        assert len(curve) == len(sweep["x"]) and curve[-1] == 0  # all landed at the end
        assert max(curve) > 0
    assert max(sweep["series"]["whole-request push"]) == pytest.approx(8.0)  # all 2k tokens
    table = captured.err.splitlines()
    assert any(line.split()[:1] == ["2k"] for line in table), captured.err
    assert "every byte right in each mode" in captured.err


def test_a_wrong_byte_at_d_fails_the_suite(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check has teeth: one block of D's request overwritten before it is checked."""

    def corrupt_then_check(
        spec: CacheSpec, buffer: Memory, index: int, blocks: list[int]
    ) -> tuple[int, int]:
        scribble(spec, buffer, blocks[-1:])
        return count_wrong_bytes(spec, buffer, index, blocks)

    monkeypatch.setattr(layerwise, "count_wrong_bytes", corrupt_then_check)
    plan = layerwise.Plan((512,), 512, layers=4, repeats=1)
    with pytest.raises(TransportError, match="bytes wrong at D"):
        layerwise.measure(plan)
