"""pytest plugin of the conformance suite (loaded in every pytest run through ``pytest11``).

It stays inert unless asked: it adds the options that pick a transport for the generic
suite module, the ``kvwire_capability`` marker, and, with ``--kvwire-report PATH``, a JSON
record of every test's outcome and capability that ``kvwire conformance`` turns into a table.

Every suite test runs under pytest-timeout (``--kvwire-timeout``, setup and teardown
included): an adapter that hangs in ``close()`` or never delivers a notification fails the
test it hangs in, by name, instead of freezing the run. The startup probe is bounded too.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

GENERIC_MODULE = "kvwire_conformance.test_selected_transport"
DEFAULT_TIMEOUT_S = 120.0
"""Seconds one suite test (setup, call and teardown) may take before it fails as hung."""
UNCHECKED = "could not check"
"""How a test's skip reason starts when the host cannot verify a claimed capability."""


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
    group.addoption(
        "--kvwire-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"fail a suite test that runs longer (default {DEFAULT_TIMEOUT_S:g})",
    )


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
    timeout = float(config.getoption("--kvwire-timeout"))
    for item in items:
        marker = item.get_closest_marker("kvwire_capability")
        capabilities[item.nodeid] = str(marker.args[0]) if marker else "core"
        if _in_suite(item) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(timeout, method="signal", func_only=False))
    config._kvwire_capabilities = capabilities  # type: ignore[attr-defined]


def _in_suite(item: pytest.Item) -> bool:
    from kvwire_conformance.suite import TransportSuite

    cls = getattr(item, "cls", None)
    return cls is not None and issubclass(cls, TransportSuite)


def _check_selected_transport(config: pytest.Config) -> None:
    """A generic run without a usable transport is a usage error, never a green run.

    The probe agent starts and closes on a helper thread, within the test timeout: a
    transport that cannot start in time is a usage error; one whose ``close()`` hangs is
    left to the tests, each of which then fails by name when its own timeout fires.
    """
    from kvwire.errors import KVWireError
    from kvwire.transport import create

    name = config.getoption("--kvwire-transport")
    if not name:
        raise pytest.UsageError(
            "the generic conformance suite needs --kvwire-transport NAME (or module:factory)"
        )
    options = parse_options(config.getoption("--kvwire-option"))
    timeout = float(config.getoption("--kvwire-timeout"))
    started = threading.Event()
    failure: list[BaseException] = []

    def probe() -> None:
        try:
            agent = create(name, "kvwire-conformance-probe", **options)
        except BaseException as exc:  # handed to the main thread below
            failure.append(exc)
            started.set()
            return
        started.set()
        agent.close()

    thread = threading.Thread(target=probe, name="kvwire-conformance-probe", daemon=True)
    thread.start()
    if not started.wait(timeout):
        raise pytest.UsageError(f"transport {name!r} did not start within {timeout:g} s")
    if failure:
        exc = failure[0]
        if isinstance(exc, (KVWireError, TypeError)):
            raise pytest.UsageError(f"cannot start transport {name!r} with {options}: {exc}")
        raise exc
    thread.join(timeout)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    outcomes: dict[str, dict[str, Any]] = _outcomes
    entry = outcomes.setdefault(report.nodeid, {"outcome": UNFINISHED, "detail": ""})
    if report.passed and report.when == "call" and entry["outcome"] == UNFINISHED:
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


_outcomes: dict[str, dict[str, Any]] = {}
UNFINISHED = "unfinished"
"""A test whose call never reported: the run stopped (or died) inside it."""


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = session.config.getoption("--kvwire-report")
    if not path:
        return
    capabilities: dict[str, str] = getattr(session.config, "_kvwire_capabilities", {})
    for entry in _outcomes.values():
        if entry["outcome"] == UNFINISHED:
            entry["outcome"] = "error"
            entry["detail"] = "the test never finished (the run was interrupted inside it)"
    rows = [
        {"test": nodeid, "capability": capabilities.get(nodeid, "core"), **entry}
        for nodeid, entry in _outcomes.items()
    ]
    with open(path, "w") as out:
        json.dump({"exitstatus": int(exitstatus), "tests": rows}, out, indent=1)
