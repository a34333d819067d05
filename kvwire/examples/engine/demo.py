"""``kvwire demo --engine``: disaggregated generation checked token by token.

Starts a P engine group and a D engine group as separate processes (TP sizes and layouts
independent), pushes N prompts through the proxy (prompt to P, ``kv_transfer_params`` to D,
tokens from D), runs the same prompts through one monolithic engine, and reports whether
every greedy token matches, with time-to-first-token split into P's prefill, the KV
transfer, and D's first decode step. Some prompts share a prefix with an earlier one, so D
serves part of them from its own prefix cache and receives only the rest. The command's
options are defined in :mod:`kvwire.commands.demo`, which imports this module (and torch)
only when ``--engine`` is given.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from typing import Any, Literal

from kvwire.errors import ConfigError
from kvwire.examples.engine.engine import Engine
from kvwire.examples.engine.process import EngineProcess
from kvwire.examples.engine.proxy import Completion, Proxy
from kvwire.examples.engine.serving import ServerConfig
from kvwire.examples.engine.settings import CacheConfig, ModelConfig

DEFAULTS: dict[str, Any] = {
    "prompts": 6,
    "max_tokens": 32,
    "p_tp": 2,
    "d_tp": 4,
    "p_layout": "HND",
    "d_layout": "NHD",
    "mode": "pull",
    "mla": False,
    "block_size": 16,
    "seed": 0,
    "transport": "shm",
    "json": False,
    "rank_processes": False,
}


def _opt(args: argparse.Namespace, name: str) -> Any:
    """The option as given, else the engine demo's default (the shared --p-tp and --d-tp
    stay None unless given; see :func:`kvwire.commands.demo.add_workload_arguments`)."""
    value = getattr(args, name, None)
    return DEFAULTS[name] if value is None else value


def make_prompts(count: int, block_size: int, seed: int, vocab: int) -> list[list[int]]:
    """Prompts of varied lengths (block-aligned and not); every third one extends an earlier
    prompt's first two blocks, so D finds that prefix in its own cache."""
    rng = random.Random(seed)
    lengths = [2 * block_size + 5, block_size - 3, 3 * block_size, 2 * block_size + 9]
    prompts: list[list[int]] = []
    for index in range(count):
        length = lengths[index % len(lengths)]
        if index % 3 == 2 and prompts and len(prompts[0]) > 2 * block_size:
            prefix = prompts[0][: 2 * block_size]
            prompts.append(prefix + [rng.randrange(vocab) for _ in range(length)])
        else:
            prompts.append([rng.randrange(vocab) for _ in range(length)])
    return prompts


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    """Serve the prompts disaggregated and monolithically; the comparison as a dict."""
    count, max_tokens = int(_opt(args, "prompts")), int(_opt(args, "max_tokens"))
    if count <= 0 or max_tokens <= 0:
        raise ConfigError("--prompts and --max-tokens must be positive")
    model = ModelConfig(mla=bool(_opt(args, "mla")), seed=int(_opt(args, "seed")))
    block = int(_opt(args, "block_size"))
    mode = str(_opt(args, "mode"))
    transport = str(_opt(args, "transport"))
    p_cache = CacheConfig(
        tp_size=_opt(args, "p_tp"), layout=_opt(args, "p_layout"), block_size=block
    )
    d_cache = CacheConfig(
        tp_size=_opt(args, "d_tp"), layout=_opt(args, "d_layout"), block_size=block
    )
    p_cache.check_model(model)
    d_cache.check_model(model)
    prompts = make_prompts(count, block, int(_opt(args, "seed")), model.vocab_size)
    mono = Engine(model, CacheConfig(tp_size=1, block_size=block))
    expected = [mono.generate(p, max_tokens, request_id=f"mono-{i}") for i, p in enumerate(prompts)]

    def server(role: Literal["prefill", "decode"], cache: CacheConfig) -> ServerConfig:
        engine_id = f"{role}-0"
        mode_: Literal["pull", "push"] = "push" if mode == "push" else "pull"
        return ServerConfig(
            role=role,
            engine_id=engine_id,
            model=model,
            cache=cache,
            mode=mode_,
            transport=transport,
            rank_processes=bool(_opt(args, "rank_processes")),
        )

    completions: list[Completion] = []
    with (
        EngineProcess(server("prefill", p_cache)) as p,
        EngineProcess(server("decode", d_cache)) as d,
    ):
        proxy = Proxy(p, d)
        for index, prompt in enumerate(prompts):
            completions.append(proxy.complete(f"req-{index}", prompt, max_tokens))
    return build_report(prompts, expected, completions, p_cache, d_cache, model, mode, transport)


