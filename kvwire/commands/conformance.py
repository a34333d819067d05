"""Run the transport conformance suite against one transport and report by capability.

``kvwire conformance NAME`` (an installed ``kvwire.transports`` entry point) or
``kvwire conformance module:factory``; ``-o KEY=VALUE`` passes factory options (VALUE is
JSON when it parses). The suite runs in a pytest subprocess, with the transport's two
agents in separate processes; the exit status is nonzero when any test failed, or when a
claim could not be checked on this host (VRAM without a GPU, ordering without
``userfaultfd``) unless ``--accept-unchecked`` lets it pass; the report names each one.

Does the suite catch bugs in your adapter? Write broken variants of it: a module
``kvwire_broken_<transport>.py`` of subclasses of your agent class, one plausible bug
each, listed as ``(name, section, what it breaks, catching test, class)`` and turned into
``VARIANTS`` by ``adapter_variants``; run one with ``kvwire conformance
kvwire_broken_<transport>:NAME -k TEST`` (it must FAIL), all of them many times with
``scripts/teeth_repeat.py``. docs/writing-a-transport.md section 8 walks through it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections import defaultdict
from typing import Any

from kvwire.errors import ConfigError

DEFAULT_CLOSE_PROBE_S = 30.0
"""Longest the up-front check waits for the probe agent's close() without --timeout."""

GENERIC_MODULE = "kvwire_conformance.test_selected_transport"
PYTEST_USAGE_ERROR = 4
PYTEST_NO_TESTS = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("transport", metavar="NAME|module:factory", help="transport to test")
    parser.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="factory option, repeatable (VALUE parsed as JSON when it can be)",
    )
    parser.add_argument("-k", dest="keyword", metavar="EXPR", help="only tests matching EXPR")
    parser.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failure")
    parser.add_argument("--json", action="store_true", help="print the outcomes as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="pytest's verbose output")
    parser.add_argument(
        "--accept-unchecked",
        action="store_true",
        help="pass a run whose only gaps are claims this host cannot check (they are still "
        "named in the report); without it such a run fails",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="fail any test (setup and teardown included) that runs longer (default 120)",
    )


def _pytest_command(args: argparse.Namespace, report: str, ini: str, root: str) -> list[str]:
    for option in args.option:
        if "=" not in option or option.startswith("="):
            raise ConfigError(f"-o wants KEY=VALUE, got {option!r}")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "--pyargs",
        GENERIC_MODULE,
        "-c",
        ini,
        "--rootdir",
        root,
        "-p",
        "no:cacheprovider",
        "--kvwire-transport",
        args.transport,
        "--kvwire-report",
        report,
        "-v" if args.verbose else "-q",
    ]
    for option in args.option:
        cmd += ["--kvwire-option", option]
    if args.keyword:
        cmd += ["-k", args.keyword]
    if args.accept_unchecked:
        cmd.append("--kvwire-accept-unchecked")
    if args.exitfirst:
        cmd.append("-x")
    if args.timeout is not None:
        if not args.timeout > 0:
            raise ConfigError(f"--timeout wants a positive number of seconds, got {args.timeout}")
        cmd += ["--kvwire-timeout", str(args.timeout)]
    return cmd


