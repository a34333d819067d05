"""Soak the runtime in real processes: the demo's P and D engines for SECONDS, with crashes.

With --chaos a random rank of P or D is SIGKILLed every few seconds and restarted after a
short downtime. Progress goes to stderr; the summary (requests, faults injected, done and
failed, bytes verified, leaks, stuck) to stdout. Exit status 1 if any byte arrived wrong,
any block leaked or any request got stuck.
"""

from __future__ import annotations

import argparse
import json
import sys

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
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--mode", choices=("pull", "push"), default="pull")
    parser.add_argument("--transport", default="shm", help="shm, nixl, ucx or module:factory")
    parser.add_argument("--p-tp", type=int, default=2)
    parser.add_argument("--d-tp", type=int, default=2)
    parser.add_argument(
        "--lease", type=float, default=5.0, help="producer lease in seconds (default 5)"
    )
    parser.add_argument(
        "--report-every", type=float, default=10.0, help="seconds between progress lines"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    from kvwire.demo.run import DemoOptions
    from kvwire.demo.soak import SoakOptions, soak
    from kvwire.transport import load

    if args.report_every <= 0:
        raise ConfigError(f"--report-every must be positive, got {args.report_every}")
    demo = DemoOptions(
        model=args.model,
        layers=args.layers,
        tokens=args.tokens,
        requests=1,
        concurrency=args.concurrency,
        mode=args.mode,
        transport=args.transport,
        p_tp=args.p_tp,
        d_tp=args.d_tp,
        lease_s=args.lease,
        progress=False,
    )
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
    load(args.transport)  # a missing transport is a usage error here, not a crash in a child
    summary = soak(options)
    if args.json:
        sys.stdout.write(json.dumps(summary.as_dict(), indent=2) + "\n")
    else:
        sys.stdout.write(summary.table())
    return 0 if summary.ok else 1
