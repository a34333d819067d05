"""Leases, heartbeats, handshakes, push matching, TP counting and peer errors."""

from __future__ import annotations

import pytest
from machine_helpers import (
    PUSH,
    consumer,
    machine_config,
    of,
    one,
    producer,
    registration,
    remote,
)

from kvwire.config import KVWireConfig
from kvwire.errors import ConfigError, LocalProtocolError
from kvwire.machine import (
    Abort,
    AllocationDone,
    ConsumerMachine,
    EvictEngine,
    FailReason,
    FreeBlocks,
    FreeReason,
    HandshakeDone,
    HandshakeFailed,
    NotificationReceived,
    PeerMisbehaved,
    PostRead,
    PostWrite,
    PrefillFinished,
    ProducerMachine,
    ProducerState,
    RequestAdded,
    RequestDone,
    RequestFailed,
    SendNotification,
    StartHandshake,
    Timer,
    TransferDone,
    TransferPosted,
    base_request_id,
    rebase_deadline,
)
from kvwire.wire.notifications import encode_heartbeat


def _held(p: ProducerMachine, rid: str, blocks: tuple[tuple[int, ...], ...] = ((1, 2),)) -> None:
    p.handle(RequestAdded(rid), 0.0)
    p.handle(PrefillFinished(rid, blocks), 0.0)


def test_heartbeat_extends_to_two_thirds_of_the_lease_and_never_shortens() -> None:
    p = producer(lease_s=30.0, lease_grace_s=0.0)
    _held(p, "r1")
    assert p.lease_deadline("r1") == 30.0
    p.handle(NotificationReceived("d", encode_heartbeat(["r1", "unknown"])), 1.0)
    assert p.lease_deadline("r1") == 30.0  # 1 + 20 < 30: never shortened
    p.handle(NotificationReceived("d", encode_heartbeat(["r1"])), 25.0)
    assert p.lease_deadline("r1") == 45.0
    assert of(p.handle(Timer(), 44.0), FreeBlocks) == []
    assert one(p.handle(Timer(), 45.0), FreeBlocks).reason is FreeReason.EXPIRED


def test_rebased_deadline_keeps_the_remaining_lease_not_the_foreign_clock() -> None:
    assert rebase_deadline(5030.0, 5000.0, 7.0) == 37.0
    assert rebase_deadline(42.0, 0.0, 7.0) == 42.0  # legacy absolute
    p = producer()
    p.handle(RequestAdded("r1"), 100.0)
    p.handle(PrefillFinished("r1", ((1,),), lease_deadline=9e9 + 30, scheduler_clock=9e9), 100.0)
    assert p.lease_deadline("r1") == 130.0


def test_consumer_heartbeats_each_engine_every_sixth_of_the_lease() -> None:
    c = consumer(lease_s=30.0)
    attempt = one(c.handle(RequestAdded("d1", remote(rid="p1")), 0.0), StartHandshake).attempt
    c.handle(RequestAdded("d2", remote(rid="p2")), 0.0)
    first = one(c.handle(HandshakeDone("P", attempt, 1), 1.0), SendNotification)
    assert first.data == b"HB:p1,p2" and first.ranks == ()
    assert of(c.handle(Timer(), 5.9), SendNotification) == []
    assert one(c.handle(Timer(), 6.0), SendNotification).data == b"HB:p1,p2"
    c.handle(AllocationDone("d1", ((),)), 6.5)  # d1 done (nothing to read)
    assert one(c.handle(Timer(), 11.0), SendNotification).data == b"HB:p2"


def test_one_handshake_in_flight_per_engine_and_failures_are_not_cached() -> None:
    c = consumer()
    acts = c.handle(RequestAdded("d1", remote(rid="p1")), 0.0)
    attempt = one(acts, StartHandshake).attempt
    assert of(c.handle(RequestAdded("d2", remote(rid="p2")), 0.0), StartHandshake) == []
    c.handle(AllocationDone("d1", ((1,),)), 0.1)
    c.handle(AllocationDone("d2", ((2,),)), 0.1)
    acts = c.handle(HandshakeFailed("P", attempt, "refused"), 0.2)
    assert {a.request_id for a in of(acts, RequestFailed)} == {"d1", "d2"}
    assert all(a.reason is FailReason.HANDSHAKE for a in of(acts, RequestFailed))
    acts = c.handle(RequestAdded("d3", remote(rid="p3")), 0.3)
    assert one(acts, StartHandshake).attempt == attempt + 1  # tried again


