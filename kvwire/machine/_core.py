"""The parts both machines share: the timer heap, remote engines, transfers and self-checks.

Nothing here reads a clock or touches I/O. Per-event work is O(1) apart from the actions an
event genuinely causes (one per queued request when a handshake ends, one per due deadline
when the timer fires).

Why one module of ~700 lines: timers, engines, transfers and the invariant checks are the
shared half of both machines and call into each other on every event.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any, ClassVar

from kvwire.config import KVWireConfig
from kvwire.errors import ConfigError, KVWireError, LocalProtocolError
from kvwire.machine.actions import (
    Action,
    ArmTimer,
    CancelTransfer,
    EvictEngine,
    ReleaseTransfer,
    StartHandshake,
)
from kvwire.machine.events import (
    Event,
    HandshakeDone,
    HandshakeFailed,
    PeerLost,
    ReleaseFailed,
    Timer,
    TransferDone,
    TransferFailed,
    TransferPosted,
)
from kvwire.machine.table import (
    ENGINE,
    TRANSFER,
    Cancel,
    Dial,
    EngineState,
    Post,
    Table,
    TransferState,
    Trigger,
    next_state,
    successors,
)

# Timer kinds; an entry is (deadline, seq, kind, subject, token) and is stale (skipped) when
# the subject is no longer the live object the entry was armed for.
T_LEASE = 0
T_WATCHDOG = 1
T_HANDSHAKE = 2
T_HEARTBEAT = 3
T_IDLE = 4
T_RELEASE = 5
T_REGISTRATION = 6
T_PARKED = 7
T_XFER = 8


class InvariantViolation(KVWireError):
    """The machine caught itself breaking one of its own guarantees (a bug in kvwire)."""


class MachineStats:
    """Counters a driver can export as metrics; plain ints, cheap to bump."""

    __slots__ = (
        "aborts_ignored",
        "actions",
        "completions_duplicate",
        "completions_early",
        "completions_parked",
        "completions_parked_applied",
        "completions_parked_dropped",
        "completions_parked_expired",
        "completions_unknown",
        "engines_evicted",
        "events",
        "handshakes_failed",
        "handshakes_started",
        "heartbeats_received",
        "heartbeats_sent",
        "lease_answers_unused",
        "lease_extensions",
        "lease_queries",
        "leases_expired",
        "leases_quarantined",
        "notifications_malformed",
        "notifications_unexpected",
        "read_deadlines_extended",
        "reads_declined_expiry",
        "reads_late",
        "registrations_duplicate",
        "registrations_expired",
        "registrations_malformed",
        "release_failures",
        "remote_errors",
        "stale_handshake_answers",
        "stream_restarts",
        "stream_rounds",
        "transfers_failed",
        "transfers_posted",
        "transfers_timed_out",
    )

    def __init__(self) -> None:
        self.aborts_ignored = 0
        self.actions = 0
        self.completions_duplicate = 0
        self.completions_early = 0
        """P: completions that came before the engine's PrefillFinished (counted, applied)."""
        self.completions_parked = 0
        """Push write notifications held for a request not yet awaiting writes."""
        self.completions_parked_applied = 0
        self.completions_parked_dropped = 0
        """Refused (buffer full) or discarded (their request ended before awaiting writes)."""
        self.completions_parked_expired = 0
        """Parked for ``registration_timeout_s`` without their request awaiting writes."""
        self.completions_unknown = 0
        self.engines_evicted = 0
        self.events = 0
        self.handshakes_failed = 0
        self.handshakes_started = 0
        self.heartbeats_received = 0
        self.heartbeats_sent = 0
        self.lease_answers_unused = 0
        """Lease answers that moved nothing (not held, not later, too late, request over)."""
        self.lease_extensions = 0
        self.lease_queries = 0
        """Consumer: lease queries asked (``QueryLeases``)."""
        self.leases_expired = 0
        self.leases_quarantined = 0
        """Expired leases whose blocks were held for the grace before being freed."""
        self.notifications_malformed = 0
        self.notifications_unexpected = 0
        self.read_deadlines_extended = 0
        """Consumer: read deadlines moved later by a producer's lease answer."""
        self.reads_declined_expiry = 0
        self.reads_late = 0
        """READs whose completion came after the read deadline: failed, never done."""
        self.registrations_duplicate = 0
        self.registrations_expired = 0
        self.registrations_malformed = 0
        self.release_failures = 0
        self.remote_errors = 0
        self.stale_handshake_answers = 0
        self.stream_restarts = 0
        """Producer, streaming: prompts preempted mid-stream, written again from new blocks."""
        self.stream_rounds = 0
        """Producer, streaming: rounds of WRITEs posted before their prompt ended."""
        self.transfers_failed = 0
        self.transfers_posted = 0
        self.transfers_timed_out = 0
        """Transfers still running at their deadline: cancelled, their request failed."""

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class Engine:
    """One remote engine as this rank sees it: handshake state plus who depends on it."""

    __slots__ = (
        "attempt",
        "clock_offset",
        "clock_uncertainty",
        "engine_id",
        "entry",
        "features",
        "hb_armed",
        "hb_ids",
        "host",
        "idle_armed",
        "last_active",
        "notes",
        "port",
        "pp_size",
        "refs",
        "state",
        "step",
        "tp_size",
        "waiting",
    )

    def __init__(self, engine_id: str, host: str, port: int, tp_size: int, pp_size: int) -> None:
        self.engine_id = engine_id
        self.state = EngineState.ABSENT
        self.entry = EngineState.ABSENT
        """The state when the current event (or fired timer) arrived: the table's key."""
        self.step = -1
        self.attempt = 0
        self.host = host
        self.port = port
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.clock_offset = 0.0
        self.clock_uncertainty = 0.0
        self.features: frozenset[str] = frozenset()
        self.waiting: dict[str, None] = {}
        """Requests queued behind the handshake, in arrival order."""
        self.refs = 0
        """Live requests that name this engine; it is never evicted while > 0."""
        self.last_active = 0.0
        self.notes: list[bytes] = []
        """Completion messages to send once the handshake is done (abort / nothing to read)."""
        self.hb_ids: dict[str, list[Any]] = {}
        """Remote request ids to heartbeat, with the local requests that want each."""
        self.hb_armed = False
        self.idle_armed = False


