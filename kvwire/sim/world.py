"""A deterministic discrete-event world that runs the real transfer machines.

Prefill (P) and decode (D) engines, each with its own TP size, clock skew and one
:class:`~kvwire.machine.ProducerMachine`/``ConsumerMachine`` per rank, exchange handshakes,
transfers and notifications through an in-memory fabric that really copies bytes between
per-rank numpy KV buffers. The simulator plays every role around the machines: the proxy
(Poisson arrivals), the engines' block managers, the side channel and the transport, and it
injects faults into all of them. One ``random.Random(seed)`` drives every choice, so a seed
reproduces a run exactly.

Bytes are checked end to end: a prompt's KV is a pattern derived from its seed, written into
the producer's blocks at prefill; a consumer request that reports success must hold exactly
that pattern (for its suffix and its heads) in every rank's blocks. Streaming push
(``stream``): the push producer computes each prompt chunk by chunk and layer by layer over
simulated time, the pattern is per (prompt, layer, token, computation), and each round's
rectangles are copied cell by cell, so bytes written before they were computed, from
blocks taken back, or into blocks the consumer reused are found.

Why one module of ~1000 lines: it is one event loop, and each handler plays a part the
driver plays in production (proxy, block manager, transport, side channel) on the same
random stream; split, the order of draws that makes a seed reproducible would be spread
across files.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvwire.config import MAX_SECONDS, KVWireConfig
from kvwire.errors import KVWireError
from kvwire.machine import (
    FEATURES,
    Abort,
    Action,
    AllocationDone,
    ArmTimer,
    CancelTransfer,
    ChunkScheduled,
    ConsumerMachine,
    EvictEngine,
    FailReason,
    FreeBlocks,
    FreeReason,
    HandshakeDone,
    HandshakeFailed,
    LayersComputed,
    LeaseConfirmed,
    NotificationReceived,
    PeerLost,
    PeerMisbehaved,
    PostRead,
    PostWrite,
    Preempted,
    PrefillFinished,
    ProducerMachine,
    ProducerState,
    QueryLeases,
    ReleaseFailed,
    ReleaseTransfer,
    RemotePrefill,
    RequestAdded,
    RequestDone,
    RequestFailed,
    SendNotification,
    StartHandshake,
    Timer,
    TransferDone,
    TransferFailed,
    TransferMode,
    TransferPosted,
)
from kvwire.sim.fault_plan import Faults
from kvwire.sim.model import (
    ARRIVALS_PER_S,
    BLOCK_TOKENS,
    CLUSTERS,
    ENGINES,
    FULL,
    LAYERS,
    POISON,
    SCRIBBLE,
    SHORT_LEASE,
    STREAM_UNITS,
    Allocator,
    Buffer,
    Engine,
    EngineSpec,
    Rank,
    Request,
    SimResult,
    Stream,
    Xfer,
    kv,
    pattern,
    piece_rows,
)


class World:
    """One simulation run; ``run()`` returns its :class:`SimResult`."""

    def __init__(
        self,
        seed: int,
        requests: int,
        faults: Faults,
        legacy_lease_rule: bool = False,
        stream: bool = False,
    ) -> None:
        self.rng = random.Random(seed)
        self.legacy = legacy_lease_rule
        """Reproduce the old rule: consumers do not bound READs by the producer's lease,
        producers free expired blocks at once, transfers have no deadline."""
        self.stream = stream
        """Push producers stream: a prompt's KV is written while it is computed."""
        self.cuts: dict[tuple[str, str], float] = {}
        """Partitioned links: (producer host, consumer host) -> when the link heals."""
        self.n_requests = requests
        self.faults = faults
        self.result = SimResult(seed=seed, faults=faults.names)
        self.t = 0.0
        self.q: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self.seq = 0
        self.engines: dict[str, Engine] = {}
        """By host (the spec name): what a handshake or registration address reaches."""
        self.by_id: dict[str, Engine] = {}
        """Running engines by engine id: what the transport can reach."""
        self.by_cluster: dict[str, tuple[list[Engine], list[Engine]]] = {}
        self.reqs_p: dict[str, Request] = {}
        self.reqs_d: dict[str, Request] = {}
        self.all_reqs: list[Request] = []
        self.arrivals_done = False
        self._dispatch: dict[type[Action], Callable[[Rank, Any], None]] = {
            StartHandshake: self._act_handshake,
            PostRead: self._act_post,
            PostWrite: self._act_post,
            CancelTransfer: self._act_cancel,
            ReleaseTransfer: self._act_release,
            SendNotification: self._act_notify,
            QueryLeases: self._act_query_leases,
            FreeBlocks: self._act_free,
            RequestDone: self._act_outcome,
            RequestFailed: self._act_outcome,
            EvictEngine: self._act_evict,
            PeerMisbehaved: self._act_misbehaved,
            ArmTimer: self._act_nothing,
        }
        specs = list(ENGINES) + ([SHORT_LEASE] if faults.short_lease else [])
        clusters = {c.name: c for c in CLUSTERS}
        for spec in specs:
            skew = self.rng.uniform(-faults.clock_skew_s, faults.clock_skew_s)
            sched = skew + self.rng.uniform(-faults.clock_skew_s, faults.clock_skew_s) * 0.01
            engine = Engine(spec, clusters[spec.cluster], skew, sched)
            self.engines[spec.name] = engine
            self.by_id[engine.engine_id] = engine
            self._start_ranks(engine)
            ps, ds = self.by_cluster.setdefault(spec.cluster, ([], []))
            (ps if spec.role == "P" else ds).append(engine)

    # ----------------------------------------------------------------- event loop

    def at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.q, (t, self.seq, fn, arg))

    def run(self) -> SimResult:
        wall = time.perf_counter()
        self.at(0.0, self._arrival, 0)
        if self.faults.crash_interval_s:
            self.at(self.rng.expovariate(1 / self.faults.crash_interval_s), self._crash)
        q = self.q
        horizon = self.n_requests / ARRIVALS_PER_S + 20_000.0
        while q:
            t, _, fn, arg = heapq.heappop(q)
            if t > horizon:
                break
            self.t = t
            fn(arg)
        self._final_checks()
        self.result.sim_time_s = round(self.t, 3)
        self.result.wall_s = round(time.perf_counter() - wall, 3)
        return self.result

    def violation(self, message: str) -> None:
        self.result.invariant_violations += 1
        if len(self.result.violations) < 20:
            self.result.violations.append(f"t={self.t:.6f} {message}")

    def feed(self, rank: Rank, event: Any, floor: float | None = None) -> None:
        """Hand one event to a rank's machine at the rank's own (skewed) clock."""
        if not rank.alive:
            return
        now = self.t + rank.engine.skew
        if now < rank.last_now:
            now = rank.last_now
        if floor is not None and now < floor:
            now = floor
        rank.last_now = now
        try:
            actions = rank.machine.handle(event, now)
        except KVWireError as exc:
            self.violation(f"{rank.agent} {type(event).__name__}: {type(exc).__name__}: {exc}")
            return
        self.result.machine_events += 1
        dispatch = self._dispatch
        for action in actions:
            dispatch[type(action)](rank, action)
        deadline = rank.machine.next_deadline()
        if deadline is not None:
            ts = deadline - rank.engine.skew
            if ts < self.t:
                ts = self.t
            if ts < rank.timer_at:
                rank.timer_at = ts
                self.at(ts, self._timer, rank)

    def feed_all(self, engine: Engine, event: Any) -> None:
        """Hand one event to every rank: each rank of an engine runs its own machine."""
        for rank in engine.ranks:
            self.feed(rank, event)

    def _timer(self, rank: Rank) -> None:
        if not rank.alive or self.t < rank.timer_at:
            return
        rank.timer_at = math.inf
        deadline = rank.machine.next_deadline()
        if deadline is None:
            return
        # Skew arithmetic can land a hair before the deadline; never fire early by more.
        floor = deadline if deadline - (self.t + rank.engine.skew) < 1e-3 else None
        self.feed(rank, Timer(), floor)

    def _deliver(self, arg: tuple[Rank, Any]) -> None:
        self.feed(arg[0], arg[1])

    # ----------------------------------------------------------------- engines

    def _start_ranks(self, engine: Engine) -> None:
        spec = engine.spec
        cluster = engine.cluster
        engine.ranks = []
        for i in range(spec.tp):
            config = KVWireConfig(
                **_sim_settings(engine.engine_id, spec, i, cluster.mode, self.legacy)
            )
            machine: ConsumerMachine | ProducerMachine
            machine = (
                ProducerMachine(config)
                if spec.role == "P"
                else ConsumerMachine(config, one_source=cluster.mla, host=spec.name, port=1)
            )
            width = engine.slice_of(i)[1]
            layered = self.stream and cluster.mode is TransferMode.PUSH
            engine.ranks.append(Rank(engine, i, machine, width, engine.blocks, layered))

    def _crash(self, _: Any) -> None:
        if self.arrivals_done:
            return
        self._kill(self.rng.choice(list(self.engines.values())))
        self.at(self.t + self.rng.expovariate(1 / self.faults.crash_interval_s), self._crash)

    def _kill(self, engine: Engine) -> None:
        """The engine's process dies; it restarts 0.5-2 s later as a new engine."""
        if engine.up:
            self.result.crashes += 1
            engine.up = False
            for rank in engine.ranks:
                rank.alive = False
            dead_id = engine.engine_id
            del self.by_id[dead_id]
            engine.inc += 1
            engine.alloc = Allocator(engine.blocks)
            if engine.spec.role == "D":
                for req in list(self.reqs_d.values()):
                    if req.d is engine and req.status == "pending":
                        self._finish(req, "failed", "consumer crashed", free_d=False)
            ps, ds = self.by_cluster[engine.spec.cluster]
            for other in ps + ds:
                if other is not engine:
                    for rank in other.ranks:
                        self.at(self.t + 0.001, self._deliver, (rank, PeerLost(dead_id)))
            self.at(self.t + self.rng.uniform(0.5, 2.0), self._restart, engine)

    def _restart(self, engine: Engine) -> None:
        engine.up = True
        self.by_id[engine.engine_id] = engine
        self._start_ranks(engine)

    # ----------------------------------------------------------------- the proxy

    def _arrival(self, index: int) -> None:
        rng = self.rng
        if index + 1 < self.n_requests:
            self.at(self.t + rng.expovariate(ARRIVALS_PER_S), self._arrival, index + 1)
        else:
            self.arrivals_done = True
        cluster = rng.choices(CLUSTERS, weights=[c.weight for c in CLUSTERS])[0]
        ps, ds = self.by_cluster[cluster.name]
        req = Request()
        self.all_reqs.append(req)
        self.result.requests += 1
        req.cluster = cluster
        req.t0 = self.t
        req.seed = rng.randrange(1 << 30)
        streaming = self.stream and cluster.mode is TransferMode.PUSH
        if streaming:
            req.nt = rng.randint(1, 16 * BLOCK_TOKENS)
            req.n = -(-req.nt // BLOCK_TOKENS)
        else:
            req.n = rng.randint(1, 16)
        roll = rng.random()
        req.k = 0 if roll < 0.7 else (req.n if roll > 0.9 else rng.randint(0, req.n - 1))
        req.p = rng.choice(ps)
        req.d = rng.choice(ds)
        req.p_rid = f"req{index}-{rng.getrandbits(32):08x}"
        req.d_rid = f"req{index}-{rng.getrandbits(32):08x}"
        if not req.p.up or not req.d.up:
            self._finish(req, "failed", "engine down at arrival", free_d=False)
            return
        req.p_inc = req.p.inc
        req.d_inc = req.d.inc
        self.reqs_p[req.p_rid] = req
        self.feed_all(req.p, RequestAdded(req.p_rid))
        if streaming:
            self._start_stream(req)
        else:
            self.at(self.t + rng.uniform(0.002, 0.02), self._prefill_done, req)
        if self.faults.abort and rng.random() < self.faults.abort / 4:
            self.at(self.t + rng.uniform(0.0, 0.05), self._abort_p, req)

    def _prefill_done(self, req: Request) -> None:
        p = req.p
        if req.status != "pending":
            return
        if not p.up or p.inc != req.p_inc:
            self._finish(req, "failed", "producer crashed", free_d=False)
            return
        if req.aborted:
            return
        ids = p.alloc.alloc(req.n)
        if ids is None:
            self._drop_prefill(req, "failed", "producer out of blocks")
            return
        req.p_ids = ids
        arr = np.asarray(ids, dtype=np.int64)
        positions = np.arange(req.n, dtype=np.int64)
        for rank in p.ranks:
            start, width = p.slice_of(rank.index)
            rank.buf[arr] = pattern(req.seed, positions, start, width)
        deadline = self._hand_over(req)
        # kvwire producers export their lease deadline (in the clock the handshake samples),
        # so a consumer declines a read that could outlive it instead of reading blocks that
        # may already hold another prompt. Heartbeats alone are no evidence that it moved
        # (they are fire-and-forget); the producer's answers to lease queries are.
        remote = self._remote(req, deadline if req.cluster.mode is TransferMode.PULL else None)
        self.at(self.t + self.rng.uniform(0.0005, 0.003), self._to_consumer, (req, remote))

    def _hand_over(self, req: Request) -> float:
        """PrefillFinished: the engine hands the prompt's blocks to its ranks' machines under
        a lease the scheduler stamps (in its own clock); returns the deadline."""
        p = req.p
        req.p_done = True
        sched_now = self.t + p.sched_skew
        deadline = sched_now + p.spec.lease_s
        self.feed_all(p, PrefillFinished(req.p_rid, (tuple(req.p_ids),), deadline, sched_now))
        return deadline

    def _remote(self, req: Request, expiry: float | None) -> RemotePrefill:
        """The producer's side of the request, as the proxy hands it to the consumer."""
        p = req.p
        pull = req.cluster.mode is TransferMode.PULL
        return RemotePrefill(
            engine_id=p.engine_id,
            request_id=req.p_rid,
            host=p.spec.name,
            port=1,
            block_ids=(tuple(req.p_ids),) if pull else (),
            tp_size=p.spec.tp,
            blocks_expiry_time=expiry,
        )

    def _abort_p(self, req: Request) -> None:
        """Abort a prompt still being prefilled. (Once finished, its KV belongs to the
        consumer's read: aborting then would hand reused blocks to a reader that cannot tell,
        which is why engines do not; the machine's handling of it is unit-tested instead.)"""
        if req.stream is not None:
            self._abort_stream(req, "aborted", "producer aborted")
            return
        if req.p.inc != req.p_inc or not req.p.up or req.p_ids or req.status != "pending":
            return
        req.aborted = True
        self._drop_prefill(req, "aborted", "producer aborted")

    def _drop_prefill(self, req: Request, status: str, reason: str) -> None:
        """End a prompt before its prefill finished: its producer ranks hold nothing yet."""
        self.reqs_p.pop(req.p_rid, None)
        self._finish(req, status, reason, free_d=False)
        self.feed_all(req.p, Abort(req.p_rid))

    def _to_consumer(self, arg: tuple[Request, RemotePrefill]) -> None:
        req, remote = arg
        d = req.d
        if req.status != "pending":
            return
        if not d.up or d.inc != req.d_inc:
            self._finish(req, "failed", "consumer crashed", free_d=False)
            return
        self.reqs_d[req.d_rid] = req
        self.feed_all(d, RequestAdded(req.d_rid, remote))
        rng = self.rng
        wait = rng.uniform(0.0, 0.03) if rng.random() > 0.002 else rng.uniform(10.0, 45.0)
        self.at(self.t + wait, self._allocate, req)
        if self.faults.abort and rng.random() < self.faults.abort:
            # A streamed prompt is still computing after the allocation: abort it mid-stream.
            later = (wait + rng.uniform(0.0, 0.05),) if req.stream is not None else ()
            times = (0.0, wait / 2, wait, wait + 0.001, wait + 0.005, wait + 0.02, *later)
            self.at(self.t + rng.choice(times), self._abort_d, req)

    def _allocate(self, req: Request) -> None:
        d = req.d
        if req.status != "pending" or req.aborted or d.inc != req.d_inc or not d.up:
            return
        m = req.n - req.k
        ids = d.alloc.alloc(m)
        if ids is None:
            self._abort_d(req)
            return
        req.d_ids = ids
        if ids:
            arr = np.asarray(ids, dtype=np.int64)
            req.d_gens = d.alloc.gens[arr].copy()
            for rank in d.ranks:
                rank.buf[arr] = POISON
        blocks = (tuple(ids),)
        self.feed_all(d, AllocationDone(req.d_rid, blocks))

    def _abort_d(self, req: Request) -> None:
        if req.status != "pending" or req.d.inc != req.d_inc or not req.d.up:
            return
        req.aborted = True
        self.feed_all(req.d, Abort(req.d_rid))

    # ----------------------------------------------------------------- streaming

    def _start_stream(self, req: Request) -> None:
        """A push prompt the producer engine computes in chunks of 3-24 tokens, layer by
        layer, while the proxy hands the request to the consumer at once (push needs none of
        the producer's blocks): the consumer's registration often reaches the producer while
        the prompt is still computing, and its KV then leaves in rounds as layers complete."""
        rng = self.rng
        bounds = [0]
        while bounds[-1] < req.nt:
            bounds.append(min(req.nt, bounds[-1] + rng.randint(3, 24)))
        req.stream = Stream(bounds)
        remote = self._remote(req, None)
        self.at(self.t + rng.uniform(0.0005, 0.003), self._to_consumer, (req, remote))
        self.at(self.t + rng.uniform(0.0005, 0.003), self._stream_step, req)

    def _stream_step(self, req: Request) -> None:
        """One forward step's scheduling (blocks for the chunk, ``ChunkScheduled``), or one
        layer of it computed and then reported (``LayersComputed``); after the last layer of
        the last chunk, ``PrefillFinished``. Faults strike between steps (``preempt``,
        ``stall``) and between layers (``vanish``)."""
        p, st, rng, f = req.p, req.stream, self.rng, self.faults
        assert st is not None
        if not p.up or p.inc != req.p_inc or req.p_aborted:
            return  # the engine died or gave the prompt up: nothing more is computed
        lo, hi = st.bounds[st.chunk], st.bounds[st.chunk + 1]
        if st.layer < 0:
            if f.preempt and req.preemptions < 3 and rng.random() < f.preempt:
                self._preempt(req)
                return
            if f.stall and st.chunk and rng.random() < f.stall:
                self.result.stalls += 1
                self.at(self.t + rng.uniform(25.0, 45.0), self._stream_step, req)
                return
            ids = p.alloc.alloc(-(-hi // BLOCK_TOKENS) - len(st.ids))
            if ids is None:
                self._abort_stream(req, "failed", "producer out of blocks")
                return
            self._scribble(p, ids)
            st.ids += ids
            whole = hi - hi % BLOCK_TOKENS  # only full blocks are written before the end
            self.feed_all(p, ChunkScheduled(req.p_rid, whole, (tuple(st.ids),), STREAM_UNITS))
            st.layer = 0
        else:
            d = req.d
            if f.vanish and rng.random() < f.vanish and d.up and d.inc == req.d_inc:
                self.result.vanished += 1
                self._kill(d)
            self._compute(req, st.layer, lo, hi)
            self.feed_all(p, LayersComputed((req.p_rid,), st.layer + 1))
            st.layer += 1
            if st.layer == LAYERS:
                st.chunk += 1
                st.layer = -1
                if st.chunk == len(st.bounds) - 1:
                    req.p_ids = st.ids
                    self._hand_over(req)
                    return
        self.at(self.t + rng.uniform(0.0003, 0.002), self._stream_step, req)

    def _compute(self, req: Request, layer: int, lo: int, hi: int) -> None:
        """Write ``layer``'s KV of tokens [lo, hi) into the prompt's blocks on every rank."""
        st = req.stream
        assert st is not None
        tokens = np.arange(lo, hi, dtype=np.int64)
        layers = np.full(len(tokens), layer, dtype=np.int64)
        blocks = np.asarray(st.ids, dtype=np.int64)[tokens // BLOCK_TOKENS]
        for rank in req.p.ranks:
            start, width = req.p.slice_of(rank.index)
            values = kv(req.seed, st.version, layers, tokens, start, width)
            rank.buf[blocks, layer, tokens % BLOCK_TOKENS] = values

    def _scribble(self, engine: Engine, ids: list[int]) -> None:
        """Blocks a prompt gets (or gives back) hold nothing of its KV."""
        arr = np.asarray(ids, dtype=np.int64)
        for rank in engine.ranks:
            rank.buf[arr] = SCRIBBLE

    def _preempt(self, req: Request) -> None:
        """The engine takes the prompt's blocks back for other prompts (so whatever reads them
        from now on reads junk) and computes it again, from the start, into new blocks."""
        st = req.stream
        assert st is not None
        req.preemptions += 1
        self.result.preemptions += 1
        self._scribble(req.p, st.ids)
        req.p.alloc.free(st.ids)
        st.ids = []
        st.version += 1
        st.chunk = 0
        self.feed_all(req.p, Preempted(req.p_rid))
        self.at(self.t + self.rng.uniform(0.001, 0.01), self._stream_step, req)

    def _abort_stream(self, req: Request, status: str, reason: str) -> None:
        """The producer engine gives a prompt up while computing it: it frees its own blocks
        (they are not the machines' before PrefillFinished), its ranks drop the request, and
        the proxy ends the consumer's side too."""
        p, st = req.p, req.stream
        assert st is not None
        if req.p_done or req.p_aborted or not p.up or p.inc != req.p_inc:
            return
        req.p_aborted = True
        self._scribble(p, st.ids)
        p.alloc.free(st.ids)
        st.ids = []
        self.feed_all(p, Abort(req.p_rid))
        for rank in p.ranks:
            if rank.machine.request_state(req.p_rid) is ProducerState.ABSENT:
                req.p_freed.add(rank.index)  # dropped while holding nothing: no FreeBlocks
        self._p_released(req)
        if req.status != "pending":
            return
        if req.d_rid in self.reqs_d:
            self._abort_d(req)
        else:
            self._finish(req, status, reason, free_d=False)

    # ----------------------------------------------------------------- actions

    def _act_nothing(self, rank: Rank, action: Any) -> None:
        pass

    def _act_misbehaved(self, rank: Rank, action: PeerMisbehaved) -> None:
        # The simulator never sends malformed messages, so any complaint is a machine bug.
        self.violation(f"{rank.agent} PeerMisbehaved: {action.detail}")

    def _act_evict(self, rank: Rank, action: EvictEngine) -> None:
        rank.peers.pop(action.engine_id, None)

    def _act_handshake(self, rank: Rank, action: StartHandshake) -> None:
        rng = self.rng
        f = self.faults
        if f.handshake_silence and rng.random() < f.handshake_silence:
            return  # the machine's own timeout must end it
        target = self.engines.get(action.host)
        if target is not None and self._cut_until(rank.engine, target) > self.t:
            return  # across a cut link: no answer; the machine's timeout ends it
        delay = rng.uniform(0.001, 0.003)
        event: Any
        if target is None or not target.up:
            event = HandshakeFailed(action.engine_id, action.attempt, "connection refused")
        elif target.engine_id != action.engine_id:
            event = HandshakeFailed(action.engine_id, action.attempt, "engine id mismatch")
        elif f.handshake_failure and rng.random() < f.handshake_failure:
            event = HandshakeFailed(action.engine_id, action.attempt, "injected failure")
        else:
            rank.peers[action.engine_id] = target.inc
            offset = target.sched_skew - rank.engine.skew + rng.uniform(-0.001, 0.001)
            # Every engine here is kvwire, so every peer announces kvwire's features.
            event = HandshakeDone(
                action.engine_id, action.attempt, target.spec.tp, 1, offset, frozenset(FEATURES)
            )
        self.at(self.t + delay, self._deliver, (rank, event))

    def _act_post(self, rank: Rank, action: PostRead | PostWrite) -> None:
        f = self.faults
        rng = self.rng
        xid = action.xfer_id
        known = rank.peers.get(action.engine_id)
        if known is None:
            self.violation(f"{rank.agent} posted to {action.engine_id} without a handshake")
            return
        peer = self.by_id.get(action.engine_id)
        if peer is None:
            # The peer process is gone: the post fails and the transport says so.
            self.at(self.t, self._deliver, (rank, TransferFailed(xid, "peer gone")))
            self.at(self.t, self._deliver, (rank, PeerLost(action.engine_id)))
            return
        if f.post_failure and rng.random() < f.post_failure:
            self.at(self.t, self._deliver, (rank, TransferFailed(xid, "post failed")))
            return
        x = Xfer()
        x.xid = xid
        x.rank = rank
        x.peer = peer
        x.peer_inc = peer.inc
        x.peer_rank = action.remote_rank[1]
        x.read = isinstance(action, PostRead)
        x.rid = action.request_id
        x.notif = action.notification
        local = list(action.local_block_ids[0]) if action.local_block_ids else []
        remote = list(action.remote_block_ids[0]) if action.remote_block_ids else []
        # The machines pass both sides' whole lists; the planner pairs them by token, which
        # with the simulator's one block size pairs the producer's tail with the consumer's.
        if x.read:
            remote = remote[len(remote) - len(local) :]
        else:
            local = local[len(local) - len(remote) :]
        if x.read:
            x.dst_ids, x.src_ids = local, remote
            x.gens = peer.alloc.gens[np.asarray(remote, dtype=np.int64)].copy()
        else:
            x.src_ids, x.dst_ids = local, remote
            x.gens = None
            owner = self.reqs_p.get(x.rid)
            if owner is not None and owner.d_gens is not None and remote == owner.d_ids:
                x.dst_gens = owner.d_gens
            if isinstance(action, PostWrite) and action.pieces and not self._round(x, action):
                self.at(self.t, self._deliver, (rank, TransferFailed(xid, "bad round")))
                return
        rank.xfers[xid] = x
        self.at(self.t, self._deliver, (rank, TransferPosted(xid)))
        latency = 0.0002 + len(local) * FULL / 5e9 + rng.expovariate(1 / 0.001)
        heal = self._cut_until(rank.engine, peer)
        if f.partition and heal <= self.t and rng.random() < f.partition:
            heal = self._partition(rank.engine, peer)
        if heal > self.t:
            x.stalled = True
            self.at(heal + latency, self._complete, x)
            return
        self.at(self.t + latency, self._complete, x)

    def _round(self, x: Xfer, action: PostWrite) -> bool:
        """Plan a streaming round's rectangles cell by cell; the DMA reads its source as it
        is posted or as it lands (either may happen: both must give the same bytes)."""
        owner = self.reqs_p.get(x.rid)
        if owner is None or owner.stream is None:
            self.violation(f"{x.rank.agent} streamed {x.rid}, not a streamed prompt")
            return False
        rows = piece_rows(action.pieces, owner.nt, list(action.local_block_ids[0]), x.dst_ids)
        if rows is None:
            self.violation(f"{x.rank.agent} round {action.pieces} of {x.rid} names unheld tokens")
            return False
        x.rows = rows
        self.result.stream_rounds += 1
        if not action.notification and not owner.streamed:
            owner.streamed = True
            self.result.streamed += 1
        if self.rng.random() < 0.5:
            x.data = self._source(x).copy()
        return True

    def _cut_until(self, a: Engine, b: Engine) -> float:
        """When the link between ``a`` and ``b`` heals (in the past if it is up)."""
        key = (a.spec.name, b.spec.name) if a.spec.role == "P" else (b.spec.name, a.spec.name)
        return self.cuts.get(key, -math.inf)

    def _partition(self, a: Engine, b: Engine) -> float:
        """Cut the link between two engines for 1-2.5 of the producer's leases."""
        p, d = (a, b) if a.spec.role == "P" else (b, a)
        heal = self.t + self.rng.uniform(1.0, 2.5) * p.spec.lease_s
        self.cuts[(p.spec.name, d.spec.name)] = heal
        self.result.partitions += 1
        return heal

    def _complete(self, x: Xfer) -> None:
        if x.cancelled or not x.rank.alive:
            return
        peer = x.peer
        ok = peer.up and peer.inc == x.peer_inc
        if ok and x.stalled:
            # The DMA resumes after the heal and moves whatever the blocks hold now: the
            # fabric cannot know the producer reused them.
            if x.gens is not None:
                now_gens = peer.alloc.gens[np.asarray(x.src_ids, dtype=np.int64)]
                x.stale = not bool(np.array_equal(now_gens, x.gens))
        elif ok and x.gens is not None:
            now_gens = peer.alloc.gens[np.asarray(x.src_ids, dtype=np.int64)]
            ok = bool(np.array_equal(now_gens, x.gens))
        f = self.faults
        if ok and f.transfer_failure and self.rng.random() < f.transfer_failure:
            ok = False
        if ok and x.dst_gens is not None:
            now_gens = peer.alloc.gens[np.asarray(x.dst_ids, dtype=np.int64)]
            if not np.array_equal(now_gens, x.dst_gens):
                self.result.late_writes += 1
                self.result.corrupt += 1
                self.violation(f"{x.rank.agent} wrote {x.rid} into blocks its consumer freed")
        if ok:
            self._copy(x)
            self._send(x.rank.agent, peer, x.peer_rank, x.notif, x.rank.engine)
            if x.stale:
                req = self.reqs_d.get(x.rid)
                if req is not None:
                    req.read_stale = True
        x.outcome = "done" if ok else "failed"
        self._answer(x)

    def _ends(self, x: Xfer) -> tuple[Rank, slice, Rank, slice]:
        """Source and destination ranks, and the bytes of a block's head slice each moves."""
        rank = x.rank
        other = x.peer.ranks[x.peer_rank]
        src_rank, dst_rank = (other, rank) if x.read else (rank, other)
        s0, sw = src_rank.engine.slice_of(src_rank.index)
        d0, dw = dst_rank.engine.slice_of(dst_rank.index)
        lo, hi = max(s0, d0), min(s0 + sw, d0 + dw)
        hi = max(lo, hi)
        return src_rank, slice(lo - s0, hi - s0), dst_rank, slice(lo - d0, hi - d0)

    def _source(self, x: Xfer) -> Buffer:
        """The bytes a streaming round reads (a view of the source rank's buffer)."""
        assert x.rows is not None
        src_rank, cols, _, _ = self._ends(x)
        blocks, layers, within = x.rows[0]
        return src_rank.buf[blocks, layers, within, cols]

    def _copy(self, x: Xfer) -> None:
        src_rank, s_cols, dst_rank, d_cols = self._ends(x)
        if s_cols.stop <= s_cols.start or not x.dst_ids:
            return
        if x.rows is not None:
            data = x.data if x.data is not None else self._source(x)
            blocks, layers, within = x.rows[1]
            dst_rank.buf[blocks, layers, within, d_cols] = data
            return
        src = np.asarray(x.src_ids, dtype=np.int64)
        dst = np.asarray(x.dst_ids, dtype=np.int64)
        dst_rank.buf[dst, ..., d_cols] = src_rank.buf[src, ..., s_cols]

    def _answer(self, x: Xfer) -> None:
        """Report a finished or cancelled transfer: released, or a failed release."""
        f = self.faults
        event: Any
        if f.release_failure and self.rng.random() < f.release_failure:
            event = ReleaseFailed(x.xid, "release failed")
        else:
            x.rank.xfers.pop(x.xid, None)
            event = TransferDone(x.xid) if x.outcome == "done" else TransferFailed(x.xid, "io")
        self.at(self.t, self._deliver, (x.rank, event))

    def _act_cancel(self, rank: Rank, action: CancelTransfer) -> None:
        x = rank.xfers.get(action.xfer_id)
        if x is None:
            self.violation(f"{rank.agent} cancelled unknown transfer {action.xfer_id}")
            return
        x.cancelled = True
        x.outcome = "failed"
        self._answer(x)

    def _act_release(self, rank: Rank, action: ReleaseTransfer) -> None:
        x = rank.xfers.get(action.xfer_id)
        if x is None:
            self.violation(f"{rank.agent} released unknown transfer {action.xfer_id}")
            return
        self._answer(x)

    def _act_query_leases(self, rank: Rank, action: QueryLeases) -> None:
        """The producer's listener answers from its ranks' lease tables, in the clock its
        handshake samples (the scheduler's here). It is the side channel, as the handshake
        is: no answer from an engine that is down, restarted, or across a cut link."""
        target = self.by_id.get(action.engine_id)
        if (
            target is None
            or not target.up
            or target.engine_id != action.engine_id
            or self._cut_until(rank.engine, target) > self.t
        ):
            return
        self.result.lease_queries += 1
        shift = target.sched_skew - target.skew  # a rank's clock -> the listener's
        delay = self.rng.uniform(0.001, 0.003)
        for rid, pid in zip(action.request_ids, action.remote_request_ids, strict=True):
            held: list[float | None] = []
            for _, tp in action.ranks:
                machine = target.ranks[tp].machine
                assert isinstance(machine, ProducerMachine)
                deadline = machine.lease_deadline(pid)
                held.append(None if deadline is None else deadline + shift)
            answer = None if None in held else min(d for d in held if d is not None)
            self.at(self.t + delay, self._deliver, (rank, LeaseConfirmed(rid, answer)))

    def _act_notify(self, rank: Rank, action: SendNotification) -> None:
        target = self.by_id.get(action.engine_id)
        if target is None:
            return
        indexes = [r[1] for r in action.ranks] if action.ranks else range(target.spec.tp)
        for i in indexes:
            self._send(rank.agent, target, i, action.data, rank.engine)

    def _send(self, sender: str, target: Engine, index: int, data: bytes, src: Engine) -> None:
        f = self.faults
        rng = self.rng
        if f.partition and self._cut_until(src, target) > self.t:
            self.result.notifications_dropped += 1
            return
        if f.drop_notification and rng.random() < f.drop_notification:
            self.result.notifications_dropped += 1
            return
        delay = 0.0001
        if f.delay_notification and rng.random() < f.delay_notification:
            delay += rng.expovariate(1 / 0.2)
        if f.reorder_notification and rng.random() < f.reorder_notification:
            delay += rng.uniform(0.0, 0.02)
        copies = 2 if f.duplicate_notification and rng.random() < f.duplicate_notification else 1
        for c in range(copies):
            self.at(
                self.t + delay + c * 0.0003,
                self._notified,
                (target, target.inc, index, sender, data),
            )

    def _notified(self, arg: tuple[Engine, int, int, str, bytes]) -> None:
        target, inc, index, sender, data = arg
        if not target.up or target.inc != inc:
            return
        self.feed(target.ranks[index], NotificationReceived(sender, data))

    # ----------------------------------------------------------------- outcomes

    def _act_free(self, rank: Rank, action: FreeBlocks) -> None:
        req = self.reqs_p.get(action.request_id)
        if req is None or req.p is not rank.engine or req.p_inc != rank.engine.inc:
            self.violation(f"{rank.agent} freed unknown request {action.request_id}")
            return
        if rank.index in req.p_freed:
            self.result.double_frees += 1
            self.violation(f"{rank.agent} freed {action.request_id} twice")
            return
        if req.stream is not None and not req.p_done:
            # A stream that ended before its prompt: the engine's blocks were never handed over.
            if any(action.block_ids):
                self.violation(f"{rank.agent} freed {action.request_id}'s unfinished blocks")
        elif tuple(action.block_ids[0]) != tuple(req.p_ids):
            self.violation(f"{rank.agent} freed {action.request_id} with the wrong blocks")
        req.p_freed.add(rank.index)
        if action.reason is FreeReason.EXPIRED:
            req.expired = True
        self._p_released(req)

    def _p_released(self, req: Request) -> None:
        """Every producer rank let go of the request: its blocks go back to the pool."""
        if len(req.p_freed) < req.p.spec.tp or self.reqs_p.pop(req.p_rid, None) is None:
            return
        bad = req.p.alloc.free(req.p_ids)
        if bad:
            self.result.double_frees += bad
            self.violation(f"{req.p_rid}: {bad} blocks freed while not allocated")

    def _act_outcome(self, rank: Rank, action: RequestDone | RequestFailed) -> None:
        req = self.reqs_d.get(action.request_id)
        if req is None or req.d is not rank.engine:
            self.violation(f"{rank.agent} reported unknown request {action.request_id}")
            return
        if rank.index in req.d_results:
            self.violation(f"{rank.agent} reported {action.request_id} twice")
            return
        req.d_results[rank.index] = action
        if len(req.d_results) < req.d.spec.tp or req.status != "pending":
            return
        failures = [a for a in req.d_results.values() if isinstance(a, RequestFailed)]
        if failures:
            first = failures[0]
            status = "aborted" if first.reason is FailReason.ABORTED else "failed"
            bounds = [a.writes_until for a in failures if a.writes_until is not None]
            until = max(bounds) if bounds else None
            self._finish(req, status, first.reason.value, free_d=True, writes_until=until)
            return
        # Done even if aborted (the abort raced with the last transfer): verified all the same.
        self._verify(req)

    def _verify(self, req: Request) -> None:
        d = req.d
        if req.d_ids:
            for rank in d.ranks:
                held, expected = self._held_kv(req, rank)
                if not np.array_equal(held, expected):
                    self.result.corrupt += 1
                    if req.read_stale:
                        self.result.stale_done += 1
                    self.violation(f"{req.d_rid}: {rank.agent} holds wrong KV after success")
                    self._finish(req, "failed", "corrupt", free_d=True)
                    return
                self.result.bytes_verified += expected.size
        self._finish(req, "done", "", free_d=True)

    def _held_kv(self, req: Request, rank: Rank) -> tuple[Buffer, Buffer]:
        """What a consumer rank holds of the request's KV, and what it must hold: the
        prompt's last blocks (past the prefix hit), its heads; streamed, every layer of every
        token of them, as last computed."""
        dst = np.asarray(req.d_ids, dtype=np.int64)
        start, width = req.d.slice_of(rank.index)
        if req.stream is None:
            positions = np.arange(req.k, req.n, dtype=np.int64)
            return rank.buf[dst], pattern(req.seed, positions, start, width)
        tokens = np.arange(req.k * BLOCK_TOKENS, req.nt, dtype=np.int64)
        layers = np.repeat(np.arange(LAYERS, dtype=np.int64), len(tokens))
        tokens = np.tile(tokens, LAYERS)
        blocks = dst[tokens // BLOCK_TOKENS - req.k]
        held = rank.buf[blocks, layers, tokens % BLOCK_TOKENS]
        return held, kv(req.seed, req.stream.version, layers, tokens, start, width)

    def _finish(
        self,
        req: Request,
        status: str,
        reason: str,
        *,
        free_d: bool,
        writes_until: float | None = None,
    ) -> None:
        """``writes_until``: push, the consumer's bound (its clock) on the producer's writes
        into the request's blocks."""
        if req.status != "pending":
            self.violation(f"{req.d_rid} finished twice ({req.status}, then {status})")
            return
        req.status = status
        if status == "done":
            self.result.done += 1
        elif status == "aborted":
            self.result.aborted += 1
            self.result.failed += 1
        else:
            self.result.failed += 1
        if status != "done":
            key = reason or status
            self.result.failures_by_reason[key] = self.result.failures_by_reason.get(key, 0) + 1
        self.reqs_d.pop(req.d_rid, None)
        if free_d and req.d_ids and req.d.inc == req.d_inc:
            if writes_until is not None:
                # A producer may still write into them until then: hold them, then hand them
                # out again (a write that lands later finds them reused, and is counted).
                self.result.quarantined_blocks += len(req.d_ids)
                self.at(max(self.t, writes_until - req.d.skew), self._release_d, req)
            else:
                self._release_d(req)

    def _release_d(self, req: Request) -> None:
        if req.d.inc != req.d_inc:
            return  # the engine restarted: its blocks went with it
        bad = req.d.alloc.free(req.d_ids)
        if bad:
            self.result.double_frees += bad
            self.violation(f"{req.d_rid}: consumer blocks freed twice")

    # ----------------------------------------------------------------- the end

    def _final_checks(self) -> None:
        res = self.result
        for req in self.all_reqs:
            if req.expired:
                res.expired += 1
            if req.status == "pending":
                res.stuck += 1
                if len(res.violations) < 20:
                    res.violations.append(f"stuck: {req.d_rid} ({req.cluster.name})")
        for engine in self.engines.values():
            if not engine.up:
                continue
            res.leaked_blocks += engine.alloc.allocated
            for rank in engine.ranks:
                live = rank.machine.live_requests()
                if live:
                    res.stuck += live
                    res.violations.append(f"{rank.agent} still tracks {live} requests")
                machine = rank.machine
                if isinstance(machine, ProducerMachine) and machine.held_blocks():
                    res.violations.append(f"{rank.agent} still holds blocks")
                if isinstance(machine, ConsumerMachine) and machine.parked_completions():
                    # Parked notifications expire on the machine's own timer: any left over
                    # at quiescence leaked.
                    res.stuck += machine.parked_completions()
                    res.violations.append(f"{rank.agent} still parks write notifications")
        for req in self.reqs_p.values():
            if req.p.up and req.p.inc == req.p_inc and len(res.violations) < 20:
                res.violations.append(f"unfreed on producer: {req.p_rid}")


def simulate(
    seed: int,
    requests: int,
    faults: Faults,
    legacy_lease_rule: bool = False,
    stream: bool = False,
) -> SimResult:
    """Run one simulation to quiescence; deterministic for a given seed and arguments.

    ``legacy_lease_rule`` runs the machines with the old, unsafe rule (reads not bounded by
    the producer's lease, no quarantine, no transfer deadline): with ``partition`` it
    shows what the new rule prevents (``stale_done > 0``). ``stream``: push producers
    stream (the prompt is computed over time in chunks and layers, and its KV written as
    it is; consumers register while it computes)."""
    return World(seed, requests, faults, legacy_lease_rule, stream).run()


def _sim_settings(
    engine_id: str, spec: EngineSpec, tp_rank: int, mode: TransferMode, legacy: bool
) -> dict[str, Any]:
    """One simulated rank's configuration, never read from the environment. The durations
    the lease would derive are fixed at the values every recorded run used (5 s expiry
    margin, 1 s completion margin, 30 s transfer timeout, a 5 s handshake: 4 s x one
    attempt + 1 s), so the same seed gives the same run whatever the lease."""
    settings: dict[str, Any] = {
        "environ": {},
        "engine_id": engine_id,
        "tp_rank": tp_rank,
        "tp_size": spec.tp,
        "mode": mode,
        "lease_s": spec.lease_s,
        "expiry_margin_s": 5.0,
        "completion_margin_s": 1.0,
        "transfer_timeout_s": 30.0,
        "handshake_timeout_s": 4.0,
        "handshake_retries": 0,
    }
    if legacy:  # the old rule: unbounded reads, no quarantine, no transfer deadlines
        settings.update(
            bound_reads_by_lease=False, lease_grace_s=0.0, transfer_timeout_s=MAX_SECONDS
        )
    return settings
