"""How a transport's cost grows with the work: the sweeps of ``kvwire bench transport``.

For every transport the suite measures, one peer agent process
(:class:`~kvwire.peer.agent.PeerAgent`, shared with the conformance suite) holds the remote
memory and this process READs from it — always between two processes, pages touched before
timing, one untimed warm-up per point, the median of several repetitions kept. Unlike the
suite's headline (plain numpy memory), both sides here use the transport's own host
allocator where it has one (shm's peer-mappable segments), else numpy memory:

* **bandwidth vs block size** (4 KiB … 8 MiB): the same total bytes as blocks of one size,
  scattered on both sides so nothing coalesces. Baselines in the same run: one numpy copy
  of the total bytes (the machine's limit) and one ``memmove`` per block of the same sizes
  in this process (the limit of any block-by-block copy);
* **post time vs descriptor count** (1 … 100k): how long ``read`` takes to return for N
  adjacent 256-byte descriptors, as given and after :func:`kvwire.layout.coalesce` (which
  merges them into one; its own time is included);
* **concurrency** (1 … 64 transfers in flight): K READs of 1 MiB each (16 scattered 64 KiB
  blocks) posted back to back, aggregate GB/s until the last is done;
* **heterogeneous TP fan-out**: a request of a Llama-3-8B-shaped cache (4 layers, HND)
  moved 1->1, 1->8 (eight D ranks each READ their head from one P rank) and 8->1 (one D
  rank READs each head from eight P ranks), with the descriptors of
  :func:`kvwire.layout.plan_read`. The eight ranks of a side are eight geometries in one
  agent's memory (one process), so the figure is the cost of the descriptor shapes
  heterogeneous TP produces — 8 KiB head slices instead of 64 KiB blocks — not of
  eight processes sharing two cores.

Each sweep is one chart with a curve per transport; the headline points are results too
(``<transport>.bw.<size>.GBps``, ``<transport>.post.<n>.us`` and ``.coalesced.us``,
``<transport>.inflight.<k>.GBps``, ``<transport>.tp.<p>to<d>.GBps``).
"""

from __future__ import annotations

import collections
import ctypes
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvwire.bench.report import Report, Result
from kvwire.demo.models import CacheSpec, preset
from kvwire.errors import KVWireError, TransportError
from kvwire.layout import coalesce, plan_read
from kvwire.layout.geometry import RemoteGeometry
from kvwire.transport import Transport, XferState, create, load, region_of_array

Descs = npt.NDArray[np.int64]

BLOCK_SIZES_FULL = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20)
BLOCK_SIZES_QUICK = (4 << 10, 64 << 10, 1 << 20, 8 << 20)
DESC_COUNTS_FULL = (1, 10, 100, 1_000, 10_000, 100_000)
DESC_COUNTS_QUICK = (1, 100, 10_000, 100_000)
DESC_BYTES = 64
IN_FLIGHT_FULL = (1, 2, 4, 8, 16, 32, 64)
IN_FLIGHT_QUICK = (1, 4, 16, 64)
XFER_BLOCKS = 16
XFER_BLOCK_BYTES = 64 << 10
TP_LAYERS = 4
TP_SHAPES = ((1, 8), (1, 1), (8, 1))
"""(P TP, D TP) pairs of the fan-out sweep, in ascending P/D order (the chart's x)."""


def size_label(nbytes: int) -> str:
    if nbytes >= 1 << 20 and nbytes % (1 << 20) == 0:
        return f"{nbytes >> 20}MiB"
    return f"{nbytes >> 10}KiB" if nbytes >= 1024 else f"{nbytes}B"


def count_label(n: int) -> str:
    return f"{n // 1000}k" if n >= 1000 and n % 1000 == 0 else str(n)


def _descs(addrs: npt.NDArray[np.int64], length: int | npt.NDArray[np.int64]) -> Descs:
    out = np.zeros((addrs.shape[0], 3), dtype=np.int64)
    out[:, 0] = addrs
    out[:, 1] = length
    return out


SHAPES = ((256, 64 << 10, "64KiB"), (32, 2 << 20, "2MiB"))
"""(count, block bytes, label) of every scattered-READ suite: cold blocks, never adjacent."""
LATENCY_BYTES = 4096
"""One small READ: the per-transfer cost, not bandwidth."""


def scattered(base: int, count: int, size: int, rng: np.random.Generator) -> Descs:
    """``count`` blocks of ``size`` at shuffled slots of a span of ``2 * count`` slots, so
    no two are adjacent in order and nothing coalesces (every READ suite's block shape)."""
    slots = rng.permutation(2 * count)[:count].astype(np.int64)
    return _descs(base + slots * size, size)


