"""The connector harness's layer-wise benchmark (interop/bench_layerwise.py), run small:
every mode's turns carry their clocks and D checked every byte; the report names the
figures ``kvwire bench layerwise`` names (its bad options: test_bench_options.py)."""

from __future__ import annotations

import bench_layerwise as bench
from harness import Zygote

PLAN = bench.Plan((256, 512), layers=4, chunk=128, repeats=1)
"""Two prompts of two and four 128-token steps over 4 layers (the whole figures are a
command's, not a test's)."""


def test_three_modes_measured_with_every_byte_checked(zygote: Zygote) -> None:
    out = bench.report(bench.measure(zygote, PLAN))
    rows = out["turns"]
    assert sorted((r["mode"], r["tokens"]) for r in rows) == sorted(
        (m, n) for m in bench.MODES for n in PLAN.sizes
    )
    for row in rows:
        # One KV head of 128 bf16 values, K and V, per token and layer.
        assert row["bytes_ok"] and row["bytes_checked"] == row["tokens"] * 4 * 2 * 128 * 2, row
        assert row["prefill_ms"] > 0 and row["total_ms"] > row["prefill_ms"], row
        # P writes in push modes (pull's D reads), and only a streaming P writes rounds
        # before the last one.
        assert (row["descriptors"] > 0) == (row["mode"] != "pull"), row
        assert row["writes"] == {"pull": 0, "push": 1}.get(row["mode"], row["writes"]), row
        assert (row["stream_rounds"] > 0) == (row["mode"] == "stream"), row
        assert (row["writes"] > 1) == (row["mode"] == "stream"), row
    assert out["layerwise.bytes_ok"] and out["layerwise.verified_MiB"] > 0
    for n in ("256", "512"):
        assert out[f"layerwise.exposed_vs_push.{n}"] > 0
        assert set(out) >= {f"layerwise.exposed_ms.{m}.{n}" for m in bench.MODES}
    assert out["layerwise.layer_transfer_ms"] > 0 and out["layerwise.layer_compute_ms"] > 0
