"""Every legal transition of the transfer state machines, in one place.

Five tables, one per kind of thing that has a state: a consumer request, a producer request,
a transfer (a posted READ/WRITE), a remote engine (its handshake), and a parked completion
(push: a producer's write notification that reached a consumer rank before the request it
names was awaiting writes). Each maps
``(state, event type) -> the states the thing may be in afterwards``. The machines look the
pair up *before* acting: a pair that is missing is an event the state does not accept and
raises :class:`~kvwire.errors.LocalProtocolError` (the driver broke the protocol), except for
``NotificationReceived``, which comes from a peer: a notification a state does not accept is
the peer's fault, so it is counted and reported as ``PeerMisbehaved``/ignored, never raised.
The state a transition ends in is checked against the table by ``tests/machine/test_table.py``,
which drives every pair through the real machines; at run time only a parked completion's
outcome is checked (with invariant checks on), the lookup that refuses an event runs always.

``ABSENT`` stands for "not tracked": never seen, or already terminal. Terminal states
(``DONE``, ``FAILED``, ``FREED``, ``ENDED``) appear only as successors.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, TypeVar

from kvwire.errors import LocalProtocolError
from kvwire.machine.events import (
    Abort,
    AllocationDone,
    Event,
    HandshakeDone,
    HandshakeFailed,
    LeaseConfirmed,
    NotificationReceived,
    PeerLost,
    PrefillFinished,
    ReleaseFailed,
    RequestAdded,
    Timer,
    TransferDone,
    TransferFailed,
    TransferPosted,
)


class _State(enum.Enum):
    """Members are singletons, so identity hashing is exact, and it is a C-level hash:
    Enum's own ``__hash__`` is Python code, and the tables are looked up on every event."""

    __hash__ = object.__hash__


class ConsumerState(_State):
    """A consumer (decode side) request."""

    ABSENT = "absent"
    WAIT_ALLOC = "wait_alloc"
    """Known from kv_transfer_params; the engine has not allocated blocks yet."""
    WAIT_PEER = "wait_peer"
    """Allocated; queued behind the handshake with the producer engine."""
    TRANSFERRING = "transferring"
    """Pull: READs being posted one rank at a time, or in flight."""
    AWAIT_WRITES = "await_writes"
    """Push: registration sent; counting the producer's write notifications."""
    DRAINING = "draining"
    """Failed or aborted: waiting for its in-flight transfers to be cancelled and released."""
    DONE = "done"
    FAILED = "failed"


class ProducerState(_State):
    """A producer (prefill side) request."""

    ABSENT = "absent"
    PREFILLING = "prefilling"
    LEASED = "leased"
    """Blocks held under a lease: waiting for completions (pull) or a registration (push)."""
    WAIT_PEER = "wait_peer"
    """Push: matched with a registration; queued behind the handshake with the consumer."""
    WRITING = "writing"
    """Push: WRITEs being posted one rank at a time, or in flight."""
    DRAINING = "draining"
    """Push: failed or aborted, waiting for in-flight writes to be cancelled and released."""
    QUARANTINED = "quarantined"
    """Pull: the lease ran out without every completion; the blocks stay unchanged for the
    grace (a READ stalled on a cut link may still resume), then are freed."""
    FREED = "freed"


class TransferState(_State):
    """One posted READ or WRITE."""

    ABSENT = "absent"
    REQUESTED = "requested"
    """``PostRead``/``PostWrite`` emitted; not yet confirmed posted."""
    POSTED = "posted"
    CANCELLING = "cancelling"
    """``CancelTransfer`` emitted; waiting for the released outcome."""
    RELEASE_FAILED = "release_failed"
    """The handle could not be released; its blocks stay held until a retry works."""
    RELEASING = "releasing"
    """``ReleaseTransfer`` emitted (a retry); waiting for the released outcome."""
    ENDED = "ended"


class ParkedState(_State):
    """Push, consumer: write notifications held for one request id that is not awaiting
    writes yet (unknown, or still allocating / handshaking). With consumer TP > 1 a producer
    writes to every consumer rank as soon as the *first* rank's registration reaches it, so
    another rank can see the notification before its engine hands it the request."""

    ABSENT = "absent"
    PARKED = "parked"
    APPLIED = "applied"
    """The request started awaiting writes: the notifications were counted."""
    EXPIRED = "expired"
    """``registration_timeout_s`` passed before the request was awaiting writes."""
    DISCARDED = "discarded"
    """The request ended (failed or aborted) before awaiting writes."""


class EngineState(_State):
    """What this rank knows about one remote engine."""

    ABSENT = "absent"
    HANDSHAKING = "handshaking"
    READY = "ready"


