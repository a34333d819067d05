"""The simulator: clean runs under every fault, determinism, and the command's contract."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvwire.cli import main
from kvwire.errors import ConfigError
from kvwire.sim import FAULT_NAMES, Faults, parse_faults, simulate

REQUIRED_KEYS = {
    "requests",
    "done",
    "failed",
    "leaked_blocks",
    "double_frees",
    "stuck",
    "invariant_violations",
    "bytes_verified",
    "wall_s",
}


@pytest.mark.parametrize("seed", [1, 2])
def test_all_faults_leave_nothing_leaked_stuck_or_corrupt(seed: int) -> None:
    result = simulate(seed, 3000, parse_faults("all"))
    assert result.requests == 3000
    assert result.done + result.failed == result.requests
    assert result.leaked_blocks == 0 and result.double_frees == 0
    assert result.stuck == 0 and result.corrupt == 0
    assert result.invariant_violations == 0, result.violations
    assert result.done > result.requests // 2  # faults cost requests, not the run
    assert result.failed > 0  # and they really were injected
    assert result.bytes_verified > 0


@pytest.mark.parametrize("fault", FAULT_NAMES)
def test_each_fault_alone_is_survived(fault: str) -> None:
    result = simulate(7, 600, parse_faults(fault))
    assert result.ok, (fault, result.violations)
    assert result.done + result.failed == 600


def test_without_faults_every_request_is_done_and_verified() -> None:
    result = simulate(3, 800, parse_faults("none"))
    assert result.done == 800 and result.failed == 0
    assert result.ok


def test_a_seed_reproduces_its_run() -> None:
    a = dataclasses.asdict(simulate(5, 500, parse_faults("all")))
    b = dataclasses.asdict(simulate(5, 500, parse_faults("all")))
    for d in (a, b):
        d.pop("wall_s")
    assert a == b


def test_unknown_fault_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        parse_faults("drop,meteor")


def test_command_prints_json_with_the_required_keys(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["sim", "--requests", "300", "--seed", "4", "--faults", "all", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert set(out) >= REQUIRED_KEYS
    assert out["requests"] == 300 and out["invariant_violations"] == 0


def test_command_summary_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--requests", "200", "--faults", "drop,abort"]) == 0
    text = capsys.readouterr().out
    assert "leaked blocks     0" in text and "stuck             0" in text
    assert main(["sim", "--requests", "0"]) == 2
    assert main(["sim", "--faults", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "unknown fault" in err


def test_command_exits_1_when_an_invariant_broke(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvwire.sim
    from kvwire.sim import SimResult

    monkeypatch.setattr(kvwire.sim, "simulate", lambda *a, **k: SimResult(seed=0, stuck=1))
    assert main(["sim", "--requests", "10", "--json"]) == 1


def test_notifications_still_parked_at_quiescence_count_as_stuck(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The final leak check reads every consumer rank's parked buffer, not only its requests."""
    from kvwire.machine import ConsumerMachine

    monkeypatch.setattr(ConsumerMachine, "parked_completions", lambda self: 1)
    result = simulate(3, 50, parse_faults("none"))
    assert result.stuck > 0 and not result.ok
    assert any("still parks write notifications" in v for v in result.violations)


def test_partition_old_rule_reports_stale_kv_done_new_rule_never() -> None:
    """The worst failure kvwire has seen, replayed: links cut for longer than the producer's
    lease while READs hang, then healed, with producers reusing freed blocks for other
    prompts. Under the old rule (reads not bounded by the lease, no quarantine, no
    transfer deadline) consumers report requests done holding another prompt's KV; under
    the new rule, on the same seed, none, and the affected requests fail as expired. The
    consumers confirm leases by query (every engine is kvwire), and a partition cuts the
    queries off with the heartbeats, so the confirmed leases never cover a cut."""
    faults = Faults(partition=0.001, short_lease=True, kinds=("short-lease", "partition"))
    old = simulate(1, 4000, faults, True)
    assert old.partitions > 0
    assert old.stale_done > 0 and not old.ok
    new = simulate(1, 4000, faults)
    assert new.partitions > 0
    assert new.stale_done == 0 and new.corrupt == 0
    assert new.ok, new.violations
    assert new.failures_by_reason.get("expired", 0) > 0
    assert new.lease_queries > 0 and old.lease_queries == 0
