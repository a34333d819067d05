"""Long-running fuzzing of kvwire's decoders (``make fuzz``).

Two engines over the same targets (``kvwire_fuzz.targets``) and seeds:

* ``atheris`` (coverage-guided libFuzzer): with ``--target all`` the first input byte picks
  the decoder and the rest is its input; ``--target NAME`` gives one decoder every byte.
  Half the mutations are libFuzzer's own, half kvwire's structure-aware ones (length
  prefixes claiming GiBs, wrong types, deep nesting, splices). Crashing inputs are written
  under ``--artifacts``; replay one with ``fuzz_decoders.py --replay FILE``.
* ``hypothesis``: the fallback where atheris cannot be installed. It draws the same
  mutations for ``--seconds`` and stops at the first failure, printing the input.

A finding is any exception other than the target's allowed kvwire errors, an input that
runs longer than ``--timeout`` seconds, or (atheris) a process above ``--rss-mb``.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

ENGINES = ("atheris", "hypothesis")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=ENGINES, default="atheris")
    parser.add_argument("--target", default="all", help="a target name, or 'all' (default)")
    parser.add_argument("--seconds", type=int, default=60, help="how long to run")
    parser.add_argument("--timeout", type=int, default=5, help="seconds one input may take")
    parser.add_argument("--rss-mb", type=int, default=2048, help="memory limit (atheris)")
    parser.add_argument("--max-len", type=int, default=1 << 16, help="largest input (atheris)")
    parser.add_argument("--corpus", type=Path, default=Path("build/fuzz/corpus"))
    parser.add_argument("--artifacts", type=Path, default=Path("build/fuzz/artifacts"))
    parser.add_argument("--replay", type=Path, help="run one saved input and report")
    parser.add_argument("--list", action="store_true", help="list the targets and exit")
    args, extra = parser.parse_known_args(argv)
    # Before anything imports kvwire: atheris instruments only what it sees imported.
    if args.engine == "atheris" and not (args.list or args.replay) and not _instrument():
        print("atheris is not installed: pip install atheris, or use --engine hypothesis")
        return 2

    from kvwire_fuzz.targets import BY_NAME, TARGETS

    if args.list:
        for t in TARGETS:
            print(f"{t.name:28s} seeds={t.seeds}")
        return 0
    if args.target != "all" and args.target not in BY_NAME:
        parser.error(f"unknown target {args.target!r}; --list shows them")
    if args.replay is not None:
        return _replay(args.target, args.replay.read_bytes())
    if args.engine == "atheris":
        return _atheris(args, extra)
    return _hypothesis(args)


def _select(target_name: str, data: bytes) -> tuple[Any, bytes]:
    """(target, its input) for one fuzz input: fixed target, or the first byte picks."""
    from kvwire_fuzz.targets import BY_NAME, TARGETS

    if target_name != "all":
        return BY_NAME[target_name], data
    if not data:
        return TARGETS[0], data
    return TARGETS[data[0] % len(TARGETS)], data[1:]


def _replay(target_name: str, data: bytes) -> int:
    from kvwire_fuzz.targets import run

    target, payload = _select(target_name, data)
    start = time.perf_counter()
    result = run(target, payload)  # raises on a finding, with the target's name
    took = time.perf_counter() - start
    outcome = "refused (allowed error)" if result is None else type(result).__name__
    print(f"{target.name}: {outcome} in {took * 1e3:.2f} ms ({len(payload)} bytes)")
    return 0


# ------------------------------------------------------------------------------ atheris


def _seed_corpus(target_name: str, corpus: Path) -> None:
    """Write the seeds (with their selector byte under --target all) into the corpus dir."""
    from kvwire_fuzz.corpus import seeds
    from kvwire_fuzz.targets import BY_NAME, TARGETS

    corpus.mkdir(parents=True, exist_ok=True)
    chosen = TARGETS if target_name == "all" else (BY_NAME[target_name],)
    for target in chosen:
        prefix = bytes([TARGETS.index(target)]) if target_name == "all" else b""
        for seed in seeds()[target.seeds]:
            data = prefix + seed
            (corpus / hashlib.sha1(data).hexdigest()).write_bytes(data)


def _instrument() -> bool:
    """Import kvwire and the targets with atheris's coverage instrumentation."""
    try:
        import atheris  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        return False
    with atheris.instrument_imports(include=["kvwire", "kvwire_fuzz"]):
        import kvwire_fuzz.corpus
        import kvwire_fuzz.mutate
        import kvwire_fuzz.targets  # noqa: F401

        import kvwire.wire  # noqa: F401
    return True


