"""Every transition of the transfer state machines, in one place: the table decides.

Five tables, one per kind of thing that has a state: a consumer request, a producer request,
a transfer (a posted READ/WRITE), a remote engine (its handshake), and a parked completion
(push: a producer's write notification that reached a consumer rank before the request it
names was awaiting writes). Each maps ``(state, trigger)`` to the *named outcomes* of that
trigger in that state and the state each outcome leads to, as h11's ``_state.py`` does for
HTTP: the handler decides which outcome happened (the read was the last one; the lease ran
out inside the grace) and names it, and the machine core assigns the state the table gives
for it (:meth:`~kvwire.machine._core.MachineCore._move`, the only assignment of a state).
An outcome ``""`` means the thing stays where it is.

A trigger is an event type, or an :class:`Internal` one for a thing moved by another
thing's event (:class:`Dial`, :class:`Post`, :class:`Cancel`). The key is the state the
thing was in when the event arrived, so one event may take a thing through several named
outcomes (a producer's finished prefill: ``leased``, then ``writing`` when a registration
was waiting), each of which the table lists. Handlers look the pair up *before* acting
(:func:`successors`): a pair that is missing is an event the state does not accept and
raises :class:`~kvwire.errors.LocalProtocolError` (the driver broke the protocol), except for
``NotificationReceived``, which comes from a peer: a notification a state does not accept is
the peer's fault, so it is counted and reported as ``PeerMisbehaved``/ignored, never raised.
``tests/machine/test_table.py`` drives every pair through the real machines, and the state
diagrams in the docs are drawn from these tables.

``ABSENT`` stands for "not tracked": never seen, or already terminal. Terminal states
(``DONE``, ``FAILED``, ``FREED``, ``ENDED``) appear only as outcomes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, TypeVar

from kvwire.errors import LocalProtocolError
from kvwire.machine.events import (
    Abort,
    AllocationDone,
    ChunkScheduled,
    Event,
    HandshakeDone,
    HandshakeFailed,
    LayersComputed,
    LeaseConfirmed,
    NotificationReceived,
    PeerLost,
    Preempted,
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
    """Push: matched with a registration; queued behind the handshake with the consumer
    (streaming: possibly while the prompt is still being computed)."""
    WRITING = "writing"
    """Push: WRITEs being posted one rank at a time, or in flight. Streaming: from before
    the prompt ends, one round of computed layers at a time; the completion rides on the
    last round, posted once the prompt is finished and every earlier round has landed."""
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


class Internal:
    """A trigger that is not an event the driver feeds: a thing moved by another thing's
    event (an engine dialled because a request needs it, a transfer cancelled because its
    request drains, a transfer created because its request posts)."""


class Dial(Internal):
    """A request needs this engine: its handshake starts."""


class Post(Internal):
    """The owner posts its next READ/WRITE: a transfer comes into being."""


class Cancel(Internal):
    """The owner drains after its first failure: a posted transfer is cancelled."""


Trigger = type[Event] | type[Internal]

C = ConsumerState
CONSUMER: dict[tuple[ConsumerState, Trigger], dict[str, ConsumerState]] = {
    # Refused parameters end the request before it is tracked: FAILED, nothing held.
    (C.ABSENT, RequestAdded): {"added": C.WAIT_ALLOC, "failed": C.FAILED},
    (C.ABSENT, Abort): {"": C.ABSENT},
    (C.ABSENT, NotificationReceived): {"": C.ABSENT},
    (C.WAIT_ALLOC, AllocationDone): {
        "wait_peer": C.WAIT_PEER,
        "read": C.TRANSFERRING,
        "register": C.AWAIT_WRITES,
        "done": C.DONE,
        "failed": C.FAILED,
    },
    (C.WAIT_ALLOC, Abort): {"failed": C.FAILED},
    (C.WAIT_ALLOC, NotificationReceived): {"": C.WAIT_ALLOC},
    (C.WAIT_PEER, HandshakeDone): {
        "read": C.TRANSFERRING,
        "register": C.AWAIT_WRITES,
        "done": C.DONE,
        "failed": C.FAILED,
    },
    (C.WAIT_PEER, HandshakeFailed): {"failed": C.FAILED},
    (C.WAIT_PEER, Abort): {"failed": C.FAILED},
    (C.WAIT_PEER, NotificationReceived): {"": C.WAIT_PEER},
    (C.TRANSFERRING, TransferPosted): {"": C.TRANSFERRING},
    # A completion observed after the read deadline fails the request (late bytes).
    (C.TRANSFERRING, TransferDone): {
        "": C.TRANSFERRING,
        "done": C.DONE,
        "draining": C.DRAINING,
        "failed": C.FAILED,
    },
    (C.TRANSFERRING, TransferFailed): {"draining": C.DRAINING, "failed": C.FAILED},
    (C.TRANSFERRING, ReleaseFailed): {"": C.TRANSFERRING},
    (C.TRANSFERRING, Abort): {"draining": C.DRAINING, "failed": C.FAILED},
    # A READ still running at its deadline (the producer's lease, or the transfer timeout).
    (C.TRANSFERRING, Timer): {"": C.TRANSFERRING, "draining": C.DRAINING},
    (C.AWAIT_WRITES, NotificationReceived): {
        "": C.AWAIT_WRITES,
        "done": C.DONE,
        "failed": C.FAILED,
    },
    (C.AWAIT_WRITES, Timer): {"failed": C.FAILED},
    # Push: the producer that was to write went away (its notifications fail).
    (C.AWAIT_WRITES, PeerLost): {"failed": C.FAILED},
    (C.AWAIT_WRITES, Abort): {"failed": C.FAILED},
    (C.DRAINING, TransferPosted): {"": C.DRAINING},
    (C.DRAINING, TransferDone): {"": C.DRAINING, "failed": C.FAILED},
    (C.DRAINING, TransferFailed): {"": C.DRAINING, "failed": C.FAILED},
    (C.DRAINING, ReleaseFailed): {"": C.DRAINING},
    (C.DRAINING, Abort): {"": C.DRAINING},
    # The answer to our own lease query, which may come in any state (even after the end):
    # it can only move a live read deadline later, never change the state.
    (C.ABSENT, LeaseConfirmed): {"": C.ABSENT},
    (C.WAIT_ALLOC, LeaseConfirmed): {"": C.WAIT_ALLOC},
    (C.WAIT_PEER, LeaseConfirmed): {"": C.WAIT_PEER},
    (C.TRANSFERRING, LeaseConfirmed): {"": C.TRANSFERRING},
    (C.AWAIT_WRITES, LeaseConfirmed): {"": C.AWAIT_WRITES},
    (C.DRAINING, LeaseConfirmed): {"": C.DRAINING},
}

P = ProducerState
PRODUCER: dict[tuple[ProducerState, Trigger], dict[str, ProducerState]] = {
    # Streaming push: a registration already waiting is matched as the request starts.
    # A stream past its write deadline (the consumer's watchdog) fails before it starts;
    # a failed stream waits, holding nothing, in PREFILLING (see below).
    (P.ABSENT, RequestAdded): {
        "added": P.PREFILLING,
        "wait_peer": P.WAIT_PEER,
        "writing": P.WRITING,
        "prefilling": P.PREFILLING,
    },
    (P.ABSENT, Abort): {"": P.ABSENT},
    (P.ABSENT, Preempted): {"": P.ABSENT},
    (P.PREFILLING, PrefillFinished): {
        "leased": P.LEASED,
        "wait_peer": P.WAIT_PEER,
        "writing": P.WRITING,
        "freed": P.FREED,
    },
    # Nothing is held yet: the engine frees its own blocks and the request is forgotten.
    (P.PREFILLING, Abort): {"forgotten": P.ABSENT},
    # A consumer's completion can overtake the engine's PrefillFinished (vLLM hands out P's
    # params a step before its worker holds the blocks): counted; the hold then frees at
    # once if every sender has reported. Streaming push: a registration matches the
    # prompt while it is computed.
    (P.PREFILLING, NotificationReceived): {
        "": P.PREFILLING,
        "wait_peer": P.WAIT_PEER,
        "writing": P.WRITING,
        "prefilling": P.PREFILLING,
    },
    # Streaming push: the engine reports progress; it is recorded, and written once matched.
    (P.PREFILLING, ChunkScheduled): {"": P.PREFILLING},
    (P.PREFILLING, LayersComputed): {"": P.PREFILLING},
    (P.PREFILLING, Preempted): {"": P.PREFILLING},
    (P.WAIT_PEER, ChunkScheduled): {"": P.WAIT_PEER},
    (P.WAIT_PEER, LayersComputed): {"": P.WAIT_PEER},
    (P.WAIT_PEER, Preempted): {"": P.WAIT_PEER},
    (P.WAIT_PEER, PrefillFinished): {"": P.WAIT_PEER, "freed": P.FREED},
    (P.WRITING, ChunkScheduled): {"": P.WRITING, "prefilling": P.PREFILLING},
    (P.WRITING, LayersComputed): {"": P.WRITING, "prefilling": P.PREFILLING},
    (P.WRITING, Preempted): {"": P.WRITING},
    (P.WRITING, PrefillFinished): {"": P.WRITING, "draining": P.DRAINING, "freed": P.FREED},
    (P.DRAINING, ChunkScheduled): {"": P.DRAINING},
    (P.DRAINING, LayersComputed): {"": P.DRAINING},
    (P.DRAINING, Preempted): {"": P.DRAINING},
    (P.DRAINING, PrefillFinished): {"": P.DRAINING},
    (P.LEASED, NotificationReceived): {
        "": P.LEASED,
        "wait_peer": P.WAIT_PEER,
        "writing": P.WRITING,
        "freed": P.FREED,
    },
    (P.LEASED, Timer): {"": P.LEASED, "quarantined": P.QUARANTINED, "freed": P.FREED},
    (P.LEASED, Abort): {"freed": P.FREED},
    (P.QUARANTINED, Timer): {"": P.QUARANTINED, "freed": P.FREED},
    (P.QUARANTINED, NotificationReceived): {"": P.QUARANTINED, "freed": P.FREED},
    (P.QUARANTINED, Abort): {"": P.QUARANTINED},
    (P.WAIT_PEER, HandshakeDone): {
        "writing": P.WRITING,
        "freed": P.FREED,
        "prefilling": P.PREFILLING,
    },
    # A stream that fails before its prompt ends waits, holding nothing, for the engine's
    # PrefillFinished (its blocks are then freed at once) or Abort.
    (P.WAIT_PEER, HandshakeFailed): {"freed": P.FREED, "prefilling": P.PREFILLING},
    (P.WAIT_PEER, Abort): {"freed": P.FREED},
    (P.WRITING, TransferPosted): {"": P.WRITING},
    (P.WRITING, TransferDone): {"": P.WRITING, "freed": P.FREED, "prefilling": P.PREFILLING},
    (P.WRITING, TransferFailed): {
        "draining": P.DRAINING,
        "freed": P.FREED,
        "prefilling": P.PREFILLING,
    },
    (P.WRITING, ReleaseFailed): {"": P.WRITING},
    (P.WRITING, Abort): {"draining": P.DRAINING, "freed": P.FREED},
    (P.WRITING, Timer): {"": P.WRITING, "draining": P.DRAINING},
    (P.DRAINING, TransferPosted): {"": P.DRAINING},
    (P.DRAINING, TransferDone): {"": P.DRAINING, "freed": P.FREED, "prefilling": P.PREFILLING},
    (P.DRAINING, TransferFailed): {"": P.DRAINING, "freed": P.FREED, "prefilling": P.PREFILLING},
    (P.DRAINING, ReleaseFailed): {"": P.DRAINING},
    (P.DRAINING, Abort): {"": P.DRAINING},
}

X = TransferState
TRANSFER: dict[tuple[TransferState, Trigger], dict[str, TransferState]] = {
    (X.ABSENT, Post): {"requested": X.REQUESTED},
    # Cancelled on arrival when its request began draining while it was being posted.
    (X.REQUESTED, TransferPosted): {"posted": X.POSTED, "cancelling": X.CANCELLING},
    (X.REQUESTED, TransferFailed): {"ended": X.ENDED},
    # Its deadline passed while being posted: cancelled once TransferPosted comes.
    (X.REQUESTED, Timer): {"": X.REQUESTED},
    (X.POSTED, TransferDone): {"ended": X.ENDED},
    (X.POSTED, TransferFailed): {"ended": X.ENDED},
    (X.POSTED, ReleaseFailed): {"release_failed": X.RELEASE_FAILED},
    # Its deadline fails the request, whose drain cancels it (``Cancel``).
    (X.POSTED, Timer): {"": X.POSTED},
    (X.POSTED, Cancel): {"cancelling": X.CANCELLING},
    (X.CANCELLING, TransferDone): {"ended": X.ENDED},
    (X.CANCELLING, TransferFailed): {"ended": X.ENDED},
    (X.CANCELLING, ReleaseFailed): {"release_failed": X.RELEASE_FAILED},
    (X.RELEASE_FAILED, Timer): {"releasing": X.RELEASING},
    (X.RELEASING, TransferDone): {"ended": X.ENDED},
    (X.RELEASING, TransferFailed): {"ended": X.ENDED},
    (X.RELEASING, ReleaseFailed): {"release_failed": X.RELEASE_FAILED},
}

K = ParkedState
PARKED: dict[tuple[ParkedState, Trigger], dict[str, ParkedState]] = {
    # Parked, or refused (stays absent) when the buffer is full.
    (K.ABSENT, NotificationReceived): {"parked": K.PARKED, "": K.ABSENT},
    (K.PARKED, NotificationReceived): {"": K.PARKED},
    # The request starts awaiting writes (or ends) while allocating / handshaking.
    (K.PARKED, AllocationDone): {"": K.PARKED, "applied": K.APPLIED, "discarded": K.DISCARDED},
    (K.PARKED, HandshakeDone): {"": K.PARKED, "applied": K.APPLIED, "discarded": K.DISCARDED},
    (K.PARKED, RequestAdded): {"": K.PARKED, "discarded": K.DISCARDED},
    (K.PARKED, HandshakeFailed): {"": K.PARKED, "discarded": K.DISCARDED},
    (K.PARKED, Abort): {"": K.PARKED, "discarded": K.DISCARDED},
    (K.PARKED, Timer): {"": K.PARKED, "expired": K.EXPIRED, "discarded": K.DISCARDED},
}

E = EngineState
ENGINE: dict[tuple[EngineState, Trigger], dict[str, EngineState]] = {
    (E.ABSENT, Dial): {"handshaking": E.HANDSHAKING},
    (E.HANDSHAKING, HandshakeDone): {"ready": E.READY, "absent": E.ABSENT},
    (E.HANDSHAKING, HandshakeFailed): {"absent": E.ABSENT},
    (E.HANDSHAKING, Timer): {"absent": E.ABSENT},
    (E.HANDSHAKING, PeerLost): {"": E.HANDSHAKING},
    (E.READY, PeerLost): {"absent": E.ABSENT},
    (E.READY, Timer): {"": E.READY, "absent": E.ABSENT},
    (E.ABSENT, PeerLost): {"": E.ABSENT},
}

Table = Mapping[tuple[Any, Trigger], Mapping[str, Any]]

TABLES: dict[str, Table] = {
    "consumer": CONSUMER,
    "producer": PRODUCER,
    "transfer": TRANSFER,
    "engine": ENGINE,
    "parked": PARKED,
}

StateT = TypeVar("StateT", bound=enum.Enum)


def successors(
    table: Mapping[tuple[StateT, Trigger], Mapping[str, StateT]],
    state: StateT,
    trigger: Trigger,
    what: str,
) -> frozenset[StateT]:
    """The states a thing may be in after ``trigger`` in ``state``, or LocalProtocolError:
    the guard every handler runs before acting (a state that does not accept an event)."""
    outcomes = table.get((state, trigger))
    if outcomes is None:
        raise LocalProtocolError(
            f"{what} in state {state.value!r} does not accept {trigger.__name__}"
        )
    return frozenset(outcomes.values())


def next_state(
    table: Mapping[tuple[StateT, Trigger], Mapping[str, StateT]],
    state: StateT,
    trigger: Trigger,
    outcome: str,
) -> StateT:
    """The state the table names for ``outcome`` of ``trigger`` in ``state``: the only
    place a machine learns what state to assign."""
    try:
        return table[(state, trigger)][outcome]
    except KeyError:
        raise LocalProtocolError(
            f"no transition {state.value!r} --{trigger.__name__}/{outcome or 'stay'}--> "
            "in the table"
        ) from None
