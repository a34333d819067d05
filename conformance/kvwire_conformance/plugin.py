"""pytest plugin of the conformance suite (loaded in every pytest run through ``pytest11``).

It stays inert unless asked: it adds the options that pick a transport for the generic
suite module, the ``kvwire_capability`` marker, and, with ``--kvwire-report PATH``, a JSON
record of every test's outcome and capability that ``kvwire conformance`` turns into a table.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

GENERIC_MODULE = "kvwire_conformance.test_selected_transport"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvwire-conformance")
    group.addoption("--kvwire-transport", metavar="NAME", help="transport for the generic suite")
    group.addoption(
        "--kvwire-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="factory option for the transport (VALUE parsed as JSON when it can be)",
    )
    group.addoption("--kvwire-report", metavar="PATH", help="write per-test outcomes as JSON")


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``["k=v", ...]`` to factory keyword options; raises UsageError on a malformed pair."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise pytest.UsageError(f"--kvwire-option wants KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kvwire_capability(name): the transport capability a conformance test checks"
    )
    config._kvwire_outcomes = {}  # type: ignore[attr-defined]


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    generic = [i for i in items if i.path.name == "test_selected_transport.py"]
    if generic:
        _check_selected_transport(config)
    capabilities: dict[str, str] = {}
    for item in items:
        marker = item.get_closest_marker("kvwire_capability")
        capabilities[item.nodeid] = str(marker.args[0]) if marker else "core"
    config._kvwire_capabilities = capabilities  # type: ignore[attr-defined]


def _check_selected_transport(config: pytest.Config) -> None:
    """A generic run without a usable transport is a usage error, never a green run."""
    from kvwire.errors import KVWireError
    from kvwire.transport import create

    name = config.getoption("--kvwire-transport")
    if not name:
        raise pytest.UsageError(
            "the generic conformance suite needs --kvwire-transport NAME (or module:factory)"
        )
    options = parse_options(config.getoption("--kvwire-option"))
    try:
        agent = create(name, "kvwire-conformance-probe", **options)
    except (KVWireError, TypeError) as exc:
        raise pytest.UsageError(f"cannot start transport {name!r} with {options}: {exc}") from exc
    agent.close()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    outcomes: dict[str, dict[str, Any]] = _outcomes
    entry = outcomes.setdefault(report.nodeid, {"outcome": "passed", "detail": ""})
    if report.skipped:
        entry["outcome"] = "skipped"
        longrepr = report.longrepr
        if isinstance(longrepr, tuple) and len(longrepr) == 3:
            entry["detail"] = str(longrepr[2]).removeprefix("Skipped: ")
    elif report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        message = str(report.longrepr).strip().splitlines()
        failures = [line for line in message if line.startswith("E ")]
        entry["detail"] = (failures[0][1:].strip() if failures else message[-1]) if message else ""


_outcomes: dict[str, dict[str, Any]] = {}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = session.config.getoption("--kvwire-report")
    if not path:
        return
    capabilities: dict[str, str] = getattr(session.config, "_kvwire_capabilities", {})
    rows = [
        {"test": nodeid, "capability": capabilities.get(nodeid, "core"), **entry}
        for nodeid, entry in _outcomes.items()
    ]
    with open(path, "w") as out:
        json.dump({"exitstatus": int(exitstatus), "tests": rows}, out, indent=1)