def _atheris(args: argparse.Namespace, extra: list[str]) -> int:
    import atheris  # type: ignore[import-untyped,import-not-found,unused-ignore]
    from kvwire_fuzz.corpus import all_seeds
    from kvwire_fuzz.mutate import RandomChooser, mutate
    from kvwire_fuzz.targets import run

    _seed_corpus(args.target, args.corpus)
    args.artifacts.mkdir(parents=True, exist_ok=True)
    pool = all_seeds()
    keep_selector = args.target == "all"

    def test_one_input(data: bytes) -> None:
        target, payload = _select(args.target, data)
        run(target, payload)

    def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
        rng = random.Random(seed)
        if rng.random() < 0.5:
            return bytes(atheris.Mutate(data, max_size))
        head, body = (data[:1], data[1:]) if keep_selector and data else (b"", data)
        return (head + mutate(body, pool, RandomChooser(rng)))[:max_size]

    libfuzzer = [
        sys.argv[0],
        f"-max_total_time={args.seconds}",
        f"-timeout={args.timeout}",
        f"-rss_limit_mb={args.rss_mb}",
        f"-max_len={args.max_len}",
        f"-artifact_prefix={args.artifacts}/",
        "-print_final_stats=1",
        *extra,
        str(args.corpus),
    ]
    print(f"atheris: target {args.target}, {args.seconds}s, corpus {args.corpus}", flush=True)
    atheris.Setup(libfuzzer, test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()
    return 0


# ---------------------------------------------------------------------------- hypothesis


def _hypothesis(args: argparse.Namespace) -> int:
    """Fresh Hypothesis runs of a few thousand examples each until the time is up.

    Chunks instead of one endless run, so a finding is shrunk and reported normally and the
    run ends between chunks without raising through Hypothesis.
    """
    import signal
    from datetime import timedelta

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from kvwire_fuzz.strategies import mutated
    from kvwire_fuzz.targets import BY_NAME, TARGETS, run

    chosen = TARGETS if args.target == "all" else (BY_NAME[args.target],)
    inputs = st.one_of(
        mutated(), st.binary(max_size=4096), st.sampled_from(chosen).flatmap(_family_inputs)
    )
    count = 0

    @settings(
        max_examples=2000,
        deadline=timedelta(seconds=args.timeout),
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(inputs)
    def fuzz(data: bytes) -> None:
        nonlocal count
        count += 1
        for target in chosen:
            run(target, data)

    # A decoder stuck inside C code never reaches Hypothesis's deadline: SIGALRM ends it.
    signal.signal(signal.SIGALRM, signal.default_int_handler)
    signal.alarm(args.seconds + 10 * args.timeout + 60)
    print(f"hypothesis: {len(chosen)} target(s), {args.seconds}s", flush=True)
    end = time.monotonic() + args.seconds
    try:
        while time.monotonic() < end:
            fuzz()
    finally:
        signal.alarm(0)
    print(f"hypothesis: {count} inputs x {len(chosen)} target(s), no finding")
    return 0


def _family_inputs(target: Any) -> Any:
    from kvwire_fuzz.strategies import mutated

    return mutated(target.seeds)


if __name__ == "__main__":
    sys.exit(main())
