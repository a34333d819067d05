"""Measure kvwire beside baselines measured in the same run.

Suites: layout, wire, machine, transport, e2e, fleet (metadata traffic of a fleet over
ZMQ handshakes and over an etcd metadata store, cold start and a prefill restart),
layerwise (the transfer time a layer-by-layer prefill leaves exposed: pull, whole-request
push and streaming push). Every figure comes with its baseline and their ratio; ``--json``
prints one JSON object per suite (a list when several run).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from kvwire.errors import ConfigError

SUITES = ("layout", "wire", "machine", "transport", "e2e", "fleet", "layerwise")
NO_CHARTS = frozenset({"layout", "fleet"})
"""Suites whose figures are single points, with no sweep for ``--plot`` to draw."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("suites", nargs="*", metavar="SUITE", help=f"any of {', '.join(SUITES)}")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and sizes")
    parser.add_argument("--transport", action="append", help="transport(s) for the transport suite")
    parser.add_argument("--plot", metavar="DIR", help="write PNG charts of the sweeps here")
    parser.add_argument(
        "--fleet",
        metavar="PxDxTP",
        help="fleet suite: prefill engines x decode engines x TP (default: 8x8x2, --quick 4x4x2)",
    )
    parser.add_argument(
        "--store",
        metavar="URL",
        help="fleet suite: etcd://host:port to use (default: start an etcd on loopback)",
    )


def run(args: argparse.Namespace) -> int:
    from kvwire.bench import plot

    every = not args.suites
    names = list(args.suites) or list(SUITES)
    for name in names:
        if name not in SUITES:
            raise ConfigError(f"unknown bench suite {name!r} (choose from {', '.join(SUITES)})")
    if args.plot:
        charted = [n for n in names if n not in NO_CHARTS]
        if not charted:
            raise ConfigError(
                f"--plot: the {', '.join(names)} suite has no sweeps to chart "
                f"(charts come from {', '.join(s for s in SUITES if s not in NO_CHARTS)})"
            )
        plot.require_matplotlib()  # fail before spending minutes on the suites
    if args.fleet or args.store:
        from kvwire.bench.fleet import parse_shape
        from kvwire.config import KNOBS

        if "fleet" not in names:
            raise ConfigError("--fleet and --store are options of the fleet suite")
        if args.fleet:
            parse_shape(args.fleet)
        if args.store:
            try:
                KNOBS["metadata_store"].parse(args.store)
            except ValueError as exc:
                raise ConfigError(f"--store {args.store!r}: {exc}") from None
    if args.transport:
        from kvwire.commands.demo import check_transport

        for transport in args.transport:
            check_transport(transport)
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
