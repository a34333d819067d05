"""Run the broken-variant library many times in a row and count how often each variant
is caught: the evidence that the suite catches each one on every run, not most runs.

    python scripts/teeth_repeat.py --runs 20 --inner shm
    python scripts/teeth_repeat.py --runs 20 --inner nixl --only nixl_drain_keeps_inbox

Each run is what ``make test`` runs once (tests/transport/test_conformance_teeth.py: each
variant's catching test, six pytest processes at a time). Prints ``NAME caught N/N`` per
variant; the exit status is 1 if any variant escaped any run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

TEETH = Path(__file__).resolve().parents[1] / "tests" / "transport"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="teeth_repeat", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="consecutive runs (default 20)")
    parser.add_argument("--inner", default="shm", choices=("shm", "nixl", "ucx"))
    parser.add_argument("--only", default="", help="comma-separated variant names")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs wants a positive count, got {args.runs}")
    sys.path.insert(0, str(TEETH))
    from test_conformance_teeth import catches
    from variant_library import VARIANTS

    chosen = [v for v in VARIANTS.values() if args.inner in v.inners]
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {v.name for v in chosen}
        if unknown:
            parser.error(f"no variant over {args.inner} named {', '.join(sorted(unknown))}")
        chosen = [v for v in chosen if v.name in names]
    caught = {v.name: 0 for v in chosen}
    escapes: dict[str, list[str]] = {v.name: [] for v in chosen}
    start = time.monotonic()
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="kvwire-teeth-") as tmp:
            for name, escaped in catches(chosen, args.inner, Path(tmp)).items():
                if escaped:
                    escapes[name].append(f"run {run + 1}: {escaped}")
                else:
                    caught[name] += 1
        took = time.monotonic() - start
        print(f"run {run + 1}/{args.runs} done ({took:.0f} s)", file=sys.stderr, flush=True)
    for name, count in caught.items():
        print(f"{name} caught {count}/{args.runs} over {args.inner}")
        for line in escapes[name]:
            print(f"  escaped {line}")
    return 0 if all(c == args.runs for c in caught.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
