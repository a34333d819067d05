"""The producer (prefill side) machine: one rank of an engine that holds KV for consumers.

After a prompt finishes, its blocks are held under a lease. Pull: consumers READ them and
say so with completion notifications, counted per sender; the blocks are freed when enough
distinct consumer ranks are done, or when the lease runs out (heartbeats push it back, never
forward). Push: the consumer's registration and the finished prompt are matched in whichever
order they arrive (exact id, then the id without its ``-xxxxxxxx`` suffix); the rank then
WRITEs to the consumer ranks it serves, one post at a time.

Streaming push (``stream_layers``): a registration also matches a prompt still being
computed. The engine reports each chunk (:class:`ChunkScheduled`) and each computed layer
(:class:`LayersComputed`); the computed, not yet written rectangle of (layers x full blocks)
goes out as one round of WRITEs, and the next round only after the last one landed, so
rounds coalesce whatever was computed meanwhile and never overlap. The last layer is held
back: the round posted after PrefillFinished carries it, the rest and the completion, so the
consumer is told only after every byte of the request is written. A stream that fails
before the prompt ends goes back to prefilling, holding nothing, and frees the prompt's
blocks as soon as the engine hands them over.

Every held block is freed exactly once (``FreeBlocks``), and only when no transfer from it
is still running.

Why one module: matching, whole-request writes and streaming rounds share one request
record and one set of endings (free, drain, back to prefilling); split apart, each half
would have to reach into the other's fields.
"""

from __future__ import annotations

import re
from typing import Any

from kvwire.config import KVWireConfig
from kvwire.errors import KVWireError, LocalProtocolError
from kvwire.layout import topology
from kvwire.machine._core import (
    T_LEASE,
    T_REGISTRATION,
    Engine,
    InvariantViolation,
    MachineCore,
    Transfer,
    rebase_deadline,
)
from kvwire.machine.actions import (
    Action,
    FreeBlocks,
    FreeReason,
    PeerMisbehaved,
    Piece,
    PostWrite,
    RemoteRank,
)
from kvwire.machine.events import (
    Abort,
    BlockIds,
    ChunkScheduled,
    HandshakeDone,
    HandshakeFailed,
    LayersComputed,
    NotificationReceived,
    Preempted,
    PrefillFinished,
    RequestAdded,
    Timer,
)
from kvwire.machine.table import (
    PRODUCER,
    EngineState,
    ProducerState,
    Trigger,
    successors,
)
from kvwire.wire.notifications import PUSH_REG_PREFIX, decode_notification, encode_completion
from kvwire.wire.schemas import Completion, Heartbeat, PushRegistration, TransferMode

S = ProducerState
_SUFFIX = re.compile(r"-[0-9a-f]{8}\Z")


def base_request_id(request_id: str) -> str:
    """The id without the per-engine random ``-xxxxxxxx`` suffix (lower-case hex)."""
    return _SUFFIX.sub("", request_id)


def _pieces(
    sent: tuple[int, int, int], computed: tuple[int, int, int], units: int
) -> tuple[Piece, ...]:
    """The rectangles computed since ``sent`` (both frontiers ``(a, b, k)``: every unit
    through token a, units [0, k) through b). A later chunk means the earlier one is done in
    every unit."""
    sa, sb, sk = sent
    a, b, k = computed
    if sb == b:
        return ((sk, k, a, b),) if k > sk and b > a else ()
    out: list[Piece] = []
    if sk < units and sb > sa:
        out.append((sk, units, sa, sb))
    if a > sb and units:
        out.append((0, units, sb, a))
    if k and b > a:
        out.append((0, k, a, b))
    return tuple(out)


def _remainder(sent: tuple[int, int, int], units: int) -> tuple[Piece, ...]:
    """Everything a stream has not written by ``sent``, through the prompt's end: the rest
    of its chunk, every token after it, and the held-back last layer."""
    sa, sb, sk = sent
    out: list[Piece] = []
    if units:
        if sb > sa and sk < units:
            out.append((sk, units, sa, sb))
        out.append((0, units, sb, -1))
    out.append((units, -1, 0, -1))
    return tuple(out)


def _unindex(by_base: dict[str, dict[str, None]], rid: str) -> None:
    """Take ``rid`` out of a by-base-id index, dropping its group once empty (so the index
    never outgrows the ids it holds)."""
    base = base_request_id(rid)
    group = by_base[base]
    del group[rid]
    if not group:
        del by_base[base]