def _median(samples: Sequence[float]) -> float:
    return float(statistics.median(samples))


@dataclass
class _Session:
    """One transport: a peer process with ``nbytes`` of memory, and a local agent with as
    much, registered and touched."""

    name: str
    nbytes: int
    local: Transport = field(init=False)
    peer_name: str = field(init=False)
    lbase: int = field(init=False)
    rbase: int = field(init=False)
    _peer: Any = field(init=False)
    _array: Any = field(init=False)

    def __post_init__(self) -> None:
        from kvwire.peer.agent import PeerAgent  # only the bench needs the peer
        from kvwire.peer.memory import allocate

        extra = list(getattr(load(self.name), "conformance_allocators", ()))
        allocator = extra[0] if extra else "numpy"
        self._peer = PeerAgent(self.name)
        try:
            self.local = create(self.name, f"kvwire-sweep-{uuid.uuid4().hex[:8]}")
            remote = self._peer.alloc(self.nbytes, allocator)
            self._peer.fill(remote["addr"], remote["nbytes"], seed=3)
            self.rbase = int(remote["addr"])
            self._array = allocate(allocator, self.nbytes)
            self._array[:] = 1  # touch every page before timing
            self.lbase = int(self._array.ctypes.data)
            self.local.register([region_of_array(self._array)])
            self.peer_name = self.local.add_peer(self._peer.metadata())
        except BaseException:
            self._peer.close()
            raise

    def post(self, ldescs: Descs, rdescs: Descs) -> object:
        return self.local.read(self.peer_name, ldescs, rdescs)

    def finish(self, handles: Sequence[object]) -> None:
        """Wait for every transfer to end, release them; raise if one did not succeed."""
        deadline = time.monotonic() + 120
        pending = list(handles)
        failed = 0
        while pending:
            still = []
            for h in pending:
                state = self.local.poll(h)
                if state is XferState.PENDING:
                    still.append(h)
                    continue
                failed += state is not XferState.DONE
                self.local.release(h)
            pending = still
            if pending:
                if time.monotonic() > deadline:
                    raise TransportError(f"{self.name}: sweep transfers still running after 120 s")
                self.local.wait(0.001)
        if failed:
            raise TransportError(f"{self.name}: {failed} sweep transfer(s) failed")

    def read_all(self, pairs: Sequence[tuple[Descs, Descs]]) -> None:
        self.finish([self.post(ld, rd) for ld, rd in pairs])

    def close(self) -> None:
        try:
            self.local.close()
        finally:
            self._peer.close()


def _timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds per call of ``fn`` after one untimed warm-up call."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# -- the four sweeps, for one transport ---------------------------------------------------


