"""Disaggregated serving end to end: P and D engine groups as processes, kvwire's runtime
moving the KV over a real transport, a proxy in between, and the greedy tokens compared
with one monolithic engine's.

Each case serves three prompts to one P/D pair: one not a multiple of the block size, one
shorter than a block, and one that extends the first prompt's two leading blocks, which D
therefore serves from its own prefix cache and receives only the rest of.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import pytest

pytest.importorskip("torch")

from kvwire.examples.engine import CacheConfig, Engine, ModelConfig
from kvwire.examples.engine.process import EngineProcess
from kvwire.examples.engine.proxy import Proxy
from kvwire.examples.engine.serving import ServerConfig

pytestmark = pytest.mark.slow

MODEL = ModelConfig()  # 8 query heads over 2 KV heads: D TP 4 holds one KV head on two ranks
BLOCK = 16
TOKENS = 32
RAGGED = [(11 * i + 2) % 256 for i in range(45)]
SHORT = [(5 * i + 1) % 256 for i in range(11)]
EXTENDS = RAGGED[: 2 * BLOCK] + [(7 * i + 3) % 256 for i in range(21)]
PROMPTS = [RAGGED, SHORT, EXTENDS]
_expected: dict[tuple[int, ...], list[int]] = {}


def monolithic(prompt: list[int]) -> list[int]:
    key = tuple(prompt)
    if key not in _expected:
        _expected[key] = Engine(MODEL, CacheConfig(block_size=BLOCK)).generate(prompt, TOKENS)
    return _expected[key]


@dataclass(frozen=True)
class Case:
    p_tp: int
    d_tp: int
    layout: str
    mode: str

    def __str__(self) -> str:
        return f"{self.p_tp}->{self.d_tp}-{self.layout}-{self.mode}"


CASES = [
    Case(1, 1, "HND", "pull"),
    Case(1, 1, "NHD", "push"),
    Case(2, 4, "HND", "pull"),
    Case(2, 4, "NHD", "push"),
    Case(4, 2, "NHD", "pull"),
    Case(4, 2, "HND", "push"),
    Case(2, 1, "NHD", "pull"),
    Case(2, 1, "HND", "push"),
]


def server(role: str, tp: int, layout: str, mode: str, transport: str = "shm") -> ServerConfig:
    return ServerConfig(
        role=role,  # type: ignore[arg-type]
        engine_id=f"{role}-engine",
        model=MODEL,
        cache=CacheConfig(tp_size=tp, layout=layout, block_size=BLOCK),
        mode=mode,  # type: ignore[arg-type]
        transport=transport,
        transfer_timeout_s=60.0,
    )


def wait_all_freed(p: EngineProcess, timeout: float = 30.0) -> dict[str, object]:
    """P gives every block back once consumers are done (condition, not a sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = p.call({"op": "stats"})
        if not stats["held_requests"] and stats["free_blocks"] == stats["num_blocks"]:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"P still holds blocks: {stats}")
        time.sleep(0.05)


def serve_all(p: EngineProcess, d: EngineProcess) -> None:
    proxy = Proxy(p, d)
    for index, prompt in enumerate(PROMPTS):
        done = proxy.complete(f"req-{index}", prompt, TOKENS)
        assert done.failed is None
        assert done.tokens == monolithic(prompt), f"prompt {index} diverged"
        assert done.p_first_token == done.tokens[0]
        expected_hit = 2 * BLOCK if prompt is EXTENDS else 0
        assert done.num_cached_on_d == expected_hit
    stats = wait_all_freed(p)
    assert stats["runtime_errors"] == []
    assert d.call({"op": "stats"})["runtime_errors"] == []


@pytest.mark.parametrize("case", CASES, ids=str)
def test_pd_tokens_match_monolithic(case: Case) -> None:
    with (
        EngineProcess(server("prefill", case.p_tp, case.layout, case.mode)) as p,
        EngineProcess(server("decode", case.d_tp, case.layout, case.mode)) as d,
    ):
        serve_all(p, d)


