"""The consumer (decode side) machine: one rank of an engine that receives KV.

Pull: the rank READs the producer's blocks, one remote rank at a time (the next READ is
posted only once the previous one is confirmed, so nothing is posted after a request's first
failure), with the completion notification attached. Push: the rank registers its blocks
with every producer rank and counts their write notifications, under a watchdog. A write
notification can beat the request to this rank (the producer writes to every consumer rank
once the first rank's registration arrives), so one for a request that is not awaiting
writes yet is parked, bounded in number and age, and counted when the request gets there.

A request ends in exactly one of ``RequestDone`` / ``RequestFailed``, and only once no
transfer into its blocks is running; after that the machine forgets it.

Why one module of ~820 lines: a consumer request's life (added, allocated, handshaken,
read or registered, finished) is one state machine whose handlers hand off to each other;
splitting it by event would scatter one request's path across files. The transitions
themselves are in :mod:`kvwire.machine.table`.
"""

from __future__ import annotations

import math
from typing import Any

from kvwire.config import KVWireConfig
from kvwire.errors import KVWireError, LocalProtocolError, RemoteProtocolError
from kvwire.layout import topology
from kvwire.machine._core import (
    T_HEARTBEAT,
    T_PARKED,
    T_WATCHDOG,
    Engine,
    InvariantViolation,
    MachineCore,
    Transfer,
)
from kvwire.machine.actions import (
    Action,
    FailReason,
    PeerMisbehaved,
    PostRead,
    QueryLeases,
    RemoteRank,
    RequestDone,
    RequestFailed,
    SendNotification,
)
from kvwire.machine.events import (
    Abort,
    AllocationDone,
    BlockIds,
    HandshakeDone,
    HandshakeFailed,
    LeaseConfirmed,
    NotificationReceived,
    PeerLost,
    RemotePrefill,
    RequestAdded,
    Timer,
)
from kvwire.machine.table import (
    CONSUMER,
    PARKED,
    ConsumerState,
    EngineState,
    ParkedState,
    Trigger,
    successors,
)
from kvwire.wire.notifications import (
    decode_notification,
    encode_completion,
    encode_heartbeat,
    encode_push_registration,
)
from kvwire.wire.schemas import (
    LEASE_QUERY,
    MAX_LEASE_IDS,
    PUSH_RELEASE,
    Completion,
    PushRegistration,
    TransferMode,
)

S = ConsumerState
_ALL_RANKS: tuple[RemoteRank, ...] = ()
_TAKES_EVIDENCE = (S.WAIT_ALLOC, S.WAIT_PEER, S.TRANSFERRING)
"""The states a lease answer can extend: the request may still read, and has not failed."""


class _Req:
    """One consumer request while it is live."""

    __slots__ = (
        "arrival",
        "confirmed",
        "engine",
        "entry",
        "expected",
        "fail_detail",
        "fail_reason",
        "hb",
        "local",
        "next_post",
        "notif",
        "plan",
        "read_deadline",
        "registered",
        "remote",
        "rid",
        "senders",
        "state",
        "step",
        "xfers",
    )

    def __init__(self, rid: str, remote: RemotePrefill, engine: Engine, now: float) -> None:
        self.rid = rid
        self.arrival = now
        self.read_deadline = math.inf
        self.registered: float | None = None
        """Push: when our registration went out (the producer writes until its watchdog)."""
        """Pull: our-clock moment after which the producer may no longer hold the blocks."""
        self.confirmed = -math.inf
        """Pull, before the read starts: the latest lease the producer confirmed (ours)."""
        self.state = S.ABSENT
        self.entry = S.ABSENT
        self.step = -1
        self.remote = remote
        self.engine = engine
        self.local: BlockIds = ()
        self.notif = b""
        self.plan: list[RemoteRank] = []
        self.next_post = 0
        self.xfers: dict[int, Transfer] = {}
        self.fail_reason = FailReason.TRANSFER
        self.fail_detail = ""
        self.senders: set[str] = set()
        self.expected = 0
        self.hb = False