class _Req:
    """One producer request while it is live."""

    __slots__ = (
        "blocks",
        "computed",
        "deadline",
        "engine",
        "entry",
        "fail_reason",
        "finished",
        "last_round",
        "needed",
        "next_post",
        "notif",
        "pieces",
        "plan",
        "reg",
        "remote_w",
        "rid",
        "round_blocks",
        "senders",
        "sent",
        "state",
        "step",
        "stream_blocks",
        "stream_failed",
        "units",
        "write_deadline",
        "xfers",
    )

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.state = S.ABSENT
        self.entry = S.ABSENT
        self.step = -1
        self.blocks: BlockIds = ()
        self.deadline = 0.0
        self.senders: set[str] = set()
        self.needed = 0
        self.reg: PushRegistration | None = None
        self.engine: Engine | None = None
        self.plan: list[RemoteRank] = []
        self.next_post = 0
        self.xfers: dict[int, Transfer] = {}
        self.fail_reason = FreeReason.FAILED
        self.remote_w: BlockIds = ()
        self.notif = b""
        # Streaming: frontiers (a, b, k) say every stream unit is through token a, and
        # units [0, k) through b (the current chunk's end); one computed, one written.
        self.finished = True
        """The engine handed over the prompt's blocks (False while a stream runs ahead)."""
        self.computed: tuple[int, int, int] = (0, 0, 0)
        self.sent: tuple[int, int, int] = (0, 0, 0)
        self.units = 0
        self.stream_blocks: BlockIds = ()
        self.stream_failed: FreeReason | None = None
        """The stream failed before the prompt ended: free with this reason at the end."""
        self.pieces: tuple[Piece, ...] = ()
        self.round_blocks: BlockIds = ()
        self.last_round = False
        """The round in flight (or posted last) carries the completion."""
        self.write_deadline = float("inf")
        """Push: every WRITE must have ended by then (the consumer's watchdog)."""


