"""kvwire's lease query over the real side channel: a listener answers it from the rank's
lease table, and refuses everything else about it with a reason, never crashing."""

from __future__ import annotations

import random
from collections.abc import Sequence

import msgspec
import pytest
import zmq

from kvwire import wire
from kvwire.config import RetryPolicy
from kvwire.errors import HandshakeAuthError, HandshakeError, HandshakeTimeoutError
from kvwire.sidechannel import HandshakeClient, HandshakeListener, refusal_reason
from kvwire.wire.schemas import LeaseQuery

TABLE = {"held": 1234.5, "also": 99.0}


def _source(ids: Sequence[str]) -> list[float | None]:
    return [TABLE.get(rid) for rid in ids]


def _listener(**kw: object) -> HandshakeListener:
    listener = HandshakeListener({(0, 0): b"payload"}, **kw).start()  # type: ignore[arg-type]
    listener.set_lease_source((0, 1), _source)
    return listener


def test_a_listener_answers_from_the_ranks_lease_table() -> None:
    with _listener() as listener, HandshakeClient(RetryPolicy(timeout=5.0)) as client:
        got = client.query_leases("127.0.0.1", listener.port, (0, 1), ["held", "gone", "also"])
        assert got == [1234.5, None, 99.0]
        assert listener.stats().leases_answered == 1 and listener.stats().rejected == 0


def test_many_ids_are_asked_in_queries_that_fit_the_request_limit() -> None:
    ids = [f"cmpl-{i:04d}-{'x' * 40}" for i in range(150)] + ["held"]
    with _listener() as listener, HandshakeClient(RetryPolicy(timeout=5.0)) as client:
        got = client.query_leases("127.0.0.1", listener.port, (0, 1), ids)
        assert got == [None] * 150 + [1234.5]
        assert listener.stats().leases_answered >= 3 and listener.stats().rejected == 0


def test_a_rank_without_a_lease_table_refuses_and_the_client_says_so() -> None:
    with _listener() as listener, HandshakeClient(RetryPolicy(timeout=5.0)) as client:
        with pytest.raises(HandshakeError, match="no lease table for rank"):
            client.query_leases("127.0.0.1", listener.port, (0, 0), ["held"])
        listener.set_lease_source((0, 1), None)
        with pytest.raises(HandshakeError, match="no lease table"):
            client.query_leases("127.0.0.1", listener.port, (0, 1), ["held"])
        assert listener.stats().refused_unknown_rank == 2


def test_with_a_secret_the_query_is_neither_served_nor_sent() -> None:
    secret = b"s" * 32
    with _listener(secret=secret) as listener:
        with (
            HandshakeClient(RetryPolicy(timeout=5.0)) as plain,
            pytest.raises(HandshakeError, match="authentication"),
        ):
            plain.query_leases("127.0.0.1", listener.port, (0, 1), ["held"])
        with (
            HandshakeClient(RetryPolicy(timeout=5.0), secret=secret) as authed,
            pytest.raises(HandshakeAuthError),
        ):
            authed.query_leases("127.0.0.1", listener.port, (0, 1), ["held"])
        assert listener.stats().leases_answered == 0


def test_hostile_lease_queries_are_refused_and_the_listener_carries_on() -> None:
    rng = random.Random(18)
    tag = wire.LEASE_QUERY_TAG
    bodies = [
        msgspec.msgpack.encode([tag, 0, 1, ["x"] * 65]),
        msgspec.msgpack.encode([tag, 0, 1, [""]]),
        msgspec.msgpack.encode([tag, -1, 1, ["a"]]),
        msgspec.msgpack.encode([tag, 0, 1, [1, 2]]),
        msgspec.msgpack.encode([tag, 0, 1]),
        wire.encode_lease_query(LeaseQuery(0, 1, ["held"]))[:-2],
    ] + [b"\x94\xc4\x0e" + tag + rng.randbytes(rng.randint(0, 60)) for _ in range(200)]
    with _listener() as listener:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(f"tcp://127.0.0.1:{listener.port}")
        try:
            refused = 0
            for body in bodies:
                sock.send(body)
                answer, _clock = sock.recv_multipart()
                refused += refusal_reason(answer) is not None
            assert refused >= 6
            sock.send(wire.encode_lease_query(LeaseQuery(0, 1, ["held"])))
            answer, clock = sock.recv_multipart()
            assert wire.decode_lease_reply(answer).deadlines == [1234.5]
            assert wire.decode_clock_reply(clock) > 0
        finally:
            sock.close(linger=0)
            ctx.term()
        stats = listener.stats()
        assert stats.internal_errors == 0 and stats.refused_malformed >= 6


def test_a_silent_peer_is_a_timeout_after_one_attempt() -> None:
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        with (
            HandshakeClient(RetryPolicy(timeout=0.05, retries=3)) as client,
            pytest.raises(HandshakeTimeoutError, match="no lease answer"),
        ):
            client.query_leases("127.0.0.1", port, (0, 0), ["a"])
    finally:
        silent.close(linger=0)
        ctx.term()