C = ConsumerState
CONSUMER: dict[tuple[ConsumerState, type[Event]], frozenset[ConsumerState]] = {
    (C.ABSENT, RequestAdded): frozenset({C.WAIT_ALLOC, C.FAILED}),
    (C.ABSENT, Abort): frozenset({C.ABSENT}),
    (C.ABSENT, NotificationReceived): frozenset({C.ABSENT}),
    (C.WAIT_ALLOC, AllocationDone): frozenset(
        {C.WAIT_PEER, C.TRANSFERRING, C.AWAIT_WRITES, C.DONE, C.FAILED}
    ),
    (C.WAIT_ALLOC, Abort): frozenset({C.FAILED}),
    (C.WAIT_ALLOC, NotificationReceived): frozenset({C.WAIT_ALLOC}),
    (C.WAIT_PEER, HandshakeDone): frozenset({C.TRANSFERRING, C.AWAIT_WRITES, C.DONE, C.FAILED}),
    (C.WAIT_PEER, HandshakeFailed): frozenset({C.FAILED}),
    (C.WAIT_PEER, Abort): frozenset({C.FAILED}),
    (C.WAIT_PEER, NotificationReceived): frozenset({C.WAIT_PEER}),
    (C.TRANSFERRING, TransferPosted): frozenset({C.TRANSFERRING}),
    # A completion observed after the read deadline fails the request (late bytes).
    (C.TRANSFERRING, TransferDone): frozenset({C.TRANSFERRING, C.DONE, C.DRAINING, C.FAILED}),
    (C.TRANSFERRING, TransferFailed): frozenset({C.DRAINING, C.FAILED}),
    (C.TRANSFERRING, ReleaseFailed): frozenset({C.TRANSFERRING}),
    (C.TRANSFERRING, Abort): frozenset({C.DRAINING, C.FAILED}),
    # A READ still running at its deadline (the producer's lease, or the transfer timeout).
    (C.TRANSFERRING, Timer): frozenset({C.TRANSFERRING, C.DRAINING}),
    (C.AWAIT_WRITES, NotificationReceived): frozenset({C.AWAIT_WRITES, C.DONE, C.FAILED}),
    (C.AWAIT_WRITES, Timer): frozenset({C.FAILED}),
    (C.AWAIT_WRITES, Abort): frozenset({C.FAILED}),
    (C.DRAINING, TransferPosted): frozenset({C.DRAINING}),
    (C.DRAINING, TransferDone): frozenset({C.DRAINING, C.FAILED}),
    (C.DRAINING, TransferFailed): frozenset({C.DRAINING, C.FAILED}),
    (C.DRAINING, ReleaseFailed): frozenset({C.DRAINING}),
    (C.DRAINING, Abort): frozenset({C.DRAINING}),
    # The answer to our own lease query, which may come in any state (even after the end):
    # it can only move a live read deadline later, never change the state.
    (C.ABSENT, LeaseConfirmed): frozenset({C.ABSENT}),
    (C.WAIT_ALLOC, LeaseConfirmed): frozenset({C.WAIT_ALLOC}),
    (C.WAIT_PEER, LeaseConfirmed): frozenset({C.WAIT_PEER}),
    (C.TRANSFERRING, LeaseConfirmed): frozenset({C.TRANSFERRING}),
    (C.AWAIT_WRITES, LeaseConfirmed): frozenset({C.AWAIT_WRITES}),
    (C.DRAINING, LeaseConfirmed): frozenset({C.DRAINING}),
}

P = ProducerState
PRODUCER: dict[tuple[ProducerState, type[Event]], frozenset[ProducerState]] = {
    (P.ABSENT, RequestAdded): frozenset({P.PREFILLING}),
    (P.ABSENT, Abort): frozenset({P.ABSENT}),
    (P.PREFILLING, PrefillFinished): frozenset({P.LEASED, P.WAIT_PEER, P.WRITING, P.FREED}),
    (P.PREFILLING, Abort): frozenset({P.ABSENT}),
    (P.LEASED, NotificationReceived): frozenset({P.LEASED, P.WAIT_PEER, P.WRITING, P.FREED}),
    (P.LEASED, Timer): frozenset({P.LEASED, P.QUARANTINED, P.FREED}),
    (P.LEASED, Abort): frozenset({P.FREED}),
    (P.QUARANTINED, Timer): frozenset({P.QUARANTINED, P.FREED}),
    (P.QUARANTINED, NotificationReceived): frozenset({P.QUARANTINED, P.FREED}),
    (P.QUARANTINED, Abort): frozenset({P.QUARANTINED}),
    (P.WAIT_PEER, HandshakeDone): frozenset({P.WRITING, P.FREED}),
    (P.WAIT_PEER, HandshakeFailed): frozenset({P.FREED}),
    (P.WAIT_PEER, Abort): frozenset({P.FREED}),
    (P.WRITING, TransferPosted): frozenset({P.WRITING}),
    (P.WRITING, TransferDone): frozenset({P.WRITING, P.FREED}),
    (P.WRITING, TransferFailed): frozenset({P.DRAINING, P.FREED}),
    (P.WRITING, ReleaseFailed): frozenset({P.WRITING}),
    (P.WRITING, Abort): frozenset({P.DRAINING, P.FREED}),
    (P.WRITING, Timer): frozenset({P.WRITING, P.DRAINING}),
    (P.DRAINING, TransferPosted): frozenset({P.DRAINING}),
    (P.DRAINING, TransferDone): frozenset({P.DRAINING, P.FREED}),
    (P.DRAINING, TransferFailed): frozenset({P.DRAINING, P.FREED}),
    (P.DRAINING, ReleaseFailed): frozenset({P.DRAINING}),
    (P.DRAINING, Abort): frozenset({P.DRAINING}),
}

