"""The outcome recorder ``kvwire conformance`` reads: registered by the plugin only when
``--kvwire-report PATH`` is given, so a run that did not ask records nothing.

One JSON row per test: its node id, the capability group its ``@capability`` files it
under, its outcome (passed, failed, error, skipped, or unchecked: this host cannot verify
a claim) and the first line that explains it. ``unchecked`` lists each unchecked claim
(the group and why), and ``accepted_unchecked`` says whether the run let them pass
(``--kvwire-accept-unchecked``) or failed them (the default: :mod:`kvwire_conformance.plugin`).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvwire_conformance.capabilities import UNCHECKED, declared

__all__ = ["UNCHECKED", "UNFINISHED", "Recorder"]
UNFINISHED = "unfinished"
"""A test whose call never reported: the run stopped (or died) inside it."""


class Recorder:
    """pytest hooks that collect outcomes and write them at the end of the session."""

    def __init__(self, path: str, accept_unchecked: bool = False) -> None:
        self.path = path
        self.accept_unchecked = accept_unchecked
        self.capabilities: dict[str, str] = {}
        self.outcomes: dict[str, dict[str, Any]] = {}

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            self.capabilities[item.nodeid] = declared(item)[0]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.outcomes.setdefault(report.nodeid, {"outcome": UNFINISHED, "detail": ""})
        unchecked = getattr(report, "kvwire_unchecked", None)
        if unchecked is not None:
            entry["outcome"], entry["detail"] = "unchecked", str(unchecked)
        elif report.passed and report.when == "call" and entry["outcome"] == UNFINISHED:
            entry["outcome"] = "passed"
        elif report.skipped:
            entry["outcome"] = "skipped"
            longrepr = report.longrepr
            if isinstance(longrepr, tuple) and len(longrepr) == 3:
                entry["detail"] = str(longrepr[2]).removeprefix("Skipped: ")
            if entry["detail"].startswith(UNCHECKED):
                entry["outcome"] = "unchecked"
        elif report.failed:
            if entry["outcome"] in ("failed", "error"):
                return  # a teardown failing after the call failed keeps the first reason
            entry["outcome"] = "failed" if report.when == "call" else "error"
            message = str(report.longrepr).strip().splitlines()
            failures = [line for line in message if line.startswith("E ")]
            timed_out = [line for line in message if "Timeout" in line and ">" in line]
            first = (timed_out or failures or message[-1:] or [""])[0]
            entry["detail"] = first[1:].strip() if first.startswith("E ") else first.strip()
            if timed_out:
                entry["detail"] = f"hung in {report.when}: {entry['detail']}"

    def pytest_sessionfinish(self, exitstatus: int) -> None:
        for entry in self.outcomes.values():
            if entry["outcome"] == UNFINISHED:
                entry["outcome"] = "error"
                entry["detail"] = "the test never finished (the run was interrupted inside it)"
        rows = [
            {"test": nodeid, "capability": self.capabilities.get(nodeid, "core"), **entry}
            for nodeid, entry in self.outcomes.items()
        ]
        unchecked = [
            {"test": row["test"], "claim": row["capability"], "detail": row["detail"]}
            for row in rows
            if row["outcome"] == "unchecked"
        ]
        doc = {
            "exitstatus": int(exitstatus),
            "tests": rows,
            "unchecked": unchecked,
            "accepted_unchecked": self.accept_unchecked,
        }
        with open(self.path, "w") as out:
            json.dump(doc, out, indent=1)
