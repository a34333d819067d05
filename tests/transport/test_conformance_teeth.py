"""The conformance suite has teeth: it fails deliberately broken shm variants.

Each variant runs through ``kvwire conformance`` exactly as an adapter author would run
it, restricted with ``-k`` to the tests that should catch it (the full suite for shm runs
in test_shm_conformance.py); the same selection passes against the real shm transport.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
CATCHERS = "moves_exact_bytes or notification_arrives_after or exactly_once or close_leaves"


def _conformance(transport: str, *extra: str) -> tuple[int, dict[str, Any]]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "kvwire.cli", "conformance", transport, "--json", *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.stdout.strip(), f"no report (status {done.returncode}): {done.stderr[-2000:]}"
    return done.returncode, json.loads(done.stdout)


def _failed(report: dict[str, Any]) -> set[str]:
    return {
        t["test"].split("::")[-1].split("[")[0]
        for t in report["tests"]
        if t["outcome"] in ("failed", "error")
    }


def test_the_real_shm_transport_passes_the_same_selection() -> None:
    code, report = _conformance("shm", "-k", CATCHERS)
    assert code == 0 and report["passed"], _failed(report)


@pytest.mark.parametrize(
    ("variant", "select", "caught_by"),
    [
        ("drops_last_descriptor", "moves_exact_bytes", {"test_read_moves_exact_bytes"}),
        ("done_before_copy", "moves_exact_bytes", {"test_write_moves_exact_bytes"}),
        (
            # The variant holds its data back after notifying, so either test catches it.
            "notifies_before_data",
            "notification_arrives_after",
            {
                "test_write_notification_arrives_after_its_data",
                "test_read_notification_arrives_after_its_data",
            },
        ),
        ("leaks_thread_on_close", "close_leaves", {"test_close_leaves_no_threads_fds_or_mappings"}),
    ],
)
def test_a_broken_variant_fails_the_suite(variant: str, select: str, caught_by: set[str]) -> None:
    code, report = _conformance(f"kvwire_broken_shm:{variant}", "-k", select)
    assert code != 0 and not report["passed"], f"the suite passed {variant}"
    assert caught_by & _failed(report), f"none of {sorted(caught_by)} failed for {variant}"


def test_injected_duplicate_notifications_fail_the_suite() -> None:
    code, report = _conformance(
        "kvwire.faults:faulty",
        "-o",
        "inner=shm",
        "-o",
        "duplicate_notifications=1.0",
        "-k",
        "exactly_once",
    )
    assert code != 0
    assert "test_notifications_arrive_exactly_once" in _failed(report)


def test_a_missing_transport_option_is_a_usage_error() -> None:
    cmd = [sys.executable, "-m", "kvwire.cli", "conformance", "kvwire.faults:faulty"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "inner" in done.stderr
