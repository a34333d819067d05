"""Hypothesis drives both machines through random legal event sequences against a model.

The model is deliberately simple: which requests exist, which transfers the machine asked
for and in what state the driver believes they are. It checks the guarantees the runtime
relies on: one terminal outcome per request, never an action for an ended request, never a
READ after a request's first failure, never an ending while a transfer into its blocks may
run, every held block freed exactly once, and nothing left once the world goes quiet.

Partitions are in the event sequences too: time may jump past a producer's lease while
READs hang, and their completions may then arrive late. A request is never done if one of
its READs completed after its read deadline (the producer's stated expiry in our clock,
less the clock's uncertainty, or the arrival plus the lease), and a producer keeps an
expired lease's blocks quarantined for the grace before freeing them.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from machine_helpers import machine_config

from kvwire.config import KVWireConfig
from kvwire.machine import (
    Abort,
    Action,
    AllocationDone,
    CancelTransfer,
    ConsumerMachine,
    EngineState,
    FreeBlocks,
    FreeReason,
    HandshakeDone,
    HandshakeFailed,
    LeaseConfirmed,
    NotificationReceived,
    PeerLost,
    PostRead,
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
from kvwire.wire.notifications import decode_notification, encode_heartbeat
from kvwire.wire.schemas import LEASE_QUERY, PushRegistration

SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

IDS = [f"r{i}" for i in range(6)]
OFFSET = 100.0
"""The producer's clock minus the consumer's, as the handshake measures it."""
UNCERTAINTY = 0.5
MARGIN = 1.0
"""``completion_margin_s``: a completion this close to the read deadline does not count."""


class _ConsumerSide(RuleBasedStateMachine):
    """What both consumer models share: their clock and the handshake with producer engine
    ``P`` (TP 2), of which at most one may be in flight; the machine times it out after 5 s."""

    features: frozenset[str] = frozenset()
    """What producer ``P`` announces in its handshake."""

    def __init__(self, config: KVWireConfig) -> None:
        super().__init__()
        self.m = ConsumerMachine(config)
        self.now = 0.0
        self.attempt: int | None = None
        self.attempt_deadline = 0.0

    def _handshake_started(self, action: StartHandshake) -> None:
        assert self.attempt is None, "two handshakes in flight for one engine"
        self.attempt = action.attempt
        self.attempt_deadline = self.now + 5.0

    def feed(self, event: Any, dt: float = 0.01) -> list[Action]:
        raise NotImplementedError

    @precondition(lambda self: self.attempt is not None)
    @rule(ok=st.booleans())
    def handshake(self, ok: bool) -> None:
        attempt = self.attempt
        assert attempt is not None
        self.attempt = None
        self.feed(
            HandshakeDone(
                "P",
                attempt,
                2,
                clock_offset=OFFSET,
                clock_uncertainty=UNCERTAINTY,
                peer_features=self.features,
            )
            if ok
            else HandshakeFailed("P", attempt)
        )

    @rule(dt=st.sampled_from([0.5, 2.0, 6.0, 31.0]))
    def tick(self, dt: float) -> None:
        attempt = self.attempt
        self.feed(Timer(), dt)
        if attempt is not None and attempt == self.attempt and self.now >= self.attempt_deadline:
            self.attempt = None  # the machine timed the handshake out

    @rule()
    def peer_lost(self) -> None:
        self.feed(PeerLost("P"))


class ConsumerModel(_ConsumerSide):
    """A pull consumer (TP 1) reading a producer engine with TP 2: two READs per request.

    The producer announces ``lease-query``, and its answers (later, earlier or no lease)
    arrive at any moment: the model moves its read deadline exactly when evidence may, so
    "never done after the deadline" covers extended deadlines too."""

    features = frozenset({LEASE_QUERY})

    def __init__(self) -> None:
        super().__init__(machine_config(engine_id="D", tp_size=1, lease_s=30.0))
        self.live: set[str] = set()
        self.allocated: set[str] = set()
        self.ended: dict[str, Action] = {}
        self.failed: set[str] = set()
        self.reads: dict[str, int] = {}
        self.done_reads: dict[str, int] = {}
        self.xfers: dict[int, tuple[str, str]] = {}  # xfer -> (request, driver state)
        self.cancelled: set[int] = set()
        self.read_deadline: dict[str, float] = {}
        self.late: set[str] = set()
        """Requests with a READ whose success was reported after the read deadline."""

    # -------------------------------------------------------------- feeding

    def feed(self, event: Any, dt: float = 0.01) -> list[Action]:
        self.now += dt
        actions = self.m.handle(event, self.now)
        for a in actions:
            rid = getattr(a, "request_id", None)
            if rid is not None:
                assert rid not in self.ended, f"{type(a).__name__} after {rid} ended"
            if isinstance(a, StartHandshake):
                self._handshake_started(a)
            elif isinstance(a, QueryLeases):
                assert set(a.request_ids) <= self.live, "asked about a request that ended"
                assert a.remote_request_ids == tuple(f"p-{r}" for r in a.request_ids)
            elif isinstance(a, PostRead):
                assert a.request_id not in self.failed, "READ posted after a failure"
                assert a.notification == f"p-{a.request_id}:1".encode()
                self.reads[a.request_id] = self.reads.get(a.request_id, 0) + 1
                assert self.reads[a.request_id] <= 2
                self.xfers[a.xfer_id] = (a.request_id, "requested")
            elif isinstance(a, CancelTransfer):
                assert self.xfers[a.xfer_id][1] in ("requested", "posted")
                self.xfers[a.xfer_id] = (a.request_id, "cancelling")
                self.cancelled.add(a.xfer_id)
            elif isinstance(a, ReleaseTransfer):
                assert self.xfers[a.xfer_id][1] == "release_failed"
                self.xfers[a.xfer_id] = (a.request_id, "releasing")
            elif isinstance(a, (RequestDone, RequestFailed)):
                rid = a.request_id
                assert rid in self.live
                assert not [x for x, (r, _) in self.xfers.items() if r == rid], (
                    f"{rid} ended with a transfer still running"
                )
                if isinstance(a, RequestDone):
                    assert rid not in self.failed
                    assert rid not in self.late, f"{rid} done with a READ that outlived the lease"
                    assert self.done_reads.get(rid, 0) in (0, 2)
                    assert self.done_reads.get(rid, 0) == 2 or self.reads.get(rid, 0) == 0
                self.ended[rid] = a
                self.live.discard(rid)
        return actions

    def _count_done(self, xid: int, rid: str) -> None:
        # The TransferDone is fed 0.01 s from now.
        if self.now + 0.01 > self.read_deadline[rid] - MARGIN:
            self.late.add(rid)
        if xid not in self.cancelled and rid not in self.failed:
            self.done_reads[rid] = self.done_reads.get(rid, 0) + 1

    # -------------------------------------------------------------- rules

    @rule(rid=st.sampled_from(IDS), lease_left=st.sampled_from([None, 8.0, 20.0, 45.0]))
    def add(self, rid: str, lease_left: float | None) -> None:
        """``lease_left``: what the producer says is left of its lease (None: vLLM's
        producer says nothing, and the consumer does not bound the read by a guess)."""
        if rid in self.live or rid in self.ended:
            return
        self.live.add(rid)
        arrival = self.now + 0.01
        if lease_left is None:
            expiry = None
            self.read_deadline[rid] = math.inf
        else:
            expiry = arrival + OFFSET + lease_left
            self.read_deadline[rid] = arrival + lease_left - UNCERTAINTY
        remote = RemotePrefill(
            engine_id="P",
            request_id=f"p-{rid}",
            host="h",
            port=1,
            block_ids=((1, 2, 3, 4),),
            tp_size=2,
            blocks_expiry_time=expiry,
        )
        self.feed(RequestAdded(rid, remote))

    @rule(rid=st.sampled_from(IDS), n=st.integers(0, 4))
    def allocate(self, rid: str, n: int) -> None:
        if rid not in self.live or rid in self.allocated or rid in self.failed:
            return
        self.allocated.add(rid)
        self.feed(AllocationDone(rid, (tuple(range(100, 100 + n)),)))

    @precondition(lambda self: self.xfers)
    @rule(data=st.data())
    def transfer(self, data: st.DataObject) -> None:
        xid = data.draw(st.sampled_from(sorted(self.xfers)))
        rid, state = self.xfers[xid]
        if state == "requested":
            if data.draw(st.booleans()):
                self.xfers[xid] = (rid, "posted")
                acts = self.feed(TransferPosted(xid))
                if any(isinstance(a, CancelTransfer) and a.xfer_id == xid for a in acts):
                    self.xfers[xid] = (rid, "cancelling")
            else:
                del self.xfers[xid]
                self.failed.add(rid)
                self.feed(TransferFailed(xid, "post"))
            return
        if state == "release_failed":
            return
        outcome = data.draw(st.sampled_from(["done", "failed", "release_failed"]))
        if outcome == "release_failed":
            self.xfers[xid] = (rid, "release_failed")
            self.feed(ReleaseFailed(xid))
            return
        del self.xfers[xid]
        if outcome == "done":
            self._count_done(xid, rid)
            self.feed(TransferDone(xid))
        else:
            self.failed.add(rid)
            self.feed(TransferFailed(xid, "io"))

    @rule(rid=st.sampled_from(IDS))
    def abort(self, rid: str) -> None:
        if rid in self.live:
            self.failed.add(rid)
        self.feed(Abort(rid))

    @precondition(lambda self: self.live or self.ended)
    @rule(data=st.data(), left=st.sampled_from([None, -3.0, 2.0, 15.0, 40.0]))
    def lease_answer(self, data: st.DataObject, left: float | None) -> None:
        """The producer says its lease for a live (or ended) request runs ``left`` s more
        (None: not held)."""
        rid = data.draw(st.sampled_from(sorted(self.live | set(self.ended))))
        at = self.now + 0.01
        deadline = None if left is None else at + OFFSET + left
        current = self.read_deadline.get(rid, math.inf)
        if (
            deadline is not None
            and rid in self.live
            and rid not in self.failed
            and self.m.engine_state("P") is EngineState.READY
            and at < current - MARGIN
        ):
            self.read_deadline[rid] = max(current, deadline - OFFSET - UNCERTAINTY)
        self.feed(LeaseConfirmed(rid, deadline))

    # -------------------------------------------------------------- checks

    @invariant()
    def states_agree(self) -> None:
        assert self.m.live_requests() == len(self.live)
        for rid in self.ended:
            assert self.m.request_state(rid).value == "absent"

    def teardown(self) -> None:
        # Let the world go quiet: answer everything, release everything, let time pass.
        for _ in range(20):
            if self.attempt is not None:
                attempt, self.attempt = self.attempt, None
                self.feed(
                    HandshakeDone(
                        "P",
                        attempt,
                        2,
                        clock_offset=OFFSET,
                        clock_uncertainty=UNCERTAINTY,
                        peer_features=self.features,
                    )
                )
            for xid, (rid, state) in sorted(self.xfers.items()):
                if state == "requested":
                    self.xfers[xid] = (rid, "posted")
                    acts = self.feed(TransferPosted(xid))
                    if any(isinstance(a, CancelTransfer) for a in acts):
                        self.xfers[xid] = (rid, "cancelling")
                elif state != "release_failed":
                    del self.xfers[xid]
                    self._count_done(xid, rid)
                    self.feed(TransferDone(xid))
            for rid in sorted(self.live - self.allocated):
                self.allocated.add(rid)
                self.feed(AllocationDone(rid, ((7,),)))
            self.tick(5.0)
        assert not self.live, f"stuck: {sorted(self.live)}"
        assert self.m.transfers_in_flight() == 0


GRACE = 15.0
"""The producer's quarantine of expired blocks (``lease_grace_s``, L/2)."""


