"""Mooncake Transfer Engine as an optional baseline of ``kvwire bench transport``.

Where ``mooncake-transfer-engine-non-cuda`` installs (it needs Debian's ``libibverbs1`` to
import even without RDMA hardware; the ``bench`` extra pins it), a peer process
(:mod:`kvwire.bench.mooncake_peer`) registers a buffer with its engine and this process
READs from it with ``batch_transfer_sync_read`` over TCP — the only protocol that works
without RDMA NICs — in the transport suite's shapes: 256 x 64 KiB and 32 x 2 MiB blocks
scattered on both sides, and one 4 KiB READ for latency. Results: ``mooncake.read.<size>.GBps``
(ratio against the suite's ``memcpy.<size>.GBps``) and ``mooncake.read.4KiB.us``. When the
package is missing or does not load, the baseline is skipped with one line on stderr.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from kvwire.bench.report import Report, Result
from kvwire.bench.sweeps import LATENCY_BYTES, SHAPES, scattered
from kvwire.framing import close_pipes, spawn, wait_or_kill

REGION_BYTES = 2 * max(count * size for count, size, _ in SHAPES)


def engine_class() -> Any:
    """Mooncake's ``TransferEngine`` class, or None when it cannot be imported here."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        module = importlib.import_module("mooncake.engine")
    except (ImportError, OSError):
        return None
    return getattr(module, "TransferEngine", None)


def start_engine(cls: Any) -> Any:
    engine = cls()
    code = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if code != 0:
        raise RuntimeError(f"mooncake initialize returned {code}")
    return engine


def _scattered(base: int, count: int, size: int, seed: int) -> list[int]:
    """The addresses of the transport suite's scattered blocks (same seeds, same slots)."""
    addrs: list[int] = scattered(base, count, size, np.random.default_rng(seed))[:, 0].tolist()
    return addrs


class _Peer:
    """The target process: its engine's address and its buffer's."""

    def __init__(self) -> None:
        self.proc = spawn(
            "kvwire.bench.mooncake_peer", str(REGION_BYTES), env={"MC_LOG_LEVEL": "ERROR"}
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError(f"mooncake peer exited ({self.proc.wait()})")
        hello = json.loads(line)
        self.target = f"127.0.0.1:{hello['port']}"
        self.addr = int(hello["addr"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # the peer serves until its stdin closes
        wait_or_kill(self.proc, 10)
        close_pipes(self.proc)


def _measure(quick: bool) -> dict[str, list[float]]:
    cls = engine_class()
    assert cls is not None
    engine = start_engine(cls)
    local = np.ones(REGION_BYTES, dtype=np.uint8)  # touched: pages faulted before timing
    base = int(local.ctypes.data)
    if engine.register_memory(base, REGION_BYTES) != 0:
        raise RuntimeError("mooncake register_memory failed")
    peer = _Peer()
    out: dict[str, list[float]] = {}
    try:

        def read(locals_: list[int], remotes: list[int], lengths: list[int]) -> None:
            code = engine.batch_transfer_sync_read(peer.target, locals_, remotes, lengths)
            if code != 0:
                raise RuntimeError(f"mooncake batch_transfer_sync_read returned {code}")

        repeats = 5 if quick else 30
        for count, size, label in SHAPES:
            ls = _scattered(base, count, size, seed=1)
            rs = _scattered(peer.addr, count, size, seed=2)
            lengths = [size] * count
            for _ in range(2):
                read(ls, rs, lengths)
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                read(ls, rs, lengths)
                samples.append(count * size / (time.perf_counter() - t0) / 1e9)
            out[label] = samples
        one = ([base], [peer.addr], [LATENCY_BYTES])
        for _ in range(5):
            read(*one)
        lat = []
        for _ in range(50 if quick else 300):
            t0 = time.perf_counter()
            read(*one)
            lat.append((time.perf_counter() - t0) * 1e6)
        out["latency"] = lat
    finally:
        peer.close()
        engine.unregister_memory(base)
    return out


def _measure_in_child(quick: bool) -> dict[str, list[float]] | None:
    """Run :func:`_measure` in a child process: Mooncake's engine never loads alongside
    NIXL and UCX in the bench process (together they crash at interpreter exit)."""
    cmd = [sys.executable, "-m", "kvwire.bench.mooncake", *(["--quick"] if quick else [])]
    env = dict(os.environ, MC_LOG_LEVEL="ERROR")
    try:
        proc = subprocess.run(cmd, capture_output=True, env=env, timeout=300, check=False)
        figures: dict[str, list[float]] = json.loads(proc.stdout)
    except (subprocess.TimeoutExpired, ValueError) as exc:
        sys.stderr.write(f"kvwire bench: Mooncake baseline failed: {exc}\n")
        return None
    if "unavailable" in figures:
        sys.stderr.write(
            "kvwire bench: Mooncake baseline skipped (mooncake-transfer-engine-non-cuda is not "
            "installed or libibverbs1 is missing; pip install 'kvwire[bench]')\n"
        )
        return None
    if "error" in figures:
        sys.stderr.write(f"kvwire bench: Mooncake baseline failed: {figures['error']}\n")
        return None
    return figures


def add_baseline(report: Report, quick: bool) -> None:
    """Measure Mooncake into ``report`` if it loads here; else one note on stderr."""
    figures = _measure_in_child(quick)
    if figures is None:
        return
    memcpy = {r.name: r.value for r in report.results}
    for _, _, label in SHAPES:
        samples = figures[label]
        value = float(np.median(samples))
        base = memcpy.get(f"memcpy.{label}.GBps")
        report.add(
            Result(
                f"mooncake.read.{label}.GBps",
                value,
                "GB/s",
                baseline=None if base is None else f"memcpy.{label}.GBps",
                ratio=None if base is None else value / base,
                min=min(samples),
                max=max(samples),
            )
        )
    lat = figures["latency"]
    report.add(
        Result("mooncake.read.4KiB.us", float(np.median(lat)), "us", min=min(lat), max=max(lat))
    )


def main() -> None:
    """Print :func:`_measure`'s figures as one JSON line, then leave without running
    Mooncake's static destructors (``os._exit``)."""
    out: dict[str, Any]
    try:
        if engine_class() is None:
            out = {"unavailable": True}
        else:
            out = dict(_measure("--quick" in sys.argv[1:]))
    except (RuntimeError, OSError, ValueError) as exc:
        out = {"error": str(exc)}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
