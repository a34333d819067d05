"""The conformance suite passes adapters that keep the contract in ways timing hides.

A suite test that fails a conforming adapter only when something lands late (a released
transfer's bytes, a notification from an earlier test) or when the host stalls a call
fails CI now and then. Each wrapper
in :mod:`kvwire_lawful` makes such an allowed behaviour happen on every run, over shm, and
the tests it touches must pass; before they were fixed, each of these runs failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

CASES = {
    "late_detached_transfers": (
        "test_release_of_a_running_transfer or test_random_operation_sequences"
    ),
    "late_foreign_notifications": (
        "notification or test_several_peers_at_once or test_random_operation_sequences"
        " or test_transfers_and_releases_return_resources_to_baseline"
    ),
    "loaded_host_stalls_a_wait": "test_wait_returns_within_its_timeout",
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("wrapper", list(CASES))
def test_the_suite_passes_a_lawful_adapter(wrapper: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    env.setdefault("UCX_NET_DEVICES", "lo")
    cmd = [
        sys.executable, "-m", "kvwire.cli", "conformance", f"kvwire_lawful:{wrapper}",
        "--json", "--accept-unchecked", "-k", CASES[wrapper],
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert done.stdout.strip(), f"no report (status {done.returncode}): {done.stderr[-2000:]}"
    report = json.loads(done.stdout)
    outcomes = {t["test"].split("::")[-1]: t for t in report["tests"]}
    failed = {n: t["detail"] for n, t in outcomes.items() if t["outcome"] in ("failed", "error")}
    assert not failed, f"the suite failed a lawful adapter ({wrapper}): {failed}"
    assert any(t["outcome"] == "passed" for t in outcomes.values()), outcomes
    assert done.returncode == 0, done.stderr[-2000:]