class ProducerMachine(MachineCore):
    """Sans-IO state of one producer rank: ``handle(event, now) -> list[Action]``."""

    role = "producer"
    _requests = PRODUCER
    _moving = S.WRITING
    _draining = S.DRAINING
    _end_actions = (FreeBlocks,)
    _ended_word = "freed"

    def __init__(self, config: KVWireConfig) -> None:
        super().__init__(config)
        self._reqs: dict[str, _Req] = {}
        # Push matching indexes (all O(1)): finished prompts waiting for a registration,
        # and registrations waiting for their prompt, each by exact and by base id.
        self._waiting: dict[str, None] = {}
        self._waiting_by_base: dict[str, dict[str, None]] = {}
        self._pending: dict[str, tuple[PushRegistration, object, float]] = {}
        """Registrations waiting for their prompt, with the time each arrived."""
        self._pending_by_base: dict[str, dict[str, None]] = {}
        self._served: dict[str, object] = {}
        """Registration ids already matched: a duplicate is ignored (idempotent)."""
        self._held_count = 0
        self._streaming = config.stream_layers and config.mode is TransferMode.PUSH
        self._handlers.update(
            {
                RequestAdded: self._on_added,
                PrefillFinished: self._on_prefill_finished,
                ChunkScheduled: self._on_chunk,
                LayersComputed: self._on_layers,
                Preempted: self._on_preempted,
                Abort: self._on_abort,
                NotificationReceived: self._on_notification,
            }
        )

    # ----------------------------------------------------------------- introspection

    def request_state(self, request_id: str) -> ProducerState:
        req = self._reqs.get(request_id)
        return S.ABSENT if req is None else req.state

    def live_requests(self) -> int:
        return len(self._reqs)

    def held_blocks(self) -> int:
        """Blocks held right now, over every request (what a leak check compares to 0)."""
        return self._held_count

    def lease_deadline(self, request_id: str) -> float | None:
        req = self._reqs.get(request_id)
        return req.deadline if req is not None and req.state is S.LEASED else None

    def pending_registrations(self) -> int:
        return len(self._pending)

    # ----------------------------------------------------------------- request events

    def _on_added(self, event: RequestAdded, now: float, out: list[Action]) -> None:
        rid = event.request_id
        self._req_state(rid, RequestAdded)
        if event.remote is not None:
            raise LocalProtocolError("a producer request has no remote side yet (remote=None)")
        if self._check and rid in self._ended:
            raise LocalProtocolError(f"request {rid!r} was added twice")
        req = _Req(rid)
        self._move(req, PRODUCER, "added")
        self._reqs[rid] = req
        if self._streaming:
            req.finished = False
            taken = self._take_registration(rid)
            if taken is None:
                self._wait(req)
            else:
                self._start_push(req, *taken, now, out)

    def _on_prefill_finished(self, event: PrefillFinished, now: float, out: list[Action]) -> None:
        req = self._req_state(event.request_id, PrefillFinished)
        blocks = event.block_ids
        if not req.finished:
            if req.state is not S.PREFILLING or req.reg is not None or req.stream_failed:
                self._finish_stream(req, event, now, out)
                return
            req.finished = True  # no registration came while it computed: as without streams
        if req.state is not S.PREFILLING:
            raise LocalProtocolError(f"request {req.rid!r} finished its prefill twice")
        if not any(blocks):
            # Nothing worth keeping: the engine frees at once (vLLM's delay_free == False).
            req.blocks = blocks
            self._free(req, FreeReason.NOTHING_TO_SEND, out)
            return
        if self._check:
            # Only within a request: two requests may hold the same block, as an engine
            # with prefix caching shares a cached prefix (vLLM counts references).
            for group in blocks:
                if len(set(group)) != len(group):
                    raise LocalProtocolError(f"request {req.rid!r} lists a block twice")
        self._held_count += sum(len(g) for g in blocks)
        req.blocks = blocks
        if event.lease_deadline is not None:
            req.deadline = rebase_deadline(event.lease_deadline, event.scheduler_clock, now)
        else:
            req.deadline = now + self.config.lease_s
        if req.needed and len(req.senders) >= req.needed:
            self._free(req, FreeReason.SENT, out)  # every consumer read before the hold
            return
        self._move(req, PRODUCER, "leased")
        self._arm(req.deadline, T_LEASE, req)
        if self.config.mode is TransferMode.PUSH:
            taken = self._take_registration(req.rid)
            if taken is None:
                self._wait(req)
            else:
                self._start_push(req, *taken, now, out)

    def _on_abort(self, event: Abort, now: float, out: list[Action]) -> None:
        req = self._reqs.get(event.request_id)
        if req is None:
            self.stats.aborts_ignored += 1
            return
        successors(PRODUCER, req.state, Abort, f"request {req.rid!r}")
        state = req.state
        req.stream_failed = FreeReason.ABORTED
        if state is S.PREFILLING:
            self._move(req, PRODUCER, "forgotten")
            self._unwait(req)
            self._remember_served(req)
            del self._reqs[req.rid]  # nothing held yet: the engine frees its own blocks
        elif state is S.LEASED or state is S.WAIT_PEER:
            self._free(req, FreeReason.ABORTED, out)
        # QUARANTINED: the engine's request is over already; the grace still runs.
        elif state is S.WRITING:
            self._begin_failure(req, FreeReason.ABORTED, out)

    # ----------------------------------------------------------------- notifications

    def _on_notification(self, event: NotificationReceived, now: float, out: list[Action]) -> None:
        try:
            msg = decode_notification(event.data)
        except KVWireError as exc:
            if bytes(event.data[: len(PUSH_REG_PREFIX)]) == PUSH_REG_PREFIX:
                self.stats.registrations_malformed += 1
                out.append(PeerMisbehaved(f"malformed registration dropped: {exc}"))
            else:
                self.stats.notifications_malformed += 1
            return
        if isinstance(msg, Heartbeat):
            self._on_heartbeat(msg, now)
        elif isinstance(msg, Completion):
            self._on_completion(msg, event.sender, now, out)
        else:
            self._on_registration(msg, now, out)

    def _on_heartbeat(self, msg: Heartbeat, now: float) -> None:
        """``deadline = max(old, now + 2L/3)``: a heartbeat never shortens a lease. The heap
        entry is left alone; the reaper re-arms it at the new deadline when it comes due."""
        self.stats.heartbeats_received += 1
        extended = now + self.config.lease_extension_s
        reqs = self._reqs
        for rid in msg.request_ids:
            req = reqs.get(rid)
            if req is not None and req.state is S.LEASED and extended > req.deadline:
                req.deadline = extended
                self.stats.lease_extensions += 1

    def _on_completion(self, msg: Completion, sender: str, now: float, out: list[Action]) -> None:
        req = self._reqs.get(msg.request_id)
        if req is None:
            # Late (after the lease ran out, or a duplicate after freeing): never free twice.
            self.stats.completions_unknown += 1
            return
        state = req.state
        early = state is S.PREFILLING
        if self.config.mode is not TransferMode.PULL or (
            state is not S.LEASED and state is not S.QUARANTINED and not early
        ):
            self.stats.notifications_unexpected += 1
            return
        successors(PRODUCER, req.state, NotificationReceived, f"request {req.rid!r}")
        if sender in req.senders:
            self.stats.completions_duplicate += 1
            return
        req.senders.add(sender)
        # The consumer states how many of its ranks read from this one (vLLM's D does the
        # same, and vLLM's P trusts it), so the count is the sender's to set.
        if not req.needed:
            req.needed = msg.count
        if early:
            self.stats.completions_early += 1
            return  # _on_prefill_finished frees at once if every sender has reported
        if len(req.senders) >= req.needed:
            # After the lease ran out the reads are over, but the lease was still missed.
            self._free(req, FreeReason.SENT if state is S.LEASED else FreeReason.EXPIRED, out)

    def _on_registration(self, reg: PushRegistration, now: float, out: list[Action]) -> None:
        if self.config.mode is not TransferMode.PUSH:
            self.stats.notifications_unexpected += 1
            return
        rid = reg.request_id
        if not rid or reg.remote_engine_id != self.config.engine_id:
            self.stats.registrations_malformed += 1
            out.append(
                PeerMisbehaved(
                    f"registration {rid!r} is not for engine {self.config.engine_id!r}; dropped"
                )
            )
            return
        if rid in self._served or rid in self._pending:
            self.stats.registrations_duplicate += 1
            return
        req = self._match_waiting(rid)
        if req is None:
            token = object()
            self._pending[rid] = (reg, token, now)
            self._pending_by_base.setdefault(base_request_id(rid), {})[rid] = None
            self._arm(now + self.config.registration_timeout_s, T_REGISTRATION, rid, token)
            return
        successors(PRODUCER, req.state, NotificationReceived, f"request {req.rid!r}")
        self._start_push(req, reg, now, now, out)

    # ----------------------------------------------------------------- push matching

    def _wait(self, req: _Req) -> None:
        self._waiting[req.rid] = None
        self._waiting_by_base.setdefault(base_request_id(req.rid), {})[req.rid] = None

    def _unwait(self, req: _Req) -> None:
        if req.rid in self._waiting:
            del self._waiting[req.rid]
            _unindex(self._waiting_by_base, req.rid)

    def _match_waiting(self, reg_id: str) -> _Req | None:
        """A finished prompt for this registration: same id first, then same base id."""
        if reg_id in self._waiting:
            return self._reqs[reg_id]
        group = self._waiting_by_base.get(base_request_id(reg_id))
        if group:
            return self._reqs[next(iter(group))]
        return None

    def _take_registration(self, rid: str) -> tuple[PushRegistration, float] | None:
        """A pending registration for this prompt (same id, then same base id), removed,
        with when it arrived."""
        reg_id: str | None = rid if rid in self._pending else None
        if reg_id is None:
            group = self._pending_by_base.get(base_request_id(rid))
            if not group:
                return None
            reg_id = next(iter(group))
        reg, _, arrived = self._pending.pop(reg_id)
        _unindex(self._pending_by_base, reg_id)
        return reg, arrived

    def _start_push(
        self, req: _Req, reg: PushRegistration, arrived: float, now: float, out: list[Action]
    ) -> None:
        self._unwait(req)
        token = object()
        self._served[reg.request_id] = token
        req.reg = reg
        # The consumer gives up on its registration after registration_timeout_s (its
        # watchdog, armed when it sent it): no write of ours may still run then, or it
        # would land in blocks the consumer has handed to another request.
        req.write_deadline = (
            arrived + self.config.registration_timeout_s - self._completion_margin_s
        )
        problem = self._check_registration(req, reg)
        if problem is not None:
            self.stats.remote_errors += 1
            out.append(PeerMisbehaved(problem, reg.decode_engine_id, req.rid))
            if not req.finished:
                # Nothing held yet: the registration is dropped; the prompt, once finished,
                # waits for another one under its lease.
                req.reg = None
                return
            self._free(req, FreeReason.PROTOCOL, out)
            return
        if not any(reg.local_block_ids):
            # The consumer needs nothing (full prefix hit, or it gave up before allocating);
            # a prompt still computing is freed when it finishes.
            if req.finished:
                self._free(req, FreeReason.SENT, out)
            return
        engine = self._engine(
            reg.decode_engine_id, reg.decode_host, reg.decode_port, reg.decode_tp_size, 1
        )
        engine.refs += 1
        engine.last_active = now
        req.engine = engine
        if engine.state is EngineState.READY:
            self._start_writes(req, engine, out)
        else:
            self._move(req, PRODUCER, "wait_peer")
            engine.waiting[req.rid] = None
            self._ensure_handshake(engine, now, out)

    def _check_registration(self, req: _Req, reg: PushRegistration) -> str | None:
        ours = self.config.tp_size
        theirs = reg.decode_tp_size
        if max(ours, theirs) % min(ours, theirs):
            return f"registration {reg.request_id!r}: consumer TP {theirs} vs ours {ours}"
        if not reg.decode_engine_id:
            return f"registration {reg.request_id!r} has no consumer engine id"
        dgroups = reg.local_block_ids
        held = req.blocks if req.finished else req.stream_blocks
        if any(dgroups) and held and len(dgroups) != len(held):
            return (
                f"registration {reg.request_id!r} has {len(dgroups)} KV-cache groups, "
                f"we hold {len(req.blocks)}"
            )
        return None

    def _start_writes(self, req: _Req, engine: Engine, out: list[Action]) -> None:
        reg = req.reg
        assert reg is not None
        cfg = self.config
        try:
            targets = topology.consumer_ranks_of_producer(cfg.tp_rank, cfg.tp_size, engine.tp_size)
            req.notif = encode_completion(reg.request_id, cfg.tp_size)
        except KVWireError as exc:
            self.stats.remote_errors += 1
            out.append(PeerMisbehaved(str(exc), engine.engine_id, req.rid))
            self._free(req, FreeReason.PROTOCOL, out)
            return
        req.remote_w = tuple(tuple(g) for g in reg.local_block_ids)
        req.plan = [(0, d) for d in targets]
        req.next_post = len(req.plan)  # no round yet
        self._move(req, PRODUCER, "writing")
        self._next_round(req, out)

    def _next_round(self, req: _Req, out: list[Action]) -> None:
        """Post the next round to every consumer rank, if one is due and none is in flight:
        after the prompt ended, the last round (everything not yet written, and the
        completion); before, what was computed since the last round."""
        if req.xfers or req.next_post < len(req.plan) or req.last_round:
            return
        if self._last_now >= req.write_deadline:
            self.stats.transfers_timed_out += 1
            self._begin_failure(req, FreeReason.FAILED, out)
            return
        if req.finished:
            req.pieces = _remainder(req.sent, req.units) if req.sent != (0, 0, 0) else ()
            req.round_blocks = req.blocks
            req.last_round = True
        else:
            pieces = _pieces(req.sent, req.computed, req.units)
            if not pieces:
                return
            req.pieces = pieces
            req.round_blocks = req.stream_blocks
            req.sent = req.computed
            self.stats.stream_rounds += 1
        req.next_post = 0
        self._post_next(req, out)

    def _post_next(self, req: _Req, out: list[Action]) -> None:
        engine = req.engine
        assert engine is not None
        rank, xfer = self._next_transfer(req)
        out.append(
            PostWrite(
                xfer.xfer_id,
                req.rid,
                engine.engine_id,
                rank,
                engine.tp_size,
                req.round_blocks,
                req.remote_w,
                req.notif if req.last_round else b"",
                req.pieces,
            )
        )

    # ----------------------------------------------------------------- streaming

    def _on_chunk(self, event: ChunkScheduled, now: float, out: list[Action]) -> None:
        req = self._req_state(event.request_id, ChunkScheduled)
        if req.finished or req.stream_failed is not None or req.state is S.DRAINING:
            return
        b = req.computed[1]
        end = event.num_tokens
        if end < b:
            raise LocalProtocolError(
                f"request {req.rid!r}: a chunk through token {end} after one through {b} "
                "(report Preempted before computing a prompt again)"
            )
        if end > b:
            req.computed = (b, end, 0)  # the last chunk is computed in every layer
        req.stream_blocks = event.block_ids
        req.units = event.units
        if req.state is S.WRITING:
            self._next_round(req, out)

    def _on_layers(self, event: LayersComputed, now: float, out: list[Action]) -> None:
        reqs = self._reqs
        for rid in event.request_ids:
            req = reqs.get(rid)
            if req is None or req.finished or req.stream_failed is not None:
                continue  # not streaming (the engine reports its whole batch)
            successors(PRODUCER, req.state, LayersComputed, f"request {rid!r}")
            a, b, k = req.computed
            units = min(event.units, req.units)
            if units > k:
                req.computed = (a, b, units)
                if req.state is S.WRITING:
                    self._next_round(req, out)

    def _on_preempted(self, event: Preempted, now: float, out: list[Action]) -> None:
        req = self._reqs.get(event.request_id)
        if req is None:
            return
        successors(PRODUCER, req.state, Preempted, f"request {req.rid!r}")
        if req.finished:
            return  # not streaming: nothing was written from the blocks taken back
        # The blocks written from are the engine's again: start over from the new ones. A
        # round in flight lands before the next is posted, so none of its bytes outlive it.
        req.computed = req.sent = (0, 0, 0)
        req.stream_blocks = ()
        self.stats.stream_restarts += 1

    def _finish_stream(
        self, req: _Req, event: PrefillFinished, now: float, out: list[Action]
    ) -> None:
        """The prompt of a request that was matched (or failed) while computing ended."""
        blocks = event.block_ids
        req.finished = True
        self._held_count += sum(len(g) for g in blocks)
        req.blocks = blocks
        req.deadline = now + self.config.lease_s
        if req.state is S.DRAINING:
            return  # freed once its writes are released
        if req.stream_failed is not None:
            self._free(req, req.stream_failed, out)
            return
        if req.state is S.PREFILLING:
            # Matched, while computing, with a registration that needs nothing.
            self._free(req, FreeReason.SENT, out)
            return
        reg = req.reg
        assert reg is not None
        if not any(blocks) or len(reg.local_block_ids) != len(blocks):
            self.stats.remote_errors += 1
            out.append(
                PeerMisbehaved(
                    f"registration {reg.request_id!r} has {len(reg.local_block_ids)} "
                    f"KV-cache groups, the prompt {len(blocks)}",
                    reg.decode_engine_id,
                    req.rid,
                )
            )
            self._begin_failure(req, FreeReason.PROTOCOL, out)
            return
        if req.state is S.WRITING:
            self._next_round(req, out)

    def _stream_ended(
        self, req: _Req, reason: FreeReason, out: list[Action], trigger: Trigger | None = None
    ) -> None:
        """End a failed request: free its blocks, or, if its prompt is still computing, wait
        for them holding nothing (the engine's blocks are its own until PrefillFinished)."""
        if req.finished or reason is FreeReason.ABORTED or req.stream_failed is not None:
            self._free(req, req.stream_failed or reason, out, trigger)
            return
        req.stream_failed = reason
        self._release_engine(req)
        self._move(req, PRODUCER, "prefilling", trigger)

    # ----------------------------------------------------------------- engines

    def _engine_ready(
        self, engine: Engine, event: HandshakeDone, now: float, out: list[Action]
    ) -> None:
        waiting = list(engine.waiting)
        engine.waiting.clear()
        for rid in waiting:
            req = self._reqs[rid]
            successors(PRODUCER, req.state, HandshakeDone, f"request {rid!r}")
            self._start_writes(req, engine, out)

    def _engine_failed(
        self, engine: Engine, waiting: list[str], now: float, out: list[Action], why: str
    ) -> None:
        for rid in waiting:
            req = self._reqs[rid]
            successors(PRODUCER, req.state, HandshakeFailed, f"request {rid!r}")
            if req.finished:
                self._free(req, FreeReason.FAILED, out, HandshakeFailed)
            else:
                self._stream_ended(req, FreeReason.FAILED, out, HandshakeFailed)

    # ----------------------------------------------------------------- transfers

    def _transfer_failed(self, req: _Req, reason: str, out: list[Action]) -> None:
        self._begin_failure(req, FreeReason.FAILED, out)

    def _drained(self, req: _Req, out: list[Action]) -> None:
        self._stream_ended(req, req.fail_reason, out)

    def _transfers_done(self, req: _Req, out: list[Action]) -> None:
        if req.last_round:
            self._free(req, FreeReason.SENT, out)
        else:
            self._next_round(req, out)

    def _transfer_deadline(self, req: _Req, now: float) -> float:
        return min(now + self._transfer_timeout_s, req.write_deadline)

    def _transfer_timed_out(self, req: _Req, out: list[Action]) -> None:
        self._begin_failure(req, FreeReason.FAILED, out)

    def _begin_failure(self, req: _Req, reason: FreeReason, out: list[Action]) -> None:
        req.fail_reason = reason
        if not req.xfers:
            self._stream_ended(req, reason, out)
            return
        self._drain(req, out)

    # ----------------------------------------------------------------- timers

    def _fire_request(
        self, kind: int, subject: Any, token: Any, now: float, out: list[Action]
    ) -> None:
        if kind == T_LEASE:
            req: _Req = subject
            if self._reqs.get(req.rid) is not req:
                return
            state = req.state
            if state is not S.LEASED and state is not S.QUARANTINED:
                return
            if req.deadline > now:
                self._arm(req.deadline, T_LEASE, req)  # extended by a heartbeat
                return
            successors(PRODUCER, state, Timer, f"request {req.rid!r}")
            grace = self.config.lease_grace
            if state is S.LEASED:
                self.stats.leases_expired += 1
                if grace > 0 and self.config.mode is TransferMode.PULL:
                    # A READ stalled on a cut link may still resume: keep the blocks
                    # unchanged a while longer rather than hand them to another prompt.
                    self.stats.leases_quarantined += 1
                    self._move(req, PRODUCER, "quarantined")
                    req.deadline = now + grace
                    self._arm(req.deadline, T_LEASE, req)
                    return
            self._free(req, FreeReason.EXPIRED, out)
        elif kind == T_REGISTRATION:
            rid: str = subject
            pending = self._pending.get(rid)
            if pending is not None and pending[1] is token:
                self.stats.registrations_expired += 1
                del self._pending[rid]
                _unindex(self._pending_by_base, rid)
            elif self._served.get(rid) is token:
                del self._served[rid]

    # ----------------------------------------------------------------- endings

    def _free(
        self, req: _Req, reason: FreeReason, out: list[Action], trigger: Trigger | None = None
    ) -> None:
        """Give the blocks back. ``trigger``: what the table knows the cause as, when it is
        not the event being handled (a handshake that timed out is a ``HandshakeFailed``)."""
        rid = req.rid
        if self._check:
            if req.xfers:
                raise InvariantViolation(f"request {rid!r} freed with transfers still running")
            if rid in self._ended:
                raise InvariantViolation(f"request {rid!r} freed twice")
            self._ended.add(rid)
            self._ended_now.add(rid)
        self._held_count -= sum(len(g) for g in req.blocks)
        self._unwait(req)
        del self._reqs[rid]
        self._release_engine(req)
        self._remember_served(req)
        self._move(req, PRODUCER, "freed", trigger)
        out.append(FreeBlocks(rid, req.blocks, reason))

    def _remember_served(self, req: _Req) -> None:
        """Keep the matched registration's id a while longer, so late duplicates stay
        idempotent, then forget it."""
        if req.reg is None:
            return
        reg_id = req.reg.request_id
        token = self._served.get(reg_id)
        if token is not None:
            self._arm(
                self._last_now + self.config.registration_timeout_s, T_REGISTRATION, reg_id, token
            )

    def _release_engine(self, req: _Req) -> None:
        engine = req.engine
        if engine is not None:
            req.engine = None
            engine.waiting.pop(req.rid, None)
            engine.refs -= 1
            engine.last_active = self._last_now
            self._maybe_forget(engine)

    def _req_state(self, rid: str, etype: type[Any]) -> _Req:
        req = self._reqs.get(rid)
        state = S.ABSENT if req is None else req.state
        successors(PRODUCER, state, etype, f"request {rid!r}")
        return req  # type: ignore[return-value]