class _Parked:
    """Push write notifications for one request id that is not awaiting writes yet: the
    first world size each distinct sender announced (a repeat is a duplicate)."""

    __slots__ = ("counts", "entry", "rid", "state", "step")

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.state = ParkedState.ABSENT
        self.entry = ParkedState.ABSENT
        self.step = -1
        self.counts: dict[str, int] = {}


class ConsumerMachine(MachineCore):
    """Sans-IO state of one consumer rank: ``handle(event, now) -> list[Action]``."""

    role = "consumer"
    _requests = CONSUMER
    _moving = S.TRANSFERRING
    _draining = S.DRAINING
    _end_actions = (RequestDone, RequestFailed)

    def __init__(
        self, config: KVWireConfig, *, one_source: bool = False, host: str = "", port: int = 0
    ) -> None:
        """``one_source``: every page of the KV cache is the same on every TP rank (MLA's, no
        TP-sharded state beside it), so each request is read from one producer rank.
        ``host``/``port``: this engine's side channel as producers dial it, sent in push
        registrations (the runtime passes its listener's real address)."""
        super().__init__(config)
        self.one_source = one_source
        self.host = host
        self.port = port
        self._reqs: dict[str, _Req] = {}
        self._plans: dict[tuple[int, int], tuple[list[RemoteRank], list[RemoteRank]]] = {}
        self._parked: dict[str, _Parked] = {}
        self._parked_count = 0
        self._handlers.update(
            {
                RequestAdded: self._on_added,
                AllocationDone: self._on_alloc,
                Abort: self._on_abort,
                NotificationReceived: self._on_notification,
                LeaseConfirmed: self._on_lease_confirmed,
            }
        )

    # ----------------------------------------------------------------- introspection

    def request_state(self, request_id: str) -> ConsumerState:
        req = self._reqs.get(request_id)
        return S.ABSENT if req is None else req.state

    def live_requests(self) -> int:
        return len(self._reqs)

    def parked_completions(self) -> int:
        """Push write notifications parked right now (what a leak check compares to 0)."""
        return self._parked_count

    def parked_state(self, request_id: str) -> ParkedState:
        return ParkedState.PARKED if request_id in self._parked else ParkedState.ABSENT

    # ----------------------------------------------------------------- request events

    def _on_added(self, event: RequestAdded, now: float, out: list[Action]) -> None:
        rid = event.request_id
        if rid in self._reqs:
            successors(CONSUMER, self._reqs[rid].state, RequestAdded, f"request {rid!r}")
        if self._check and rid in self._ended:
            raise LocalProtocolError(f"request {rid!r} was added twice")
        remote = event.remote
        if remote is None:
            raise LocalProtocolError("a consumer request needs its producer (remote)")
        problem = _check_remote(remote, self.config)
        notif = b""
        if problem is None and self.config.mode is TransferMode.PULL:
            try:
                count = topology.pull_completion_count(remote.tp_size, self.config.tp_size)
                notif = encode_completion(remote.request_id, count)
            except KVWireError as exc:
                problem = str(exc)
        if problem is not None:
            out.append(PeerMisbehaved(problem, remote.engine_id or None, rid))
            self.stats.remote_errors += 1
            self._discard_parked(rid)
            self._terminal_out(rid, RequestFailed(rid, (), FailReason.PROTOCOL, problem), out)
            return
        engine = self._engine(
            remote.engine_id, remote.host, remote.port, remote.tp_size, remote.pp_size
        )
        req = _Req(rid, remote, engine, now)
        self._move(req, CONSUMER, "added")
        req.notif = notif
        self._reqs[rid] = req
        engine.refs += 1
        engine.last_active = now
        self._hb_add(req, now)
        # Handshake early: it overlaps the engine's allocation, and heartbeats need it.
        self._ensure_handshake(engine, now, out)

    def _on_alloc(self, event: AllocationDone, now: float, out: list[Action]) -> None:
        req = self._req(event.request_id, AllocationDone)
        req.local = event.block_ids
        engine = req.engine
        if not any(event.block_ids):
            # Nothing to move: tell the producer it may free, and finish at once. The
            # message is best effort (the lease reclaims the blocks if it is lost), so the
            # request never waits on it.
            self._release_producer(req, out)
            self._finish(req, out)
            return
        pull = self.config.mode is TransferMode.PULL
        if pull and len(event.block_ids) != len(req.remote.block_ids):
            problem = (
                f"{len(event.block_ids)} local KV-cache groups but the producer sent "
                f"{len(req.remote.block_ids)}"
            )
            self._protocol_failure(req, problem, out)
            return
        if engine.state is EngineState.READY:
            self._start(req, now, out)
        else:
            self._move(req, CONSUMER, "wait_peer")
            engine.waiting[req.rid] = None
            self._ensure_handshake(engine, now, out)

    def _on_abort(self, event: Abort, now: float, out: list[Action]) -> None:
        req = self._reqs.get(event.request_id)
        if req is None:
            # Aborts race with completion: an id that already ended (or never started) is
            # nothing to do.
            self.stats.aborts_ignored += 1
            return
        successors(CONSUMER, req.state, Abort, f"request {req.rid!r}")
        state = req.state
        if state is S.TRANSFERRING:
            self._begin_failure(req, FailReason.ABORTED, "aborted", out)
        elif state is not S.DRAINING:  # DRAINING: on its way out; keep the first reason.
            self._fail_now(req, FailReason.ABORTED, "aborted", out)

    # ----------------------------------------------------------------- engines

    def _engine_ready(
        self, engine: Engine, event: HandshakeDone, now: float, out: list[Action]
    ) -> None:
        push = self.config.mode is TransferMode.PUSH
        if push and PUSH_RELEASE not in engine.features:
            engine.notes.clear()  # releases this producer would not understand
        if engine.notes:
            ranks = self._notify_ranks(engine)
            for data in engine.notes:
                out.append(SendNotification(engine.engine_id, ranks, data, None))
            engine.notes.clear()
        waiting = list(engine.waiting)
        engine.waiting.clear()
        for rid in waiting:
            req = self._reqs[rid]
            successors(CONSUMER, req.state, HandshakeDone, f"request {rid!r}")
            self._start(req, now, out)
        if engine.hb_ids and not engine.hb_armed:
            self._heartbeat(engine, now, out)

    def _engine_failed(
        self, engine: Engine, waiting: list[str], now: float, out: list[Action], why: str
    ) -> None:
        for rid in waiting:
            req = self._reqs[rid]
            successors(CONSUMER, req.state, HandshakeFailed, f"request {rid!r}")
            self._fail_now(req, FailReason.HANDSHAKE, why, out, HandshakeFailed)

    def _heartbeat(self, engine: Engine, now: float, out: list[Action]) -> None:
        """Keep the producer's leases alive: ``HB:`` with every remote id still wanted."""
        engine.hb_armed = False
        if self._engines.get(engine.engine_id) is not engine:
            return
        if engine.state is not EngineState.READY or not engine.hb_ids:
            return
        out.append(
            SendNotification(engine.engine_id, _ALL_RANKS, encode_heartbeat(list(engine.hb_ids)))
        )
        self.stats.heartbeats_sent += 1
        engine.hb_armed = True
        self._arm(now + self.config.heartbeat_s, T_HEARTBEAT, engine)
        cfg = self.config
        if (
            LEASE_QUERY in engine.features
            and cfg.bound_reads_by_lease
            and cfg.mode is TransferMode.PULL
        ):
            self._query_leases(engine, now, out)

    def _query_leases(self, engine: Engine, now: float, out: list[Action]) -> None:
        """Ask a producer that answers lease queries to confirm the leases it pushed back
        on our heartbeats, for the requests whose read deadline comes within two
        heartbeats (and the expiry margin): the answer arrives, and a lost one is asked
        again, before the deadline would stop the request. Costs what the heartbeat just
        cost: one pass over the ids it named."""
        horizon = now + 2 * self.config.heartbeat_s + self._expiry_margin_s
        late = self._completion_margin_s
        local: list[str] = []
        remote: list[str] = []
        for pid, reqs in engine.hb_ids.items():
            for req in reqs:
                deadline = self._known_deadline(req)
                if now < deadline - late and deadline - late <= horizon:
                    local.append(req.rid)
                    remote.append(pid)
        if not local:
            return
        reads, _ = self._plan_or_empty(engine)
        if not reads:
            return
        for start in range(0, len(local), MAX_LEASE_IDS):
            out.append(
                QueryLeases(
                    engine.engine_id,
                    engine.host,
                    engine.port,
                    tuple(reads),
                    tuple(local[start : start + MAX_LEASE_IDS]),
                    tuple(remote[start : start + MAX_LEASE_IDS]),
                )
            )
            self.stats.lease_queries += 1

    def _known_deadline(self, req: _Req) -> float:
        """The read deadline a request runs under now (ours): fixed when its read starts,
        before that the stated expiry or a later lease the producer confirmed."""
        if req.state is S.TRANSFERRING:
            return req.read_deadline
        return max(self._read_deadline(req), req.confirmed)

    def _on_lease_confirmed(self, event: LeaseConfirmed, now: float, out: list[Action]) -> None:
        """Evidence that the producer holds the blocks until ``deadline`` (its clock). Only
        a live request still ahead of its deadline takes it, and only to move the deadline
        later: a request past its deadline may already have read blocks the producer
        gave away, so nothing revives it."""
        req = self._reqs.get(event.request_id)
        state = S.ABSENT if req is None else req.state
        successors(CONSUMER, state, LeaseConfirmed, f"request {event.request_id!r}")
        if (
            req is None
            or event.deadline is None
            or req.engine.state is not EngineState.READY
            or state not in _TAKES_EVIDENCE
        ):
            self.stats.lease_answers_unused += 1
            return
        current = self._known_deadline(req)
        confirmed = self._in_our_clock(req.engine, event.deadline)
        if now >= current - self._completion_margin_s or confirmed <= current:
            self.stats.lease_answers_unused += 1
            return
        if state is S.TRANSFERRING:
            req.read_deadline = confirmed  # transfer timers re-arm when they come due
        else:
            req.confirmed = confirmed
        self.stats.read_deadlines_extended += 1

    def _engine_lost(self, engine: Engine, out: list[Action]) -> None:
        """Push: a producer that went away will never write what we registered for. Fail
        its requests now, with the cause, rather than at the registration watchdog (which
        names only a missing write, and comes registration_timeout_s later)."""
        if self.config.mode is not TransferMode.PUSH:
            return
        waiting = [
            req for reqs in engine.hb_ids.values() for req in reqs if req.state is S.AWAIT_WRITES
        ]
        for req in waiting:
            successors(CONSUMER, req.state, PeerLost, f"request {req.rid!r}")
            detail = f"producer {engine.engine_id!r} went away before its writes arrived"
            self._fail_now(req, FailReason.TRANSFER, detail, out)

    def _hb_add(self, req: _Req, now: float) -> None:
        engine = req.engine
        pid = req.remote.request_id
        engine.hb_ids.setdefault(pid, []).append(req)
        req.hb = True
        if engine.state is EngineState.READY and not engine.hb_armed:
            engine.hb_armed = True
            self._arm(now + self.config.heartbeat_s, T_HEARTBEAT, engine)

    def _hb_drop(self, req: _Req) -> None:
        if not req.hb:
            return
        req.hb = False
        ids = req.engine.hb_ids
        pid = req.remote.request_id
        wanting = ids[pid]
        wanting.remove(req)  # almost always the only one: one consumer request per id
        if not wanting:
            del ids[pid]

    # ----------------------------------------------------------------- starting a request

    def _start(self, req: _Req, now: float, out: list[Action]) -> None:
        """The engine is READY: read (pull) or register (push)."""
        engine = req.engine
        if self.config.mode is TransferMode.PUSH:
            self._register(req, now, out)
            return
        cfg = self.config
        expiry = req.remote.blocks_expiry_time
        if cfg.bound_reads_by_lease:
            req.read_deadline = max(self._read_deadline(req), req.confirmed)
            declined = now + self._expiry_margin_s >= req.read_deadline
        else:  # the old rule: only a stated expiry, without the clock's uncertainty
            declined = (
                expiry is not None and now + self._expiry_margin_s >= expiry - engine.clock_offset
            )
        if declined:
            self.stats.reads_declined_expiry += 1
            self._fail_now(req, FailReason.EXPIRED, "remote blocks expire too soon to read", out)
            return
        try:
            plan, _ = self._plan(engine)
        except KVWireError as exc:
            self._protocol_failure(req, str(exc), out)
            return
        req.plan = plan
        req.next_post = 0
        self._move(req, CONSUMER, "read")
        self._post_next(req, out)

    def _read_deadline(self, req: _Req) -> float:
        """The latest moment, in our clock, at which the producer is known to still hold
        the request's blocks. A producer that states its expiry (kvwire's does) is taken
        at its word, moved into our clock with the handshake's offset and made earlier by
        the offset's uncertainty; otherwise (vLLM's producer) only the configured lease
        from the request's arrival here would be the only bound, and vLLM's producer
        extends its lease on our heartbeats without telling us, so such a bound fails reads
        that vLLM's own consumer completes (make interop's heartbeat cell): without a
        stated expiry the read is unbounded here, as in vLLM, and P's quarantine is the
        guard."""
        expiry = req.remote.blocks_expiry_time
        if expiry is not None and math.isfinite(expiry):
            return self._in_our_clock(req.engine, expiry)
        return math.inf

    @staticmethod
    def _in_our_clock(engine: Engine, producer_time: float) -> float:
        """A producer's deadline in our clock, never later than it can be: the offset's
        uncertainty is taken off."""
        return producer_time - engine.clock_offset - engine.clock_uncertainty

    def _transfer_deadline(self, req: _Req, now: float) -> float:
        deadline = now + self._transfer_timeout_s
        if self.config.bound_reads_by_lease:
            deadline = min(deadline, req.read_deadline - self._completion_margin_s)
        return deadline

    def _completion_too_late(self, req: _Req, now: float) -> bool:
        cfg = self.config
        if cfg.bound_reads_by_lease and now > req.read_deadline - self._completion_margin_s:
            self.stats.reads_late += 1
            return True
        return False

    def _transfer_timed_out(self, req: _Req, out: list[Action]) -> None:
        cfg = self.config
        if (
            cfg.bound_reads_by_lease
            and self._last_now >= req.read_deadline - self._completion_margin_s
        ):
            detail = "read did not end before the producer's lease: its bytes cannot be trusted"
            self._begin_failure(req, FailReason.EXPIRED, detail, out)
        else:
            self._begin_failure(req, FailReason.TIMEOUT, "transfer timed out", out)

    def _plan(self, engine: Engine) -> tuple[list[RemoteRank], list[RemoteRank]]:
        """(ranks to READ from, every rank to notify) for the engine's TP/PP sizes."""
        key = (engine.tp_size, engine.pp_size)
        plan = self._plans.get(key)
        if plan is None:
            cfg = self.config
            try:
                peers = topology.remote_ranks(cfg.tp_rank, cfg.tp_size, *key)
                if self.one_source:
                    src = [topology.replicated_source(cfg.tp_rank, cfg.tp_size, key[0])]
                else:
                    src = topology.remote_tp_ranks(cfg.tp_rank, cfg.tp_size, key[0])
            except KVWireError as exc:
                raise RemoteProtocolError(
                    f"engine {engine.engine_id!r} has TP {key[0]}, incompatible with ours "
                    f"({cfg.tp_size}): {exc}"
                ) from None
            reads = [(pp, tp) for pp in range(key[1]) for tp in src]
            plan = (reads, peers)
            self._plans[key] = plan
        return plan

    def _notify_ranks(self, engine: Engine) -> tuple[RemoteRank, ...]:
        try:
            return tuple(self._plan(engine)[1])
        except KVWireError:
            return _ALL_RANKS

    def _post_next(self, req: _Req, out: list[Action]) -> None:
        rank, xfer = self._next_transfer(req)
        out.append(
            PostRead(
                xfer.xfer_id,
                req.rid,
                req.engine.engine_id,
                rank,
                req.engine.tp_size,
                req.local,
                req.remote.block_ids,
                req.notif,
            )
        )

    def _register(self, req: _Req, now: float, out: list[Action]) -> None:
        engine = req.engine
        try:
            req.expected = topology.consumer_expected_notifications(
                engine.tp_size, self.config.tp_size, engine.pp_size
            )
        except KVWireError as exc:
            self._protocol_failure(req, str(exc), out)
            return
        out.append(
            SendNotification(
                engine.engine_id, _ALL_RANKS, self._registration(req, req.local), req.rid
            )
        )
        self._move(req, CONSUMER, "register")
        req.registered = now
        self._arm(now + self.config.registration_timeout_s, T_WATCHDOG, req)
        entry = self._unpark(req.rid, "applied")
        if entry is not None:
            self.stats.completions_parked_applied += len(entry.counts)
            for sender, count in entry.counts.items():
                if self._count_write(req, sender, count, out):
                    break

    def _registration(self, req: _Req, blocks: BlockIds) -> bytes:
        cfg = self.config
        remote = req.remote
        reg = PushRegistration(
            request_id=req.rid,
            decode_engine_id=cfg.engine_id,
            decode_host=self.host,
            decode_port=self.port,
            decode_tp_size=cfg.tp_size,
            local_block_ids=[list(g) for g in blocks],
            remote_engine_id=remote.engine_id,
            remote_host=remote.host,
            remote_port=remote.port,
            remote_tp_size=remote.tp_size,
            remote_pp_size=remote.pp_size,
        )
        return encode_push_registration(reg)

    # ----------------------------------------------------------------- transfers

    def _transfer_failed(self, req: _Req, reason: str, out: list[Action]) -> None:
        self._begin_failure(req, FailReason.TRANSFER, reason or "transfer failed", out)

    def _drained(self, req: _Req, out: list[Action]) -> None:
        self._fail_now(req, req.fail_reason, req.fail_detail, out)

    def _transfers_done(self, req: _Req, out: list[Action]) -> None:
        self._release_producer(req, out, only_unread=True)
        self._finish(req, out)

    def _begin_failure(self, req: _Req, reason: FailReason, detail: str, out: list[Action]) -> None:
        """First failure of a request with transfers: post nothing more, cancel what runs,
        and report only once every handle is released (their DMA may target its blocks)."""
        req.fail_reason = reason
        req.fail_detail = detail
        self._hb_drop(req)
        if not req.xfers:
            self._fail_now(req, reason, detail, out)
            return
        self._drain(req, out)

    # ----------------------------------------------------------------- notifications

    def _on_notification(self, event: NotificationReceived, now: float, out: list[Action]) -> None:
        try:
            msg = decode_notification(event.data)
        except KVWireError:
            self.stats.notifications_malformed += 1
            return
        if not isinstance(msg, Completion) or self.config.mode is not TransferMode.PUSH:
            self.stats.notifications_unexpected += 1
            return
        req = self._reqs.get(msg.request_id)
        if req is not None and req.state is S.AWAIT_WRITES:
            successors(CONSUMER, req.state, NotificationReceived, f"request {req.rid!r}")
            self._count_write(req, event.sender, msg.count, out)
            return
        if (S.ABSENT if req is None else req.state, NotificationReceived) not in CONSUMER:
            self.stats.notifications_unexpected += 1
            return
        self._park(msg.request_id, event.sender, msg.count, now)

    def _count_write(self, req: _Req, sender: str, count: int, out: list[Action]) -> bool:
        """Count one producer rank's write notification; True if the request ended."""
        if count != req.engine.tp_size:
            self._protocol_failure(
                req,
                f"write notification says producer world size {count}, "
                f"handshake said {req.engine.tp_size}",
                out,
            )
            return True
        if sender in req.senders:
            self.stats.completions_duplicate += 1
            return False
        req.senders.add(sender)
        if len(req.senders) >= req.expected:
            self._finish(req, out)
            return True
        return False

    # ----------------------------------------------------------------- parked completions

    def _park(self, rid: str, sender: str, count: int, now: float) -> None:
        """Hold a write notification until ``rid`` awaits writes (or it expires)."""
        entry = self._parked.get(rid)
        if entry is not None and sender in entry.counts:
            self.stats.completions_duplicate += 1
            return
        if self._parked_count >= self.config.max_parked_completions:
            self.stats.completions_parked_dropped += 1
            return
        if entry is None:
            entry = _Parked(rid)
            self._move(entry, PARKED, "parked")
            self._parked[rid] = entry
            self._arm(now + self.config.registration_timeout_s, T_PARKED, entry)
        entry.counts[sender] = count
        self._parked_count += 1
        self.stats.completions_parked += 1

    def _unpark(self, rid: str, outcome: str) -> _Parked | None:
        """Take ``rid``'s parked notifications out of the buffer with ``outcome``
        (``applied``, ``discarded`` or ``expired``)."""
        entry = self._parked.pop(rid, None)
        if entry is None:
            return None
        self._move(entry, PARKED, outcome)
        self._parked_count -= len(entry.counts)
        return entry

    def _discard_parked(self, rid: str) -> None:
        entry = self._unpark(rid, "discarded")
        if entry is not None:
            self.stats.completions_parked_dropped += len(entry.counts)

    # ----------------------------------------------------------------- timers

    def _fire_request(
        self, kind: int, subject: Any, token: Any, now: float, out: list[Action]
    ) -> None:
        if kind == T_WATCHDOG:
            req: _Req = subject
            if self._reqs.get(req.rid) is req and req.state is S.AWAIT_WRITES:
                successors(CONSUMER, req.state, Timer, f"request {req.rid!r}")
                self._fail_now(req, FailReason.TIMEOUT, "producer writes did not arrive", out)
        elif kind == T_PARKED:
            entry: _Parked = subject
            if self._parked.get(entry.rid) is entry:
                self._unpark(entry.rid, "expired")
                self.stats.completions_parked_expired += len(entry.counts)

    # ----------------------------------------------------------------- endings

    def _release_producer(self, req: _Req, out: list[Action], only_unread: bool = False) -> None:
        """Tell the producer ranks this rank owes a completion that they may free.

        Completions are counted per sender, so repeating one is harmless. In push mode a
        producer that announced :data:`PUSH_RELEASE` learns from a registration with no
        blocks instead; any other (vLLM's) frees when its lease runs out.
        """
        engine = req.engine
        if self.config.mode is TransferMode.PUSH:
            # Before our registration went out, an empty one lets the producer free now;
            # after it, the producer is (or was) writing and ends on its own.
            if req.state is S.WAIT_ALLOC or req.state is S.WAIT_PEER:
                data = self._registration(req, ())
                if engine.state is EngineState.READY:
                    if PUSH_RELEASE in engine.features:
                        out.append(SendNotification(engine.engine_id, _ALL_RANKS, data, req.rid))
                elif engine.state is EngineState.HANDSHAKING:
                    engine.notes.append(data)
            return
        if engine.state is EngineState.READY:
            reads, peers = self._plan_or_empty(engine)
            ranks = [r for r in peers if r not in reads] if only_unread else peers
            if ranks:
                out.append(SendNotification(engine.engine_id, tuple(ranks), req.notif, req.rid))
        elif engine.state is EngineState.HANDSHAKING:
            engine.notes.append(req.notif)

    def _plan_or_empty(self, engine: Engine) -> tuple[list[RemoteRank], list[RemoteRank]]:
        try:
            return self._plan(engine)
        except KVWireError:
            return [], []

    def _protocol_failure(self, req: _Req, detail: str, out: list[Action]) -> None:
        self.stats.remote_errors += 1
        out.append(PeerMisbehaved(detail, req.engine.engine_id, req.rid))
        self._fail_now(req, FailReason.PROTOCOL, detail, out)

    def _finish(self, req: _Req, out: list[Action]) -> None:
        self._move(req, CONSUMER, "done")
        self._end(req)
        self._terminal_out(req.rid, RequestDone(req.rid), out)

    def _fail_now(
        self,
        req: _Req,
        reason: FailReason,
        detail: str,
        out: list[Action],
        trigger: Trigger | None = None,
    ) -> None:
        """End ``req`` as failed. ``trigger``: what the table knows the cause as, when it is
        not the event being handled (a handshake that timed out is a ``HandshakeFailed``)."""
        self._release_producer(req, out)
        self._move(req, CONSUMER, "failed", trigger)
        self._end(req)
        until = None
        if req.registered is not None:
            until = req.registered + self.config.registration_timeout_s
        failed = RequestFailed(req.rid, req.local, reason, detail, until)
        self._terminal_out(req.rid, failed, out)

    def _end(self, req: _Req) -> None:
        if self._check and req.xfers:
            raise InvariantViolation(f"request {req.rid!r} ends with transfers still running")
        self._hb_drop(req)
        del self._reqs[req.rid]
        self._discard_parked(req.rid)
        engine = req.engine
        engine.waiting.pop(req.rid, None)  # queued behind a handshake (WAIT_PEER)
        engine.refs -= 1
        engine.last_active = self._last_now
        self._maybe_forget(engine)

    def _terminal_out(
        self, rid: str, action: RequestDone | RequestFailed, out: list[Action]
    ) -> None:
        if self._check:
            if rid in self._ended:
                raise InvariantViolation(f"request {rid!r} reported a second terminal outcome")
            self._ended.add(rid)
            self._ended_now.add(rid)
        out.append(action)

    def _req(self, rid: str, etype: type[Any]) -> _Req:
        req = self._reqs.get(rid)
        state = S.ABSENT if req is None else req.state
        successors(CONSUMER, state, etype, f"request {rid!r}")
        assert req is not None
        return req


def _check_remote(remote: RemotePrefill, config: KVWireConfig) -> str | None:
    """Why the producer's parameters cannot be used, or None. They come from the peer."""
    if not remote.engine_id or not remote.request_id:
        return "kv_transfer_params lack the producer's engine or request id"
    if "," in remote.request_id:
        return f"producer request id {remote.request_id!r} contains ','"
    if remote.tp_size < 1 or remote.pp_size < 1 or remote.dcp_size < 1:
        return (
            f"producer sizes tp={remote.tp_size} pp={remote.pp_size} "
            f"dcp={remote.dcp_size} are not positive"
        )
    if remote.dcp_size > 1:
        # A DCP-sharded producer holds a slice of each block's tokens per rank; reading it
        # needs a gather across ranks that kvwire's planner does not do. Refusing here keeps
        # the request from being reported done with one shard's bytes.
        return (
            f"producer KV is DCP-sharded (dcp_size {remote.dcp_size}); kvwire consumers "
            "read only unsharded (dcp_size 1) producers"
        )
    big, small = max(remote.tp_size, config.tp_size), min(remote.tp_size, config.tp_size)
    if big % small:
        return f"producer TP {remote.tp_size} and ours {config.tp_size} do not divide"
    return None
