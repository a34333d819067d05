"""Simulate P/D engines running kvwire's real state machines, with injected faults.

Deterministic: the same --seed, --requests and --faults give the same run. Exits 1 if any
invariant broke (a leak, a double free, a stuck request, corrupt KV after a success).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from kvwire.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--requests", type=int, default=2000, help="requests to simulate (default 2000)"
    )
    parser.add_argument(
        "--faults",
        default="all",
        help="'all', 'none', or a comma list of: drop, delay, duplicate, reorder, transfer, "
        "post, handshake, crash, release, skew, abort, short-lease, partition, and with "
        "--stream preempt, stall, vanish (default all)",
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="push producers stream: prompts are computed over time in chunks and layers, "
        "consumers register while they compute, and each layer's KV is written once computed",
    )
    parser.add_argument(
        "--legacy-lease-rule",
        action="store_true",
        help="run the old, unsafe rule (reads not bounded by the producer's lease, no "
        "quarantine, no transfer deadlines) to reproduce stale KV reported done",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    from kvwire.sim import STREAM_FAULTS, parse_faults, simulate

    if args.requests < 1 or args.requests > 10_000_000:
        raise ConfigError(f"--requests must be between 1 and 10000000, got {args.requests}")
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    faults = parse_faults(args.faults)
    named = set(faults.kinds) & STREAM_FAULTS
    if named and not args.stream and args.faults.strip() != "all":
        # Named on purpose, they would inject nothing: say so rather than report 0 of them.
        raise ConfigError(
            f"--faults {', '.join(sorted(named))} act on streamed prompts: add --stream"
        )
    result = simulate(
        args.seed,
        args.requests,
        faults,
        legacy_lease_rule=args.legacy_lease_rule,
        stream=args.stream,
    )
    if args.json:
        sys.stdout.write(json.dumps(dataclasses.asdict(result), sort_keys=True) + "\n")
    else:
        _print_summary(result)
    return 0 if result.ok else 1


def _print_summary(result: object) -> None:
    d = dataclasses.asdict(result)  # type: ignore[call-overload]
    lines = [
        f"kvwire sim  seed={d['seed']}  faults={','.join(d['faults']) or 'none'}",
        f"  requests          {d['requests']}",
        f"  done              {d['done']}  (bytes verified: {d['bytes_verified']})",
        f"  failed            {d['failed']}  (aborted {d['aborted']}; "
        f"leases expired on {d['expired']})",
        f"  leaked blocks     {d['leaked_blocks']}",
        f"  double frees      {d['double_frees']}",
        f"  stuck             {d['stuck']}",
        f"  corrupt KV        {d['corrupt']}",
        f"  stale KV done     {d['stale_done']}  (partitions: {d['partitions']})",
        f"  late writes       {d['late_writes']}",
        f"  invariant breaks  {d['invariant_violations']}",
        f"  machine events    {d['machine_events']}",
        f"  crashes           {d['crashes']}",
        f"  streamed          {d['streamed']}  (rounds {d['stream_rounds']}; preempted "
        f"{d['preemptions']}, stalled {d['stalls']}, consumers vanished {d['vanished']})",
        f"  simulated time    {d['sim_time_s']:.1f} s",
        f"  wall time         {d['wall_s']:.2f} s",
    ]
    if d["failures_by_reason"]:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(d["failures_by_reason"].items()))
        lines.append(f"  failures by cause {reasons}")
    for message in d["violations"]:
        lines.append(f"  ! {message}")
    sys.stdout.write("\n".join(lines) + "\n")
