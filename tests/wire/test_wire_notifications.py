"""Notification framing: completion, heartbeat, PUSH_REG, and what is refused."""

from __future__ import annotations

import pytest

import kvwire


def test_completion_request_id_may_contain_colons() -> None:
    wire = kvwire.encode_completion("chatcmpl:abc:def", 4)
    assert wire == b"chatcmpl:abc:def:4"
    assert kvwire.decode_notification(wire) == kvwire.Completion("chatcmpl:abc:def", 4)


def test_completion_non_ascii_id_round_trips() -> None:
    wire = kvwire.encode_completion("req-é", 2)
    assert kvwire.decode_notification(wire) == kvwire.Completion("req-é", 2)


@pytest.mark.parametrize(
    "data",
    [
        b"req",  # no count
        b"req:",  # empty count
        b":3",  # empty id
        b"req:0",  # a world size is at least 1
        b"req:-1",
        b"req:+1",
        b"req: 1",
        b"req:1 ",
        b"req:1_0",
        b"req:\xd9\xa1",  # Arabic-Indic digit one: int() accepts it, we do not
        b"req:1.0",
        b"req:9999999999",  # absurd world size
        b"\xff\xfereq:1",  # not UTF-8
    ],
)
def test_bad_completions_are_rejected(data: bytes) -> None:
    with pytest.raises(kvwire.WireDecodeError):
        kvwire.decode_notification(data)


@pytest.mark.parametrize(
    ("request_id", "count"),
    [("", 1), ("HB:x", 1), ("PUSH_REG:x", 1), ("r", 0), ("r", -2), ("r", True), ("r", 1.5)],
)
def test_ambiguous_completions_are_not_encoded(request_id: str, count: object) -> None:
    with pytest.raises(kvwire.WireEncodeError):
        kvwire.encode_completion(request_id, count)  # type: ignore[arg-type]


def test_heartbeat_round_trip_and_empty() -> None:
    assert kvwire.decode_notification(b"HB:") == kvwire.Heartbeat(())
    assert kvwire.encode_heartbeat([]) == b"HB:"
    hb = kvwire.Heartbeat(("a", "b:c", "d"))
    assert kvwire.decode_notification(kvwire.encode(hb)) == hb


@pytest.mark.parametrize("ids", [["a,b"], ["a", ""], [""], ["ok", 3]])
def test_heartbeat_ids_that_cannot_round_trip_are_refused(ids: list[object]) -> None:
    with pytest.raises(kvwire.WireEncodeError):
        kvwire.encode_heartbeat(ids)  # type: ignore[arg-type]


@pytest.mark.parametrize("data", [b"HB:a,,b", b"HB:,", b"HB:a,", b"HB:\xff"])
def test_bad_heartbeats_are_rejected(data: bytes) -> None:
    with pytest.raises(kvwire.WireDecodeError):
        kvwire.decode_notification(data)


REG = kvwire.PushRegistration(
    request_id="cmpl-1",
    decode_engine_id="d",
    decode_host="10.0.0.1",
    decode_port=5600,
    decode_tp_size=2,
    local_block_ids=[[1, 2], [3]],
    remote_engine_id="p",
    remote_host="10.0.0.2",
    remote_port=5700,
    remote_tp_size=1,
    remote_pp_size=1,
)


def test_push_registration_round_trip() -> None:
    wire = kvwire.encode(REG)
    assert wire.startswith(b"PUSH_REG:\x8b")
    assert kvwire.decode_notification(wire) == REG
    assert kvwire.decode(wire, kvwire.PushRegistration) == REG


@pytest.mark.parametrize(
    "data",
    [
        b"PUSH_REG:",
        b"PUSH_REG:\x80",  # empty map: required fields missing
        b"PUSH_REG:\xc1",  # never-used msgpack byte
        kvwire.encode(REG)[:-1],  # truncated
        kvwire.encode(REG).replace(b"\xcd\x15\xe0", b"\xa2xx", 1),  # port as str
        kvwire.encode(REG).replace(b"\xcd\x15\xe0", b"\xd1\xff\xff", 1),  # negative port
    ],
)
def test_bad_push_registrations_are_rejected(data: bytes) -> None:
    with pytest.raises(kvwire.WireDecodeError):
        kvwire.decode_notification(data)


def test_kind_specific_decode_refuses_other_kinds() -> None:
    with pytest.raises(kvwire.WireDecodeError, match="Heartbeat"):
        kvwire.decode(b"req:1", kvwire.Heartbeat)
    with pytest.raises(kvwire.WireDecodeError):
        kvwire.decode(b"HB:a", kvwire.Completion)
    assert kvwire.decode(b"HB:a", kvwire.Heartbeat) == kvwire.Heartbeat(("a",))


def test_notification_size_limit() -> None:
    wire = kvwire.encode_heartbeat([f"id-{i}" for i in range(1000)])
    with pytest.raises(kvwire.WireDecodeError, match="exceeds"):
        kvwire.decode_notification(wire, max_size=100)
    assert len(kvwire.decode_notification(wire).request_ids) == 1000  # type: ignore[union-attr]