def test_pd_mixed_layouts_mla() -> None:
    mla = ModelConfig(mla=True, seed=1)
    prompt = RAGGED
    want = Engine(mla, CacheConfig(block_size=BLOCK)).generate(prompt, TOKENS)
    p_cfg = ServerConfig(
        role="prefill",
        engine_id="p-mla",
        model=mla,
        cache=CacheConfig(tp_size=4, layout="NHD", block_size=BLOCK),
    )
    d_cfg = ServerConfig(
        role="decode",
        engine_id="d-mla",
        model=mla,
        cache=CacheConfig(tp_size=2, layout="HND", block_size=BLOCK),
    )
    with EngineProcess(p_cfg) as p, EngineProcess(d_cfg) as d:
        done = Proxy(p, d).complete("mla", prompt, TOKENS)
        assert done.failed is None and done.tokens == want
        wait_all_freed(p)


def test_corrupted_block_is_never_a_silent_match() -> None:
    """D's transport garbles the first block every READ lands and still reports DONE."""
    corrupt = "kvwire.examples.engine.corrupting_transport:corrupting"
    with (
        EngineProcess(server("prefill", 2, "HND", "pull")) as p,
        EngineProcess(server("decode", 2, "HND", "pull", transport=corrupt)) as d,
    ):
        done = Proxy(p, d).complete("bad", RAGGED, TOKENS)
        assert done.failed is not None or done.tokens != monolithic(RAGGED)


def test_failed_transfer_is_reported_not_generated() -> None:
    """A transfer the transport reports FAILED ends the request as failed on D."""
    options = {"inner": "shm", "done_to_failed": 1.0}
    p_cfg = server("prefill", 2, "HND", "pull")
    d_cfg = ServerConfig(
        role="decode",
        engine_id="decode-engine",
        model=MODEL,
        cache=CacheConfig(tp_size=4, block_size=BLOCK),
        transport="kvwire.testing.faulty_transport:faulty",
        transport_options=options,
    )
    with EngineProcess(p_cfg) as p, EngineProcess(d_cfg) as d:
        done = Proxy(p, d).complete("doomed", RAGGED, TOKENS)
        assert done.failed is not None and "transfer" in done.failed
        assert done.tokens == []
        assert d.call({"op": "stats"})["active_requests"] == []


def test_cli_demo_engine_json() -> None:
    import json
    import subprocess
    import sys

    argv = [sys.executable, "-m", "kvwire", "demo", "--engine", "--json", "--prompts", "3"]
    argv += ["--max-tokens", "8", "--p-tp", "2", "--d-tp", "1", "--mode", "push"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["prompts"] == 3
    assert report["tokens_compared"] == 24
    assert report["mismatched_tokens"] == 0 and report["all_match"] is True
    assert set(report["ttft_mean_s"]) == {"prefill", "transfer", "first_decode_step", "total"}


def test_cli_demo_engine_defaults_to_heterogeneous_tp() -> None:
    """Bare ``kvwire demo --engine`` is P TP2 -> D TP4 (as documented); the byte demo TP1."""
    from kvwire.cli import build_parser
    from kvwire.commands.demo import workload_options
    from kvwire.examples.engine.demo import _opt

    args = build_parser().parse_args(["demo", "--engine"])
    assert (_opt(args, "p_tp"), _opt(args, "d_tp")) == (2, 4)
    assert (workload_options(args).p_tp, workload_options(args).d_tp) == (1, 1)
    given = build_parser().parse_args(["demo", "--engine", "--p-tp", "1", "--d-tp", "1"])
    assert (_opt(given, "p_tp"), _opt(given, "d_tp")) == (1, 1)


def test_pd_over_nixl() -> None:
    """The same engine pair over NIXL (UCX on loopback; the Makefile sets UCX_NET_DEVICES)."""
    case = Case(2, 4, "HND", "pull")
    with (
        EngineProcess(server("prefill", case.p_tp, case.layout, case.mode, "nixl")) as p,
        EngineProcess(server("decode", case.d_tp, case.layout, case.mode, "nixl")) as d,
    ):
        serve_all(p, d)


def test_pd_with_every_rank_in_its_own_process() -> None:
    """Ranks as processes: D's one rank reads heads from two P rank processes."""
    p_cfg = replace(server("prefill", 2, "NHD", "pull"), rank_processes=True)
    d_cfg = replace(server("decode", 1, "HND", "pull"), rank_processes=True)
    with EngineProcess(p_cfg) as p, EngineProcess(d_cfg) as d:
        serve_all(p, d)