def _bandwidth(
    s: _Session, sizes: Sequence[int], total: int, repeats: int, baselines: _Baselines
) -> list[list[float]]:
    """GB/s samples per block size: ``total`` bytes as scattered blocks of that size."""
    rng = np.random.default_rng(11)
    out = []
    for size in sizes:
        count = max(1, total // size)
        ld = scattered(s.lbase, count, size, rng)
        rd = scattered(s.rbase, count, size, rng)
        s.read_all([(ld, rd)])  # warm-up
        samples = []
        for _ in range(repeats):
            baselines.sample(size)
            t0 = time.perf_counter()
            s.read_all([(ld, rd)])
            samples.append(count * size / (time.perf_counter() - t0) / 1e9)
        out.append(samples)
    return out


def _post_times(
    s: _Session, counts: Sequence[int], repeats: int
) -> tuple[list[list[float]], list[list[float]]]:
    """Seconds for ``read`` to return, per descriptor count: as given, and coalesced."""
    raw: list[list[float]] = []
    merged: list[list[float]] = []
    for n in counts:
        offsets = np.arange(n, dtype=np.int64) * DESC_BYTES
        ld, rd = _descs(s.lbase + offsets, DESC_BYTES), _descs(s.rbase + offsets, DESC_BYTES)
        for sink, merge in ((raw, False), (merged, True)):
            samples = []
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                handle = s.post(*coalesce(ld, rd)) if merge else s.post(ld, rd)
                posted = time.perf_counter() - t0
                s.finish([handle])
                if i:  # the first is a warm-up
                    samples.append(posted)
            sink.append(samples)
    return raw, merged


def _coalesce_alone(counts: Sequence[int], repeats: int) -> list[float]:
    """Median seconds of :func:`kvwire.layout.coalesce` on N adjacent descriptors."""
    out = []
    for n in counts:
        offsets = np.arange(n, dtype=np.int64) * DESC_BYTES
        ld, rd = _descs((1 << 30) + offsets, DESC_BYTES), _descs((1 << 40) + offsets, DESC_BYTES)
        out.append(_median(_timed(lambda ld=ld, rd=rd: coalesce(ld, rd), repeats)))  # type: ignore[misc]
    return out


def _in_flight(s: _Session, depths: Sequence[int], repeats: int) -> list[list[float]]:
    """Aggregate GB/s samples per number of 1 MiB READs in flight at once."""
    rng = np.random.default_rng(12)
    slots = s.nbytes // XFER_BLOCK_BYTES
    out = []
    for k in depths:
        need = k * XFER_BLOCKS
        lslots = rng.permutation(slots)[:need].astype(np.int64).reshape(k, XFER_BLOCKS)
        rslots = rng.permutation(slots)[:need].astype(np.int64).reshape(k, XFER_BLOCKS)
        pairs = [
            (
                _descs(s.lbase + ls * XFER_BLOCK_BYTES, XFER_BLOCK_BYTES),
                _descs(s.rbase + rs * XFER_BLOCK_BYTES, XFER_BLOCK_BYTES),
            )
            for ls, rs in zip(lslots, rslots, strict=True)
        ]
        times = _timed(lambda pairs=pairs: s.read_all(pairs), repeats)  # type: ignore[misc]
        out.append([need * XFER_BLOCK_BYTES / t / 1e9 for t in times])
    return out


def tp_pairs(
    p_tp: int, d_tp: int, lbase: int, rbase: int, blocks: int
) -> list[tuple[Descs, Descs]]:
    """The READs of one request (``blocks`` random blocks of a 2x larger cache per rank)
    from P ranks laid out from ``rbase`` to D ranks laid out from ``lbase``: every D rank
    READs from each P rank it shares heads with, descriptors from ``plan_read``."""
    model = preset("llama-3-8b")
    rng = np.random.default_rng(13)
    num_blocks = 2 * blocks
    p_blocks = rng.permutation(num_blocks)[:blocks].tolist()
    d_blocks = rng.permutation(num_blocks)[:blocks].tolist()
    p_specs = [CacheSpec(model, TP_LAYERS, num_blocks, r, p_tp) for r in range(p_tp)]
    d_specs = [CacheSpec(model, TP_LAYERS, num_blocks, r, d_tp) for r in range(d_tp)]
    remotes = [
        RemoteGeometry.from_local(spec.geometry(rbase + r * spec.total_bytes))
        for r, spec in enumerate(p_specs)
    ]
    pairs = []
    for r, spec in enumerate(d_specs):
        local = spec.geometry(lbase + r * spec.total_bytes)
        for remote in remotes:
            if p_tp > d_tp and remote.tp_rank * d_tp // p_tp != r:
                continue  # this P rank's heads belong to another D rank
            if d_tp > p_tp and r * p_tp // d_tp != remote.tp_rank:
                continue
            plan = plan_read(local, remote, [d_blocks], [p_blocks])
            if plan.num_descs:
                pairs.append((plan.local_descs, plan.remote_descs))
    return pairs


def _fanout(s: _Session, blocks: int, repeats: int) -> list[list[float]]:
    """GB/s samples per (P TP, D TP) shape of :data:`TP_SHAPES`."""
    out = []
    for p_tp, d_tp in TP_SHAPES:
        pairs = tp_pairs(p_tp, d_tp, s.lbase, s.rbase, blocks)
        nbytes = sum(int(ld[:, 1].sum()) for ld, _ in pairs)
        times = _timed(lambda pairs=pairs: s.read_all(pairs), repeats)  # type: ignore[misc]
        out.append([nbytes / t / 1e9 for t in times])
    return out


# -- baselines ----------------------------------------------------------------------------


class _Baselines:
    """One numpy copy of ``total`` bytes, and one memmove per block of a given size
    (scattered as the transports' blocks are), in this process. Sampled between the
    transports' repetitions so both see the same machine load."""

    def __init__(self, sizes: Sequence[int], total: int) -> None:
        self.total = total
        self.src = np.ones(2 * total, dtype=np.uint8)
        self.dst = np.zeros(2 * total, dtype=np.uint8)
        np.copyto(self.dst, self.src)  # fault every page in
        rng = np.random.default_rng(14)
        self.spans: dict[int, tuple[list[int], list[int], list[int]]] = {}
        for size in sizes:
            count = max(1, total // size)
            d = scattered(int(self.dst.ctypes.data), count, size, rng)[:, 0].tolist()
            src = scattered(int(self.src.ctypes.data), count, size, rng)[:, 0].tolist()
            self.spans[size] = (d, src, [size] * count)
        self.whole: list[float] = []
        self.per_block: dict[int, list[float]] = {size: [] for size in sizes}

    def sample(self, size: int) -> None:
        t0 = time.perf_counter()
        np.copyto(self.dst[: self.total], self.src[: self.total])
        self.whole.append(self.total / (time.perf_counter() - t0) / 1e9)
        d, src, n = self.spans[size]
        t0 = time.perf_counter()
        collections.deque(map(ctypes.memmove, d, src, n), maxlen=0)
        self.per_block[size].append(sum(n) / (time.perf_counter() - t0) / 1e9)

    def medians(self) -> tuple[list[float], list[float]]:
        """GB/s: the numpy copy (one value per size, all equal), and memmove per block."""
        whole = _median(self.whole)
        return [whole] * len(self.per_block), [_median(v) for v in self.per_block.values()]


# -- the entry point ----------------------------------------------------------------------


@dataclass
class _Figures:
    bandwidth: list[list[float]]
    post_raw: list[list[float]]
    post_merged: list[list[float]]
    in_flight: list[list[float]]
    fanout: list[list[float]]


def run_sweeps(report: Report, names: Sequence[str], quick: bool) -> None:
    """Measure the four sweeps for every transport in ``names`` into ``report``."""
    sizes = BLOCK_SIZES_QUICK if quick else BLOCK_SIZES_FULL
    counts = DESC_COUNTS_QUICK if quick else DESC_COUNTS_FULL
    depths = IN_FLIGHT_QUICK if quick else IN_FLIGHT_FULL
    repeats = 3 if quick else 7
    region = (64 if quick else 128) << 20
    total = region // 2
    tp_blocks = region // (2 * TP_LAYERS * 64 << 10)  # the 1->1 cache fills half the region
    figures: dict[str, _Figures] = {}
    baselines = _Baselines(sizes, total)
    for name in names:
        session = _Session(name, region)
        try:
            raw, merged = _post_times(session, counts, repeats)
            figures[name] = _Figures(
                bandwidth=_bandwidth(session, sizes, total, repeats, baselines),
                post_raw=raw,
                post_merged=merged,
                in_flight=_in_flight(session, depths, repeats),
                fanout=_fanout(session, tp_blocks, repeats),
            )
        finally:
            session.close()
    if not figures:
        return
    memcpy, per_block = baselines.medians()
    merge_only = [t * 1e6 for t in _coalesce_alone(counts, repeats)]
    _record(report, figures, sizes, counts, depths, memcpy, per_block, total, merge_only)


def _spread(samples: Sequence[float], scale: float = 1.0) -> tuple[float, float, float]:
    return _median(samples) * scale, min(samples) * scale, max(samples) * scale


@dataclass
class _Curves:
    """One sweep's curves: the first transport's (with its spread) and the others'."""

    y: list[float]
    y_min: list[float]
    y_max: list[float]
    others: dict[str, list[float]]


def _curves(
    figures: dict[str, _Figures], pick: Callable[[_Figures], list[list[float]]], scale: float = 1.0
) -> _Curves:
    first, *rest = figures
    samples = pick(figures[first])
    return _Curves(
        y=[_median(s) * scale for s in samples],
        y_min=[min(s) * scale for s in samples],
        y_max=[max(s) * scale for s in samples],
        others={n: [_median(s) * scale for s in pick(figures[n])] for n in rest},
    )


def _results(
    report: Report,
    name: str,
    fig: _Figures,
    sizes: Sequence[int],
    counts: Sequence[int],
    depths: Sequence[int],
    memcpy_gbps: float,
    memcpy_line: str,
) -> None:
    """The headline points of one transport's sweeps as results."""

    def add(
        suffix: str, samples: Sequence[float], unit: str, scale: float = 1.0, **kw: Any
    ) -> float:
        med, lo, hi = _spread(samples, scale)
        report.add(Result(f"{name}.{suffix}", med, unit, min=lo, max=hi, **kw))
        return med

    for size, samples in zip(sizes, fig.bandwidth, strict=True):
        med = _median(samples)
        add(f"bw.{size_label(size)}.GBps", samples, "GB/s", baseline=memcpy_line,
            ratio=med / memcpy_gbps)  # fmt: skip
    n = count_label(counts[-1])
    raw = add(f"post.{n}.us", fig.post_raw[-1], "us", 1e6)
    merged = _median(fig.post_merged[-1]) * 1e6
    add(f"post.{n}.coalesced.us", fig.post_merged[-1], "us", 1e6,
        baseline=f"uncoalesced: {raw:.4g} us", ratio=raw / merged)  # fmt: skip
    for k, samples in ((depths[0], fig.in_flight[0]), (depths[-1], fig.in_flight[-1])):
        add(f"inflight.{k}.GBps", samples, "GB/s", baseline=memcpy_line,
            ratio=_median(samples) / memcpy_gbps)  # fmt: skip
    one = _median(fig.fanout[TP_SHAPES.index((1, 1))])
    for (p_tp, d_tp), samples in zip(TP_SHAPES, fig.fanout, strict=True):
        if (p_tp, d_tp) == (1, 1):
            add("tp.1to1.GBps", samples, "GB/s")
        else:
            line = f"{name}.tp.1to1: {one:.3g} GB/s"
            add(f"tp.{p_tp}to{d_tp}.GBps", samples, "GB/s", baseline=line,
                ratio=_median(samples) / one)  # fmt: skip


def _record(
    report: Report,
    figures: dict[str, _Figures],
    sizes: Sequence[int],
    counts: Sequence[int],
    depths: Sequence[int],
    memcpy: list[float],
    per_block: list[float],
    total: int,
    merge_only: list[float],
) -> None:
    first = next(iter(figures))
    memcpy_line = f"numpy copy of {size_label(total)}: {memcpy[0]:.3g} GB/s"
    for name, fig in figures.items():
        _results(report, name, fig, sizes, counts, depths, memcpy[0], memcpy_line)

    bw = _curves(figures, lambda f: f.bandwidth)
    baselines = {"numpy copy (one process)": memcpy, "memmove per block (one process)": per_block}
    report.add_sweep(
        "transport.bandwidth_vs_block_size",
        sizes,
        bw.y,
        xlabel="block size (bytes; same total bytes, scattered blocks)",
        ylabel="READ GB/s (two processes)",
        label=first,
        y_min=bw.y_min,
        y_max=bw.y_max,
        series={**bw.others, **baselines},
        title="Bandwidth vs block size",
    )
    raw = _curves(figures, lambda f: f.post_raw, 1e6)
    merged = _curves(figures, lambda f: f.post_merged, 1e6)
    series = {**raw.others, f"{first}, coalesced": merged.y}
    series.update({f"{n}, coalesced": v for n, v in merged.others.items()})
    series["kvwire.layout.coalesce alone"] = merge_only
    report.add_sweep(
        "transport.post_time_vs_descriptors",
        counts,
        raw.y,
        xlabel=f"descriptors ({DESC_BYTES} B each, adjacent)",
        ylabel="time for read() to return (us)",
        label=first,
        y_min=raw.y_min,
        y_max=raw.y_max,
        series=series,
        title="Post time vs descriptor count, with and without kvwire.layout.coalesce",
    )
    depth = _curves(figures, lambda f: f.in_flight)
    report.add_sweep(
        "transport.concurrency",
        depths,
        depth.y,
        xlabel="READs in flight (1 MiB each: 16 scattered 64 KiB blocks)",
        ylabel="aggregate GB/s",
        label=first,
        y_min=depth.y_min,
        y_max=depth.y_max,
        series={**depth.others, "numpy copy (one process)": [memcpy[0]] * len(depths)},
        title="Throughput vs transfers in flight",
    )
    fan = _curves(figures, lambda f: f.fanout)
    report.add_sweep(
        "transport.tp_fanout",
        [p / d for p, d in TP_SHAPES],
        fan.y,
        xlabel="P TP / D TP (1->8 = 0.125, 1->1 = 1, 8->1 = 8); Llama-3-8B heads, 4 layers",
        ylabel="GB/s of the whole request",
        label=first,
        y_min=fan.y_min,
        y_max=fan.y_max,
        series=fan.others,
        title="Heterogeneous TP fan-out (descriptors from kvwire.layout.plan_read)",
    )


DEFAULT_TRANSPORTS = ("shm", "nixl", "ucx")


def installed_transports() -> list[str]:
    """The transports the suite measures when none is named: those of
    :data:`DEFAULT_TRANSPORTS` that load here (nixl and ucx are optional extras)."""
    out = []
    for name in DEFAULT_TRANSPORTS:
        try:
            load(name)
        except KVWireError:
            continue
        out.append(name)
    return out
