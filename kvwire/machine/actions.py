"""What a machine asks its driver to do: the outputs of ``machine.handle(event, now)``.

The driver executes actions in list order and reports their outcomes as events:
``PostRead``/``PostWrite`` -> ``TransferPosted`` then ``TransferDone``/``TransferFailed``
(or ``TransferFailed`` alone when posting raised); ``StartHandshake`` -> ``HandshakeDone`` /
``HandshakeFailed``; ``CancelTransfer``/``ReleaseTransfer`` -> ``TransferDone`` /
``TransferFailed`` once the handle is released, ``ReleaseFailed`` if it could not be.
``QueryLeases`` -> one ``LeaseConfirmed`` per request it names, or nothing (an unanswered
query is no evidence). ``SendNotification``, ``FreeBlocks``, ``RequestDone``,
``RequestFailed``, ``EvictEngine``, ``PeerMisbehaved`` and ``ArmTimer`` need no answer.

A remote rank is ``(pp_rank, tp_rank)`` of the remote engine.
"""

from __future__ import annotations

import enum

import msgspec

from kvwire.machine.events import BlockIds

RemoteRank = tuple[int, int]
"""``(pp_rank, tp_rank)`` of a rank of the remote engine."""


class FailReason(str, enum.Enum):
    """Why a consumer request ended without its KV (the engine recomputes or fails it)."""

    HANDSHAKE = "handshake"
    TRANSFER = "transfer"
    EXPIRED = "expired"
    """The producer's blocks expire (or are too close to) before a read could finish."""
    TIMEOUT = "timeout"
    """Push: the producer's writes did not all arrive before the registration watchdog."""
    ABORTED = "aborted"
    PROTOCOL = "protocol"
    """The peer broke a protocol rule concerning this request."""


class FreeReason(str, enum.Enum):
    """Why a producer let go of a request's blocks."""

    SENT = "sent"
    """Every consumer rank that needed them said it is done (pull) / every write landed."""
    NOTHING_TO_SEND = "nothing_to_send"
    EXPIRED = "expired"
    ABORTED = "aborted"
    FAILED = "failed"
    PROTOCOL = "protocol"


class Action(msgspec.Struct, frozen=True):
    """Base of every output."""


class StartHandshake(Action, frozen=True):
    """Fetch ``engine_id``'s metadata over the side channel; answer with ``attempt`` echoed.

    ``expected_tp_size`` is what the request parameters claimed (the handshake is the
    authority); the machine times the attempt out itself after ``handshake_timeout_s``.
    """

    engine_id: str
    attempt: int
    host: str
    port: int
    expected_tp_size: int
    expected_pp_size: int = 1


class PostRead(Action, frozen=True):
    """Consumer, pull: READ ``remote_block_ids`` of one remote rank into ``local_block_ids``.

    The two lists pair up group by group and position by position (the producer's list is
    already trimmed to its tail). ``notification`` must be attached so the producer learns
    the read is over only after the data moved. With the consumer's TP smaller than the
    producer's, several reads fill different chunks of the same local blocks; the chunk is
    ``remote tp_rank % (remote_tp // local_tp)``.
    """

    xfer_id: int
    request_id: str
    engine_id: str
    remote_rank: RemoteRank
    remote_tp_size: int
    local_block_ids: BlockIds
    remote_block_ids: BlockIds
    notification: bytes


Piece = tuple[int, int, int, int]
"""Streaming push: ``(first_unit, end_unit, first_token, end_token)``, a rectangle of stream
units (runs of local regions, in order) by tokens. ``end_unit`` -1: through the last region;
``end_token`` -1: through the prompt's end."""


class PostWrite(Action, frozen=True):
    """Producer, push: WRITE ``local_block_ids`` into ``remote_block_ids`` of one D rank.

    ``pieces`` empty: the whole request. Otherwise only those rectangles (a streaming round);
    ``notification`` is then empty except on the last round.
    """

    xfer_id: int
    request_id: str
    engine_id: str
    remote_rank: RemoteRank
    remote_tp_size: int
    local_block_ids: BlockIds
    remote_block_ids: BlockIds
    notification: bytes
    pieces: tuple[Piece, ...] = ()


class CancelTransfer(Action, frozen=True):
    """Abort and release a transfer that is no longer wanted (its request failed/aborted)."""

    xfer_id: int
    request_id: str


class ReleaseTransfer(Action, frozen=True):
    """Try again to release the handle of a transfer whose release failed."""

    xfer_id: int
    request_id: str


class SendNotification(Action, frozen=True):
    """Send ``data`` to the listed ranks of ``engine_id`` (every agent of it when empty).

    ``request_id`` names the local request it is about, or None for engine-level messages
    (heartbeats, releases queued for a handshake).
    """

    engine_id: str
    ranks: tuple[RemoteRank, ...]
    data: bytes
    request_id: str | None = None


class QueryLeases(Action, frozen=True):
    """Consumer, pull: ask the listener of ``engine_id`` (at ``host:port``, a producer that
    announced :data:`~kvwire.wire.schemas.LEASE_QUERY`) which lease deadline each of
    ``ranks`` holds for ``remote_request_ids``; answer with a ``LeaseConfirmed`` for the
    local id at the same position of ``request_ids``, carrying the earliest deadline over
    the ranks (None if any rank does not hold it)."""

    engine_id: str
    host: str
    port: int
    ranks: tuple[RemoteRank, ...]
    request_ids: tuple[str, ...]
    remote_request_ids: tuple[str, ...]


class FreeBlocks(Action, frozen=True):
    """Producer: the request's blocks may be reused now. Emitted exactly once per held request."""

    request_id: str
    block_ids: BlockIds
    reason: FreeReason


class RequestDone(Action, frozen=True):
    """Consumer: the request's KV is in its local blocks. A terminal outcome."""

    request_id: str


class RequestFailed(Action, frozen=True):
    """Consumer: the request ended without its KV. A terminal outcome.

    ``invalid_block_ids`` are the local blocks whose contents must not be trusted (recompute
    them); no READ of ours into them is still running when this is emitted. Push: after
    our registration went out the producer may still WRITE into them until
    ``writes_until`` (our clock), the end of its write bound; reusing them for another
    request before then risks that request's bytes.
    """

    request_id: str
    invalid_block_ids: BlockIds
    reason: FailReason
    detail: str = ""
    writes_until: float | None = None


class EvictEngine(Action, frozen=True):
    """Forget ``engine_id``'s agents and descriptors: idle past its TTL, nothing in flight."""

    engine_id: str


class PeerMisbehaved(Action, frozen=True):
    """A peer broke a protocol rule (log and count it); ``request_id`` if one request suffers."""

    detail: str
    engine_id: str | None = None
    request_id: str | None = None


class ArmTimer(Action, frozen=True):
    """The machine's earliest deadline moved earlier: call ``handle(Timer(), now)`` by then.

    ``next_deadline()`` always gives the same answer; this action saves polling it.
    """

    deadline: float


ACTION_TYPES: tuple[type[Action], ...] = (
    StartHandshake,
    PostRead,
    PostWrite,
    CancelTransfer,
    ReleaseTransfer,
    SendNotification,
    QueryLeases,
    FreeBlocks,
    RequestDone,
    RequestFailed,
    EvictEngine,
    PeerMisbehaved,
    ArmTimer,
)
