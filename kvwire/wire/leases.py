"""The lease query, kvwire's side-channel extension ``lease-query`` (never sent to vLLM).

A consumer bounds each READ by the deadline its producer stated in the params. A kvwire
producer pushes that deadline back on every heartbeat, but heartbeats are one-way
notifications, so the consumer cannot know it. The query closes that gap over the
producer's listener, which already answers every consumer (pull mode gives the producer no
route of its own to the consumer): the consumer names request ids, the listener answers
the deadline the producer rank holds for each, in the producer's clock, with a clock frame
as every answer of that listener carries.

Both messages are small and bounded: the query by the listener's request limit (1 KiB) and
:data:`~kvwire.wire.schemas.MAX_LEASE_IDS`, the answer by the same count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, cast

import msgspec

from kvwire.errors import WireDecodeError, WireEncodeError
from kvwire.wire.codec import decode_struct, encode_struct
from kvwire.wire.handshake import MAX_RANK
from kvwire.wire.schemas import MAX_LEASE_IDS, LeaseDeadlines, LeaseQuery, LeaseReply

LEASE_QUERY_TAG = b"kvwire_lease_q"
MAX_LEASE_QUERY_SIZE = 1024
"""The listener's default request limit: a query is split to fit it."""
MAX_LEASE_REPLY_SIZE = 16 + 9 * MAX_LEASE_IDS
"""An array header and at most ``MAX_LEASE_IDS`` float64 values."""

_QueryWire = tuple[
    bytes,
    int,
    int,
    Annotated[list[str], msgspec.Meta(max_length=MAX_LEASE_IDS)],
]


def encode_lease_query(query: LeaseQuery) -> bytes:
    """``msgpack([b"kvwire_lease_q", pp_rank, tp_rank, [ids]])``; refuses what the decoder
    would refuse, so kvwire never sends a query a kvwire listener cannot read."""
    try:
        _check_query(query.pp_rank, query.tp_rank, query.request_ids)
    except WireDecodeError as exc:
        raise WireEncodeError(str(exc)) from None
    data = encode_struct((LEASE_QUERY_TAG, query.pp_rank, query.tp_rank, query.request_ids))
    if len(data) > MAX_LEASE_QUERY_SIZE:
        raise WireEncodeError(f"lease query of {len(data)} bytes exceeds {MAX_LEASE_QUERY_SIZE}")
    return data


def is_lease_query(data: bytes) -> bool:
    """Whether a side-channel request frame claims to be a lease query (cheap: the tag is
    within the first bytes; the frame is then decoded, or refused, as one)."""
    return LEASE_QUERY_TAG in data[:24]


def decode_lease_query(
    data: bytes | bytearray | memoryview, *, max_size: int = MAX_LEASE_QUERY_SIZE
) -> LeaseQuery:
    """The query a consumer sent; a wrong tag, shape or id is a ``WireDecodeError``."""
    fields: tuple[bytes, int, int, list[str]] = decode_struct(
        data, cast(Any, _QueryWire), max_size=max_size, what="lease query"
    )
    tag, pp_rank, tp_rank, ids = fields
    if tag != LEASE_QUERY_TAG:
        raise WireDecodeError(f"lease query: unknown tag {tag[:32]!r}")
    _check_query(pp_rank, tp_rank, ids)
    return LeaseQuery(pp_rank=pp_rank, tp_rank=tp_rank, request_ids=ids)


def _check_query(pp_rank: object, tp_rank: object, ids: Sequence[object]) -> None:
    for rank in (pp_rank, tp_rank):
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < MAX_RANK:
            raise WireDecodeError(f"lease query: rank ({pp_rank}, {tp_rank}) out of range")
    if len(ids) > MAX_LEASE_IDS:
        raise WireDecodeError(f"lease query: {len(ids)} ids, more than {MAX_LEASE_IDS}")
    for rid in ids:
        if not isinstance(rid, str) or not rid:
            raise WireDecodeError("lease query: a request id is empty or not a string")


def encode_lease_reply(reply: LeaseReply) -> bytes:
    """The bare msgpack array of deadlines (None: not held); non-finite values refused."""
    for value in reply.deadlines:
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise WireEncodeError(f"lease deadline must be a finite float or None, got {value!r}")
    if len(reply.deadlines) > MAX_LEASE_IDS:
        raise WireEncodeError(f"lease reply of {len(reply.deadlines)} values")
    return encode_struct([None if v is None else float(v) for v in reply.deadlines])


def decode_lease_reply(
    data: bytes | bytearray | memoryview, *, max_size: int = MAX_LEASE_REPLY_SIZE
) -> LeaseReply:
    """P's deadlines; NaN or infinity would extend a read forever, so they are refused."""
    values = decode_struct(data, LeaseDeadlines, max_size=max_size, what="lease reply")
    for value in values:
        if value is not None and not math.isfinite(value):
            raise WireDecodeError(f"lease reply: deadline {value!r} is not finite")
    return LeaseReply(deadlines=values)