def test_handshake_times_out_and_a_late_answer_is_ignored() -> None:
    c = consumer(handshake_timeout_s=4.0, handshake_retries=0)  # one 4 s attempt + 1 s: 5 s
    attempt = one(c.handle(RequestAdded("d1", remote()), 0.0), StartHandshake).attempt
    c.handle(AllocationDone("d1", ((1,),)), 0.0)
    failed = one(c.handle(Timer(), 5.0), RequestFailed)
    assert failed.reason is FailReason.HANDSHAKE
    assert c.handle(HandshakeDone("P", attempt, 1), 6.0) == []
    assert c.stats.stale_handshake_answers == 1
    with pytest.raises(LocalProtocolError):
        c.handle(HandshakeDone("P", attempt + 50, 1), 6.0)


def test_idle_engine_is_evicted_but_never_while_a_transfer_runs() -> None:
    c = consumer(engine_idle_ttl_s=100.0, lease_s=1000.0, transfer_timeout_s=1000.0)
    attempt = one(c.handle(RequestAdded("d1", remote()), 0.0), StartHandshake).attempt
    c.handle(AllocationDone("d1", ((1, 2),)), 0.0)
    read = one(c.handle(HandshakeDone("P", attempt, 1), 0.0), PostRead)
    c.handle(TransferPosted(read.xfer_id), 0.0)
    assert of(c.handle(Timer(), 500.0), EvictEngine) == []  # read still in flight
    assert one(c.handle(TransferDone(read.xfer_id), 501.0), RequestDone)
    assert of(c.handle(Timer(), 600.0), EvictEngine) == []  # idle only 99 s
    assert one(c.handle(Timer(), 700.0), EvictEngine).engine_id == "P"


def test_producer_counts_distinct_consumer_ranks_for_heterogeneous_tp() -> None:
    p = producer(tp_size=1)
    _held(p, "r1")
    assert p.handle(NotificationReceived("d-rank-0", b"r1:4"), 1.0) == []
    assert p.handle(NotificationReceived("d-rank-0", b"r1:4"), 1.0) == []  # duplicate
    assert p.handle(NotificationReceived("d-rank-1", b"r1:4"), 1.0) == []
    assert p.handle(NotificationReceived("d-rank-2", b"r1:4"), 1.0) == []
    assert one(p.handle(NotificationReceived("d-rank-3", b"r1:4"), 1.0), FreeBlocks)
    assert p.stats.completions_duplicate == 1


def test_consumer_with_more_ranks_reads_its_one_producer_rank() -> None:
    c = consumer(tp_size=4, tp_rank=3)
    attempt = one(c.handle(RequestAdded("d1", remote(tp=2)), 0.0), StartHandshake).attempt
    c.handle(AllocationDone("d1", ((5,),)), 0.0)
    read = one(c.handle(HandshakeDone("P", attempt, 2), 0.0), PostRead)
    assert read.remote_rank == (0, 1)
    # Both whole lists: the planner pairs them by token (the producer's tail here).
    assert read.local_block_ids == ((5,),) and read.remote_block_ids == ((10, 11, 12),)
    # vLLM's count: how many consumer ranks read this producer rank (4 // 2), not our TP.
    assert read.notification == b"p1:2"


def test_push_registration_and_prompt_match_in_either_order_by_base_id() -> None:
    for order in ("registration-first", "prompt-first"):
        p = producer(mode=PUSH, stream_layers=False)
        p.handle(RequestAdded("req-7-0badc0de"), 0.0)
        note = NotificationReceived("d", registration("req-7-12345678", blocks=((8, 9),)))
        if order == "registration-first":
            assert p.handle(note, 0.1) == [] or p.pending_registrations() == 1
            acts = p.handle(PrefillFinished("req-7-0badc0de", ((1, 2, 3),)), 0.2)
        else:
            p.handle(PrefillFinished("req-7-0badc0de", ((1, 2, 3),)), 0.1)
            acts = p.handle(note, 0.2)
        attempt = one(acts, StartHandshake).attempt
        write = one(p.handle(HandshakeDone("D", attempt, 1), 0.3), PostWrite)
        assert write.local_block_ids == ((1, 2, 3),) and write.remote_block_ids == ((8, 9),)
        assert write.notification == b"req-7-12345678:1"
        # A duplicate registration is idempotent.
        assert of(p.handle(note, 0.35), (PostWrite, StartHandshake)) == []
        p.handle(TransferPosted(write.xfer_id), 0.4)
        assert one(p.handle(TransferDone(write.xfer_id), 0.5), FreeBlocks).reason is FreeReason.SENT
        assert p.handle(note, 0.6) == []
        assert p.stats.registrations_duplicate == 2