def _table(tests: list[dict[str, Any]]) -> str:
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for test in tests:
        outcome = "failed" if test["outcome"] == "error" else test["outcome"]
        counts[test["capability"]][outcome] += 1
    rows = [("capability", "passed", "failed", "skipped", "unchecked", "verdict")]
    for cap in sorted(counts):
        c = counts[cap]
        verdict = (
            "FAIL"
            if c["failed"]
            else "could not check"
            if c["unchecked"]
            else ("pass" if c["passed"] else "skipped")
        )
        rows.append(
            (
                cap,
                str(c["passed"]),
                str(c["failed"]),
                str(c["skipped"]),
                str(c["unchecked"]),
                verdict,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for test in tests:
        if test["outcome"] in ("failed", "error", "skipped", "unchecked"):
            name = test["test"].split("::")[-1]
            lines.append(f"{test['outcome'].upper():8} {name}: {test['detail']}")
    return "\n".join(lines)


def _claim(test: dict[str, Any]) -> dict[str, str]:
    """An unchecked test as the claim it leaves open: its capability group and why."""
    return {
        "claim": test["capability"],
        "test": test["test"].split("::")[-1],
        "detail": test["detail"],
    }


def _check_agent(transport: str, options: list[str], close_timeout: float) -> None:
    """Start and close one agent with the options, so an unknown transport, a ``module:attr``
    that is no factory or an option it does not take is a usage error."""
    from kvwire.errors import KVWireError
    from kvwire.transport import create

    kwargs: dict[str, Any] = {}
    for option in options:
        key, sep, raw = option.partition("=")
        if not sep or not key:
            raise ConfigError(f"-o wants KEY=VALUE, got {option!r}")
        try:
            kwargs[key] = json.loads(raw)
        except ValueError:
            kwargs[key] = raw
    try:
        agent = create(transport, f"kvwire-conformance-check-{os.getpid()}", **kwargs)
    except KVWireError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"cannot start transport {transport!r} with {kwargs}: {exc}") from None
    # Closed on a daemon thread, waited for at most the per-test timeout: an adapter whose
    # close() hangs is the suite's to report, naming the test, not this probe's to freeze.
    closer = threading.Thread(target=agent.close, name="kvwire-conformance-probe", daemon=True)
    closer.start()
    closer.join(close_timeout)


def _call(cmd: list[str], stdout: int | None) -> int:
    """Run pytest in its own process group: Ctrl-C reaches only us, and we end the whole
    group (pytest and the agents it started) before reporting the interruption."""
    proc = subprocess.Popen(cmd, stdout=stdout, process_group=0)
    try:
        return proc.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise


def run(args: argparse.Namespace) -> int:
    for module in ("pytest", "kvwire_conformance"):
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"kvwire conformance needs {module!r}: pip install 'kvwire[dev]'")
    # One line here for a transport that does not start, not pytest's page.
    _check_agent(args.transport, args.option, args.timeout or DEFAULT_CLOSE_PROBE_S)
    with tempfile.TemporaryDirectory(prefix="kvwire-conformance-") as tmp:
        report = os.path.join(tmp, "report.json")
        ini = os.path.join(tmp, "pytest.ini")
        with open(ini, "w") as out:
            out.write("[pytest]\n")
        cmd = _pytest_command(args, report, ini, tmp)
        stdout = subprocess.DEVNULL if args.json else None
        code = _call(cmd, stdout)
        if code == PYTEST_USAGE_ERROR or not os.path.exists(report):
            raise ConfigError(
                f"the conformance run for {args.transport!r} could not start "
                f"(pytest exit status {code}; its error is above)"
            )
        with open(report) as inp:
            outcome = json.load(inp)
    tests: list[dict[str, Any]] = outcome["tests"]
    failed = [t for t in tests if t["outcome"] in ("failed", "error")]
    unchecked = [t for t in tests if t["outcome"] == "unchecked"]
    refused = bool(unchecked) and not args.accept_unchecked
    ok = code == 0 and not failed and not refused and bool(tests)
    if args.json:
        doc = {
            "transport": args.transport,
            "passed": ok,
            "tests": tests,
            "unchecked": [_claim(t) for t in unchecked],
            "accepted_unchecked": bool(args.accept_unchecked),
        }
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    else:
        sys.stdout.write(f"\nkvwire conformance: {args.transport}\n{_table(tests)}\n")
        total = len(tests)
        passed = sum(t["outcome"] == "passed" for t in tests)
        skipped = sum(t["outcome"] == "skipped" for t in tests)
        verdict = "PASS" if ok else "FAIL"
        sys.stdout.write(
            f"{verdict}: {passed} passed, {len(failed)} failed, {skipped} skipped, "
            f"{len(unchecked)} could not be checked on this host, of {total}\n"
        )
        for test in unchecked:
            claim = _claim(test)
            sys.stdout.write(f"unchecked claim {claim['claim']!r}: {claim['detail']}\n")
        if refused:
            sys.stdout.write(
                "unchecked claims fail the run; --accept-unchecked accepts them (still named)\n"
            )
    if code == PYTEST_NO_TESTS:
        sys.stderr.write("kvwire conformance: no test matched\n")
    return 0 if ok else 1