def build_report(
    prompts: list[list[int]],
    expected: list[list[int]],
    completions: list[Completion],
    p_cache: CacheConfig,
    d_cache: CacheConfig,
    model: ModelConfig,
    mode: str,
    transport: str,
) -> dict[str, Any]:
    requests = []
    mismatched = compared = 0
    for prompt, want, got in zip(prompts, expected, completions, strict=True):
        wrong = sum(1 for a, b in zip(want, got.tokens, strict=False) if a != b)
        wrong += abs(len(want) - len(got.tokens))
        compared += len(want)
        mismatched += wrong
        requests.append(
            {
                "request_id": got.request_id,
                "prompt_tokens": len(prompt),
                "cached_on_d": got.num_cached_on_d,
                "match": wrong == 0 and got.failed is None,
                "mismatched_tokens": wrong,
                "failed": got.failed,
                "prefill_s": got.prefill_s,
                "transfer_s": got.transfer_s,
                "first_step_s": got.first_step_s,
                "ttft_s": got.ttft_s,
            }
        )
    ok = [c for c in completions if c.failed is None]

    def mean(name: str) -> float | None:
        return statistics.fmean(getattr(c, name) for c in ok) if ok else None

    return {
        "prompts": len(prompts),
        "tokens_compared": compared,
        "mismatched_tokens": mismatched,
        "failed_requests": len(completions) - len(ok),
        "all_match": mismatched == 0 and len(ok) == len(completions),
        "config": {
            "p_tp": p_cache.tp_size,
            "d_tp": d_cache.tp_size,
            "p_layout": p_cache.kv_layout.value,
            "d_layout": d_cache.kv_layout.value,
            "block_size": p_cache.block_size,
            "mode": mode,
            "transport": transport,
            "mla": model.mla,
            "q_heads": model.q_heads,
            "kv_heads": model.cached_kv_heads,
        },
        "ttft_mean_s": {
            "prefill": mean("prefill_s"),
            "transfer": mean("transfer_s"),
            "first_decode_step": mean("first_step_s"),
            "total": mean("ttft_s"),
        },
        "requests": requests,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:7.2f}"


def print_report(report: dict[str, Any]) -> None:
    cfg = report["config"]
    kind = "MLA" if cfg["mla"] else f"GQA {cfg['kv_heads']} KV heads"
    print(
        f"P TP{cfg['p_tp']} {cfg['p_layout']} -> D TP{cfg['d_tp']} {cfg['d_layout']}, "
        f"{cfg['mode']} over {cfg['transport']}, {kind}, blocks of {cfg['block_size']}"
    )
    print(
        f"{'request':<8} {'prompt':>6} {'D hit':>5} {'prefill':>8} {'xfer':>8} {'step1':>8} "
        f"{'TTFT ms':>8}  tokens"
    )
    for r in report["requests"]:
        verdict = "match" if r["match"] else (r["failed"] or f"{r['mismatched_tokens']} differ")
        print(
            f"{r['request_id']:<8} {r['prompt_tokens']:>6} {r['cached_on_d']:>5} "
            f"{_ms(r['prefill_s'])} {_ms(r['transfer_s'])} {_ms(r['first_step_s'])} "
            f"{_ms(r['ttft_s'])}  {verdict}"
        )
    t = report["ttft_mean_s"]
    print(
        f"mean TTFT {_ms(t['total']).strip()} ms = prefill {_ms(t['prefill']).strip()} + "
        f"transfer {_ms(t['transfer']).strip()} + first decode step "
        f"{_ms(t['first_decode_step']).strip()} (+ proxy/IPC)"
    )
    verdict = "every token matches" if report["all_match"] else "MISMATCH"
    print(
        f"{report['prompts']} prompts, {report['tokens_compared']} tokens compared, "
        f"{report['mismatched_tokens']} mismatched, {report['failed_requests']} failed: {verdict}"
    )


def run(args: argparse.Namespace) -> int:
    """Entry point for ``kvwire demo --engine``: 0 when every token matches, else 1."""
    import json

    report = run_demo(args)
    if _opt(args, "json"):
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        print_report(report)
    return 0 if report["all_match"] else 1
