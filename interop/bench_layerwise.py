"""Benchmark: layer-wise streaming inside vLLM, the transfer time a prefill leaves exposed.

Run in the vLLM venv (``make interop-venv`` first)::

    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python interop/bench_layerwise.py [--quick] [--json]

The connector-harness half of ``kvwire bench layerwise`` (which measures kvwire's reference
runtime): here a P and a D engine run vLLM's real Scheduler and workers
(interop/vllm_engine.py), ``KVWireConnector`` on both sides, over real NIXL (UCX) on DRAM,
and every transfer call is the connector's, driven by vLLM's chunked prefill. Three modes,
one engine pair each, on the same prompts:

* ``pull``: P computes; its params go to D (the harness stands for the proxy); D reads;
* ``push``: D gets the request first and registers its blocks; P writes the whole request
  when it finishes (``stream_layers: false``);
* ``stream``: the same with ``stream_layers: true``: P's connector writes each computed
  layer while the later ones compute (``save_kv_layer``), the last layer with the
  completion.

The model: Llama-3-70B's attention geometry for one rank of TP 8 (80 layers, one KV head of
128 bf16 values, 40 KiB per token: 1.25 GiB per side at 32k tokens), 32-token blocks, each
engine's free-block order shuffled first (a long-running engine's fragmented pool), 4k-token
prefill steps. Each layer of each step is real CPU work on P's engine thread sized to a set
time: it writes the layer's KV values of the step's chunk, then runs single-threaded matrix
products for the rest of the time (vllm_engine's ``set_compute``). The time is sized
in the run: the fastest of :data:`PROBES` whole-request pushes of the largest prompt with no
compute, divided by its layer-chunks (80 per 4k tokens), is one layer-chunk's transfer; a
layer is given exactly that (``--factor`` times it), the edge of the issue's condition "a
layer's compute takes at least as long as its transfer". P's engine thread runs alone on
the first CPU and every other thread of both engines on the others (placed again when one
starts: it would inherit the engine thread's CPU), as a GPU's compute is not slowed by a
copy. D's engine loop steps with a 1 ms pause while it waits (``IDLE_STEP_S``); a step
that schedules no tokens runs no layers, as in vLLM's model runner.

*Exposed*: from the end of P's last layer (P's clock) to the end of the D step whose
``get_finished`` reported the request (D's; both ``perf_counter``, CLOCK_MONOTONIC, one
host). *Prefill*: P's first layer's start to its last layer's end. *Total*: P's first layer
to D's KV. D checks every byte of every request, on its first read; a wrong byte fails the
run. Each pair's first request (the handshake, the pages faulting in) is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Geometry, SchedulerEngine, Zygote, engines, params_ahead, wait_until
from yardstick import IDLE_STEP_S

from kvwire.bench.e2e import label
from kvwire.bench.layerwise_peer import BLAS_THREADS
from kvwire.demo.models import preset

MODES = ("pull", "push", "stream")
BLOCK = 32
PROBES = 3
TIMEOUT_S = 240.0
TARGET = 0.2
"""Streaming's exposed time over whole-request push's, at most, at the largest prompt."""


@dataclass(frozen=True)
class Plan:
    sizes: tuple[int, ...] = (4096, 32768)
    """Prompt lengths (tokens), whole blocks."""
    layers: int = 80
    chunk: int = 4096
    """Tokens per prefill step."""
    repeats: int = 3
    factor: float = 1.0
    """A layer's compute over one layer-chunk's measured transfer."""

    def __post_init__(self) -> None:
        if any(n % BLOCK for n in (*self.sizes, self.chunk)):
            raise ValueError(f"prompt lengths and the chunk must be whole {BLOCK}-token blocks")


FULL = Plan()
QUICK = Plan((4096, 8192), repeats=2)


@dataclass
class Pair:
    """One mode's engines and what they have done so far."""

    mode: str
    p: SchedulerEngine
    d: SchedulerEngine
    turns: int = 0


