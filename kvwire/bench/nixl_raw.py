"""kvwire against raw NIXL, for ``kvwire bench transport --transport nixl``.

Bench tooling, not part of the adapter: it imports :mod:`kvwire_nixl` and NIXL (both only
when it runs), while the adapter imports nothing above the transport interface.

The question is what kvwire adds to NIXL, so both contenders must see the same conditions;
two separate runs against two separate peer processes differed by 10 % or more on this
machine for reasons that had nothing to do with kvwire. Here, in one run:

* **One target.** A spawned process registers the source blocks with a *raw* NIXL agent
  (NIXL's progress thread off, UCX error handling ``none``, as kvwire configures its own
  agents) and then stays idle: it never calls into NIXL while samples are taken, so
  neither initiator is helped or hindered by its progress, and both read the very same
  remote memory through the very same remote agent.
* **Two initiators in this process, same memory.** A raw ``nixl_agent`` and a kvwire
  :class:`NixlTransport` (default options, progress thread included: kvwire as shipped)
  both register the same destination buffers and load the target's metadata blob, which is
  NIXL's own (kvwire's ``add_peer`` takes exactly what ``get_agent_metadata`` returns). The
  descriptor arrays are the same objects for both.
* **Raw means the NIXL Python API and nothing else**: lists prepared once and one request
  re-posted with ``transfer`` / ``check_xfer_state`` (NIXL's fastest path). kvwire goes
  through its public API: ``read`` / ``poll`` / ``release`` per transfer.
* **Same waiting.** Both spin on the state (raw ``check_xfer_state``, kvwire ``poll``,
  which calls it), with a deadline set only once a transfer is still running.
* **Samples in turns.** Every repetition times raw and kvwire back to back, in alternating
  order, each preceded by a memcpy of the same byte count (the generic bench's baseline,
  so both see the cache state that copy leaves); latency alternates blocks of
  ``LATENCY_BLOCK`` calls (alternating single calls moved both medians up a little and
  the margin to the latency target by under 0.1 us).

Each contender's bytes are checked against the target's content once before timing.
Results: ``nixl.read.{64KiB,2MiB}.GBps`` and ``nixl.read.4KiB.us`` (baseline: the raw
figure, ratio: kvwire / raw of the medians), ``nixl_raw.read.{64KiB,2MiB}.GBps``,
``nixl_raw.read.4KiB.us``, and ``nixl.read.{64KiB,2MiB}.vs_raw``: the median (and range)
of kvwire / raw over the back-to-back pairs of samples, the steadier ratio when the
machine's load comes and goes.
"""

from __future__ import annotations

import os
import select
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from kvwire.bench.report import QUICK_REPEATS, MemcpySampler, Result, bandwidth_in_turns
from kvwire.bench.sweeps import LATENCY_BYTES, SHAPES, scattered
from kvwire.errors import TransportError
from kvwire.framing import close_pipes, read_frame, spawn, wait_or_kill, write_frame
from kvwire.transport import Region, XferState

REPEATS = {"64KiB": 120, "2MiB": 60}
"""Repetitions per shape (each times both contenders): about 1.5 and 3 s here. Under the
load of a shared 2-core machine single samples vary 2-5x, so the medians need this many;
the paired ratios (``.vs_raw``) settle with fewer."""
BACKEND_OPTIONS = {"ucx_error_handling_mode": "none"}
TIMEOUT_S = 60.0
LATENCY_BLOCK = 20


def _agent(name: str) -> Any:
    from kvwire_nixl._loader import load_nixl

    api, _ = load_nixl()
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", dict(BACKEND_OPTIONS))
    return agent


def _source_bytes(seed: int, nbytes: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8)