class ProducerModel(RuleBasedStateMachine):
    """A pull producer (TP 1) whose consumers have TP 2: two completions free a request."""

    def __init__(self) -> None:
        super().__init__()
        self.m = ProducerMachine(machine_config(engine_id="P", tp_size=1, lease_s=30.0))
        self.now = 0.0
        self.added: set[str] = set()
        self.holding: dict[str, tuple[int, ...]] = {}
        self.deadline: dict[str, float] = {}
        self.freed: dict[str, FreeReason] = {}
        self.senders: dict[str, set[str]] = {}
        self.aborted: set[str] = set()
        self.quarantined: dict[str, float] = {}
        """Leases that ran out without both completions -> when the grace ends."""
        self.next_block = 0

    def feed(self, event: Any, dt: float = 0.01) -> list[Action]:
        self.now += dt
        if isinstance(event, Timer):
            for rid in self.holding:
                if rid not in self.quarantined and self.deadline[rid] <= self.now:
                    self.quarantined[rid] = self.now + GRACE
        actions = self.m.handle(event, self.now)
        for a in actions:
            rid = getattr(a, "request_id", None)
            assert rid is None or rid not in self.freed, f"{type(a).__name__} after free"
            if isinstance(a, FreeBlocks):
                assert a.block_ids == (self.holding[rid],)
                if a.reason is FreeReason.EXPIRED:
                    assert self.now >= self.deadline[rid], "reaped before its deadline"
                    assert rid in self.quarantined, "expired blocks freed without the grace"
                    both = len(self.senders.get(rid, set())) >= 2
                    assert both or self.now >= self.quarantined[rid], "grace cut short"
                elif a.reason is FreeReason.SENT:
                    assert len(self.senders.get(rid, set())) >= 2
                else:
                    assert a.reason is FreeReason.ABORTED and rid in self.aborted
                self.freed[rid] = a.reason
                del self.holding[rid]
        return actions

    @rule(rid=st.sampled_from(IDS))
    def add(self, rid: str) -> None:
        if rid in self.added:
            return
        self.added.add(rid)
        self.feed(RequestAdded(rid))

    @rule(rid=st.sampled_from(IDS), n=st.integers(1, 3))
    def finish_prefill(self, rid: str, n: int) -> None:
        if rid not in self.added or rid in self.holding or rid in self.freed:
            return
        if rid in self.aborted:
            return
        blocks = tuple(range(self.next_block, self.next_block + n))
        self.next_block += n
        self.holding[rid] = blocks
        self.feed(PrefillFinished(rid, (blocks,)))
        self.deadline[rid] = self.now + 30.0

    @rule(rid=st.sampled_from(IDS), sender=st.sampled_from(["d0", "d1"]))
    def completion(self, rid: str, sender: str) -> None:
        prefilling = rid in self.added and rid not in self.freed and rid not in self.aborted
        if rid in self.holding or prefilling:  # early completions count (vLLM's P does)
            self.senders.setdefault(rid, set()).add(sender)
        self.feed(NotificationReceived(sender, f"{rid}:2".encode()))

    @rule(ids=st.lists(st.sampled_from(IDS), min_size=1, max_size=3))
    def heartbeat(self, ids: list[str]) -> None:
        self.now += 0.01
        for rid in ids:
            if rid in self.holding and rid not in self.quarantined:
                self.deadline[rid] = max(self.deadline[rid], self.now + 20.0)
        self.feed(NotificationReceived("d0", encode_heartbeat(ids)), 0.0)

    @rule(rid=st.sampled_from(IDS))
    def abort(self, rid: str) -> None:
        if rid in self.added and rid not in self.freed:
            self.aborted.add(rid)
        self.feed(Abort(rid))

    @rule(dt=st.sampled_from([1.0, 7.0, 19.0, 31.0]))
    def tick(self, dt: float) -> None:
        self.feed(Timer(), dt)

    @invariant()
    def held_matches(self) -> None:
        assert self.m.held_blocks() == sum(len(b) for b in self.holding.values())
        for rid, deadline in self.deadline.items():
            if rid in self.holding:
                expected = None if rid in self.quarantined else deadline
                assert self.m.lease_deadline(rid) == expected  # extended, never shortened

    def teardown(self) -> None:
        self.feed(Timer(), 1000.0)  # every lease runs out: quarantined
        self.feed(Timer(), GRACE)  # and the grace with it
        assert not self.holding, f"leaked: {sorted(self.holding)}"
        assert self.m.held_blocks() == 0


