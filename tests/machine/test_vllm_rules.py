"""Regression tests for the rules kvwire once got wrong against vLLM's running connector.

Each test fails on the behaviour that vLLM 0.31.0's own classes exposed (make interop runs
those classes against kvwire; these pin the rule at the machine level, where it lives).
"""

from __future__ import annotations

from machine_helpers import PUSH, consumer, of, one, producer, remote

from kvwire.machine import (
    Abort,
    AllocationDone,
    FailReason,
    FreeBlocks,
    HandshakeDone,
    NotificationReceived,
    PostRead,
    PrefillFinished,
    RequestAdded,
    RequestFailed,
    SendNotification,
    StartHandshake,
)
from kvwire.machine.events import RemotePrefill
from kvwire.wire.schemas import PUSH_RELEASE


def test_producer_waits_for_the_count_the_consumer_sends() -> None:
    """vLLM D (TP 4) reading kvwire P (TP 2) sends ``rid:2`` from each of the two D ranks that
    read a P rank. kvwire P once took the count for D's world size, waited for 4 // 2 = 1 and
    freed while the second reader was still reading."""
    p = producer(tp_size=2, tp_rank=0)
    p.handle(RequestAdded("r1"), 0.0)
    p.handle(PrefillFinished("r1", ((1, 2),)), 0.0)
    assert of(p.handle(NotificationReceived("d-rank-0", b"r1:2"), 1.0), FreeBlocks) == []
    assert one(p.handle(NotificationReceived("d-rank-1", b"r1:2"), 1.0), FreeBlocks)


def test_consumer_sends_how_many_ranks_read_the_producer_rank_not_its_world_size() -> None:
    """kvwire D (TP 2) reading vLLM P (TP 2): vLLM P frees after the count it is sent. The
    old count, D's world size 2, was never reached: P held every request until its lease."""
    c = consumer(tp_size=2, tp_rank=1)
    attempt = one(c.handle(RequestAdded("d1", remote(tp=2)), 0.0), StartHandshake).attempt
    c.handle(AllocationDone("d1", ((5,),)), 0.0)
    read = one(c.handle(HandshakeDone("P", attempt, 2), 0.0), PostRead)
    assert read.notification == b"p1:1"


def test_consumer_refuses_a_dcp_sharded_producer_by_name() -> None:
    c = consumer()
    prefill = RemotePrefill(
        engine_id="P", request_id="p1", host="h", port=1, block_ids=((1,),), dcp_size=2
    )
    failed = one(c.handle(RequestAdded("d1", remote=prefill), 0.0), RequestFailed)
    assert failed.reason is FailReason.PROTOCOL and "dcp_size 2" in failed.detail


def _push_consumer_aborted_before_registering(features: frozenset[str]) -> list[bytes]:
    c = consumer(mode=PUSH, host="d", port=7)
    attempt = one(c.handle(RequestAdded("d1", remote(blocks=())), 0.0), StartHandshake).attempt
    c.handle(HandshakeDone("P", attempt, 1, peer_features=features), 0.1)
    acts = c.handle(Abort("d1"), 0.2)
    assert one(acts, RequestFailed).reason is FailReason.ABORTED
    return [a.data for a in of(acts, SendNotification)]


def test_push_release_goes_only_to_producers_that_announced_it() -> None:
    """vLLM's push P raises on a registration with no blocks and keeps the blocks until the
    lease; kvwire D once sent it to every producer."""
    assert _push_consumer_aborted_before_registering(frozenset()) == []
    sent = _push_consumer_aborted_before_registering(frozenset({PUSH_RELEASE}))
    assert len(sent) == 1 and sent[0].startswith(b"PUSH_REG:")


def test_push_release_queued_behind_a_handshake_is_dropped_for_a_vllm_producer() -> None:
    for features, expected in ((frozenset(), 0), (frozenset({PUSH_RELEASE}), 1)):
        c = consumer(mode=PUSH, host="d", port=7)
        start = c.handle(RequestAdded("d1", remote(blocks=())), 0.0)
        attempt = one(start, StartHandshake).attempt
        c.handle(Abort("d1"), 0.1)
        acts = c.handle(HandshakeDone("P", attempt, 1, peer_features=features), 0.2)
        assert len(of(acts, SendNotification)) == expected
