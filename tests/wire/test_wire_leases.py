"""The lease-query extension's two messages: exact bytes, and every bad input refused with
a one-line WireDecodeError (the fuzz targets cover random and mutated input)."""

from __future__ import annotations

import msgspec
import pytest

from kvwire import wire
from kvwire.errors import WireDecodeError, WireEncodeError
from kvwire.wire.schemas import FEATURES, LEASE_QUERY, MAX_LEASE_IDS, LeaseQuery, LeaseReply


def test_the_feature_is_announced_in_every_kvwire_hello() -> None:
    assert LEASE_QUERY in FEATURES


def test_query_is_a_tagged_msgpack_array_and_round_trips() -> None:
    query = LeaseQuery(pp_rank=1, tp_rank=2, request_ids=["cmpl-a", "cmpl-b"])
    data = wire.encode_lease_query(query)
    assert msgspec.msgpack.decode(data) == [wire.LEASE_QUERY_TAG, 1, 2, ["cmpl-a", "cmpl-b"]]
    assert wire.decode_lease_query(data) == query


def test_reply_is_a_bare_array_of_deadlines_and_round_trips() -> None:
    data = wire.encode_lease_reply(LeaseReply([12.5, None]))
    assert msgspec.msgpack.decode(data) == [12.5, None]
    assert wire.decode_lease_reply(data).deadlines == [12.5, None]


ENC = msgspec.msgpack.encode
TAG = wire.LEASE_QUERY_TAG
BAD_QUERIES = {
    "empty": b"",
    "truncated": wire.encode_lease_query(LeaseQuery(0, 0, ["abc"]))[:-1],
    "handshake request": wire.encode_handshake_request(0, 0),
    "wrong tag": ENC([b"kvwire_lease_x", 0, 0, ["a"]]),
    "tag as str": ENC([TAG.decode(), 0, 0, ["a"]]),
    "negative rank": ENC([TAG, -1, 0, ["a"]]),
    "huge rank": ENC([TAG, 0, 1 << 40, ["a"]]),
    "bool rank": ENC([TAG, True, 0, ["a"]]),
    "empty id": ENC([TAG, 0, 0, [""]]),
    "id not a str": ENC([TAG, 0, 0, [7]]),
    "ids not a list": ENC([TAG, 0, 0, {"a": 1}]),
    "too many ids": ENC([TAG, 0, 0, ["x"] * (MAX_LEASE_IDS + 1)]),
    "extra field": ENC([TAG, 0, 0, ["a"], 1]),
    "oversize": ENC([TAG, 0, 0, ["x" * 1100]]),
    "a map": ENC({"pp_rank": 0, "tp_rank": 0, "request_ids": ["a"]}),
    "nested deep": b"\x94" + b"\x91" * 5000,
}


@pytest.mark.parametrize("data", BAD_QUERIES.values(), ids=BAD_QUERIES.keys())
def test_a_bad_query_is_a_one_line_decode_error(data: bytes) -> None:
    with pytest.raises(WireDecodeError) as err:
        wire.decode_lease_query(data)
    assert "\n" not in str(err.value)


BAD_REPLIES = {
    "empty": b"",
    "truncated": wire.encode_lease_reply(LeaseReply([1.0, 2.0]))[:-3],
    "nan": ENC([float("nan")]),
    "inf": ENC([float("inf"), None]),
    "-inf": ENC([float("-inf")]),
    "a str": ENC(["1.0"]),
    "a bool": ENC([True]),
    "not a list": ENC(1.0),
    "too many": ENC([1.0] * (MAX_LEASE_IDS + 1)),
    "oversize": b"\xdc\xff\xff" + b"\xc0" * 2000,
    "refusal frame": b"KVWIRE_ERROR:no",
}


@pytest.mark.parametrize("data", BAD_REPLIES.values(), ids=BAD_REPLIES.keys())
def test_a_bad_reply_is_a_one_line_decode_error(data: bytes) -> None:
    with pytest.raises(WireDecodeError) as err:
        wire.decode_lease_reply(data)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "query",
    [
        LeaseQuery(0, 0, ["x"] * (MAX_LEASE_IDS + 1)),
        LeaseQuery(0, 0, ["x" * 2000]),
        LeaseQuery(0, 0, [""]),
    ],
    ids=["too many", "too large", "empty id"],
)
def test_kvwire_never_encodes_a_query_its_listener_would_refuse(query: LeaseQuery) -> None:
    with pytest.raises(WireEncodeError):
        wire.encode_lease_query(query)


def test_kvwire_never_encodes_a_non_finite_deadline() -> None:
    with pytest.raises(WireEncodeError):
        wire.encode_lease_reply(LeaseReply([float("nan")]))