def _registers(action: SendNotification) -> bool:
    """A registration with blocks (an empty one tells the producer to free, nothing more)."""
    msg = decode_notification(action.data)
    return isinstance(msg, PushRegistration) and any(msg.local_block_ids)


class PushConsumerModel(_ConsumerSide):
    """A push consumer (TP 1) written to by a producer with TP 2: two distinct writers
    complete a request. Write notifications arrive at any time, before the request exists
    or while it allocates or handshakes; the model parks them exactly as the protocol says
    (until the request awaits writes, at most ``REG_S`` after the first, per request id)."""

    REG_S = 10.0

    def __init__(self) -> None:
        super().__init__(
            machine_config(engine_id="D", mode=TransferMode.PUSH, registration_timeout_s=self.REG_S)
        )
        self.state: dict[str, str] = {}  # live request -> wait_alloc | wait_peer | await
        self.ended: set[str] = set()
        self.counted: dict[str, set[str]] = {}
        self.parked: dict[str, tuple[float, set[str]]] = {}  # rid -> (first parked, senders)
        self.await_since: dict[str, float] = {}
        self.empty: set[str] = set()
        self.losing = False

    def feed(self, event: Any, dt: float = 0.01) -> list[Action]:
        self.now += dt
        if isinstance(event, Timer):
            for rid, (since, _) in list(self.parked.items()):
                if self.now >= since + self.REG_S:
                    del self.parked[rid]
        actions = self.m.handle(event, self.now)
        for a in actions:
            rid = getattr(a, "request_id", None)
            if rid is not None:
                assert rid not in self.ended, f"{type(a).__name__} after {rid} ended"
            if isinstance(a, StartHandshake):
                self._handshake_started(a)
            elif isinstance(a, SendNotification) and rid is not None and _registers(a):
                # The registration: the request now awaits writes and takes what was parked.
                assert self.state[rid] in ("wait_alloc", "wait_peer")
                self.state[rid] = "await"
                self.await_since[rid] = self.now
                _, senders = self.parked.pop(rid, (0.0, set()))
                self.counted[rid] = set(senders)
            elif isinstance(a, RequestDone):
                assert rid in self.state
                assert rid in self.empty or len(self.counted.get(rid, ())) >= 2, (
                    f"{rid} done with writers {self.counted.get(rid)}"
                )
                self._ended(rid)
            elif isinstance(a, RequestFailed):
                assert rid in self.state
                if self.state[rid] == "await":
                    assert len(self.counted.get(rid, ())) < 2, f"{rid} failed after both writes"
                    timed_out = self.now >= self.await_since[rid] + self.REG_S
                    lost = self.losing and a.reason.value == "transfer"
                    assert timed_out or lost or a.reason.value == "aborted", a
                self._ended(rid)
        for rid, st_ in self.state.items():
            if st_ == "await":
                assert len(self.counted.get(rid, ())) < 2, f"{rid} has both writes but is live"
        return actions

    def _ended(self, rid: str) -> None:
        self.ended.add(rid)
        del self.state[rid]
        self.parked.pop(rid, None)

    @rule(rid=st.sampled_from(IDS))
    def add(self, rid: str) -> None:
        if rid in self.state or rid in self.ended:
            return
        self.state[rid] = "wait_alloc"
        remote = RemotePrefill(
            engine_id="P", request_id=f"p-{rid}", host="h", port=1, block_ids=(), tp_size=2
        )
        self.feed(RequestAdded(rid, remote))

    @rule(rid=st.sampled_from(IDS), n=st.integers(0, 3))
    def allocate(self, rid: str, n: int) -> None:
        if self.state.get(rid) != "wait_alloc":
            return
        if n == 0:
            self.empty.add(rid)
        else:
            self.state[rid] = "wait_peer"  # the registration (if READY) moves it on
        self.feed(AllocationDone(rid, (tuple(range(100, 100 + n)),)))

    @rule(rid=st.sampled_from(IDS), sender=st.sampled_from(["p0", "p1"]))
    def write_notification(self, rid: str, sender: str) -> None:
        if self.state.get(rid) == "await":
            self.counted[rid].add(sender)
        else:
            since, senders = self.parked.get(rid, (self.now + 0.01, set()))
            senders.add(sender)
            self.parked[rid] = (since, senders)
        self.feed(NotificationReceived(sender, f"{rid}:2".encode()))

    @rule(rid=st.sampled_from(IDS))
    def abort(self, rid: str) -> None:
        self.feed(Abort(rid))

    @rule()
    def peer_lost(self) -> None:
        """The producer is gone: every request awaiting its writes fails now."""
        awaiting = {rid for rid, st_ in self.state.items() if st_ == "await"}
        self.losing = True
        self.feed(PeerLost("P"))
        self.losing = False
        assert not awaiting & set(self.state), "a request awaiting writes outlived its producer"

    @invariant()
    def agrees(self) -> None:
        assert self.m.live_requests() == len(self.state)
        assert self.m.parked_completions() == sum(len(s) for _, s in self.parked.values())

    def teardown(self) -> None:
        for _ in range(4):
            for rid in sorted(r for r, st_ in self.state.items() if st_ == "wait_alloc"):
                self.allocate(rid, 1)
            if self.attempt is not None:
                attempt, self.attempt = self.attempt, None
                self.feed(HandshakeDone("P", attempt, 2))
            self.tick(6.0)
        self.feed(Timer(), 100.0)
        assert not self.state, f"stuck: {sorted(self.state)}"
        assert self.m.parked_completions() == 0, "parked notifications leaked"


TestConsumerModel = ConsumerModel.TestCase
TestConsumerModel.settings = SETTINGS
TestProducerModel = ProducerModel.TestCase
TestProducerModel.settings = SETTINGS
TestPushConsumerModel = PushConsumerModel.TestCase
TestPushConsumerModel.settings = SETTINGS
