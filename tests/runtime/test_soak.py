"""The real-process soak (`kvwire soak`): killing a decode rank costs only its requests,
and a short chaotic soak drains with nothing leaked or stuck.

The long soaks are commands (docs/reliability.md records their figures); these tests keep
the soak's own machinery honest in a few seconds.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from kvwire.cli import main
from kvwire.demo.engines import EngineOptions, PrefillEngine
from kvwire.demo.soak import KILLED, ChaosDecodeEngine

from .conftest import finish

pytestmark = pytest.mark.slow

TOKENS = 256  # 16 blocks: 1 MiB per layer


def _options(role: str, tp: int) -> EngineOptions:
    return EngineOptions(
        model="llama-3-8b",
        layers=2,
        tp=tp,
        num_blocks=256,
        mode="pull",
        transport="shm",
        engine_id=f"{role}-soaktest",
        lease_s=2.0,
    )


def test_killed_decode_rank_fails_its_requests_and_the_pools_come_back() -> None:
    prefill = PrefillEngine(_options("prefill", 1))
    decode = ChaosDecodeEngine(_options("decode", 2))
    prefill.start()
    decode.start()
    try:
        # Rank 0 is frozen first, so it cannot report before it dies: its requests are
        # certainly in flight when it is killed.
        os.kill(decode._ranks[0].proc.pid, signal.SIGSTOP)
        doomed = {f"doomed-{i}": i for i in range(4)}
        for rid, i in doomed.items():
            decode.submit(rid, i, prefill.prefill(rid, i, TOKENS), TOKENS)
        decode.kill_rank(0)
        assert not decode.healthy
        results = finish(decode, len(doomed))
        for res in results:
            # Rank 1 received its share intact; rank 0's share is lost with it.
            assert not res.ok and res.reasons == [KILLED], res
            assert res.invalid_blocks == [res.blocks], res
            assert res.checked_bytes > 0 and res.wrong_bytes == 0, res
        assert decode.blocks_missing() == 0, "a dead rank's requests kept their blocks"

        decode.restart_rank(0)
        assert decode.healthy
        fresh = {f"fresh-{i}": 10 + i for i in range(3)}
        for rid, i in fresh.items():
            decode.submit(rid, i, prefill.prefill(rid, i, TOKENS), TOKENS)
        again = finish(decode, len(fresh))
        assert all(r.ok and r.wrong_bytes == 0 and r.checked_bytes > 0 for r in again), again

        # P never heard from the dead rank about the doomed requests: its lease frees them.
        deadline = time.monotonic() + 30
        while prefill.held_requests() and time.monotonic() < deadline:
            prefill.reclaim()
            time.sleep(0.1)
        assert prefill.held_requests() == 0
        assert sum(int(rank["held"]) for rank in prefill.stats()) == 0
        assert prefill.freed_reasons["expired"] == len(doomed)
        assert prefill.freed_reasons["sent"] == len(fresh)
    finally:
        decode.close()
        prefill.close()


def test_soak_command_with_chaos_drains_without_leaks(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["soak", "--seconds", "8", "--chaos", "--kill-every", "1.5", "--downtime", "0.1",
            "0.3", "--seed", "3", "--layers", "1", "--tokens", "128", "--p-tp", "1",
            "--d-tp", "2", "--lease", "2", "--report-every", "2", "--json"]  # fmt: skip
    code = main(argv)
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert code == 0, summary
    assert summary["faults_injected"] >= 1 and summary["restarts"] == summary["faults_injected"]
    assert summary["done"] > 0 and summary["bytes_verified"] > 0
    assert summary["bytes_wrong"] == 0
    assert summary["leaks"] == 0 and summary["stuck"] == 0
    assert summary["requests"] == summary["done"] + summary["failed"]
    assert "kill " in captured.err and "requests:" in captured.err  # progress on stderr


@pytest.mark.parametrize(
    "argv",
    [["--seconds", "0"], ["--kill-every", "-1"], ["--downtime", "2", "1"],
     ["--report-every", "0"], ["--transport", "nosuch"], ["--p-tp", "3"]],
)  # fmt: skip
def test_soak_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["soak", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvwire soak: ") and err.count("\n") == 1, err
