"""The consumer's read deadline moves later only on evidence: a kvwire producer's answer to
a lease query (``lease-query``), asked only of producers that announced it.

The producer below says its blocks expire at its time 1020; its clock is 1000 s ahead of
ours, known to 0.5 s; lease 30 s, so heartbeats every 5 s, completion margin 1 s and expiry
margin 5 s. The read deadline is therefore 19.5 and a READ still running at 18.5 is
cancelled, unless the producer confirms a later lease.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from machine_helpers import consumer, of, one, producer, remote

from kvwire.errors import LocalProtocolError
from kvwire.machine import (
    Abort,
    Action,
    AllocationDone,
    CancelTransfer,
    ConsumerState,
    FailReason,
    HandshakeDone,
    LeaseConfirmed,
    PostRead,
    QueryLeases,
    RequestAdded,
    RequestDone,
    RequestFailed,
    StartHandshake,
    Timer,
    TransferDone,
    TransferFailed,
    TransferPosted,
)
from kvwire.wire.schemas import LEASE_QUERY, PUSH_RELEASE, TransferMode

WITH = frozenset({LEASE_QUERY, PUSH_RELEASE})


def _reading(features: frozenset[str] = WITH, **kw: Any) -> tuple[Any, PostRead, list[Action]]:
    """A consumer whose READ of ``d1`` (producer id ``p1``) was posted at t=1."""
    c = consumer(lease_s=30.0, completion_margin_s=1.0, expiry_margin_s=5.0, **kw)
    attempt = one(c.handle(RequestAdded("d1", remote(expiry=1020.0)), 0.0), StartHandshake)
    c.handle(AllocationDone("d1", ((7, 8),)), 0.5)
    done = HandshakeDone(
        "P", attempt.attempt, 1, clock_offset=1000.0, clock_uncertainty=0.5, peer_features=features
    )
    acts = c.handle(done, 1.0)
    read = one(acts, PostRead)
    c.handle(TransferPosted(read.xfer_id), 1.0)
    return c, read, acts


def _run_timers(c: Any, until: float, step: float = 0.5, start: float = 1.0) -> list[Action]:
    out: list[Action] = []
    t = start
    while t <= until:
        out += c.handle(Timer(), t)
        t += step
    return out


def test_the_producer_is_asked_only_once_the_deadline_comes_within_two_heartbeats() -> None:
    c, _, first = _reading()
    assert of(first, QueryLeases) == []  # heartbeat at 1.0: 19.5 - 1 is beyond 1 + 10 + 5
    ask = one(c.handle(Timer(), 6.0), QueryLeases)
    assert ask == QueryLeases("P", "p-host", 5600, ((0, 0),), ("d1",), ("p1",))
    assert c.stats.lease_queries == 1


def test_a_confirmed_lease_lets_the_read_run_past_the_stated_expiry_and_end_done() -> None:
    c, read, _ = _reading()
    c.handle(Timer(), 6.0)
    # P's lease runs to its 1040 now (our 1040 - 1000 - 0.5 = 39.5).
    assert c.handle(LeaseConfirmed("d1", 1040.0), 6.1) == []
    assert c.stats.read_deadlines_extended == 1
    assert of(_run_timers(c, 30.0, start=6.5), CancelTransfer) == []
    assert one(c.handle(TransferDone(read.xfer_id), 30.0), RequestDone)


def test_the_extended_deadline_is_still_a_deadline() -> None:
    c, read, _ = _reading(transfer_timeout_s=60.0)
    c.handle(LeaseConfirmed("d1", 1040.0), 6.1)
    assert of(c.handle(Timer(), 38.4), CancelTransfer) == []
    assert one(c.handle(Timer(), 38.5), CancelTransfer).xfer_id == read.xfer_id
    failed = one(c.handle(TransferDone(read.xfer_id), 38.6), RequestFailed)
    assert failed.reason is FailReason.EXPIRED and failed.invalid_block_ids == ((7, 8),)


def test_a_completion_seen_after_the_extended_deadline_is_failed_never_done() -> None:
    c, read, _ = _reading(transfer_timeout_s=60.0)
    c.handle(LeaseConfirmed("d1", 1040.0), 6.1)
    failed = one(c.handle(TransferDone(read.xfer_id), 38.6), RequestFailed)
    assert failed.reason is FailReason.EXPIRED
    assert c.stats.reads_late == 1


def test_without_the_answer_the_same_read_fails_at_the_stated_deadline() -> None:
    c, read, _ = _reading()
    c.handle(Timer(), 6.0)  # asked, never answered
    assert one(c.handle(Timer(), 18.5), CancelTransfer).xfer_id == read.xfer_id
    failed = one(c.handle(TransferDone(read.xfer_id), 18.6), RequestFailed)
    assert failed.reason is FailReason.EXPIRED


@pytest.mark.parametrize("deadline", [None, 1010.0, 1019.9, 1020.0])
def test_evidence_never_moves_the_deadline_earlier(deadline: float | None) -> None:
    """Not held (None), or a lease no later than what we have, changes nothing: the READ
    still completes done just inside 19.5 - 1."""
    c, read, _ = _reading()
    c.handle(LeaseConfirmed("d1", deadline), 6.1)
    assert c.stats.read_deadlines_extended == 0 and c.stats.lease_answers_unused == 1
    assert of(c.handle(Timer(), 18.4), CancelTransfer) == []
    assert one(c.handle(TransferDone(read.xfer_id), 18.4), RequestDone)


def test_evidence_never_revives_a_read_past_its_deadline() -> None:
    """At 18.6 the deadline (18.5 with the margin) has passed, even if the timer has not
    been fed yet: the READ may already hold bytes P gave away, so a later lease is not
    taken, and the completion still fails."""
    c, read, _ = _reading()
    c.handle(LeaseConfirmed("d1", 1040.0), 18.6)
    assert c.stats.read_deadlines_extended == 0
    failed = one(c.handle(TransferDone(read.xfer_id), 18.7), RequestFailed)
    assert failed.reason is FailReason.EXPIRED


def test_evidence_for_a_failing_or_ended_request_is_ignored() -> None:
    c, read, _ = _reading()
    one(c.handle(Abort("d1"), 5.0), CancelTransfer)
    assert c.request_state("d1") is ConsumerState.DRAINING
    assert c.handle(LeaseConfirmed("d1", 1040.0), 5.1) == []
    assert c.request_state("d1") is ConsumerState.DRAINING
    one(c.handle(TransferFailed(read.xfer_id, "cancelled"), 5.2), RequestFailed)
    assert c.handle(LeaseConfirmed("d1", 1040.0), 5.3) == []  # absent: a late answer
    assert c.handle(LeaseConfirmed("never-seen", 1040.0), 5.4) == []
    assert c.stats.read_deadlines_extended == 0 and c.stats.lease_answers_unused == 3


def test_a_request_still_waiting_for_its_blocks_takes_the_evidence_too() -> None:
    """Allocated late (t=25, past the stated 19.5): declined without evidence, read with it."""
    for confirmed in (False, True):
        c = consumer(lease_s=30.0, completion_margin_s=1.0, expiry_margin_s=5.0)
        attempt = one(c.handle(RequestAdded("d1", remote(expiry=1020.0)), 0.0), StartHandshake)
        c.handle(
            HandshakeDone(
                "P", attempt.attempt, 1, clock_offset=1000.0, clock_uncertainty=0.5,
                peer_features=WITH,
            ),
            1.0,
        )  # fmt: skip
        one(c.handle(Timer(), 6.0), QueryLeases)  # waiting requests are asked too
        if confirmed:
            c.handle(LeaseConfirmed("d1", 1040.0), 6.1)
        acts = c.handle(AllocationDone("d1", ((7, 8),)), 25.0)
        if confirmed:
            read = one(acts, PostRead)
            c.handle(TransferPosted(read.xfer_id), 25.0)
            assert one(c.handle(TransferDone(read.xfer_id), 30.0), RequestDone)
        else:
            assert one(acts, RequestFailed).reason is FailReason.EXPIRED


@pytest.mark.parametrize(
    ("features", "kw"),
    [
        (frozenset(), {}),  # vLLM's producer announces nothing
        (frozenset({PUSH_RELEASE}), {}),  # a kvwire producer without the extension
        (WITH, {"bound_reads_by_lease": False}),  # the old rule asks nothing
    ],
    ids=["vllm", "kvwire-without-feature", "old-rule"],
)
def test_a_producer_that_did_not_announce_the_feature_is_never_asked(
    features: frozenset[str], kw: dict[str, Any]
) -> None:
    c, _, first = _reading(features, **kw)
    actions = first + _run_timers(c, 60.0)
    assert of(actions, QueryLeases) == []
    assert c.stats.lease_queries == 0


def test_reads_without_a_stated_expiry_are_not_asked_about() -> None:
    """A producer that states no expiry gave no deadline to extend (vLLM's case)."""
    c = consumer(lease_s=30.0)
    attempt = one(c.handle(RequestAdded("d1", remote(expiry=None)), 0.0), StartHandshake)
    c.handle(AllocationDone("d1", ((7,),)), 0.5)
    acts = c.handle(HandshakeDone("P", attempt.attempt, 1, peer_features=WITH), 1.0)
    assert of(acts + _run_timers(c, 25.0), QueryLeases) == []


def test_many_requests_are_asked_in_queries_of_at_most_64_ids() -> None:
    c = consumer(lease_s=30.0, completion_margin_s=1.0, expiry_margin_s=5.0)
    attempt = None
    for i in range(70):
        acts = c.handle(RequestAdded(f"d{i}", remote(rid=f"p{i}", expiry=1020.0)), 0.0)
        attempt = attempt or one(acts, StartHandshake).attempt
    assert attempt is not None
    c.handle(HandshakeDone("P", attempt, 1, clock_offset=1000.0, peer_features=WITH), 1.0)
    asks = of(c.handle(Timer(), 6.0), QueryLeases)
    assert [len(a.request_ids) for a in asks] == [64, 6]
    assert {r for a in asks for r in a.remote_request_ids} == {f"p{i}" for i in range(70)}


def test_only_finite_deadlines_are_events_and_producers_refuse_them() -> None:
    for bad in (math.nan, math.inf, "1.0", True):
        with pytest.raises(LocalProtocolError):
            LeaseConfirmed("d1", bad)  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError):
        producer().handle(LeaseConfirmed("r1", 1.0), 0.0)


def test_a_push_consumer_never_asks() -> None:
    """Push: the producer writes and D holds no read deadline, so there is nothing to
    extend, even if the params carried an expiry."""
    c = consumer(lease_s=30.0, mode=TransferMode.PUSH)
    attempt = one(c.handle(RequestAdded("d1", remote(expiry=1020.0)), 0.0), StartHandshake)
    c.handle(AllocationDone("d1", ((7, 8),)), 0.5)
    done = HandshakeDone("P", attempt.attempt, 1, clock_offset=1000.0, peer_features=WITH)
    acts = c.handle(done, 1.0)
    assert of(acts + _run_timers(c, 25.0), QueryLeases) == []
