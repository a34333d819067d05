"""What a driver tells a machine: the inputs of ``machine.handle(event, now)``.

Events are frozen and checked on construction, so a malformed event fails where it is made,
not deep inside a transition. Time is never part of an event: the driver passes ``now``
alongside, in the clock of the process that runs the machine.

Block ids are per KV-cache group: ``((b0, b1, ...), (c0, ...))``, one tuple per group, logical
ids as the engine's block manager hands them out. The machine never builds descriptors; the
driver turns block ids plus a remote rank into descriptors with :mod:`kvwire.layout`.
"""

from __future__ import annotations

import math
from array import array

import msgspec

from kvwire.errors import LocalProtocolError

BlockIds = tuple[tuple[int, ...], ...]
"""Logical block ids, one tuple per KV-cache group."""


def check_block_ids(block_ids: object, what: str) -> None:
    """Raise :class:`LocalProtocolError` unless ``block_ids`` is a tuple of int tuples >= 0."""
    if type(block_ids) is not tuple:
        raise LocalProtocolError(f"{what} must be a tuple of per-group tuples")
    for group in block_ids:
        if type(group) is not tuple:
            raise LocalProtocolError(f"{what} must be a tuple of per-group tuples")
        if not group:
            continue
        try:
            ids = array("q", group)  # C-level type check: ints only
        except (TypeError, OverflowError):
            raise LocalProtocolError(f"{what} must hold integer block ids") from None
        if min(ids) < 0:
            raise LocalProtocolError(f"{what} holds a negative block id")


def _check_id(value: object, what: str) -> None:
    if type(value) is not str or not value:
        raise LocalProtocolError(f"{what} must be a non-empty str, got {value!r}")


class Event(msgspec.Struct, frozen=True):
    """Base of every input."""


class RemotePrefill(msgspec.Struct, frozen=True, kw_only=True):
    """The producer's side of one request, as the consumer learns it from kv_transfer_params.

    ``engine_id``/``request_id`` are the *producer's* (``remote_engine_id``,
    ``remote_request_id``); ``block_ids`` is ``remote_block_ids`` (empty in push mode);
    ``blocks_expiry_time`` is in the producer's clock and is converted with the handshake's
    clock offset. The machine checks the protocol rules (no ',' in the id, sizes >= 1) itself
    and fails only this request if they are broken, because these values come from the peer.
    """

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: BlockIds = ()
    tp_size: int = 1
    pp_size: int = 1
    dcp_size: int = 1
    blocks_expiry_time: float | None = None


class RequestAdded(Event, frozen=True):
    """A request this rank takes part in.

    Consumer: ``remote`` is required (where the prompt's KV lives). Producer: ``remote`` is
    None; the request is being prefilled and its blocks are not held yet.
    """

    request_id: str
    remote: RemotePrefill | None = None

    def __post_init__(self) -> None:
        _check_id(self.request_id, "request_id")
        if self.remote is not None and not isinstance(self.remote, RemotePrefill):
            raise LocalProtocolError("remote must be a RemotePrefill or None")


class AllocationDone(Event, frozen=True):
    """Consumer: the engine allocated the blocks to fill (only the uncomputed suffix).

    Empty ``block_ids`` (a full local prefix hit) means nothing to move: the producer is only
    told it may free.
    """

    request_id: str
    block_ids: BlockIds

    def __post_init__(self) -> None:
        _check_id(self.request_id, "request_id")
        check_block_ids(self.block_ids, "block_ids")


class PrefillFinished(Event, frozen=True):
    """Producer: the prompt is computed; the machine now holds ``block_ids`` until released.

    ``lease_deadline``/``scheduler_clock`` let a deadline stamped by another process (the
    scheduler) be rebased onto this process's clock: ``now + (deadline - scheduler_clock)``;
    ``scheduler_clock == 0`` means the deadline is already absolute in this clock. Without a
    deadline the lease is ``now + L``.
    """

    request_id: str
    block_ids: BlockIds
    lease_deadline: float | None = None
    scheduler_clock: float = 0.0

    def __post_init__(self) -> None:
        _check_id(self.request_id, "request_id")
        check_block_ids(self.block_ids, "block_ids")


