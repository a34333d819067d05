"""The demo takes its mode and transport from the one configuration: a flag, else the
KVWIRE_* variable, else the --config file, else the default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SMALL = ["--requests", "2", "--tokens", "64", "--layers", "1", "--no-progress", "--json"]


def _demo(*argv: str, env: dict[str, str]) -> dict[str, object]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_")}
    proc = subprocess.run(
        [sys.executable, "-m", "kvwire", *argv],
        env={**base, "UCX_NET_DEVICES": "lo", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    summary: dict[str, object] = json.loads(proc.stdout)
    return summary


def test_the_demo_honours_kvwire_transport_and_mode() -> None:
    pytest.importorskip("kvwire_ucx", reason="the ucx extra is not installed")
    summary = _demo("demo", *SMALL, env={"KVWIRE_TRANSPORT": "ucx", "KVWIRE_MODE": "push"})
    assert (summary["transport"], summary["mode"], summary["verified"]) == ("ucx", "push", True)


def test_a_flag_wins_over_the_variable_and_the_file(tmp_path: Path) -> None:
    config = tmp_path / "kvwire.toml"
    config.write_text('mode = "push"\nlease_s = 12\n')
    summary = _demo(
        "--config", str(config), "demo", "--mode", "pull", *SMALL,
        env={"KVWIRE_MODE": "push", "KVWIRE_TRANSPORT": "shm"},
    )  # fmt: skip
    assert (summary["transport"], summary["mode"]) == ("shm", "pull")
    summary = _demo("demo", *SMALL, env={"KVWIRE_CONFIG": str(config)})
    assert summary["mode"] == "push"  # the file, with no flag and no variable
