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
that pattern (for its suffix and its heads) in every rank's blocks.

Why one module of ~780 lines: it is one event loop, and each handler plays a part the
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
    ConsumerMachine,
    EvictEngine,
    FailReason,
    FreeBlocks,
    FreeReason,
    HandshakeDone,
    HandshakeFailed,
    LeaseConfirmed,
    NotificationReceived,
    PeerLost,
    PeerMisbehaved,
    PostRead,
    PostWrite,
    PrefillFinished,
    ProducerMachine,
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
    CLUSTERS,
    ENGINES,
    FULL,
    POISON,
    SHORT_LEASE,
    Allocator,
    Engine,
    EngineSpec,
    Rank,
    Request,
    SimResult,
    Xfer,
    pattern,
)


class World:
    """One simulation run; ``run()`` returns its :class:`SimResult`."""

    def __init__(
        self, seed: int, requests: int, faults: Faults, legacy_lease_rule: bool = False
    ) -> None:
        self.rng = random.Random(seed)
        self.legacy = legacy_lease_rule
        """Reproduce the old rule: consumers do not bound READs by the producer's lease,
        producers free expired blocks at once, transfers have no deadline."""
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
                else ConsumerMachine(config, mla=cluster.mla, host=spec.name, port=1)
            )
            engine.ranks.append(Rank(engine, i, machine, engine.slice_of(i)[1], engine.blocks))

    def _crash(self, _: Any) -> None:
        if self.arrivals_done:
            return
        engine = self.rng.choice(list(self.engines.values()))
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
        self.at(self.t + self.rng.expovariate(1 / self.faults.crash_interval_s), self._crash)

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
        sched_now = self.t + p.sched_skew
        deadline = sched_now + p.spec.lease_s
        blocks = (tuple(ids),)
        self.feed_all(p, PrefillFinished(req.p_rid, blocks, deadline, sched_now))
        # kvwire producers export their lease deadline (in the clock the handshake samples),
        # so a consumer declines a read that could outlive it instead of reading blocks that
        # may already hold another prompt. Heartbeats alone are no evidence that it moved
        # (they are fire-and-forget); the producer's answers to lease queries are.
        expiry = deadline if req.cluster.mode is TransferMode.PULL else None
        remote = RemotePrefill(
            engine_id=p.engine_id,
            request_id=req.p_rid,
            host=p.spec.name,
            port=1,
            block_ids=blocks if req.cluster.mode is TransferMode.PULL else (),
            tp_size=p.spec.tp,
            blocks_expiry_time=expiry,
        )
        self.at(self.t + self.rng.uniform(0.0005, 0.003), self._to_consumer, (req, remote))

    def _abort_p(self, req: Request) -> None:
        """Abort a prompt still being prefilled. (Once finished, its KV belongs to the
        consumer's read: aborting then would hand reused blocks to a reader that cannot tell,
        which is why engines do not; the machine's handling of it is unit-tested instead.)"""
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
            self.at(
                self.t + rng.choice((0.0, wait / 2, wait, wait + 0.001, wait + 0.005, wait + 0.02)),
                self._abort_d,
                req,
            )

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
            for rank in d.ranks:
                rank.buf[arr] = POISON
        blocks = (tuple(ids),)
        self.feed_all(d, AllocationDone(req.d_rid, blocks))

    def _abort_d(self, req: Request) -> None:
        if req.status != "pending" or req.d.inc != req.d_inc or not req.d.up:
            return
        req.aborted = True
        self.feed_all(req.d, Abort(req.d_rid))

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
        if ok:
            self._copy(x)
            self._send(x.rank.agent, peer, x.peer_rank, x.notif, x.rank.engine)
            if x.stale:
                req = self.reqs_d.get(x.rid)
                if req is not None:
                    req.read_stale = True
        x.outcome = "done" if ok else "failed"
        self._answer(x)

    def _copy(self, x: Xfer) -> None:
        rank = x.rank
        other = x.peer.ranks[x.peer_rank]
        src_rank, dst_rank = (other, rank) if x.read else (rank, other)
        s0, sw = src_rank.engine.slice_of(src_rank.index)
        d0, dw = dst_rank.engine.slice_of(dst_rank.index)
        lo, hi = max(s0, d0), min(s0 + sw, d0 + dw)
        if hi <= lo or not x.dst_ids:
            return
        src = np.asarray(x.src_ids, dtype=np.int64)
        dst = np.asarray(x.dst_ids, dtype=np.int64)
        dst_rank.buf[dst, lo - d0 : hi - d0] = src_rank.buf[src, lo - s0 : hi - s0]

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
        if tuple(action.block_ids[0]) != tuple(req.p_ids):
            self.violation(f"{rank.agent} freed {action.request_id} with the wrong blocks")
        req.p_freed.add(rank.index)
        if action.reason is FreeReason.EXPIRED:
            req.expired = True
        if len(req.p_freed) == req.p.spec.tp:
            bad = req.p.alloc.free(req.p_ids)
            if bad:
                self.result.double_frees += bad
                self.violation(f"{action.request_id}: {bad} blocks freed while not allocated")
            del self.reqs_p[action.request_id]

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
            self._finish(req, status, first.reason.value, free_d=True)
            return
        # Done even if aborted (the abort raced with the last transfer): verified all the same.
        self._verify(req)

    def _verify(self, req: Request) -> None:
        d = req.d
        if req.d_ids:
            dst = np.asarray(req.d_ids, dtype=np.int64)
            positions = np.arange(req.k, req.n, dtype=np.int64)
            for rank in d.ranks:
                start, width = d.slice_of(rank.index)
                expected = pattern(req.seed, positions, start, width)
                if not np.array_equal(rank.buf[dst], expected):
                    self.result.corrupt += 1
                    if req.read_stale:
                        self.result.stale_done += 1
                    self.violation(f"{req.d_rid}: {rank.agent} holds wrong KV after success")
                    self._finish(req, "failed", "corrupt", free_d=True)
                    return
                self.result.bytes_verified += expected.size
        self._finish(req, "done", "", free_d=True)

    def _finish(self, req: Request, status: str, reason: str, *, free_d: bool) -> None:
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
            if req.cluster.mode is TransferMode.PUSH and status != "done":
                # A producer may still be writing into them: never hand them out again.
                self.result.quarantined_blocks += len(req.d_ids)
                req.d.alloc.allocated -= len(req.d_ids)
            else:
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
    seed: int, requests: int, faults: Faults, legacy_lease_rule: bool = False
) -> SimResult:
    """Run one simulation to quiescence; deterministic for a given seed and arguments.

    ``legacy_lease_rule`` runs the machines with the old, unsafe rule (reads not bounded by
    the producer's lease, no quarantine, no transfer deadline): with ``partition`` it
    shows what the new rule prevents (``stale_done > 0``)."""
    return World(seed, requests, faults, legacy_lease_rule).run()


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
