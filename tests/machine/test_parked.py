"""Push: write notifications that reach a consumer rank before its request awaits writes.

With consumer TP > 1 a producer writes to every consumer rank as soon as the *first* rank's
registration reaches it, so the other ranks can see the notification before their engine
handed them the request (or while they still allocate or handshake). Dropping it made the
request wait for its watchdog; the machine parks it instead, bounded in number and age.
"""

from __future__ import annotations

from machine_helpers import PULL, PUSH, consumer, of, one, remote

from kvwire.machine import (
    Abort,
    AllocationDone,
    ArmTimer,
    ConsumerMachine,
    FailReason,
    HandshakeDone,
    HandshakeFailed,
    NotificationReceived,
    RequestAdded,
    RequestDone,
    RequestFailed,
    SendNotification,
    StartHandshake,
    Timer,
)
from kvwire.machine.table import ParkedState


def _d_rank(**kw: object) -> ConsumerMachine:
    """Consumer rank 1 of TP 2, pushed to by a producer of TP 1 (one writer per rank)."""
    return consumer(mode=PUSH, tp_size=2, tp_rank=1, registration_timeout_s=10.0, **kw)


def _add(c: ConsumerMachine, now: float, rid: str = "d1", p_tp: int = 1) -> int:
    acts = c.handle(RequestAdded(rid, remote(rid=f"p-{rid}", blocks=(), tp=p_tp)), now)
    return int(one(acts, StartHandshake).attempt)


def test_a_write_notification_before_the_request_completes_it_on_registration() -> None:
    c = _d_rank()
    # The producer served rank 0's registration and wrote to both ranks; ours is first here.
    acts = c.handle(NotificationReceived("p0", b"d1:1"), 0.0)
    assert one(acts, ArmTimer).deadline == 10.0 and len(acts) == 1
    assert c.parked_completions() == 1 and c.parked_state("d1") is ParkedState.PARKED
    attempt = _add(c, 0.1)
    c.handle(AllocationDone("d1", ((4, 5),)), 0.2)
    acts = c.handle(HandshakeDone("P", attempt, 1), 0.3)
    (reg,) = of(acts, SendNotification)
    assert reg.data.startswith(b"PUSH_REG:")  # the registration still goes out (idempotent)
    assert one(acts, RequestDone).request_id == "d1"
    assert c.parked_completions() == 0 and c.live_requests() == 0
    assert c.stats.completions_parked == 1 and c.stats.completions_parked_applied == 1
    assert c.next_deadline() is None or c.handle(Timer(), 100.0) == []  # no stale watchdog


def test_notifications_while_allocating_or_handshaking_are_kept() -> None:
    c = consumer(mode=PUSH, registration_timeout_s=10.0)  # TP 1 fed by a producer of TP 2
    attempt = _add(c, 0.0, p_tp=2)
    c.handle(NotificationReceived("p0", b"d1:2"), 0.1)  # wait_alloc
    c.handle(AllocationDone("d1", ((4,),)), 0.2)
    c.handle(NotificationReceived("p1", b"d1:2"), 0.3)  # wait_peer
    assert c.parked_completions() == 2
    acts = c.handle(HandshakeDone("P", attempt, 2), 0.4)
    assert one(acts, RequestDone).request_id == "d1"  # wait_peer -> done in one step


def test_duplicates_count_once_per_distinct_sender_parked_or_not() -> None:
    c = consumer(mode=PUSH, registration_timeout_s=10.0)
    c.handle(NotificationReceived("p0", b"d1:2"), 0.0)
    c.handle(NotificationReceived("p0", b"d1:2"), 0.0)
    assert c.parked_completions() == 1 and c.stats.completions_duplicate == 1
    attempt = _add(c, 0.1, p_tp=2)
    c.handle(AllocationDone("d1", ((4,),)), 0.2)
    acts = c.handle(HandshakeDone("P", attempt, 2), 0.3)
    assert not of(acts, RequestDone)  # one distinct sender of the two needed
    assert c.handle(NotificationReceived("p0", b"d1:2"), 0.4) == []
    assert c.stats.completions_duplicate == 2
    assert one(c.handle(NotificationReceived("p1", b"d1:2"), 0.5), RequestDone)


def test_parked_notifications_expire_after_the_registration_timeout_and_are_counted() -> None:
    c = _d_rank()
    c.handle(NotificationReceived("p0", b"gone:1"), 1.0)
    c.handle(NotificationReceived("p0", b"d1:1"), 2.0)
    assert c.next_deadline() == 11.0  # armed from the time passed in, nothing read
    c.handle(Timer(), 10.999)
    assert c.parked_completions() == 2
    c.handle(Timer(), 11.0)
    assert c.parked_completions() == 1 and c.stats.completions_parked_expired == 1
    c.handle(Timer(), 12.0)
    assert c.parked_completions() == 0 and c.stats.completions_parked_expired == 2
    # Too late: the request now waits for its own watchdog, exactly as without parking.
    attempt = _add(c, 13.0)
    c.handle(AllocationDone("d1", ((4,),)), 13.0)
    assert not of(c.handle(HandshakeDone("P", attempt, 1), 13.0), RequestDone)
    failed = one(c.handle(Timer(), 23.0), RequestFailed)
    assert failed.reason is FailReason.TIMEOUT


def test_the_buffer_is_bounded_and_refusals_are_counted() -> None:
    c = _d_rank(max_parked_completions=2)
    for i in range(3):
        c.handle(NotificationReceived("p0", f"r{i}:1".encode()), 0.0)
    assert c.parked_completions() == 2
    assert c.stats.completions_parked == 2 and c.stats.completions_parked_dropped == 1
    assert c.parked_state("r2") is ParkedState.ABSENT


def test_a_request_that_ends_before_awaiting_writes_discards_its_parked_notifications() -> None:
    c = _d_rank()
    attempt = _add(c, 0.0)
    c.handle(NotificationReceived("p0", b"d1:1"), 0.1)
    one(c.handle(Abort("d1"), 0.2), RequestFailed)
    assert c.parked_completions() == 0 and c.stats.completions_parked_dropped == 1

    c.handle(RequestAdded("d2", remote(rid="p-d2", blocks=())), 1.0)  # same handshake
    c.handle(AllocationDone("d2", ((4,),)), 1.0)
    c.handle(NotificationReceived("p0", b"d2:1"), 1.1)
    one(c.handle(HandshakeFailed("P", attempt, "refused"), 1.2), RequestFailed)
    assert c.parked_completions() == 0 and c.stats.completions_parked_dropped == 2


def test_a_parked_notification_with_the_wrong_world_size_fails_the_request_on_apply() -> None:
    c = _d_rank()
    c.handle(NotificationReceived("p0", b"d1:3"), 0.0)
    attempt = _add(c, 0.1)
    c.handle(AllocationDone("d1", ((4,),)), 0.2)
    acts = c.handle(HandshakeDone("P", attempt, 1), 0.3)
    assert one(acts, RequestFailed).reason is FailReason.PROTOCOL
    assert c.parked_completions() == 0


def test_pull_consumers_never_park() -> None:
    c = consumer(mode=PULL)
    c.handle(NotificationReceived("p0", b"d1:1"), 0.0)
    assert c.parked_completions() == 0 and c.stats.notifications_unexpected == 1
    assert c.next_deadline() is None