X = TransferState
TRANSFER: dict[tuple[TransferState, type[Event]], frozenset[TransferState]] = {
    (X.REQUESTED, TransferPosted): frozenset({X.POSTED, X.CANCELLING}),
    (X.REQUESTED, TransferFailed): frozenset({X.ENDED}),
    # Its deadline passed while being posted: cancelled once TransferPosted comes.
    (X.REQUESTED, Timer): frozenset({X.REQUESTED}),
    (X.POSTED, TransferDone): frozenset({X.ENDED}),
    (X.POSTED, TransferFailed): frozenset({X.ENDED}),
    (X.POSTED, ReleaseFailed): frozenset({X.RELEASE_FAILED}),
    (X.POSTED, Timer): frozenset({X.POSTED, X.CANCELLING}),
    (X.CANCELLING, TransferDone): frozenset({X.ENDED}),
    (X.CANCELLING, TransferFailed): frozenset({X.ENDED}),
    (X.CANCELLING, ReleaseFailed): frozenset({X.RELEASE_FAILED}),
    (X.RELEASE_FAILED, Timer): frozenset({X.RELEASING}),
    (X.RELEASING, TransferDone): frozenset({X.ENDED}),
    (X.RELEASING, TransferFailed): frozenset({X.ENDED}),
    (X.RELEASING, ReleaseFailed): frozenset({X.RELEASE_FAILED}),
}

K = ParkedState
PARKED: dict[tuple[ParkedState, type[Event]], frozenset[ParkedState]] = {
    # Parked, or refused (stays absent) when the buffer is full.
    (K.ABSENT, NotificationReceived): frozenset({K.PARKED, K.ABSENT}),
    (K.PARKED, NotificationReceived): frozenset({K.PARKED}),
    # The request starts awaiting writes (or ends) while allocating / handshaking.
    (K.PARKED, AllocationDone): frozenset({K.PARKED, K.APPLIED, K.DISCARDED}),
    (K.PARKED, HandshakeDone): frozenset({K.PARKED, K.APPLIED, K.DISCARDED}),
    (K.PARKED, RequestAdded): frozenset({K.PARKED, K.DISCARDED}),
    (K.PARKED, HandshakeFailed): frozenset({K.PARKED, K.DISCARDED}),
    (K.PARKED, Abort): frozenset({K.PARKED, K.DISCARDED}),
    (K.PARKED, Timer): frozenset({K.PARKED, K.EXPIRED, K.DISCARDED}),
}

E = EngineState
ENGINE: dict[tuple[EngineState, type[Event]], frozenset[EngineState]] = {
    (E.HANDSHAKING, HandshakeDone): frozenset({E.READY, E.ABSENT}),
    (E.HANDSHAKING, HandshakeFailed): frozenset({E.ABSENT}),
    (E.HANDSHAKING, Timer): frozenset({E.ABSENT}),
    (E.HANDSHAKING, PeerLost): frozenset({E.HANDSHAKING}),
    (E.READY, PeerLost): frozenset({E.ABSENT}),
    (E.READY, Timer): frozenset({E.READY, E.ABSENT}),
    (E.ABSENT, PeerLost): frozenset({E.ABSENT}),
}

TABLES: dict[str, Mapping[Any, frozenset[Any]]] = {
    "consumer": CONSUMER,
    "producer": PRODUCER,
    "transfer": TRANSFER,
    "engine": ENGINE,
    "parked": PARKED,
}

StateT = TypeVar("StateT", bound=enum.Enum)


def successors(
    table: Mapping[tuple[StateT, type[Event]], frozenset[StateT]],
    state: StateT,
    event_type: type[Event],
    what: str,
) -> frozenset[StateT]:
    """The states allowed after ``event_type`` in ``state``, or LocalProtocolError."""
    allowed = table.get((state, event_type))
    if allowed is None:
        raise LocalProtocolError(
            f"{what} in state {state.value!r} does not accept {event_type.__name__}"
        )
    return allowed