@contextmanager
def pair(zygote: Zygote, mode: str, plan: Plan) -> Iterator[Pair]:
    geo = Geometry(
        model="llama-3-70b",
        layers=plan.layers,
        num_blocks=max(plan.sizes) // BLOCK + 2,
        block_size=BLOCK,
        kv_heads=1,
    )
    p_options = {
        "extra_config": {"transport": "nixl", "stream_layers": mode == "stream"},
        "layerwise": True,
        "scheduler": {"batch_tokens": plan.chunk},
    }
    d_options = {"extra_config": {"transport": "nixl"}}
    transfer = "pull" if mode == "pull" else "push"
    with engines(
        zygote, "KVWireConnector", "KVWireConnector", p_options, d_options,
        geo=geo, mode=transfer, lease=300, prefix_caching=False,
    ) as (p, d):  # fmt: skip
        p.peer.call({"op": "fragment", "seed": 1})
        d.peer.call({"op": "fragment", "seed": 2})
        yield Pair(mode, p, d)


def turn(pair: Pair, tokens: int) -> dict[str, Any]:
    """One request through the pair: its clocks, D's byte check and P's streamed rounds."""
    p, d = pair.p, pair.d
    pair.turns += 1
    rid, index = f"{pair.mode}-{tokens}-{pair.turns}", pair.turns
    for engine in (p, d):
        engine.peer.call({"op": "pin"})  # threads started since the last turn
    posted = p.peer.call({"op": "debug"})
    before = p.peer.call({"op": "clocks"})
    seen = len(before["layer_s"])
    p.add(rid, index, tokens)
    run_d = {"op": "run_until", "rid": rid, "timeout": TIMEOUT_S}
    with ThreadPoolExecutor(1) as pool:
        if pair.mode == "pull":
            prefill(p, rid)
            d.add(rid, index, tokens, p.state["outputs"][rid])
            received = pool.submit(d.peer.call, run_d)
        else:
            d.add(rid, index, tokens, params_ahead(p, rid))
            wait_until(
                lambda: min(p.pending_registrations()) > 0, d.step, TIMEOUT_S, "D's registration"
            )
            received = pool.submit(d.peer.call, run_d)
            prefill(p, rid)
        # P's engine loop goes on while D's runs: its connector learns of the finished
        # request at its next step (push posts then), and frees the blocks once D has them.
        steps(p, lambda: rid in p.state.get("sent", ()), f"P to free {rid}")
        received.result()
    wait_until(lambda: rid in d.state.get("outputs", {}), d.step, TIMEOUT_S, f"D to read {rid}")
    wrong, checked = d.state["checked"].get(rid, (0, 0))  # none: D never read it whole
    p_clocks, d_clocks = p.peer.call({"op": "clocks"}), d.peer.call({"op": "clocks"})
    first, last = p_clocks["computed_at"][rid]
    done = d_clocks["received_at"][rid]
    return {
        "mode": pair.mode,
        "tokens": tokens,
        "exposed_ms": (done - last) * 1e3,
        "prefill_ms": (last - first) * 1e3,
        "total_ms": (done - first) * 1e3,
        "layer_ms": statistics.median(p_clocks["layer_s"][seen:]) * 1e3,
        "save_ms": (p_clocks["save_s"] - before["save_s"]) * 1e3,
        **posting(posted, p.peer.call({"op": "debug"})),
        "bytes_checked": checked,
        "bytes_ok": checked == tokens * layers_bytes(p) and wrong == 0,
    }


