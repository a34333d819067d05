"""Smoke tests of the ``wire`` and ``machine`` bench suites in --quick mode.

They check shapes and invariants of the reports, never timings: a benchmark's numbers are
for ``kvwire bench`` to print, not for a test to assert.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvwire.bench import machine as machine_suite
from kvwire.bench import wire as wire_suite
from kvwire.bench.report import Report

VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "vllm-0.31.0-nixl-v13.json"


def quick_args() -> argparse.Namespace:
    return argparse.Namespace(suites=[], json=True, quick=True, transport=None, plot=None)


def check_report_shape(report: Report, suite: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(report.to_json())
    assert doc["suite"] == suite
    assert set(doc["machine"]) >= {"cpu", "cores", "python", "versions"}
    names = [r["name"] for r in doc["results"]]
    assert len(names) == len(set(names)), "result names must be unique"
    for r in doc["results"]:
        assert set(r) >= {"name", "value", "unit"}
        assert r["name"].startswith(f"{suite}.")
        assert math.isfinite(r["value"]) and r["value"] > 0, r
        if "min" in r:
            assert 0 < r["min"] <= r["value"] <= r["max"], r
        if "ratio" in r:
            assert r["ratio"] > 0 and isinstance(r["baseline"], str), r
    for name, sweep in doc.get("sweeps", {}).items():
        assert name.startswith(f"{suite}.")
        n = len(sweep["x"])
        assert n >= 2 and sweep["x"] == sorted(sweep["x"])
        assert isinstance(sweep["xlabel"], str) and isinstance(sweep["ylabel"], str)
        curves = [sweep["y"], *sweep.get("series", {}).values()]
        for curve in curves:
            assert len(curve) == n and all(v > 0 for v in curve)
        if "y_min" in sweep:
            assert all(
                lo <= y <= hi
                for lo, y, hi in zip(sweep["y_min"], sweep["y"], sweep["y_max"], strict=True)
            )
    return doc


def by_name(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in doc["results"]}


@pytest.mark.timeout(120)
def test_wire_suite_quick_report() -> None:
    doc = check_report_shape(wire_suite.run(quick_args()), "wire")
    results = by_name(doc)
    headline = results["wire.decode_handshake.ratio_vs_vllm"]
    assert headline["unit"] == "x"
    # The ratio is the baseline's time over kvwire's, as the per-op timings say.
    kv = results["wire.decode_handshake.kvwire_us"]["value"]
    vl = results["wire.decode_handshake.vllm_us"]["value"]
    assert headline["min"] <= vl / kv * 1.5 and vl / kv <= headline["max"] * 1.5
    for op in (
        "decode_handshake",
        "decode_agent_metadata",
        "decode_handshake_payload",
        "encode_handshake",
        "encode_agent_metadata",
        "small.decode_handshake",
    ):
        assert {f"wire.{op}.kvwire_us", f"wire.{op}.vllm_us", f"wire.{op}.ratio_vs_vllm"} <= set(
            results
        )
    assert "wire.decode_handshake_vs_regions" in doc["sweeps"]


def test_vllm_definitions_reproduce_the_golden_bytes() -> None:
    """The bench's own copies of vLLM's dataclasses must write vLLM's bytes, or the
    comparison would not be like for like."""
    vectors = json.loads(VECTORS.read_text())
    encoder = msgspec.msgpack.Encoder()
    assert vectors["agent_metadata"]
    for case in vectors["agent_metadata"]:
        fields = dict(case["fields"])
        fields["agent_metadata"] = bytes.fromhex(fields["agent_metadata"]["hex"])
        fields["ssm_sizes"] = tuple(fields["ssm_sizes"])
        layouts = fields["packed_member_layouts"]
        fields["packed_member_layouts"] = {k: tuple(v) for k, v in layouts.items()}
        md = wire_suite.VllmAgentMetadata(**fields)
        assert encoder.encode(md).hex() == case["msgpack"], case["kind"]
        decoded = msgspec.msgpack.Decoder(wire_suite.VllmAgentMetadata).decode(
            bytes.fromhex(case["msgpack"])
        )
        assert decoded == md
    assert vectors["handshake_payload"]
    for payload in vectors["handshake_payload"]:
        wrapped = wire_suite.VllmHandshakePayload(
            payload["compatibility_hash"], bytes.fromhex(payload["agent_metadata_msgpack"])
        )
        assert encoder.encode(wrapped).hex() == payload["msgpack"]


def test_vllm_decode_handshake_refuses_a_foreign_hash() -> None:
    msg = wire_suite._Message(4, "a" * 64)
    assert wire_suite.vllm_decode_handshake(msg.payload, "a" * 64) == msg.theirs
    with pytest.raises(RuntimeError, match="hash"):
        wire_suite.vllm_decode_handshake(msg.payload, "b" * 64)


@pytest.mark.timeout(180)
def test_machine_suite_quick_report() -> None:
    doc = check_report_shape(machine_suite.run(quick_args()), "machine")
    results = by_name(doc)
    headline = results["machine.events_per_s"]
    assert headline["unit"] == "events/s" and "dict" in headline["baseline"]
    assert results["machine.us_per_event"]["value"] == pytest.approx(
        1e6 / headline["value"], rel=1e-9
    )
    sweep = doc["sweeps"]["machine.events_vs_live_requests"]
    assert sweep["x"][0] == 1 and len(sweep["x"]) >= 3
    assert "dict insert+pop (baseline)" in sweep["series"]


@pytest.mark.parametrize("live", [1, 3, 50])
def test_pull_pipeline_keeps_its_live_count(live: int) -> None:
    pipeline = machine_suite.PullPipeline(live)
    assert pipeline.consumer.live_requests() == live
    assert pipeline.producer.live_requests() == live
    events = pipeline.steps(40)
    # Seven request events per step, plus timers and delivered heartbeats.
    assert events >= 7 * 40
    assert pipeline.consumer.live_requests() == live
    assert pipeline.producer.live_requests() == live
    assert pipeline.producer.held_blocks() == live * machine_suite.BLOCKS_PER_REQUEST
    assert pipeline.consumer.stats.transfers_failed == 0


def test_pull_pipeline_fires_heartbeats_at_small_live_counts() -> None:
    """With one live request a step is 10 ms of simulated time: 5 s brings a heartbeat."""
    pipeline = machine_suite.PullPipeline(1)
    pipeline.steps(600)
    assert pipeline.consumer.stats.heartbeats_sent >= 1
    assert pipeline.producer.stats.heartbeats_received >= 1
    assert pipeline.producer.stats.leases_expired == 0
