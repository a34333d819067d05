"""Random P/D pairs end to end for a set time, every token checked.

Draws pairs the way the test suite's property test does (block sizes either way, kernel
blocks, TP pairs, layouts, MLA, KV-cache groups with a sliding window, prefix hits, pull and
push, engine mistakes) and runs each through real Producer and Consumer runtimes in two
processes over shared memory. Each ends done with exactly the producer's bytes, or refused
with a named cause; anything else is a violation, shrunk to the smallest pair that shows it.
Progress goes to stderr, the summary to stdout. Exit status 1 on a violation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections import Counter

from kvwire.errors import ConfigError

BATCH = 25
"""Examples per Hypothesis run; the time budget is checked between runs."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to search")
    parser.add_argument("--seed", type=int, help="first seed (default: a random one, printed)")
    parser.add_argument(
        "--tp",
        type=int,
        nargs="+",
        default=[1, 2, 4],
        metavar="N",
        help="TP sizes to draw for either side",
    )
    parser.add_argument(
        "--report-every", type=float, default=10.0, help="seconds between progress lines"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def _check(args: argparse.Namespace) -> None:
    if not math.isfinite(args.seconds) or not 0 < args.seconds <= 7 * 24 * 3600:
        raise ConfigError(f"--seconds must be positive and at most a week, got {args.seconds}")
    if not math.isfinite(args.report_every) or args.report_every <= 0:
        raise ConfigError(f"--report-every must be positive, got {args.report_every}")
    if args.seed is not None and args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    bad = [n for n in args.tp if n not in (1, 2, 4, 8)]
    if bad:
        raise ConfigError(f"--tp sizes must be 1, 2, 4 or 8, got {bad[0]}")


def run(args: argparse.Namespace) -> int:
    _check(args)
    try:
        from hypothesis import Phase, given, settings
        from hypothesis import seed as seeded
    except ImportError:
        raise ConfigError(
            "kvwire pairs draws pairs with Hypothesis: pip install hypothesis"
        ) from None
    import random

    from kvwire.pairs.cases import cases
    from kvwire.pairs.oracle import Case
    from kvwire.pairs.run import PairRunner, Verdict

    first_seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    counts: Counter[str] = Counter()
    violations: list[Verdict] = []
    start = time.monotonic()
    last_report = start
    batches = 0
    print(f"kvwire pairs: seed {first_seed}, {args.seconds:g}s", file=sys.stderr)
    with PairRunner() as runner:
        while time.monotonic() - start < args.seconds and not violations:

            @seeded(first_seed + batches)
            @settings(
                max_examples=BATCH,
                deadline=None,
                database=None,
                phases=(Phase.generate, Phase.shrink),
            )
            @given(case=cases(tp=tuple(args.tp), unsupported=True))
            def one(case: Case) -> None:
                verdict = runner.run(case)
                counts[verdict.kind] += 1
                if not verdict.ok:
                    violations.append(verdict)
                    raise AssertionError(str(verdict))

            with contextlib.suppress(AssertionError):  # the violation is recorded in the list
                one()
            batches += 1
            now = time.monotonic()
            if now - last_report >= args.report_every:
                last_report = now
                print(
                    f"  {now - start:5.0f}s  {sum(counts.values())} pairs: "
                    f"{counts['done']} done, {counts['refused']} refused, "
                    f"{counts['violation']} violations",
                    file=sys.stderr,
                )
    summary = {
        "seed": first_seed,
        "seconds": round(time.monotonic() - start, 1),
        "pairs": sum(counts.values()),
        "done": counts["done"],
        "refused": counts["refused"],
        "violations": counts["violation"],
        "smallest_violation": str(violations[-1]) if violations else None,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(
            f"{summary['pairs']} pairs in {summary['seconds']}s (seed {first_seed}): "
            f"{summary['done']} done with every token checked, {summary['refused']} refused "
            f"by name, {summary['violations']} violations"
        )
        if violations:
            print(f"smallest violation: {violations[-1]}")
    return 1 if violations else 0
