"""pytest plugin of the conformance suite (``pytest11`` entry point, so loaded in every
pytest run of an environment where kvwire is installed).

Installed, it only registers: the ``kvwire_capability`` marker and the ``--kvwire-*``
options. Everything else acts only when asked:

* ``--kvwire-report PATH`` registers the recorder (:mod:`kvwire_conformance.report`),
  which writes each test's outcome and capability as JSON for ``kvwire conformance``;
  without it nothing is recorded.
* Tests of a :class:`~kvwire_conformance.base.SuiteBase` subclass (found without importing
  the suite: a run that never imported it has none) run under pytest-timeout
  (``--kvwire-timeout``, setup and teardown included), so an adapter that hangs in
  ``close()`` or never delivers a notification fails the test it hangs in, by name,
  instead of freezing the run.
* A suite test that could not check a claim on this host (it skipped with a reason that
  starts ``could not check``) fails, naming the claim, unless
  ``--kvwire-accept-unchecked`` is given: then it stays a skip the report files as
  ``unchecked``. A claim nobody verified is never a silent pass.
* Collecting the generic module (``kvwire conformance``'s) checks up front that the
  transport named by ``--kvwire-transport`` starts, within the timeout.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

import pytest

GENERIC_MODULE = "kvwire_conformance.test_selected_transport"
DEFAULT_TIMEOUT_S = 120.0
"""Seconds one suite test (setup, call and teardown) may take before it fails as hung."""
RECORDER = "kvwire-conformance-recorder"
"""The name the recorder is registered under, when ``--kvwire-report`` asks for it."""


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
        "--kvwire-accept-unchecked",
        action="store_true",
        default=False,
        help="let claims this host cannot check pass as unchecked (default: they fail)",
    )
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
        "markers",
        "kvwire_capability(*needs, group=None): what a conformance test needs of the transport",
    )
    path = config.getoption("--kvwire-report")
    if path:
        from kvwire_conformance.report import Recorder

        accept = bool(config.getoption("--kvwire-accept-unchecked"))
        config.pluginmanager.register(Recorder(str(path), accept), RECORDER)


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    if any(i.path.name == "test_selected_transport.py" for i in items):
        _check_selected_transport(config)
    base = _suite_base()
    if base is None:
        return
    timeout = float(config.getoption("--kvwire-timeout"))
    for item in items:
        cls = getattr(item, "cls", None)
        in_suite = cls is not None and issubclass(cls, base)
        if in_suite and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(timeout, method="signal", func_only=False))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """An unchecked claim of a suite test fails it, unless the run accepts unchecked
    claims; either way the report keeps ``kvwire_unchecked`` (the reason) for the recorder."""
    report = yield
    base = _suite_base()
    cls = getattr(item, "cls", None)
    if base is None or cls is None or not issubclass(cls, base) or not report.skipped:
        return report
    from kvwire_conformance.capabilities import UNCHECKED  # loaded by the suite already

    reason = _skip_reason(report)
    if not reason.startswith(UNCHECKED):
        return report
    report.kvwire_unchecked = reason
    if not item.config.getoption("--kvwire-accept-unchecked"):
        report.outcome = "failed"
        report.longrepr = (
            f"unchecked claim: {reason} (fails the run; --kvwire-accept-unchecked, or "
            "`kvwire conformance --accept-unchecked`, accepts it)"
        )
    return report


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return ""


def _suite_base() -> type | None:
    """The suite's base class if this run imported it (every suite test class did), else
    None: looked up, never imported, so an unrelated project's run pulls nothing in."""
    module = sys.modules.get("kvwire_conformance.base")
    base = getattr(module, "SuiteBase", None)
    return base if isinstance(base, type) else None


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