def test_streaming_push_matches_a_registration_by_base_id_while_the_prompt_computes() -> None:
    """With streams (the default), a registration that comes first is matched at once: the
    handshake starts while the prompt computes, and the prompt, once finished (the engine
    reported no layers here), is written whole with the completion."""
    p = producer(mode=PUSH)
    p.handle(RequestAdded("req-7-0badc0de"), 0.0)
    note = NotificationReceived("d", registration("req-7-12345678", blocks=((8, 9),)))
    attempt = one(p.handle(note, 0.1), StartHandshake).attempt
    assert p.request_state("req-7-0badc0de") is ProducerState.WAIT_PEER
    assert of(p.handle(HandshakeDone("D", attempt, 1), 0.2), PostWrite) == []
    write = one(p.handle(PrefillFinished("req-7-0badc0de", ((1, 2, 3),)), 0.3), PostWrite)
    assert write.pieces == () and write.local_block_ids == ((1, 2, 3),)
    assert write.notification == b"req-7-12345678:1"
    p.handle(TransferPosted(write.xfer_id), 0.4)
    assert one(p.handle(TransferDone(write.xfer_id), 0.5), FreeBlocks).reason is FreeReason.SENT


def test_base_id_strips_only_an_eight_hex_suffix() -> None:
    assert base_request_id("chat-1-deadbeef") == "chat-1"
    assert base_request_id("chat-1-DEADBEEF") == "chat-1-DEADBEEF"
    assert base_request_id("chat-1-deadbee") == "chat-1-deadbee"


def test_malformed_registration_is_dropped_and_counted() -> None:
    p = producer(mode=PUSH)
    acts = p.handle(NotificationReceived("d", b"PUSH_REG:\xc1garbage"), 0.0)
    assert one(acts, PeerMisbehaved)
    p.handle(NotificationReceived("d", b"\xff\xfe not utf8"), 0.0)
    assert p.stats.registrations_malformed == 1
    assert p.stats.notifications_malformed == 1


def test_push_consumer_watchdog_fails_a_request_whose_writes_never_come() -> None:
    c = consumer(mode=PUSH, registration_timeout_s=10.0)
    attempt = one(c.handle(RequestAdded("d1", remote(blocks=())), 0.0), StartHandshake).attempt
    c.handle(AllocationDone("d1", ((4, 5),)), 0.0)
    acts = c.handle(HandshakeDone("P", attempt, 2), 0.0)
    (reg,) = [a for a in of(acts, SendNotification) if a.request_id == "d1"]
    assert reg.data.startswith(b"PUSH_REG:") and reg.ranks == ()
    assert c.handle(NotificationReceived("p0", b"d1:2"), 1.0) == []
    failed = one(c.handle(Timer(), 10.0), RequestFailed)
    assert failed.reason is FailReason.TIMEOUT and failed.invalid_block_ids == ((4, 5),)
    assert failed.writes_until == 10.0  # the producer's writes are bounded by the watchdog


def test_a_push_request_aborted_after_registering_says_until_when_writes_may_land() -> None:
    """An abort cannot stop the producer's writes into the request's blocks (a streaming
    producer writes all through its prefill); they end by the registration's watchdog,
    which the failure names so the engine reuses the blocks only after it."""
    c = consumer(mode=PUSH, registration_timeout_s=10.0)
    attempt = one(c.handle(RequestAdded("d1", remote(blocks=())), 0.0), StartHandshake).attempt
    c.handle(AllocationDone("d1", ((4, 5),)), 0.5)
    c.handle(HandshakeDone("P", attempt, 2), 2.0)  # the registration goes out now
    failed = one(c.handle(Abort("d1"), 3.0), RequestFailed)
    assert failed.writes_until == 12.0
    c2 = consumer(mode=PUSH)
    c2.handle(RequestAdded("d2", remote(blocks=())), 0.0)
    assert one(c2.handle(Abort("d2"), 0.1), RequestFailed).writes_until is None  # none sent