def _target(sizes: list[int]) -> None:
    """The idle side (``python -m kvwire.bench.nixl_raw --target SIZE...``): one source
    region per shape, registered and filled, announced in one frame on stdout; then it
    only waits for stdin to close (it never calls into NIXL while the initiators measure)."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    agent = _agent(f"kvwire-rawbench-target-{os.getpid()}")
    sources = [np.zeros(n, dtype=np.uint8) for n in sizes]
    for seed, source in enumerate(sources):
        agent.register_memory([(int(source.ctypes.data), source.nbytes, 0, "")], "DRAM")
        source[:] = _source_bytes(seed, source.nbytes)
    bases = [int(s.ctypes.data) for s in sources]
    write_frame(sys.stdout.buffer, {"metadata": agent.get_agent_metadata(), "bases": bases})
    while read_frame(sys.stdin.buffer) is not None:
        pass


class _RawRead:
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
        if state == "PROC":
            deadline = time.monotonic() + TIMEOUT_S
            while state == "PROC" and time.monotonic() < deadline:
                state = agent.check_xfer_state(request)
        if state != "DONE":
            raise TransportError(f"raw NIXL READ ended {state}")

    def close(self) -> None:
        self.request.release()
        self.local.release()
        self.remote.release()


class _KvwireRead:
    """The same READ through kvwire's public API: read, poll until done, release."""

    def __init__(self, transport: Any, peer: str, local: np.ndarray, remote: np.ndarray):
        self.transport = transport
        self.peer = peer
        self.local = local
        self.remote = remote

    def __call__(self) -> None:
        transport = self.transport
        handle = transport.read(self.peer, self.local, self.remote)
        state = transport.poll(handle)
        if state is XferState.PENDING:
            deadline = time.monotonic() + TIMEOUT_S
            while state is XferState.PENDING and time.monotonic() < deadline:
                state = transport.poll(handle)
        transport.release(handle)
        if state is not XferState.DONE:
            raise TransportError(f"kvwire NIXL READ ended {state.name}")


class _OwnMemcpy:
    """The memcpy sampler used when no generic bench passes its own (standalone runs)."""

    def __init__(self) -> None:
        self.buffers: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, label: str, nbytes: int) -> None:
        if nbytes not in self.buffers:
            self.buffers[nbytes] = (np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8))
        src, dst = self.buffers[nbytes]
        np.copyto(dst, src)


def _check_moved(
    read: Callable[[], None], sink: np.ndarray, local: np.ndarray, remote: np.ndarray, source: Any
) -> None:
    """One READ into a zeroed sink must land the target's bytes block by block."""
    sink[:] = 0
    read()
    base, remote_base = int(sink.ctypes.data), int(source[1])
    for (laddr, length, _), (raddr, _, _) in zip(local.tolist(), remote.tolist(), strict=True):
        got = sink[laddr - base : laddr - base + length]
        want = source[0][raddr - remote_base : raddr - remote_base + length]
        if not np.array_equal(got, want):
            raise TransportError(f"benchmark READ landed wrong bytes at {laddr:#x}")


def _latency(
    contenders: dict[str, Callable[[], None]], rounds: int, warmup: int, block: int = LATENCY_BLOCK
) -> dict[str, list[float]]:
    """Microseconds per call: each round times ``block`` calls of one contender, then of
    the other (order alternating by round), so both share the machine's drift while each
    runs as a steady loop, as a latency-bound caller would."""
    names = list(contenders)
    for _ in range(warmup):
        for fn in contenders.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in names}
    clock = time.perf_counter
    for rnd in range(rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            fn = contenders[name]
            out = samples[name]
            for _ in range(block):
                t0 = clock()
                fn()
                out.append((clock() - t0) * 1e6)
    return samples


class _Rig:
    """The target process, both initiators and the destination buffers they share; torn
    down in order (requests, agents, then memory: an agent must deregister buffers that
    still exist)."""

    def __init__(self, sizes: list[int]) -> None:
        from kvwire_nixl.transport import NixlTransport

        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        # A fresh interpreter talking msgpack frames: nothing is pickled.
        self.target = spawn("kvwire.bench.nixl_raw", "--target", *map(str, sizes))
        self.closers: list[Callable[[], None]] = []
        self.raw_regs: list[Any] = []
        self.kvwire: NixlTransport | None = None
        tag = uuid.uuid4().hex[:8]
        self.raw: Any = _agent(f"kvwire-rawbench-raw-{tag}")
        self.kvwire = NixlTransport(f"kvwire-rawbench-kvwire-{tag}")
        self.sinks = []
        for nbytes in sizes:  # as the generic bench: zeroed, then every page touched
            sink = np.zeros(nbytes, dtype=np.uint8)
            sink[:] = 1
            self.sinks.append(sink)
        stdout = self.target.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], TIMEOUT_S)
        hello = read_frame(stdout) if ready else None
        if hello is None:
            raise TransportError("the raw NIXL target process did not start")
        metadata: bytes = hello["metadata"]
        self.remote_bases: list[int] = hello["bases"]
        for sink in self.sinks:
            row = (int(sink.ctypes.data), sink.nbytes, 0, "")
            self.raw_regs.append(self.raw.register_memory([row], "DRAM"))
        self.kvwire.register([Region(int(s.ctypes.data), s.nbytes) for s in self.sinks])
        peer = self.raw.add_remote_agent(metadata)
        self.raw_peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        self.kvwire_peer = self.kvwire.add_peer(metadata)

    def contenders(self, local: np.ndarray, remote: np.ndarray) -> dict[str, Callable[[], None]]:
        """The same READ both ways, raw first (names are the result prefixes)."""
        assert self.kvwire is not None
        raw = _RawRead(self.raw, self.raw_peer, local, remote)
        self.closers.append(raw.close)
        return {
            "nixl_raw": raw,
            "nixl": _KvwireRead(self.kvwire, self.kvwire_peer, local, remote),
        }

    def close(self) -> None:
        for close in self.closers:
            close()
        if self.kvwire is not None:
            self.kvwire.close()
        if getattr(self, "raw", None) is not None:
            for reg in self.raw_regs:
                self.raw.deregister_memory(reg)
            self.raw = None  # the agent goes before the buffers it registered
        close_pipes(self.target)  # the target's signal to exit
        wait_or_kill(self.target, TIMEOUT_S)


