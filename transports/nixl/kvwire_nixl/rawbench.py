"""Raw NIXL baseline for ``kvwire bench transport --transport nixl``.

The same READs the generic transport bench makes through kvwire (256 x 64 KiB and
32 x 2 MiB scattered blocks, one 4 KiB descriptor for latency), made here with NIXL's
Python API and nothing of kvwire in between: two processes (this one initiates, a spawned
one registers the source and stays idle), metadata over a pipe, NIXL's fastest path
(descriptor lists prepared once, one request re-posted), the progress settings the
kvwire adapter uses (NIXL's progress thread off, UCX error handling ``none``), and the
generic bench's sampling (a memcpy of the same bytes before every timed READ), so the two
figures differ only by what kvwire adds.

Results: ``nixl_raw.read.64KiB.GBps``, ``nixl_raw.read.2MiB.GBps``,
``nixl_raw.read.4KiB.us``.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvwire.bench.report import Result, repeat
from kvwire.errors import TransportError

SHAPES = ((256, 64 << 10, "64KiB"), (32, 2 << 20, "2MiB"))
LATENCY_BYTES = 4096
BACKEND_OPTIONS = {"ucx_error_handling_mode": "none"}
TIMEOUT_S = 60.0


def _agent(name: str) -> Any:
    from kvwire_nixl._loader import load_nixl

    api, _ = load_nixl()
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", dict(BACKEND_OPTIONS))
    return agent


def _target(conn: Connection, sizes: list[int]) -> None:
    """The idle side: one source region per shape, allocated, registered and then filled
    the way the generic bench's peer does it; then it only waits for 'stop'."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    agent = _agent(f"kvwire-rawbench-target-{os.getpid()}")
    sources = [np.zeros(n, dtype=np.uint8) for n in sizes]
    for seed, source in enumerate(sources):
        agent.register_memory([(int(source.ctypes.data), source.nbytes, 0, "")], "DRAM")
        source[:] = np.frombuffer(np.random.default_rng(seed).bytes(source.nbytes), np.uint8)
    conn.send((agent.get_agent_metadata(), [int(s.ctypes.data) for s in sources]))
    conn.recv()  # 'stop'
    conn.send("stopped")


def _scattered(base: int, count: int, size: int, seed: int) -> np.ndarray:
    """Same placement as the generic bench: shuffled, non-adjacent slots."""
    slots = np.random.default_rng(seed).permutation(2 * count)[:count].astype(np.int64)
    descs = np.zeros((count, 3), dtype=np.int64)
    descs[:, 0] = base + slots * size
    descs[:, 1] = size
    return descs


class _Read:
    """One prepared READ request, re-posted on every call (NIXL's fast path)."""

    def __init__(self, agent: Any, peer: str, local: np.ndarray, remote: np.ndarray) -> None:
        self.agent = agent
        self.local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
        self.remote = agent.prep_xfer_dlist(peer, remote, "DRAM")
        index = np.arange(local.shape[0], dtype=np.int32)
        self.request = agent.make_prepped_xfer("READ", self.local, index, self.remote, index)

    def __call__(self) -> None:
        agent, request = self.agent, self.request
        state = agent.transfer(request)
        deadline = time.monotonic() + TIMEOUT_S
        while state == "PROC" and time.monotonic() < deadline:
            state = agent.check_xfer_state(request)
        if state != "DONE":
            raise TransportError(f"raw NIXL READ ended {state}")

    def close(self) -> None:
        self.request.release()
        self.local.release()
        self.remote.release()


def raw_baseline(quick: bool) -> list[Result]:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    repeats = 5 if quick else 30
    sizes = [2 * count * size for count, size, _ in SHAPES]
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    target = ctx.Process(target=_target, args=(theirs, sizes), daemon=True)
    target.start()
    agent = _agent(f"kvwire-rawbench-initiator-{os.getpid()}")
    sinks = []
    for nbytes in sizes:  # as the generic bench: zeroed, then every page touched
        sink = np.zeros(nbytes, dtype=np.uint8)
        sink[:] = 1
        sinks.append(sink)
    results: list[Result] = []
    try:
        if not mine.poll(TIMEOUT_S):
            raise TransportError("the raw NIXL target process did not start")
        metadata, remote_bases = mine.recv()
        for sink in sinks:
            agent.register_memory([(int(sink.ctypes.data), sink.nbytes, 0, "")], "DRAM")
        peer = agent.add_remote_agent(metadata)
        peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        for (count, size, label), sink, remote_base in zip(
            SHAPES, sinks, remote_bases, strict=True
        ):
            read = _Read(
                agent,
                peer,
                _scattered(int(sink.ctypes.data), count, size, seed=1),
                _scattered(remote_base, count, size, seed=2),
            )
            samples = []
            for _ in range(2):
                read()  # warm both sides' pages
            copy_src = np.ones(count * size, dtype=np.uint8)
            copy_dst = np.zeros_like(copy_src)
            for _ in range(repeats):
                # The generic bench samples its memcpy baseline (a copy of the same bytes)
                # right before every transport READ, which leaves the caches cold; do the
                # same so raw and kvwire figures see the same cache state.
                np.copyto(copy_dst, copy_src)
                t0 = time.perf_counter()
                read()
                samples.append(count * size / (time.perf_counter() - t0) / 1e9)
            read.close()
            results.append(
                Result(
                    f"nixl_raw.read.{label}.GBps",
                    float(np.median(samples)),
                    "GB/s",
                    min=min(samples),
                    max=max(samples),
                )
            )
        one = _Read(
            agent,
            peer,
            np.array([[int(sinks[0].ctypes.data), LATENCY_BYTES, 0]], dtype=np.int64),
            np.array([[remote_bases[0], LATENCY_BYTES, 0]], dtype=np.int64),
        )
        timing = repeat(one, repeats=50 if quick else 300, warmup=10)
        one.close()
        results.append(Result("nixl_raw.read.4KiB.us", timing.median * 1e6, "us"))
    finally:
        mine.send("stop")
        if mine.poll(TIMEOUT_S):
            mine.recv()
        target.join(TIMEOUT_S)
        if target.is_alive():
            target.kill()
    return results


if __name__ == "__main__":
    for result in raw_baseline(quick=False):
        print(result.as_dict())