def test_push_consumer_completes_after_every_producer_rank_wrote() -> None:
    c = consumer(mode=PUSH)
    attempt = one(c.handle(RequestAdded("d1", remote(blocks=(), tp=2)), 0.0), StartHandshake)
    c.handle(AllocationDone("d1", ((4,),)), 0.0)
    c.handle(HandshakeDone("P", attempt.attempt, 2), 0.0)
    assert c.handle(NotificationReceived("p0", b"d1:2"), 1.0) == []
    assert c.handle(NotificationReceived("p0", b"d1:2"), 1.0) == []  # duplicate
    assert one(c.handle(NotificationReceived("p1", b"d1:2"), 1.0), RequestDone)


def test_a_bad_peer_message_fails_only_the_request_it_concerns() -> None:
    c = consumer(mode=PUSH)
    attempt = one(c.handle(RequestAdded("d1", remote(blocks=(), tp=2)), 0.0), StartHandshake)
    c.handle(RequestAdded("d2", remote(rid="p2", blocks=(), tp=2)), 0.0)
    c.handle(AllocationDone("d1", ((4,),)), 0.0)
    c.handle(AllocationDone("d2", ((5,),)), 0.0)
    c.handle(HandshakeDone("P", attempt.attempt, 2), 0.0)
    acts = c.handle(NotificationReceived("p0", b"d1:3"), 1.0)  # wrong producer world size
    assert one(acts, RequestFailed).reason is FailReason.PROTOCOL
    assert one(acts, PeerMisbehaved).request_id == "d1"
    assert c.live_requests() == 1
    acts = c.handle(RequestAdded("d3", remote(rid="bad,id")), 1.0)
    assert one(acts, RequestFailed).reason is FailReason.PROTOCOL


def test_refused_events_change_nothing_and_time_cannot_go_backwards() -> None:
    c = consumer()
    with pytest.raises(LocalProtocolError):
        c.handle(AllocationDone("nope", ((1,),)), 0.0)
    with pytest.raises(LocalProtocolError):
        c.handle(PrefillFinished("x", ((1,),)), 0.0)
    c.handle(RequestAdded("d1", remote()), 5.0)
    with pytest.raises(LocalProtocolError):
        c.handle(RequestAdded("d1", remote()), 5.0)
    with pytest.raises(LocalProtocolError):
        c.handle(Timer(), 4.0)
    with pytest.raises(LocalProtocolError):
        RequestAdded("")
    with pytest.raises(LocalProtocolError):
        AllocationDone("d1", ((-1,),))


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="engine_id is not set"):
        consumer(engine_id="")
    with pytest.raises(ConfigError):
        machine_config(engine_id="x", tp_size=2, tp_rank=2)
    with pytest.raises(ConfigError):
        machine_config(engine_id="x", lease_s=0)
    with pytest.raises(TypeError, match="KVWireConfig"):
        ConsumerMachine({"engine_id": "x"})  # type: ignore[arg-type]
    assert machine_config(engine_id="x", lease_s=30).heartbeat_s == 5.0


def test_unset_durations_are_derived_from_the_lease_in_one_place() -> None:
    short = KVWireConfig(environ={}, engine_id="x", lease_s=3.0)
    assert (short.expiry_margin, short.completion_margin) == (0.5, 0.3)
    assert (short.transfer_timeout, short.lease_grace) == (30.0, 1.5)
    long = KVWireConfig(environ={}, engine_id="x", lease_s=120.0, expiry_margin_s=2.0)
    assert (long.expiry_margin, long.completion_margin, long.transfer_timeout) == (2.0, 1.0, 120.0)


def test_requests_sharing_prefix_blocks_are_held_and_freed_each_once() -> None:
    """An engine with prefix caching hands two requests the same cached blocks (and vLLM's
    hybrid manager its null block in every window list): both are held at once, each is
    freed once with its own list, and nothing stays held. Only a list naming a block twice
    is refused."""
    p = producer(lease_s=30.0, lease_grace_s=0.0)
    _held(p, "a", ((1, 2, 3), (0, 7)))
    _held(p, "b", ((1, 2, 3, 4), (0, 8)))
    assert p.held_blocks() == 11  # references, as the engine counts them
    freed = of(p.handle(Timer(), 31.0), FreeBlocks)
    assert sorted((f.request_id, f.block_ids) for f in freed) == [
        ("a", ((1, 2, 3), (0, 7))),
        ("b", ((1, 2, 3, 4), (0, 8))),
    ]
    assert p.held_blocks() == 0
    p.handle(RequestAdded("c"), 40.0)
    with pytest.raises(LocalProtocolError, match="lists a block twice"):
        p.handle(PrefillFinished("c", ((5, 5),)), 40.0)
