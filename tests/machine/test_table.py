"""Every (state, event) pair of the transition tables, driven through the real machines."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from machine_helpers import PULL, PUSH, STREAM, ConsumerAt, ProducerAt, registration, remote

from kvwire.errors import LocalProtocolError
from kvwire.machine import (
    EVENT_TYPES,
    Abort,
    AllocationDone,
    ChunkScheduled,
    ConsumerState,
    EngineState,
    FreeBlocks,
    HandshakeDone,
    HandshakeFailed,
    LayersComputed,
    LeaseConfirmed,
    NotificationReceived,
    PeerLost,
    Preempted,
    PrefillFinished,
    ProducerState,
    ReleaseFailed,
    RequestAdded,
    RequestDone,
    RequestFailed,
    Timer,
    TransferDone,
    TransferFailed,
    TransferPosted,
    TransferState,
)
from kvwire.machine.table import (
    CONSUMER,
    ENGINE,
    PARKED,
    PRODUCER,
    TRANSFER,
    Cancel,
    ParkedState,
    Table,
)

# Events addressed to the request itself: a state that does not list them must refuse them.
DIRECT = {
    RequestAdded,
    AllocationDone,
    PrefillFinished,
    ChunkScheduled,
    Preempted,
    TransferPosted,
    TransferDone,
    TransferFailed,
    ReleaseFailed,
    LeaseConfirmed,
}

# Pairs the table lists for a streaming prompt (still computing) that a handler refuses
# when the prompt already finished: a second PrefillFinished is the engine's error.
FINISHED_REFUSES = {
    (ProducerState.WAIT_PEER, PrefillFinished),
    (ProducerState.WRITING, PrefillFinished),
    (ProducerState.DRAINING, PrefillFinished),
}

CONSUMER_STATES = [
    ("absent", PULL),
    ("absent", PUSH),
    ("wait_alloc", PULL),
    ("wait_peer", PULL),
    ("transferring", PULL),
    ("draining", PULL),
    ("wait_alloc", PUSH),
    ("wait_peer", PUSH),
    ("await_writes", PUSH),
]
PRODUCER_STATES = [
    ("absent", PULL),
    ("prefilling", PULL),
    ("leased", PULL),
    ("quarantined", PULL),
    ("absent", PUSH),
    ("prefilling", PUSH),
    ("leased", PUSH),
    ("wait_peer", PUSH),
    ("writing", PUSH),
    ("draining", PUSH),
    ("absent", STREAM),
    ("prefilling", STREAM),
    ("wait_peer", STREAM),
    ("writing", STREAM),
    ("draining", STREAM),
]


def _event(at: ConsumerAt | ProducerAt, etype: type[Any], push: bool = True) -> Any:
    """An event of ``etype`` addressed to the request ``at`` drove (and its peer engine)."""
    rid = at.rid
    consumer = isinstance(at, ConsumerAt)
    peer = "P" if consumer else "D"
    x_last = at.xfers[-1] if at.xfers else 999
    x_first = at.xfers[0] if at.xfers else 999
    if consumer:
        note = NotificationReceived("p-agent", b"d1:1")
    else:
        note = NotificationReceived("d-agent", registration(rid, decode_tp=2) if push else b"r1:1")
    return {
        RequestAdded: lambda: RequestAdded(rid, remote(tp=2) if consumer else None),
        AllocationDone: lambda: AllocationDone(rid, ((7, 8),)),
        PrefillFinished: lambda: PrefillFinished(rid, ((1,),) if consumer else ((1, 2, 3),)),
        HandshakeDone: lambda: HandshakeDone(peer, at.attempt or 1, 2),
        HandshakeFailed: lambda: HandshakeFailed(peer, at.attempt or 1, "no"),
        TransferPosted: lambda: TransferPosted(x_last),
        TransferDone: lambda: TransferDone(x_first),
        TransferFailed: lambda: TransferFailed(x_first, "io"),
        ReleaseFailed: lambda: ReleaseFailed(x_first, "busy"),
        NotificationReceived: lambda: note,
        Abort: lambda: Abort(rid),
        PeerLost: lambda: PeerLost(peer),
        LeaseConfirmed: lambda: LeaseConfirmed(rid, 1e9),
        ChunkScheduled: lambda: ChunkScheduled(rid, 64, ((1, 2, 3),), 1),
        LayersComputed: lambda: LayersComputed((rid,), 1),
        Preempted: lambda: Preempted(rid),
        Timer: lambda: Timer(),
    }[etype]()


def _ends(table: Table, state: Any, trigger: type[Any]) -> frozenset[Any] | None:
    """The states the table lets ``trigger`` lead to from ``state`` (None: not accepted)."""
    outcomes = table.get((state, trigger))
    return None if outcomes is None else frozenset(outcomes.values())


def _check_request_pair(
    at: ConsumerAt | ProducerAt,
    state: str,
    etype: type[Any],
    table: Table,
    endings: Sequence[tuple[type[Any], Any]],
    push: bool,
) -> None:
    """Drive ``etype`` into the request ``at`` holds in ``state``: the machine must refuse
    exactly the direct events the table lacks, and end where the table allows. ``endings``
    maps the actions that end a request to the terminal state they stand for."""
    before = at.m.request_state(at.rid)
    assert before.value == state
    allowed = _ends(table, before, etype)
    event = _event(at, etype, push)
    dt = 1e6 if (etype is Timer and allowed is not None) else 1e-4
    try:
        actions = at.step(event, dt)
    except LocalProtocolError:
        if (before, etype) in FINISHED_REFUSES and isinstance(at, ProducerAt) and not at.stream:
            assert at.m.request_state(at.rid) is before
            return
        assert allowed is None, f"{state} refused {etype.__name__} although the table lists it"
        assert at.m.request_state(at.rid) is before  # a refused event changes nothing
        return
    ended = [end for cls, end in endings if any(isinstance(a, cls) for a in actions)]
    after = ended[0] if ended else at.m.request_state(at.rid)
    if allowed is None:
        assert etype not in DIRECT, f"{state} accepted {etype.__name__} not in the table"
        assert after is before, f"{etype.__name__} moved {state} outside the table"
    else:
        assert after in allowed, (state, etype.__name__, after)


CONSUMER_ENDINGS = ((RequestDone, ConsumerState.DONE), (RequestFailed, ConsumerState.FAILED))
PRODUCER_ENDINGS = ((FreeBlocks, ProducerState.FREED),)


@pytest.mark.parametrize(("state", "mode"), CONSUMER_STATES)
@pytest.mark.parametrize("etype", EVENT_TYPES, ids=lambda t: t.__name__)
def test_consumer_pair(state: str, mode: Any, etype: type[Any]) -> None:
    at = ConsumerAt(state, mode)
    _check_request_pair(at, state, etype, CONSUMER, CONSUMER_ENDINGS, mode is PUSH)


@pytest.mark.parametrize(("state", "mode"), PRODUCER_STATES)
@pytest.mark.parametrize("etype", EVENT_TYPES, ids=lambda t: t.__name__)
def test_producer_pair(state: str, mode: Any, etype: type[Any]) -> None:
    at = ProducerAt(state, mode)
    _check_request_pair(at, state, etype, PRODUCER, PRODUCER_ENDINGS, mode is not PULL)


# (parked notifications for d1?, the request's own state): push, so parking applies.
PARKED_SETUPS = [
    ("absent", "absent"),
    ("absent", "wait_alloc"),
    ("parked", "absent"),
    ("parked", "wait_alloc"),
    ("parked", "wait_peer"),
]


def _parked_outcome(at: ConsumerAt, before: dict[str, int]) -> ParkedState:
    stats = at.m.stats
    if stats.completions_parked_applied > before["completions_parked_applied"]:
        return ParkedState.APPLIED
    if stats.completions_parked_expired > before["completions_parked_expired"]:
        return ParkedState.EXPIRED
    if stats.completions_parked_dropped > before["completions_parked_dropped"]:
        return ParkedState.DISCARDED
    return at.m.parked_state("d1")


@pytest.mark.parametrize(("parked", "request_state"), PARKED_SETUPS)
@pytest.mark.parametrize("etype", EVENT_TYPES, ids=lambda t: t.__name__)
def test_parked_pair(parked: str, request_state: str, etype: type[Any]) -> None:
    at = ConsumerAt(request_state, PUSH)
    if parked == "parked":
        at.step(NotificationReceived("p-agent", b"d1:1"))
    before = at.m.parked_state("d1")
    assert before.value == parked
    allowed = _ends(PARKED, before, etype)
    counters = at.m.stats.as_dict()
    event = _event(at, etype)
    try:
        at.step(event, 1e6 if etype is Timer else 1e-4)
    except LocalProtocolError:
        assert at.m.parked_state("d1") is before  # a refused event changes nothing
        return
    after = _parked_outcome(at, counters)
    if allowed is None:
        assert after is before, f"{etype.__name__} moved parked {parked} outside the table"
    else:
        assert after in allowed, (parked, request_state, etype.__name__, after)
    assert at.m.parked_completions() == (1 if after is ParkedState.PARKED else 0)


def _transfer_at(state: str) -> tuple[ConsumerAt, int]:
    """A consumer whose transfer is in ``state``; returns it and the transfer id."""
    if state == "requested":
        at = ConsumerAt("transferring")
        return at, at.xfers[1]
    if state == "posted":
        at = ConsumerAt("transferring")
        return at, at.xfers[0]
    if state == "cancelling":
        at = ConsumerAt("draining")
        return at, at.xfers[0]
    at = ConsumerAt("transferring")
    at.step(ReleaseFailed(at.xfers[0], "busy"))
    if state == "releasing":
        at.step(Timer(), 2.0)
    return at, at.xfers[0]


TRANSFER_EVENTS = (TransferPosted, TransferDone, TransferFailed, ReleaseFailed, Timer)


@pytest.mark.parametrize(
    "state", ["requested", "posted", "cancelling", "release_failed", "releasing"]
)
@pytest.mark.parametrize("etype", TRANSFER_EVENTS, ids=lambda t: t.__name__)
def test_transfer_pair(state: str, etype: type[Any]) -> None:
    at, xid = _transfer_at(state)
    before = at.m.transfer_state(xid)
    assert before.value == state
    allowed = _ends(TRANSFER, before, etype)
    if allowed is not None and etype is Timer:
        # Its deadline fails the request, whose drain cancels it (the ``Cancel`` row).
        allowed |= _ends(TRANSFER, before, Cancel) or frozenset()
    event = Timer() if etype is Timer else etype(xid)
    dt = 2.0 if etype is Timer else 1e-4
    try:
        at.step(event, dt)
    except LocalProtocolError:
        assert allowed is None
        assert at.m.transfer_state(xid) is before
        return
    after = at.m.transfer_state(xid)
    after = TransferState.ENDED if after is TransferState.ABSENT else after
    if allowed is None:
        assert etype is Timer and after is before
    else:
        assert after in allowed, (state, etype.__name__, after)


def test_no_transfer_event_is_accepted_for_an_unknown_id() -> None:
    at = ConsumerAt("transferring")
    for etype in (TransferPosted, TransferDone, TransferFailed, ReleaseFailed):
        with pytest.raises(LocalProtocolError):
            at.step(etype(12345))


@pytest.mark.parametrize("state", ["absent", "handshaking", "ready"])
@pytest.mark.parametrize(
    "etype", (HandshakeDone, HandshakeFailed, PeerLost, Timer), ids=lambda t: t.__name__
)
def test_engine_pair(state: str, etype: type[Any]) -> None:
    at = ConsumerAt("absent" if state == "absent" else "wait_alloc")
    if state == "ready":
        at.step(HandshakeDone("P", at.attempt, 2))
        at.step(Abort("d1"))  # nothing depends on the engine any more: it may be evicted
    before = at.m.engine_state("P")
    assert before.value == state
    allowed = _ends(ENGINE, before, etype)
    event = {
        HandshakeDone: lambda: HandshakeDone("P", at.attempt or 1, 2),
        HandshakeFailed: lambda: HandshakeFailed("P", at.attempt or 1),
        PeerLost: lambda: PeerLost("P"),
        Timer: lambda: Timer(),
    }[etype]()
    try:
        at.step(event, 1e7 if etype is Timer else 1e-4)
    except LocalProtocolError:
        assert allowed is None
        return
    after = at.m.engine_state("P")
    if allowed is None:
        assert after is before
    else:
        assert after in allowed, (state, etype.__name__, after)
    if etype is Timer and state != "absent":
        assert after is EngineState.ABSENT  # timed out, or idle past its TTL


def test_states_are_assigned_only_from_the_table() -> None:
    """Outside ``MachineCore._move`` (which assigns what the table names), a state is only
    ever set once, to ``ABSENT``, when a thing is created: no handler decides a state."""
    import ast
    from pathlib import Path

    import kvwire.machine

    offenders = []
    for path in sorted(Path(kvwire.machine.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef):
                continue
            for node in ast.walk(func):
                if not isinstance(node, ast.Assign):
                    continue
                for target in node.targets:
                    if not (isinstance(target, ast.Attribute) and target.attr == "state"):
                        continue
                    initial = (
                        func.name == "__init__"
                        and isinstance(node.value, ast.Attribute)
                        and node.value.attr == "ABSENT"
                    )
                    if func.name != "_move" and not initial:
                        offenders.append(f"{path.name}:{node.lineno} in {func.name}")
    assert offenders == []
