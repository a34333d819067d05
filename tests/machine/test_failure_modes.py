"""One test per vLLM failure mode listed in PROTOCOL.md; each fails on the buggy behaviour."""

from __future__ import annotations

from typing import Any

from machine_helpers import consumer, of, one, producer, remote

from kvwire.config import MAX_SECONDS
from kvwire.machine import (
    Abort,
    AllocationDone,
    ArmTimer,
    CancelTransfer,
    FailReason,
    FreeBlocks,
    FreeReason,
    HandshakeDone,
    NotificationReceived,
    PostRead,
    PrefillFinished,
    ProducerState,
    ReleaseFailed,
    ReleaseTransfer,
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
from kvwire.wire.notifications import encode_heartbeat


def test_reaper_scans_every_lease_not_only_up_to_the_first_live_one() -> None:
    """vllm#58222: leases are not ordered by deadline (heartbeats move them, TTLs differ);
    stopping at the first unexpired entry stranded the expired ones behind it."""
    p = producer(lease_s=30.0, lease_grace_s=0.0)
    for i, rid in enumerate(["head", "a", "b", "c"]):
        p.handle(RequestAdded(rid), 0.0)
        p.handle(PrefillFinished(rid, ((10 * i, 10 * i + 1),)), 0.0)
    # The first-armed lease is extended by heartbeats; the others are not.
    for t in (5.0, 10.0, 15.0, 20.0, 25.0):
        p.handle(NotificationReceived("d", encode_heartbeat(["head"])), t)
    actions = p.handle(Timer(), 31.0)
    freed = {a.request_id: a.reason for a in of(actions, FreeBlocks)}
    assert freed == {rid: FreeReason.EXPIRED for rid in ("a", "b", "c")}
    assert p.lease_deadline("head") == 25.0 + 20.0
    assert of(p.handle(Timer(), 44.9), FreeBlocks) == []
    assert one(p.handle(Timer(), 45.0), FreeBlocks).request_id == "head"
    assert p.held_blocks() == 0


def test_reaper_finds_short_leases_behind_long_ones_armed_earlier() -> None:
    """Mixed TTLs (rebased deadlines) in arming order long, short: both must be reaped."""
    p = producer(lease_s=30.0, lease_grace_s=0.0)
    p.handle(RequestAdded("long"), 0.0)
    p.handle(PrefillFinished("long", ((1,),), lease_deadline=1000.0, scheduler_clock=900.0), 0.0)
    p.handle(RequestAdded("short"), 0.0)
    p.handle(PrefillFinished("short", ((2,),), lease_deadline=905.0, scheduler_clock=900.0), 0.0)
    assert one(p.handle(Timer(), 6.0), FreeBlocks).request_id == "short"
    assert one(p.handle(Timer(), 100.0), FreeBlocks).request_id == "long"


def _mla_pair() -> tuple[list[PostRead], list[SendNotification]]:
    """Consumer TP 1 reading an MLA producer with TP 2: one READ, one bare notification."""
    c = consumer(mla=True, tp_size=1)
    acts = c.handle(RequestAdded("decode-id-1", remote(rid="prefill-id-9", tp=2)), 0.0)
    attempt = one(acts, StartHandshake).attempt
    c.handle(AllocationDone("decode-id-1", ((4, 5),)), 0.1)
    acts = c.handle(HandshakeDone("P", attempt, 2), 0.2)
    read = one(acts, PostRead)
    c.handle(TransferPosted(read.xfer_id), 0.3)
    acts = c.handle(TransferDone(read.xfer_id), 0.4)
    assert of(acts, RequestDone)
    return [read], [a for a in of(acts, SendNotification) if a.request_id]


def test_mla_notifications_use_the_producer_request_id_and_free_every_producer_rank() -> None:
    """vllm#36958: the extra notification to the ranks not read carried D's id, so those
    producer ranks never matched it and leaked their blocks."""
    reads, notes = _mla_pair()
    assert reads[0].remote_rank == (0, 0)
    assert reads[0].notification == b"prefill-id-9:1"
    assert len(notes) == 1 and notes[0].ranks == ((0, 1),)
    assert notes[0].data == b"prefill-id-9:1"
    for rank, data in ((0, reads[0].notification), (1, notes[0].data)):
        p = producer(tp_size=2, tp_rank=rank)
        p.handle(RequestAdded("prefill-id-9"), 0.0)
        p.handle(PrefillFinished("prefill-id-9", ((1, 2),)), 0.0)
        freed = one(p.handle(NotificationReceived("decode-rank-0", data), 1.0), FreeBlocks)
        assert freed.reason is FreeReason.SENT


def test_abort_before_allocation_still_releases_the_producer() -> None:
    """vLLM once stranded P's blocks when D aborted a request before allocating: nothing
    told P to free. The abort must notify (once the handshake is done) and end at once."""
    c = consumer()
    attempt = one(c.handle(RequestAdded("d1", remote(rid="p7")), 0.0), StartHandshake).attempt
    acts = c.handle(Abort("d1"), 0.1)
    failed = one(acts, RequestFailed)
    assert failed.reason is FailReason.ABORTED and failed.invalid_block_ids == ()
    acts = c.handle(HandshakeDone("P", attempt, 1), 0.2)
    note = one(acts, SendNotification)
    assert note.data == b"p7:1" and note.request_id is None
    p = producer()
    p.handle(RequestAdded("p7"), 0.0)
    p.handle(PrefillFinished("p7", ((3, 4),)), 0.0)
    assert one(p.handle(NotificationReceived("d", note.data), 0.3), FreeBlocks).request_id == "p7"


def test_a_lost_notify_only_message_neither_blocks_the_consumer_nor_leaks_the_producer() -> None:
    """Notify failure: D ended a full-prefix-hit request only after its notification was
    sent; a failing send stuck it. Here D finishes in the same step, and P's lease reclaims
    the blocks if the message never arrives."""
    c = consumer()
    attempt = one(c.handle(RequestAdded("d1", remote(rid="p1")), 0.0), StartHandshake).attempt
    c.handle(HandshakeDone("P", attempt, 1), 0.1)
    acts = c.handle(AllocationDone("d1", ((),)), 0.2)
    kinds = [type(a) for a in acts if not isinstance(a, ArmTimer)]
    assert kinds == [SendNotification, RequestDone]
    assert one(acts, SendNotification).data == b"p1:1"
    assert c.live_requests() == 0
    p = producer(lease_s=30.0)
    p.handle(RequestAdded("p1"), 0.0)
    p.handle(PrefillFinished("p1", ((1, 2),)), 0.0)
    # The message is lost: nothing arrives; the lease, then the grace, frees the blocks
    # exactly once.
    assert of(p.handle(Timer(), 30.0), FreeBlocks) == []
    assert one(p.handle(Timer(), 45.0), FreeBlocks).reason is FreeReason.EXPIRED
    assert p.handle(NotificationReceived("d", b"p1:1"), 46.0) == []
    assert p.held_blocks() == 0


def test_failure_after_a_partial_post_posts_nothing_more_and_waits_for_the_running_read() -> None:
    """Failure after partial posts: vLLM kept posting reads for a request that had already
    failed, and reported its blocks free while an earlier READ could still be writing."""
    c = consumer(tp_size=1)
    attempt = one(c.handle(RequestAdded("d1", remote(tp=4)), 0.0), StartHandshake).attempt
    c.handle(AllocationDone("d1", ((7, 8),)), 0.0)
    first = one(c.handle(HandshakeDone("P", attempt, 4), 0.0), PostRead)
    second = one(c.handle(TransferPosted(first.xfer_id), 0.0), PostRead)
    acts = c.handle(TransferFailed(second.xfer_id, "post raised"), 0.0)
    assert of(acts, PostRead) == []  # ranks 2 and 3 are never read
    assert one(acts, CancelTransfer).xfer_id == first.xfer_id
    assert of(acts, RequestFailed) == []  # the first READ may still write into 7, 8
    # Its release fails: the blocks stay held, and the machine asks again later.
    assert of(c.handle(ReleaseFailed(first.xfer_id), 0.1), RequestFailed) == []
    assert of(c.handle(Timer(), 0.5), RequestFailed) == []
    retry = one(c.handle(Timer(), 1.2), ReleaseTransfer)
    assert retry.xfer_id == first.xfer_id
    acts = c.handle(TransferFailed(first.xfer_id, "cancelled"), 1.3)
    failed = one(acts, RequestFailed)
    assert failed.invalid_block_ids == ((7, 8),) and failed.reason is FailReason.TRANSFER
    assert c.transfers_in_flight() == 0


def test_lease_that_expires_during_a_read_is_freed_once_and_late_messages_are_ignored() -> None:
    """Expired lease during a read: the late completion (and heartbeat) must not free the
    blocks a second time, nor extend a lease that no longer exists."""
    p = producer(lease_s=30.0, lease_grace_s=0.0)
    p.handle(RequestAdded("p1"), 0.0)
    p.handle(PrefillFinished("p1", ((1, 2, 3),)), 0.0)
    assert one(p.handle(Timer(), 30.0), FreeBlocks).reason is FreeReason.EXPIRED
    assert p.handle(NotificationReceived("d", encode_heartbeat(["p1"])), 30.5) == []
    assert p.handle(NotificationReceived("d", b"p1:1"), 31.0) == []
    assert p.stats.completions_unknown == 1
    assert p.held_blocks() == 0


def test_expired_blocks_are_quarantined_for_the_grace_and_never_revived() -> None:
    """A READ stalled on a cut link may resume after the lease: the blocks stay unchanged
    (held, not handed to another prompt) for the grace; a heartbeat that arrives then does
    not bring the lease back, and the blocks are freed once, as expired."""
    p = producer(lease_s=30.0, lease_grace_s=10.0)
    p.handle(RequestAdded("p1"), 0.0)
    p.handle(PrefillFinished("p1", ((1, 2, 3),)), 0.0)
    assert of(p.handle(Timer(), 30.0), FreeBlocks) == []
    assert p.request_state("p1") is ProducerState.QUARANTINED
    assert p.held_blocks() == 3 and p.lease_deadline("p1") is None
    assert p.handle(NotificationReceived("d", encode_heartbeat(["p1"])), 31.0) == []
    assert of(p.handle(Timer(), 39.9), FreeBlocks) == []
    assert one(p.handle(Timer(), 40.0), FreeBlocks).reason is FreeReason.EXPIRED
    assert p.handle(NotificationReceived("d", b"p1:1"), 41.0) == []
    assert p.stats.leases_expired == 1 and p.stats.leases_quarantined == 1
    assert p.held_blocks() == 0


def test_a_completion_during_the_quarantine_frees_at_once() -> None:
    """The consumer's completion says its READs are over: nothing can hit the blocks."""
    p = producer(lease_s=30.0, lease_grace_s=10.0)
    p.handle(RequestAdded("p1"), 0.0)
    p.handle(PrefillFinished("p1", ((1, 2),)), 0.0)
    p.handle(Timer(), 30.0)
    assert p.handle(NotificationReceived("d0", b"p1:2"), 31.0) == []
    assert one(p.handle(NotificationReceived("d1", b"p1:2"), 32.0), FreeBlocks).reason is (
        FreeReason.EXPIRED
    )
    assert p.held_blocks() == 0


def test_consumer_declines_a_read_whose_blocks_expire_inside_the_margin() -> None:
    """The expiry is in the producer's clock: convert with the handshake offset."""
    c = consumer(expiry_margin_s=5.0)
    # Producer clock runs 1000 s ahead; its blocks expire at producer time 1106.
    attempt = one(
        c.handle(RequestAdded("d1", remote(expiry=1106.0)), 100.0), StartHandshake
    ).attempt
    c.handle(AllocationDone("d1", ((7,),)), 100.0)
    acts = c.handle(HandshakeDone("P", attempt, 1, clock_offset=1000.0), 101.5)
    failed = one(acts, RequestFailed)  # 101.5 + 5 >= 1106 - 1000
    assert failed.reason is FailReason.EXPIRED and of(acts, PostRead) == []
    c2 = consumer(expiry_margin_s=5.0)
    attempt = one(
        c2.handle(RequestAdded("d2", remote(expiry=1106.0)), 100.0), StartHandshake
    ).attempt
    c2.handle(AllocationDone("d2", ((7,),)), 100.0)
    assert of(c2.handle(HandshakeDone("P", attempt, 1, clock_offset=1000.0), 100.9), PostRead)


def _reading(expiry: float | None, offset: float = 0.0, uncertainty: float = 0.0) -> Any:
    """A consumer (completion margin 1 s, lease 30 s) whose READ of ``d1`` was posted at
    t=1; returns the machine and the READ."""
    c = consumer(lease_s=30.0, completion_margin_s=1.0, expiry_margin_s=5.0)
    acts = c.handle(RequestAdded("d1", remote(expiry=expiry)), 0.0)
    attempt = one(acts, StartHandshake).attempt
    c.handle(AllocationDone("d1", ((7, 8),)), 0.5)
    done = HandshakeDone("P", attempt, 1, clock_offset=offset, clock_uncertainty=uncertainty)
    read = one(c.handle(done, 1.0), PostRead)
    c.handle(TransferPosted(read.xfer_id), 1.0)
    return c, read


def test_a_read_completed_after_the_producers_lease_is_failed_never_done() -> None:
    """docs/reliability.md's worst case: a READ stalled on a cut link resumed after the
    producer's lease ran out, and its completion reported another prompt's KV as done.
    The producer said its blocks expire at its time 1020 (its clock 1000 s ahead, known to
    0.5 s): our deadline is 19.5, and a completion seen after 18.5 fails the request with
    its blocks invalid."""
    c, read = _reading(expiry=1020.0, offset=1000.0, uncertainty=0.5)
    acts = c.handle(TransferDone(read.xfer_id), 18.6)
    failed = one(acts, RequestFailed)
    assert failed.reason is FailReason.EXPIRED and failed.invalid_block_ids == ((7, 8),)
    assert of(acts, RequestDone) == []
    assert c.stats.reads_late == 1
    # The same completion just inside the deadline is a success.
    c, read = _reading(expiry=1020.0, offset=1000.0, uncertainty=0.5)
    assert one(c.handle(TransferDone(read.xfer_id), 18.4), RequestDone)


def test_a_read_still_running_at_its_deadline_is_cancelled_and_its_late_end_ignored() -> None:
    """Every READ is bounded: at the read deadline the machine cancels it; the driver's
    answer (even a success that raced the cancel) ends the request as failed."""
    c, read = _reading(expiry=1020.0, offset=1000.0, uncertainty=0.5)
    assert of(c.handle(Timer(), 18.4), CancelTransfer) == []
    acts = c.handle(Timer(), 18.5)
    assert one(acts, CancelTransfer).xfer_id == read.xfer_id
    assert of(acts, RequestFailed) == []  # not before the handle is released
    assert c.stats.transfers_timed_out == 1
    failed = one(c.handle(TransferDone(read.xfer_id), 30.0), RequestFailed)
    assert failed.reason is FailReason.EXPIRED and failed.invalid_block_ids == ((7, 8),)


def test_without_a_stated_expiry_the_read_is_not_bounded_by_a_guess() -> None:
    """vLLM's producer states no expiry and extends its lease on our heartbeats without
    telling us: a bound from the request's arrival failed reads vLLM's own consumer
    completes (make interop's heartbeat cell). Only the transfer timeout bounds it."""
    c, read = _reading(expiry=None)
    assert of(c.handle(Timer(), 28.9), CancelTransfer) == []
    assert one(c.handle(TransferDone(read.xfer_id), 29.5), RequestDone)


def test_a_push_write_past_its_transfer_timeout_is_cancelled() -> None:
    """Push: a producer's WRITE is bounded by ``transfer_timeout_s``; the blocks are freed
    only once the cancelled handle is released."""
    from machine_helpers import ProducerAt

    at = ProducerAt("writing", TransferMode.PUSH)
    acts = at.step(Timer(), 31.0)
    assert one(acts, CancelTransfer).xfer_id == at.xfers[0]
    assert at.m.request_state("r1") is ProducerState.DRAINING
    assert of(at.step(TransferPosted(at.xfers[1])), CancelTransfer)
    at.step(TransferFailed(at.xfers[0], "cancelled"))
    assert one(at.step(TransferDone(at.xfers[1])), FreeBlocks).reason is FreeReason.FAILED


def test_the_old_rule_reports_a_late_read_done() -> None:
    """``bound_reads_by_lease=False`` (kept only to reproduce the old behaviour) reports the
    late READ of the first test as done: what the new rule exists to prevent."""
    c = consumer(lease_s=30.0, bound_reads_by_lease=False, transfer_timeout_s=MAX_SECONDS)
    attempt = one(c.handle(RequestAdded("d1", remote(expiry=1020.0)), 0.0), StartHandshake)
    c.handle(AllocationDone("d1", ((7, 8),)), 0.5)
    read = one(c.handle(HandshakeDone("P", attempt.attempt, 1, clock_offset=1000.0), 1.0), PostRead)
    c.handle(TransferPosted(read.xfer_id), 1.0)
    assert one(c.handle(TransferDone(read.xfer_id), 60.0), RequestDone)
