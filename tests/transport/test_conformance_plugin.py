"""The conformance plugin is inert where it is not asked for.

It is a ``pytest11`` entry point, so it loads in every pytest run of an environment with
kvwire installed. An unrelated project run with it must behave exactly as without it: the
same outcomes, no file written, no suite, transport or numpy import, no marker added to its
tests; only ``--kvwire-report`` (what ``kvwire conformance`` passes) makes it record.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

PROJECT_TESTS = """
import pytest

@pytest.mark.parametrize("x", [1, 2])
def test_passes(x):
    assert x

def test_fails():
    assert False, "on purpose"

@pytest.mark.skip(reason="on purpose")
def test_skipped():
    pass

class TestLikeASuite:
    def test_in_a_class(self):
        pass
"""

OBSERVER = """
import json, os, sys

def pytest_collection_finish(session):
    session.config._observed_markers = {
        item.nodeid: sorted(m.name for m in item.iter_markers()) for item in session.items
    }

def pytest_unconfigure(config):
    manager = config.pluginmanager
    with open(os.environ["OBSERVED"], "w") as out:
        json.dump({
            "plugin_loaded": manager.get_plugin("kvwire_conformance") is not None,
            "recorder": manager.get_plugin("kvwire-conformance-recorder") is not None,
            "modules": sorted(sys.modules),
            "markers": getattr(config, "_observed_markers", {}),
        }, out)
"""


def _run(project: Path, observed: Path, *args: str) -> tuple[int, list[str], dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_DISABLE_PLUGIN_AUTOLOAD"}
    env["OBSERVED"] = str(observed)
    cmd = [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", *args]
    done = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=120)
    outcomes = ("PASSED", "FAILED", "SKIPPED", "ERROR")
    summary = [line for line in done.stdout.splitlines() if line.startswith(outcomes)]
    return done.returncode, sorted(summary), json.loads(observed.read_text())


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if "__pycache__" not in p.parts)


def test_an_unrelated_project_runs_as_without_the_plugin(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_unrelated.py").write_text(PROJECT_TESTS)
    (project / "conftest.py").write_text(OBSERVER)
    before = _tree(project)

    code, summary, seen = _run(project, tmp_path / "with.json")
    code_without, summary_without, seen_without = _run(
        project, tmp_path / "without.json", "-p", "no:kvwire_conformance"
    )

    assert seen["plugin_loaded"], "the entry point did not load: this proves nothing"
    assert not seen_without["plugin_loaded"]
    assert (code, summary) == (code_without, summary_without)
    assert code == 1 and len(summary) == 5, summary  # the run did what the project says
    assert seen["markers"] == seen_without["markers"], "the plugin marked the project's tests"
    assert not seen["recorder"], "the plugin recorded a run that did not ask"
    imported = set(seen["modules"]) - set(seen_without["modules"])
    assert imported == {"kvwire_conformance", "kvwire_conformance.plugin"}, sorted(imported)
    assert _tree(project) == before, "the plugin wrote into the project"


def test_it_records_only_when_asked(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_unrelated.py").write_text(PROJECT_TESTS)
    (project / "conftest.py").write_text(OBSERVER)
    report = tmp_path / "report.json"

    code, _, seen = _run(project, tmp_path / "seen.json", "--kvwire-report", str(report))

    assert code == 1 and seen["recorder"]
    rows = {row["test"].split("::")[-1]: row for row in json.loads(report.read_text())["tests"]}
    assert {name: row["outcome"] for name, row in rows.items()} == {
        "test_passes[1]": "passed",
        "test_passes[2]": "passed",
        "test_fails": "failed",
        "test_skipped": "skipped",
        "test_in_a_class": "passed",
    }
    assert {row["capability"] for row in rows.values()} == {"core"}


def test_each_suite_test_declares_its_needs_once_and_each_is_a_capability() -> None:
    import dataclasses

    from kvwire_conformance import TransportSuite
    from kvwire_conformance.capabilities import MARKER, MEMORY_KINDS

    from kvwire.transport import Capabilities

    flags = {f.name for f in dataclasses.fields(Capabilities)}
    tests = [name for name in dir(TransportSuite) if name.startswith("test_")]
    assert len(tests) >= 31
    wrong = []
    for name in tests:
        marks = [m for m in getattr(getattr(TransportSuite, name), "pytestmark", [])]
        declared = [m for m in marks if m.name == MARKER]
        if len(declared) > 1:
            wrong.append(f"{name}: {len(declared)} capability markers")
        for mark in declared:
            for need in mark.args:
                for op in ("read", "write"):
                    if str(need).format(op=op) not in flags | set(MEMORY_KINDS):
                        wrong.append(f"{name}: {need!r}")
    assert wrong == []
