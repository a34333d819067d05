"""Benchmark: one 70B-geometry, 4k-token request through vLLM's own NixlConnector and
through KVWireConnector, in the same run, on DRAM over real NIXL.

Run in the vLLM venv: ``VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python interop/bench_connector.py``.
Each pair is a P and a D engine (vLLM's real Scheduler and a TP-1 worker per process,
interop/vllm_engine.py), both sides on the same connector. Reported per connector, from D
(the side that posts READs): descriptors posted and the time spent posting them — the
connector's own counters (vLLM's from NIXL's telemetry ``descCount``/``postDuration``,
kvwire's runtime metrics) — and the wall time of D's ``start_load_kv`` call in which the
fetch began. The bytes are checked on D. Figures vary from run to run; compare within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Geometry, SchedulerEngine, Zygote, wait_until

CONNECTORS = ("NixlConnector", "KVWireConnector")


def run_pair(
    zygote: Zygote, connector: str, geo: Geometry, tokens: int, fragment: bool
) -> dict[str, Any]:
    extra = {"transport": "nixl"}
    p = SchedulerEngine("P", connector, zygote, geo=geo, extra_config=extra, lease=120)
    try:
        d = SchedulerEngine("D", connector, zygote, geo=geo, extra_config=extra, lease=120)
        try:
            if fragment:
                p.peer.call({"op": "fragment", "seed": 1})
                d.peer.call({"op": "fragment", "seed": 2})
            p.add("bench", 1, tokens)
            wait_until(lambda: "bench" in p.state.get("outputs", {}), p.step, 300, "P")
            d.add("bench", 1, tokens, p.state["outputs"]["bench"])

            def both() -> None:
                d.step()
                p.step()

            wait_until(lambda: "bench" in d.state.get("outputs", {}), both, 300, "D")
            wrong, checked = d.state["checked"]["bench"]
            stats = d.peer.call({"op": "stats"})
        finally:
            d.close()
    finally:
        p.close()
    data = stats["stats"]
    if connector == "NixlConnector":
        descriptors = sum(data.get("num_descriptors", []))
        post_s = sum(data.get("post_duration", []))
    else:
        descriptors = int(data.get("descriptors", 0))
        post_s = float(data.get("post_s", 0.0))
    return {
        "connector": connector,
        "descriptors": descriptors,
        "post_ms": round(post_s * 1e3, 3),
        "start_load_kv_ms": round(max(stats["load_calls"], default=0.0) * 1e3, 3),
        "bytes_checked": checked,
        "bytes_wrong": wrong,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--json", action="store_true", help="one JSON object per connector")
    parser.add_argument(
        "--fragment",
        action="store_true",
        help="shuffle both engines' free-block order first (a long-running engine's pool)",
    )
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    block = 32
    geo = Geometry(
        model="llama-3-70b",
        layers=args.layers,
        num_blocks=-(-args.tokens // block) + 2,
        block_size=block,
    )
    zygote = Zygote(sys.executable)
    try:
        rows = [run_pair(zygote, c, geo, args.tokens, args.fragment) for c in CONNECTORS]
    finally:
        zygote.close()
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(
        f"70B geometry ({args.layers} layers, 8 KV heads, head dim 128, bf16), "
        f"{args.tokens} tokens, DRAM, NIXL (UCX), one request"
        + (", fragmented block pools" if args.fragment else ", fresh (contiguous) block pools")
    )
    print(f"{'connector':<16} {'descriptors':>11} {'post ms':>9} {'start_load_kv ms':>17} bytes")
    for r in rows:
        ok = "ok" if r["bytes_wrong"] == 0 and r["bytes_checked"] else "WRONG"
        print(
            f"{r['connector']:<16} {r['descriptors']:>11} {r['post_ms']:>9.3f} "
            f"{r['start_load_kv_ms']:>17.3f} {r['bytes_checked']} {ok}"
        )
    return 0 if all(r["bytes_wrong"] == 0 and r["bytes_checked"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
