"""Soak the runtime in real processes: the demo's P and D engines for SECONDS, with crashes.

With --chaos a random rank of P or D is SIGKILLed every few seconds and restarted after a
short downtime. Progress goes to stderr; the summary (requests, faults injected, done and
failed, bytes verified, leaks, stuck) to stdout. Exit status 1 if any byte arrived wrong,
any block leaked or any request got stuck.
"""

from __future__ import annotations

import argparse

from kvwire.commands.demo import (
    add_workload_arguments,
    check_transport,
    workload_options,
    write_summary,
)
from kvwire.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=600.0, help="how long (default 600)")
    parser.add_argument("--chaos", action="store_true", help="kill and restart random ranks")
    parser.add_argument(
        "--kill-every", type=float, default=6.0, help="mean seconds between kills (default 6)"
    )
    parser.add_argument(
        "--downtime",
        type=float,
        nargs=2,
        default=(0.2, 2.0),
        metavar=("MIN", "MAX"),
        help="a killed rank restarts after MIN..MAX seconds (default 0.2 2)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    add_workload_arguments(parser, layers=4, tokens=512, tp=2, lease=5.0)
    parser.add_argument(
        "--report-every", type=float, default=10.0, help="seconds between progress lines"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    import math

    from kvwire.demo.soak import SoakOptions, soak

    for flag, value in (
        ("--seconds", args.seconds),
        ("--kill-every", args.kill_every),
        ("--report-every", args.report_every),
        ("--downtime", args.downtime[0]),
        ("--downtime", args.downtime[1]),
    ):
        if not math.isfinite(value) or value < 0 or value > 7 * 24 * 3600:
            raise ConfigError(f"{flag} must be a number of seconds up to a week, got {value}")
    if args.report_every <= 0:
        raise ConfigError(f"--report-every must be positive, got {args.report_every}")
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    demo = workload_options(args, requests=1, progress=False)
    options = SoakOptions(
        seconds=args.seconds,
        chaos=args.chaos,
        kill_every_s=args.kill_every,
        downtime_s=(args.downtime[0], args.downtime[1]),
        seed=args.seed,
        demo=demo,
        report_every_s=args.report_every,
    )
    options.validate()
    check_transport(demo.transport)
    summary = soak(options)
    write_summary(summary, as_json=args.json)
    return 0 if summary.ok else 1