class ChunkScheduled(Event, frozen=True):
    """Producer, streaming push: a forward step computes the prompt through ``num_tokens``.

    ``block_ids`` are the request's blocks so far (they cover at least ``num_tokens``);
    ``units`` is how many leading stream units (region runs, in region order) may be written
    before the prompt ends: the last layer is always held back for the final WRITE, which
    carries the completion, so no bytes are ever written after it. ``num_tokens`` is
    rounded down to whole blocks by the caller: a block is written once, when full.
    """

    request_id: str
    num_tokens: int
    block_ids: BlockIds
    units: int

    def __post_init__(self) -> None:
        _check_id(self.request_id, "request_id")
        check_block_ids(self.block_ids, "block_ids")
        for name in ("num_tokens", "units"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise LocalProtocolError(f"{name} must be an int >= 0, got {value!r}")


class LayersComputed(Event, frozen=True):
    """Producer, streaming push: the first ``units`` stream units of these requests' current
    chunks are computed (one event per layer for a whole batch: O(batch), never O(blocks))."""

    request_ids: tuple[str, ...]
    units: int

    def __post_init__(self) -> None:
        if type(self.request_ids) is not tuple:
            raise LocalProtocolError("request_ids must be a tuple of str")
        for rid in self.request_ids:
            _check_id(rid, "request_id")
        if type(self.units) is not int or self.units < 0:
            raise LocalProtocolError(f"units must be an int >= 0, got {self.units!r}")


class Preempted(Event, frozen=True):
    """Producer, streaming push: the engine took the request's blocks back to recompute it
    later; what was written from them is rewritten from the new blocks."""

    request_id: str

    def __post_init__(self) -> None:
        _check_id(self.request_id, "request_id")


class HandshakeDone(Event, frozen=True):
    """The side-channel handshake with ``engine_id`` (started by ``StartHandshake``) worked.

    ``clock_offset`` is the remote clock minus ours (``remote_ts - (t_send + t_recv) / 2`` of
    the lowest-RTT sample). ``attempt`` echoes the action's, so a late answer to an abandoned
    attempt is recognised and ignored.
    """

    engine_id: str
    attempt: int
    remote_tp_size: int
    remote_pp_size: int = 1
    clock_offset: float = 0.0
    peer_features: frozenset[str] = frozenset()
    """kvwire additions the peer announced (:data:`kvwire.wire.schemas.FEATURES`)."""
    clock_uncertainty: float = 0.0
    """How far ``clock_offset`` may be off (half the sample's RTT): a consumer moves the
    producer's expiry time this much earlier, so its read deadline is never late."""

    def __post_init__(self) -> None:
        _check_id(self.engine_id, "engine_id")
        u = self.clock_uncertainty
        if not isinstance(u, (int, float)) or not u >= 0 or u == float("inf"):
            raise LocalProtocolError(f"clock_uncertainty must be finite and >= 0, got {u!r}")
        if type(self.remote_tp_size) is not int or self.remote_tp_size < 1:
            raise LocalProtocolError(f"remote_tp_size must be >= 1, got {self.remote_tp_size}")
        if type(self.remote_pp_size) is not int or self.remote_pp_size < 1:
            raise LocalProtocolError(f"remote_pp_size must be >= 1, got {self.remote_pp_size}")


class HandshakeFailed(Event, frozen=True):
    """The handshake with ``engine_id`` failed (timeout, refused, incompatible peer)."""

    engine_id: str
    attempt: int
    reason: str = ""

    def __post_init__(self) -> None:
        _check_id(self.engine_id, "engine_id")


class TransferPosted(Event, frozen=True):
    """The READ/WRITE of ``PostRead``/``PostWrite`` number ``xfer_id`` was posted."""

    xfer_id: int


class TransferDone(Event, frozen=True):
    """The transfer completed (every byte landed) and its handle was released."""

    xfer_id: int


class TransferFailed(Event, frozen=True):
    """The transfer failed to post, failed, or was cancelled; its handle was released."""

    xfer_id: int
    reason: str = ""


class ReleaseFailed(Event, frozen=True):
    """Releasing the transfer's handle failed: DMA may still run, so its blocks stay held.

    The machine asks again with ``ReleaseTransfer`` after ``release_retry_s``; the driver
    answers that with ``TransferDone``/``TransferFailed`` (released) or ``ReleaseFailed``.
    """

    xfer_id: int
    reason: str = ""


class NotificationReceived(Event, frozen=True):
    """Raw notification bytes from the transport; ``sender`` is the sending agent's name.

    The sender lets the machine count completions from distinct ranks, so a duplicated
    notification can never complete a request early.
    """

    sender: str
    data: bytes


class Abort(Event, frozen=True):
    """The engine gave up on the request (at any stage); aborting an unknown id is a no-op."""

    request_id: str

    def __post_init__(self) -> None:
        _check_id(self.request_id, "request_id")


class PeerLost(Event, frozen=True):
    """The transport says ``engine_id`` went away (crash, restart): forget its handshake.

    Its transfers still end through ``TransferFailed``; the next request handshakes again.
    """

    engine_id: str

    def __post_init__(self) -> None:
        _check_id(self.engine_id, "engine_id")


class LeaseConfirmed(Event, frozen=True):
    """Consumer, pull: the producer answered a lease query (``QueryLeases``) for this
    request: ``deadline`` is the earliest lease deadline its queried ranks hold, in the
    *producer's* clock (the machine moves it into ours with the handshake's offset and
    uncertainty, as it does the expiry in the params), or None when a rank does not hold
    the blocks under a lease. Evidence only ever moves the read deadline later, and only
    while it is still ahead; an answer for a request that ended is ignored."""

    request_id: str
    deadline: float | None = None

    def __post_init__(self) -> None:
        _check_id(self.request_id, "request_id")
        d = self.deadline
        if d is not None and (
            isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d)
        ):
            raise LocalProtocolError(f"deadline must be a finite float or None, got {d!r}")


class Timer(Event, frozen=True):
    """``now`` reached ``machine.next_deadline()``: reap leases, fire watchdogs, heartbeat."""


EVENT_TYPES: tuple[type[Event], ...] = (
    RequestAdded,
    AllocationDone,
    PrefillFinished,
    ChunkScheduled,
    LayersComputed,
    Preempted,
    HandshakeDone,
    HandshakeFailed,
    TransferPosted,
    TransferDone,
    TransferFailed,
    ReleaseFailed,
    NotificationReceived,
    Abort,
    PeerLost,
    LeaseConfirmed,
    Timer,
)
