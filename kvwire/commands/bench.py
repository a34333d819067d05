"""Measure kvwire beside baselines measured in the same run.

Suites: layout, wire, machine, transport, e2e. Every figure comes with its baseline and
their ratio; ``--json`` prints one JSON object per suite (a list when several run).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from kvwire.bench import plot
from kvwire.errors import ConfigError

SUITES = ("layout", "wire", "machine", "transport", "e2e")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("suites", nargs="*", metavar="SUITE", help=f"any of {', '.join(SUITES)}")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and sizes")
    parser.add_argument("--transport", action="append", help="transport(s) for the transport suite")
    parser.add_argument("--plot", metavar="DIR", help="write PNG charts of the sweeps here")


def run(args: argparse.Namespace) -> int:
    every = not args.suites
    names = list(args.suites) or list(SUITES)
    for name in names:
        if name not in SUITES:
            raise ConfigError(f"unknown bench suite {name!r} (choose from {', '.join(SUITES)})")
    if args.plot:
        plot.require_matplotlib()  # fail before spending minutes on the suites
    reports = []
    for name in names:
        try:
            module = importlib.import_module(f"kvwire.bench.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"kvwire.bench.{name}":
                raise
            if every:  # "all suites" means all that exist so far
                sys.stderr.write(f"kvwire bench: suite {name!r} is not built yet; skipped\n")
                continue
            raise ConfigError(f"bench suite {name!r} is not built yet") from None
        report = module.run(args)
        reports.append(report)
        if not args.json:
            sys.stdout.write(report.to_table() + "\n\n")
    if args.json:
        docs = [r.as_dict() for r in reports]
        sys.stdout.write(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2) + "\n")
    if args.plot:
        for path in plot.write_plots(reports, args.plot):
            sys.stderr.write(f"wrote {path}\n")
    return 0