class Transfer:
    """One READ or WRITE the machine asked for, until its handle is released."""

    __slots__ = ("entry", "owner", "posted", "state", "step", "xfer_id")

    def __init__(self, xfer_id: int, owner: Any, posted: float) -> None:
        self.xfer_id = xfer_id
        self.owner = owner
        self.posted = posted
        """When it was asked for: its deadline is recomputed from it (it may move later)."""
        self.state = TransferState.ABSENT
        self.entry = TransferState.ABSENT
        self.step = -1


class MachineCore:
    """Timers, engines, transfers and invariant plumbing; subclasses add request logic.

    A request that moves blocks (a consumer's READs, a producer's WRITEs) has the same
    shape on both sides: a ``plan`` of remote ranks posted one at a time (``next_post``),
    its live ``xfers`` by id, and a draining state it waits in for every handle to be
    released after its first failure. The subclass names its request table and the two
    states; the transfer events are handled here.
    """

    role = "machine"
    _requests: ClassVar[Table] = {}
    """The request table of this side (``CONSUMER`` / ``PRODUCER``)."""
    _moving: Any = None
    """The request state in which transfers are being posted (TRANSFERRING / WRITING)."""
    _draining: Any = None
    """The request state that waits for its transfers' release after a failure."""
    _end_actions: tuple[type[Action], ...] = ()
    """The actions that end a request (after one, no action may name it again)."""
    _ended_word = "ended"

    def __init__(self, config: KVWireConfig) -> None:
        if not isinstance(config, KVWireConfig):
            raise TypeError("config must be a KVWireConfig")
        if not config.engine_id:
            raise ConfigError("engine_id is not set (pass engine_id=... or set KVWIRE_ENGINE_ID)")
        self.config = config
        # Durations the lease derives, resolved once: events read them, never recompute.
        self._handshake_budget_s = config.handshake_budget_s()
        self._transfer_timeout_s = config.transfer_timeout
        self._expiry_margin_s = config.expiry_margin
        self._completion_margin_s = config.completion_margin
        self.stats = MachineStats()
        self._check = config.check_invariants
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._seq = 0
        self._engines: dict[str, Engine] = {}
        self._xfers: dict[int, Transfer] = {}
        self._next_xfer = 1
        self._attempts = 0
        self._last_now = float("-inf")
        self._handlers: dict[type[Event], Callable[[Any, float, list[Action]], None]] = {
            HandshakeDone: self._on_handshake_done,
            HandshakeFailed: self._on_handshake_failed,
            TransferPosted: self._on_xfer,
            TransferDone: self._on_xfer,
            TransferFailed: self._on_xfer,
            ReleaseFailed: self._on_xfer,
            PeerLost: self._on_peer_lost,
            Timer: self._on_timer,
        }
        """Events both sides handle here; each machine adds its request events."""
        self._event_type: type[Event] = Timer
        """The type of the event being handled (the table key of what it causes)."""
        self._step = 0
        """Counts events and fired timers: a thing's ``entry`` state is the one it had when
        the current step began."""
        self._ended: set[str] = set()
        """With invariant checks on: every request id that has ended (they never come back)."""
        self._ended_now: set[str] = set()
        """With invariant checks on: the ids that ended during the event being handled."""

    # ----------------------------------------------------------------- public surface

    def handle(self, event: Event, now: float) -> list[Action]:
        """Feed one event at time ``now`` (seconds, this process's clock); get the actions.

        Raises :class:`LocalProtocolError` for an event the current state does not accept
        (nothing changed in that case) or for time running backwards.
        """
        handler = self._handlers.get(type(event))
        if handler is None:
            raise LocalProtocolError(f"{self.role} does not accept {type(event).__name__}")
        if now < self._last_now:
            raise LocalProtocolError(f"time went backwards: {now} < {self._last_now}")
        self._last_now = now
        self._event_type = type(event)
        self._step += 1
        heap = self._heap
        before = heap[0][0] if heap else None
        out: list[Action] = []
        handler(event, now, out)
        while heap and heap[0][2] == T_XFER and self._xfer_entry_stale(heap[0][3]):
            # A transfer that ended has no deadline: drop its entry now rather than wake
            # the driver for nothing when it comes due.
            heapq.heappop(heap)
        if out and self._check:
            self._verify(out)
        if heap and (before is None or heap[0][0] < before):
            out.append(ArmTimer(heap[0][0]))
        stats = self.stats
        stats.events += 1
        stats.actions += len(out)
        return out

    def next_deadline(self) -> float | None:
        """When the machine next needs ``handle(Timer(), now)``; None if nothing is armed.

        May be earlier than strictly needed (a lazily deleted entry): a Timer event with
        nothing due is harmless. Never later than a real deadline.
        """
        return self._heap[0][0] if self._heap else None

    def engine_state(self, engine_id: str) -> EngineState:
        engine = self._engines.get(engine_id)
        return EngineState.ABSENT if engine is None else engine.state

    def transfer_state(self, xfer_id: int) -> TransferState:
        xfer = self._xfers.get(xfer_id)
        return TransferState.ABSENT if xfer is None else xfer.state

    def transfers_in_flight(self) -> int:
        return len(self._xfers)

    # ----------------------------------------------------------------- transitions

    def _move(self, thing: Any, table: Table, outcome: str, trigger: Trigger | None = None) -> None:
        """Assign ``thing`` the state ``table`` names for ``outcome``, keyed by the state it
        was in when this step (event or fired timer) began and by the step's event type (or
        an internal ``trigger``). Every state change of every machine comes through here;
        it runs on every transition, so the lookup is inlined (``next_state`` is the same
        lookup with its error)."""
        step = self._step
        if thing.step != step:
            thing.step = step
            thing.entry = thing.state
        try:
            thing.state = table[thing.entry, trigger or self._event_type][outcome]
        except KeyError:
            next_state(table, thing.entry, trigger or self._event_type, outcome)  # raises

    # ----------------------------------------------------------------- timers

    def _arm(self, deadline: float, kind: int, subject: Any, token: Any = None) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, kind, subject, token))

    def _on_timer(self, event: Timer, now: float, out: list[Action]) -> None:
        """Pop every entry that is due. An entry whose deadline was pushed back (a lease
        extended by a heartbeat) is re-armed at its current deadline rather than kept in
        place, so the heap holds exactly one live entry per lease with a key no later than
        that lease's deadline: popping until the top is in the future therefore reaches
        *every* expired lease, whatever order they were armed or extended in."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, kind, subject, token = heapq.heappop(heap)
            self._step += 1  # each due timer is its own step: the table keys on its start
            self._fire(kind, subject, token, now, out)

    def _fire(self, kind: int, subject: Any, token: Any, now: float, out: list[Action]) -> None:
        if kind == T_HANDSHAKE:
            engine: Engine = subject
            if (
                self._engines.get(engine.engine_id) is engine
                and engine.state is EngineState.HANDSHAKING
                and engine.attempt == token
            ):
                self._handshake_failed(engine, now, out, "handshake timed out")
        elif kind == T_HEARTBEAT:
            self._heartbeat(subject, now, out)
        elif kind == T_IDLE:
            self._idle_check(subject, now, out)
        elif kind == T_RELEASE:
            xfer: Transfer = subject
            if self._xfers.get(xfer.xfer_id) is xfer and xfer.state is TransferState.RELEASE_FAILED:
                self._move(xfer, TRANSFER, "releasing")
                out.append(ReleaseTransfer(xfer.xfer_id, xfer.owner.rid))
        elif kind == T_XFER:
            self._transfer_deadline_passed(subject, out)
        else:
            self._fire_request(kind, subject, token, now, out)

    def _fire_request(
        self, kind: int, subject: Any, token: Any, now: float, out: list[Action]
    ) -> None:
        raise NotImplementedError

    # ----------------------------------------------------------------- engines

    def _engine(self, engine_id: str, host: str, port: int, tp: int, pp: int) -> Engine:
        engine = self._engines.get(engine_id)
        if engine is None:
            engine = Engine(engine_id, host, port, tp, pp)
            self._engines[engine_id] = engine
        return engine

    def _ensure_handshake(self, engine: Engine, now: float, out: list[Action]) -> None:
        """Start a handshake unless one is in flight or done: one in flight per engine."""
        if engine.state is not EngineState.ABSENT:
            return
        self._attempts += 1
        engine.attempt = self._attempts
        self._move(engine, ENGINE, "handshaking", Dial)
        self.stats.handshakes_started += 1
        out.append(
            StartHandshake(
                engine.engine_id,
                engine.attempt,
                engine.host,
                engine.port,
                engine.tp_size,
                engine.pp_size,
            )
        )
        self._arm(now + self._handshake_budget_s, T_HANDSHAKE, engine, engine.attempt)

    def _handshake_event(self, event: HandshakeDone | HandshakeFailed) -> Engine | None:
        """The engine the answer belongs to, or None for a stale answer (ignored)."""
        if type(event.attempt) is not int or not 0 < event.attempt <= self._attempts:
            raise LocalProtocolError(f"handshake attempt {event.attempt!r} was never started")
        engine = self._engines.get(event.engine_id)
        if (
            engine is None
            or engine.attempt != event.attempt
            or engine.state is not EngineState.HANDSHAKING
        ):
            self.stats.stale_handshake_answers += 1
            return None
        successors(ENGINE, engine.state, type(event), "engine")
        return engine

    def _on_handshake_done(self, event: HandshakeDone, now: float, out: list[Action]) -> None:
        engine = self._handshake_event(event)
        if engine is None:
            return
        engine.tp_size = event.remote_tp_size
        engine.pp_size = event.remote_pp_size
        engine.clock_offset = event.clock_offset
        engine.clock_uncertainty = event.clock_uncertainty
        engine.features = event.peer_features
        self._move(engine, ENGINE, "ready")
        engine.last_active = now
        self._engine_ready(engine, event, now, out)
        if engine.state is EngineState.READY and not engine.idle_armed:
            engine.idle_armed = True
            self._arm(now + self.config.engine_idle_ttl_s, T_IDLE, engine)

    def _on_handshake_failed(self, event: HandshakeFailed, now: float, out: list[Action]) -> None:
        engine = self._handshake_event(event)
        if engine is None:
            return
        self._handshake_failed(engine, now, out, event.reason or "handshake failed")

    def _handshake_failed(self, engine: Engine, now: float, out: list[Action], why: str) -> None:
        """Failures are not cached: the engine goes back to ABSENT and the next request
        starts a new handshake; everything queued behind this one fails with it."""
        self.stats.handshakes_failed += 1
        self._move(engine, ENGINE, "absent")
        engine.notes.clear()
        waiting = list(engine.waiting)
        engine.waiting.clear()
        self._engine_failed(engine, waiting, now, out, why)
        self._maybe_forget(engine)

    def _on_peer_lost(self, event: PeerLost, now: float, out: list[Action]) -> None:
        engine = self._engines.get(event.engine_id)
        if engine is None:
            return
        successors(ENGINE, engine.state, PeerLost, "engine")
        self._engine_lost(engine, out)
        if engine.state is EngineState.READY:
            self._move(engine, ENGINE, "absent")
            engine.hb_armed = False
            engine.idle_armed = False
            self._maybe_forget(engine)

    def _engine_lost(self, engine: Engine, out: list[Action]) -> None:
        """What a side does with its requests when a peer engine went away (by default
        nothing: their transfers end through ``TransferFailed``)."""

    def _maybe_forget(self, engine: Engine) -> None:
        if (
            engine.state is EngineState.ABSENT
            and engine.refs == 0
            and not engine.waiting
            and self._engines.get(engine.engine_id) is engine
        ):
            del self._engines[engine.engine_id]

    def _idle_check(self, engine: Engine, now: float, out: list[Action]) -> None:
        if self._engines.get(engine.engine_id) is not engine:
            return
        if engine.state is not EngineState.READY:
            engine.idle_armed = False
            return
        ttl = self.config.engine_idle_ttl_s
        if engine.refs > 0:
            self._arm(now + ttl, T_IDLE, engine)
            return
        if now < engine.last_active + ttl:
            self._arm(engine.last_active + ttl, T_IDLE, engine)
            return
        self._move(engine, ENGINE, "absent")
        engine.idle_armed = False
        engine.hb_armed = False
        del self._engines[engine.engine_id]
        self.stats.engines_evicted += 1
        out.append(EvictEngine(engine.engine_id))

    def _engine_ready(
        self, engine: Engine, event: HandshakeDone, now: float, out: list[Action]
    ) -> None:
        raise NotImplementedError

    def _engine_failed(
        self, engine: Engine, waiting: list[str], now: float, out: list[Action], why: str
    ) -> None:
        raise NotImplementedError

    def _heartbeat(self, engine: Engine, now: float, out: list[Action]) -> None:
        engine.hb_armed = False

    # ----------------------------------------------------------------- transfers

    def _new_transfer(self, owner: Any) -> Transfer:
        xfer = Transfer(self._next_xfer, owner, self._last_now)
        self._move(xfer, TRANSFER, "requested", Post)
        self._next_xfer += 1
        self._xfers[xfer.xfer_id] = xfer
        self.stats.transfers_posted += 1
        return xfer

    def _transfer_for(self, xfer_id: int, event_type: type[Event]) -> Transfer:
        xfer = self._xfers.get(xfer_id)
        if xfer is None:
            raise LocalProtocolError(f"transfer {xfer_id!r} is unknown or already ended")
        successors(TRANSFER, xfer.state, event_type, f"transfer {xfer_id}")
        return xfer

    def _next_transfer(self, req: Any) -> tuple[Any, Transfer]:
        """The next rank of ``req``'s plan and a new transfer to it, owned by ``req``,
        with its deadline armed: no READ/WRITE runs unbounded."""
        rank = req.plan[req.next_post]
        req.next_post += 1
        xfer = self._new_transfer(req)
        req.xfers[xfer.xfer_id] = xfer
        self._arm(self._transfer_deadline(req, xfer.posted), T_XFER, xfer)
        return rank, xfer

    def _transfer_deadline(self, req: Any, now: float) -> float:
        """When a transfer of ``req`` posted now must have ended."""
        return now + self._transfer_timeout_s

    def _xfer_entry_stale(self, xfer: Transfer) -> bool:
        state = xfer.state
        return self._xfers.get(xfer.xfer_id) is not xfer or (
            state is not TransferState.POSTED and state is not TransferState.REQUESTED
        )

    def _transfer_deadline_passed(self, xfer: Transfer, out: list[Action]) -> None:
        """A transfer's deadline came while it may still run: the request fails, which
        cancels it (or, still being posted, cancels it once posted); whatever the transfer
        reports afterwards is a released handle, never a success."""
        if self._xfers.get(xfer.xfer_id) is not xfer:
            return
        state = xfer.state
        if state is not TransferState.POSTED and state is not TransferState.REQUESTED:
            return  # already being cancelled or released
        req = xfer.owner
        if req.state is not self._moving:
            return
        successors(TRANSFER, state, Timer, f"transfer {xfer.xfer_id}")
        successors(self._requests, req.state, Timer, f"request {req.rid!r}")
        due = self._transfer_deadline(req, xfer.posted)
        if due > self._last_now:
            # Evidence moved the deadline later since this entry was armed: re-arm it
            # there (one live entry per transfer, as for leases).
            self._arm(due, T_XFER, xfer)
            return
        self.stats.transfers_timed_out += 1
        self._transfer_timed_out(req, out)

    def _transfer_timed_out(self, req: Any, out: list[Action]) -> None:
        """A transfer of a moving request ran past its deadline (its first failure)."""
        raise NotImplementedError

    def _completion_too_late(self, req: Any, now: float) -> bool:
        """Whether a transfer of ``req`` that reports success at ``now`` must not count."""
        return False

    def _on_xfer(
        self,
        event: TransferPosted | TransferDone | TransferFailed | ReleaseFailed,
        now: float,
        out: list[Action],
    ) -> None:
        etype = type(event)
        xfer = self._transfer_for(event.xfer_id, etype)
        req = xfer.owner
        successors(self._requests, req.state, etype, f"request {req.rid!r}")
        if etype is TransferPosted:
            if req.state is self._draining:  # it failed while this post was under way
                self._move(xfer, TRANSFER, "cancelling")
                out.append(CancelTransfer(xfer.xfer_id, req.rid))
                return
            self._move(xfer, TRANSFER, "posted")
            if req.next_post < len(req.plan):
                self._post_next(req, out)
            return
        if etype is ReleaseFailed:
            self._release_failed(xfer, now)
            return
        # Released: the transfer is over either way.
        self._move(xfer, TRANSFER, "ended")
        del self._xfers[xfer.xfer_id]
        del req.xfers[xfer.xfer_id]
        if etype is TransferFailed:
            self.stats.transfers_failed += 1
            if req.state is self._moving:
                reason = event.reason if isinstance(event, TransferFailed) else ""
                self._transfer_failed(req, reason, out)
                return
        elif req.state is self._moving and self._completion_too_late(req, now):
            # The bytes may have been read after the peer stopped holding them.
            self._transfer_timed_out(req, out)
            return
        if req.state is self._draining:
            if not req.xfers:
                self._drained(req, out)
            return
        if not req.xfers and req.next_post >= len(req.plan):
            self._transfers_done(req, out)

    def _drain(self, req: Any, out: list[Action]) -> None:
        """Post nothing more and cancel what runs; the request waits in its draining state
        until every handle is released (their DMA may still touch its blocks). A transfer
        still being posted is cancelled once its ``TransferPosted`` arrives."""
        req.next_post = len(req.plan)
        self._move(req, self._requests, "draining")
        for xfer in req.xfers.values():
            if xfer.state is TransferState.POSTED:
                self._move(xfer, TRANSFER, "cancelling", Cancel)
                out.append(CancelTransfer(xfer.xfer_id, req.rid))

    def _post_next(self, req: Any, out: list[Action]) -> None:
        """Post the transfer to the next rank of ``req``'s plan."""
        raise NotImplementedError

    def _transfer_failed(self, req: Any, reason: str, out: list[Action]) -> None:
        """A transfer of a request that was still moving blocks failed (its first failure)."""
        raise NotImplementedError

    def _drained(self, req: Any, out: list[Action]) -> None:
        """The last transfer of a draining request was released: end it as it failed."""
        raise NotImplementedError

    def _transfers_done(self, req: Any, out: list[Action]) -> None:
        """Every transfer of the plan was posted and released without failing."""
        raise NotImplementedError

    def _release_failed(self, xfer: Transfer, now: float) -> None:
        """The handle could not be released: DMA may still be running, so the owner keeps
        its blocks; ask again after ``release_retry_s``."""
        self.stats.release_failures += 1
        self._move(xfer, TRANSFER, "release_failed")
        self._arm(now + self.config.release_retry_s, T_RELEASE, xfer)

    def _verify(self, out: list[Action]) -> None:
        """No action names a request after the action that ended it (in this call or any
        earlier one)."""
        ended_now = self._ended_now
        ended = self._ended
        end_actions = self._end_actions
        seen_end: set[str] = set()
        for action in out:
            rid = getattr(action, "request_id", None)
            if rid is None or rid not in ended:
                continue
            if rid in seen_end or rid not in ended_now:
                raise InvariantViolation(
                    f"{type(action).__name__} for {self._ended_word} request {rid!r}"
                )
            if isinstance(action, end_actions):
                seen_end.add(rid)
        ended_now.clear()


def rebase_deadline(deadline: float, scheduler_clock: float, now_local: float) -> float:
    """A deadline stamped by another process, moved onto this process's clock.

    The stamping process sent ``deadline`` together with its own clock reading
    ``scheduler_clock``; what is left of the lease is their difference. ``0`` means the
    sender's clock is ours (legacy absolute deadline).
    """
    if scheduler_clock == 0:
        return deadline
    return now_local + (deadline - scheduler_clock)