def posting(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What P's runtime did for the turn: rounds streamed, WRITEs and their descriptors, and
    their time from the start of each post to its end, summed (a request has one WRITE in
    flight at a time; NIXL's UCX copies here inside the post call)."""
    was, now = before["metrics"], after["metrics"]
    spent = now["post_s"] + now["transfer_s"] - was["post_s"] - was["transfer_s"]
    return {
        "stream_rounds": after["machine"]["stream_rounds"] - before["machine"]["stream_rounds"],
        "writes": now["transfers_done"] - was["transfers_done"],
        "descriptors": now["descriptors"] - was["descriptors"],
        "write_ms": spent * 1e3,
    }


def layers_bytes(p: SchedulerEngine) -> int:
    """KV bytes per prompt token on the engine's one rank, every layer and head."""
    model = preset(p.geo.model)
    return p.geo.layers * (p.geo.kv_heads or model.kv_heads) * model.content_bytes


def prefill(p: SchedulerEngine, rid: str) -> None:
    """Step P back to back (the step that ends the prompt hands its params on at once)
    until it has finished ``rid``'s prefill."""
    steps(p, lambda: rid in p.state.get("outputs", {}), f"P to finish {rid}", pause_s=0.0)


def steps(
    engine: SchedulerEngine, done: Callable[[], bool], what: str, pause_s: float = IDLE_STEP_S
) -> None:
    """Step ``engine`` as its engine loop would until ``done``."""
    deadline = time.monotonic() + TIMEOUT_S
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}: {engine.peer.log[-3:]}")
        engine.step()
        time.sleep(pause_s)


def measure(
    zygote: Zygote, plan: Plan, progress: Callable[[str], object] = lambda line: None
) -> dict[str, Any]:
    """Every mode's timed turns, and the layer compute they ran with."""
    largest = max(plan.sizes)
    chunks = -(-largest // plan.chunk)
    rows: list[dict[str, Any]] = []
    sizing: dict[str, Any] = {}
    for mode in ("push", "stream", "pull"):  # push first: it sizes the compute
        with pair(zygote, mode, plan) as engines_:
            if mode == "push":
                engines_.p.peer.call({"op": "compute", "seconds": 0.0})
                turn(engines_, min(plan.sizes))
                probes = [turn(engines_, largest) for _ in range(PROBES)]
                transfer_ms = min(r["exposed_ms"] for r in probes) / (plan.layers * chunks)
                sizing = {
                    "layer_transfer_ms": transfer_ms,
                    "layer_compute_target_ms": transfer_ms * plan.factor,
                    "probes_ok": all(r["bytes_ok"] for r in probes),
                }
                progress(f"sizing: one layer-chunk's transfer {transfer_ms:.3f} ms")
            seconds = sizing["layer_compute_target_ms"] / 1e3
            engines_.p.peer.call({"op": "compute", "seconds": seconds})
            if mode != "push":
                turn(engines_, min(plan.sizes))
            for tokens in plan.sizes:
                for i in range(plan.repeats):
                    row = turn(engines_, tokens)
                    rows.append(row)
                    progress(
                        f"{mode} {label(tokens)} turn {i + 1}/{plan.repeats}: exposed "
                        f"{row['exposed_ms']:.1f} ms, prefill {row['prefill_ms']:.0f} ms, "
                        f"bytes {'ok' if row['bytes_ok'] else 'WRONG'}"
                    )
    return {"plan": plan, "rows": rows, "sizing": sizing}


def _med(rows: list[dict[str, Any]], mode: str, tokens: int, what: str) -> float:
    return statistics.median(r[what] for r in rows if r["mode"] == mode and r["tokens"] == tokens)


def report(measured: dict[str, Any]) -> dict[str, Any]:
    """The suite's figures under the names ``kvwire bench layerwise`` gives its own."""
    plan: Plan = measured["plan"]
    rows = measured["rows"]
    out: dict[str, Any] = {}
    for tokens in plan.sizes:
        n = label(tokens)
        for mode in MODES:
            for what in ("exposed_ms", "prefill_ms", "total_ms"):
                out[f"layerwise.{what}.{mode}.{n}"] = round(_med(rows, mode, tokens, what), 3)
        push = out[f"layerwise.exposed_ms.push.{n}"]
        out[f"layerwise.exposed_vs_push.{n}"] = round(
            out[f"layerwise.exposed_ms.stream.{n}"] / push, 4
        )
        out[f"layerwise.pull_vs_push.{n}"] = round(out[f"layerwise.exposed_ms.pull.{n}"] / push, 4)
        out[f"layerwise.total_vs_push.{n}"] = round(
            out[f"layerwise.total_ms.stream.{n}"] / out[f"layerwise.total_ms.push.{n}"], 4
        )
        stream = [r["exposed_ms"] for r in rows if r["mode"] == "stream" and r["tokens"] == tokens]
        pushes = [r["exposed_ms"] for r in rows if r["mode"] == "push" and r["tokens"] == tokens]
        out[f"layerwise.stream_never_slower.{n}"] = max(stream) < min(pushes)
        out[f"layerwise.stream_rounds.{n}"] = _med(rows, "stream", tokens, "stream_rounds")
    sizing = measured["sizing"]
    out["layerwise.layer_transfer_ms"] = round(sizing["layer_transfer_ms"], 4)
    out["layerwise.layer_compute_ms"] = round(statistics.median(r["layer_ms"] for r in rows), 4)
    out["layerwise.verified_MiB"] = round(sum(r["bytes_checked"] for r in rows) / 2**20, 1)
    out["layerwise.bytes_ok"] = sizing["probes_ok"] and all(r["bytes_ok"] for r in rows)
    largest = label(max(plan.sizes))
    out["layerwise.meets_target"] = out[f"layerwise.exposed_vs_push.{largest}"] <= TARGET and all(
        out[f"layerwise.stream_never_slower.{label(n)}"] for n in plan.sizes
    )
    # The target's condition as run: what a layer took over its chunk's lone transfer (at
    # least --factor, since a layer burns until its time is up; more where it overran).
    out["layerwise.compute_vs_transfer"] = round(
        out["layerwise.layer_compute_ms"] / out["layerwise.layer_transfer_ms"], 3
    )
    out["turns"] = rows
    return out


def side_by_side(out: dict[str, Any], plan: Plan) -> str:
    lines = [
        "        exposed ms: last layer -> D has the KV      total ms: first layer -> D has the KV",
        f"{'tokens':>7} {'pull':>9} {'push':>9} {'stream':>9} {'stream/push':>11}"
        f" {'pull':>10} {'push':>9} {'stream':>9} {'stream/push':>11}",
    ]
    for tokens in plan.sizes:
        n = label(tokens)
        exp = [out[f"layerwise.exposed_ms.{m}.{n}"] for m in MODES]
        tot = [out[f"layerwise.total_ms.{m}.{n}"] for m in MODES]
        lines.append(
            f"{n:>7} {exp[0]:>9.2f} {exp[1]:>9.2f} {exp[2]:>9.2f}"
            f" {out[f'layerwise.exposed_vs_push.{n}']:>11.3f}"
            f" {tot[0]:>10.1f} {tot[1]:>9.1f} {tot[2]:>9.1f}"
            f" {out[f'layerwise.total_vs_push.{n}']:>11.3f}"
        )
    lines.append(
        f"a layer's {label(plan.chunk)} chunk: written alone in "
        f"{out['layerwise.layer_transfer_ms']:.3f} ms, computed in "
        f"{out['layerwise.layer_compute_ms']:.3f} ms "
        f"({out['layerwise.compute_vs_transfer']:.2f}x)"
    )
    lines.append(
        "bytes "
        f"{'all checked' if out['layerwise.bytes_ok'] else 'NOT all right'} "
        f"({out['layerwise.verified_MiB']} MiB); target (stream/push <= {TARGET} at "
        f"{label(max(plan.sizes))}, never slower): "
        f"{'met' if out['layerwise.meets_target'] else 'MISSED'}"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument("--quick", action="store_true", help="4k and 8k tokens, 2 turns")
    parser.add_argument("--repeats", type=int, default=None, metavar="N",
                        help="timed turns per mode and size (default 3; --quick 2)")  # fmt: skip
    parser.add_argument("--factor", type=float, default=1.0, metavar="F",
                        help="a layer's compute over its transfer (default 1)")  # fmt: skip
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    if args.repeats is not None and not 1 <= args.repeats <= 50:
        parser.error(f"--repeats must be 1..50, got {args.repeats}")
    if not 0.1 <= args.factor <= 10:
        parser.error(f"--factor must be 0.1..10, got {args.factor:g}")
    plan = replace(plan, repeats=args.repeats or plan.repeats, factor=args.factor)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.update(BLAS_THREADS)  # the emulated compute is one thread, as a GPU's driver
    zygote = Zygote(sys.executable)
    began = time.monotonic()
    try:
        measured = measure(
            zygote,
            plan,
            lambda line: print(f"[{time.monotonic() - began:.0f} s] {line}", file=sys.stderr),
        )
    finally:
        zygote.close()
    out = report(measured)
    print(side_by_side(out, plan), file=sys.stderr)
    if args.json:
        print(json.dumps(out, indent=1))
    return 0 if out["layerwise.bytes_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
