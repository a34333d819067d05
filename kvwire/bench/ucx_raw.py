"""The raw UCX figures that ``kvwire bench transport --transport ucx`` sets kvwire against.

The bench's figure (:func:`same_memory_reader`): the very rows a kvwire READ posts, on the
adapter's own worker and endpoint, posted and progressed to completion by the C helper's
loop, with no kvwire code in between, sampled in turns with the adapter over the same 256
scattered, cold blocks. That is the floor of any adapter over this UCP: ``ucx_perftest``
(below, still runnable as ``python -m kvwire.bench.ucx_raw``) re-reads one buffer that stays
in cache, which is faster than any copy of scattered cold blocks and so not a fair target.

Bench tooling, not part of the adapter: it imports :mod:`kvwire_ucx` and posts on its
worker, and only ``kvwire bench transport`` imports it; the adapter itself imports nothing
above the transport interface.

:func:`raw_baseline` runs ``ucx_perftest`` from the libucx wheel (the same UCX build the
adapter binds), two processes on loopback, test ``ucp_get``: a server, then a client
connecting to 127.0.0.1 on a free port. The ``UCX_*`` environment (``UCX_TLS``,
``UCX_NET_DEVICES``) is passed through unchanged, so both figures of one run use the same
transports.

Bandwidth runs use perftest's default window of outstanding gets; the 4 KiB latency run
uses a window of one (``-O 1``), i.e. the time one get takes from post to completion, which
is what a single small kvwire READ is compared with.
"""

from __future__ import annotations

import os
import re
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from kvwire_ucx._native_load import NATIVE
from kvwire_ucx.transport import UcxTransport

from kvwire.bench.report import Result
from kvwire.errors import TransportUnavailableError
from kvwire.transport import Descs, Transport

_ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+")
_MIB = 1 << 20


@dataclass(frozen=True)
class PerftestFigures:
    """The final row of one ``ucx_perftest`` run."""

    latency_us: float
    """Overall average time per get, microseconds."""
    bandwidth_gbps: float
    """Overall bandwidth in GB/s (10^9 bytes; perftest prints MiB/s)."""


def _wheel_dir() -> Path:
    try:
        import libucx
    except ImportError as exc:
        raise TransportUnavailableError(
            "the raw ucx baseline needs ucx_perftest from the libucx wheel: "
            "pip install 'kvwire[ucx]'"
        ) from exc
    return Path(libucx.__file__).parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def parse_final_row(output: str) -> PerftestFigures:
    """The figures of perftest's ``-f`` (final numbers only) output."""
    for line in reversed(output.splitlines()):
        match = _ROW.match(line)
        if match:
            latency = float(match.group(4))
            bandwidth_mib = float(match.group(6))
            return PerftestFigures(latency, bandwidth_mib * _MIB / 1e9)
    raise TransportUnavailableError(f"ucx_perftest printed no result row:\n{output[-2000:]}")


def run_perftest(size: int, iterations: int, *, window: int | None = None) -> PerftestFigures:
    """One ``ucx_perftest -t ucp_get`` between a server and a client process."""
    wheel = _wheel_dir()
    binary = wheel / "bin" / "ucx_perftest"
    env = dict(os.environ)
    libdir = str(wheel / "lib")
    env["LD_LIBRARY_PATH"] = (
        f"{libdir}:{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else libdir
    )
    args = ["-t", "ucp_get", "-s", str(size), "-n", str(iterations)]
    args += ["-w", str(max(iterations // 10, 10)), "-f"]
    if window is not None:
        args += ["-O", str(window)]
    port = _free_port()
    server = subprocess.Popen(
        [str(binary), *args, "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        # perftest's stdout is block-buffered on a pipe, so "Waiting for connection" cannot
        # be read in time; retry the client while the server is not listening yet.
        deadline = time.monotonic() + 30.0
        while True:
            client = subprocess.run(
                [str(binary), "127.0.0.1", *args, "-p", str(port)],
                capture_output=True,
                text=True,
                env=env,
                timeout=300,
            )
            output = client.stdout + client.stderr
            if client.returncode == 0:
                return parse_final_row(client.stdout)
            refused = "Connection refused" in output
            if not refused or server.poll() is not None or time.monotonic() > deadline:
                raise TransportUnavailableError(
                    f"ucx_perftest client failed ({client.returncode}): {output[-2000:]}"
                )
            time.sleep(0.05)
    finally:
        server.kill()
        server.wait()


def raw_baseline(quick: bool) -> list[Result]:
    """``ucx_raw.read.{64KiB,2MiB}.GBps`` and ``ucx_raw.read.4KiB.us`` from ucx_perftest."""
    repeats = 1 if quick else 3
    scale = 1 if quick else 5
    plan = (
        ("ucx_raw.read.64KiB.GBps", 64 * 1024, 4000 * scale, None),
        ("ucx_raw.read.2MiB.GBps", 2 * _MIB, 200 * scale, None),
        ("ucx_raw.read.4KiB.us", 4096, 20000 * scale, 1),
    )
    results: list[Result] = []
    for name, size, iterations, window in plan:
        runs = [run_perftest(size, iterations, window=window) for _ in range(repeats)]
        if name.endswith(".us"):
            values = [r.latency_us for r in runs]
            unit = "us"
        else:
            values = [r.bandwidth_gbps for r in runs]
            unit = "GB/s"
        results.append(
            Result(name, statistics.median(values), unit, min=min(values), max=max(values))
        )
    return results


RAW_WAIT_NS = 60 * 10**9


def same_memory_reader(
    transport: Transport, peer: str, local: Descs, remote: Descs
) -> Callable[[], None] | None:
    """A raw READ of ``remote`` into ``local`` for the bench to time beside kvwire's: the
    rows the adapter would post, planned once here, posted and completed by one call of the
    C helper on the adapter's worker (its lock held, as UCP's serialized mode requires).
    None without the helper (then there is no raw loop free of Python to compare with)."""
    if NATIVE is None or not isinstance(transport, UcxTransport):
        return None
    with transport._lock:
        target = transport._peer(peer)
        rows = transport._plan_many(target, local, remote)
    columns = [np.array(column, dtype=np.uint64) for column in rows]
    endpoint = target.endpoint

    def read() -> None:
        with transport._lock:
            running = endpoint.post_rma_native(False, *columns, wait_ns=RAW_WAIT_NS)
        if running:
            raise TransportUnavailableError(f"raw UCX READ: {running} gets still running")

    return read


def main() -> None:
    """``python -m kvwire.bench.ucx_raw``: print the raw figures."""
    for result in raw_baseline(quick=True):
        print(f"{result.name}: {result.value:.4g} {result.unit}")


if __name__ == "__main__":
    main()
