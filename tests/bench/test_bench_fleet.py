"""``kvwire bench fleet`` at its smallest: the figures are there and the counts hold (no
timing is asserted; the suite itself is a command, run by hand)."""

from __future__ import annotations

import json

import pytest

from kvwire.cli import main as cli_main


def test_bench_fleet_prints_both_modes_and_the_store_down_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli_main(["bench", "fleet", "--fleet", "1x2x1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    got = {r["name"]: r["value"] for r in report["results"]}
    assert got["fleet.ranks"] == 3
    assert got["fleet.messages.zmq"] == 2 * 2  # two decode ranks x one prefill rank
    assert got["fleet.messages.store"] >= 4 * 3  # four per rank (more if etcd was slow)
    assert got["fleet.messages.store_zmq_handshakes"] == 0
    assert got["fleet.restart_load_failures"] == 0 and got["fleet.cold_load_failures"] == 0
    assert got["fleet.restart_load_failures.zmq"] == 2  # one per decode engine
    assert got["fleet.store_down.messages"] == got["fleet.messages.zmq"]
    assert got["fleet.store_down.restart_load_failures"] == 2
    assert got["fleet.restart_seen_s"] > 0