def _result(name: str, values: list[float], unit: str, raw: str | None, raw_value: float) -> Result:
    """Median and range; kvwire's figures carry the raw one as baseline (ratio kvwire/raw)."""
    value = statistics.median(values)
    return Result(
        name,
        value,
        unit,
        baseline=raw,
        ratio=None if raw is None else value / raw_value,
        min=min(values),
        max=max(values),
    )


def paired_benchmark(quick: bool, memcpy: MemcpySampler | None = None) -> list[Result]:
    """kvwire and raw NIXL reading the same remote memory from one idle target, in turns
    (see the module docstring); ``memcpy`` is the generic bench's baseline sampler."""
    sample_memcpy: MemcpySampler = memcpy if memcpy is not None else _OwnMemcpy()
    rig = _Rig([2 * count * size for count, size, _ in SHAPES])
    results: list[Result] = []
    try:
        for seed, ((count, size, label), sink, remote_base) in enumerate(
            zip(SHAPES, rig.sinks, rig.remote_bases, strict=True)
        ):
            local = scattered(int(sink.ctypes.data), count, size, np.random.default_rng(1))
            remote = scattered(remote_base, count, size, np.random.default_rng(2))
            pair = rig.contenders(local, remote)
            source = (_source_bytes(seed, sink.nbytes), remote_base)
            for read in pair.values():
                _check_moved(read, sink, local, remote, source)
                read()  # warm both sides' pages and the request
            repeats = QUICK_REPEATS if quick else REPEATS[label]
            samples = bandwidth_in_turns(pair, count * size, label, repeats, sample_memcpy)
            raw_name = f"nixl_raw.read.{label}.GBps"
            raw_gbps = statistics.median(samples["nixl_raw"])
            pairs = [k / r for k, r in zip(samples["nixl"], samples["nixl_raw"], strict=True)]
            results += [
                _result(f"nixl.read.{label}.GBps", samples["nixl"], "GB/s", raw_name, raw_gbps),
                _result(raw_name, samples["nixl_raw"], "GB/s", None, raw_gbps),
                _result(f"nixl.read.{label}.vs_raw", pairs, "x", None, 1.0),
            ]
        one_local = np.array([[int(rig.sinks[0].ctypes.data), LATENCY_BYTES, 0]], np.int64)
        one_remote = np.array([[rig.remote_bases[0], LATENCY_BYTES, 0]], np.int64)
        latency = _latency(rig.contenders(one_local, one_remote), 15 if quick else 150, warmup=50)
        raw_us = statistics.median(latency["nixl_raw"])
        results += [
            _result("nixl.read.4KiB.us", latency["nixl"], "us", "nixl_raw.read.4KiB.us", raw_us),
            _result("nixl_raw.read.4KiB.us", latency["nixl_raw"], "us", None, raw_us),
        ]
    finally:
        rig.close()
    return sorted(results, key=lambda r: (r.name.startswith("nixl_raw"), r.unit, r.name))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--target"]:
        _target([int(n) for n in sys.argv[2:]])
    else:
        for result in paired_benchmark(quick=False):
            print(result.as_dict())
