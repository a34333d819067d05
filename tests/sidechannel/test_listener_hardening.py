"""The listener survives a flood of bad requests and still answers a good one."""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq

from kvwire import decode_clock_reply, encode_handshake_request
from kvwire.config import RetryPolicy
from kvwire.errors import HandshakeError, HandshakeTimeoutError, PeerUnreachableError
from kvwire.sidechannel import (
    HandshakeClient,
    HandshakeListener,
    ListenerLimits,
    refusal_reason,
)

PAYLOADS = {(0, 0): b"payload-0-0", (0, 1): b"payload-0-1", (1, 0): b"payload-1-0"}


def _wait_until(predicate: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.005)
    raise AssertionError("condition not reached in time")


def _malformed_bodies(rng: random.Random) -> list[list[bytes]]:
    """Bodies that follow a REQ envelope, each wrong in its own way (1,000 in all)."""
    bodies: list[list[bytes]] = []
    for _ in range(500):  # random bytes
        bodies.append([rng.randbytes(rng.randint(0, 200))])
    for i in range(150):  # wrong frame counts
        bodies.append([encode_handshake_request(0, 0)] * (2 + i % 3))
    for i in range(150):  # unknown ranks
        bodies.append([encode_handshake_request(7 + i, i)])
    for i in range(100):  # well-formed msgpack, wrong shape or tag
        shapes: list[object] = [
            ["get_meta_msg", 0, 0],
            [b"get_meta_msg", 0],
            [b"get_meta_msg", -1, 0],
            [b"other", 0, 0],
            {"pp": 0},
            [b"get_meta_msg", 0, 0, 0],
            [b"get_meta_msg", 1 << 40, 0],
            [b"get_meta_msg", "0", 0],
        ]
        bodies.append([msgspec.msgpack.encode(shapes[i % len(shapes)])])
    for _ in range(100):  # oversize but below libzmq's per-frame cap: split across frames
        bodies.append([b"x" * 900, b"y" * 900])
    rng.shuffle(bodies)
    return bodies


def test_thousand_malformed_requests_then_a_valid_one() -> None:
    rng = random.Random(1234)
    bodies = _malformed_bodies(rng)
    # One DEALER pipelines all 1,000 requests before reading an answer: the default limits
    # refuse exactly that (rate) and drop answers a peer does not read (queue), so this test,
    # which wants every answer, lifts both. test_listener_hostile covers the defaults.
    limits = ListenerLimits.unlimited_rate(queued_per_peer=2000)
    with HandshakeListener(PAYLOADS, max_request_bytes=1024, limits=limits) as listener:
        endpoint = f"tcp://127.0.0.1:{listener.port}"
        ctx = zmq.Context()
        try:
            # A DEALER speaks the REQ envelope without waiting between requests.
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVTIMEO, 30_000)
            dealer.connect(endpoint)
            for body in bodies:
                dealer.send_multipart([b"", *body])
            refusals = 0
            for _ in bodies:
                frames = dealer.recv_multipart()
                assert frames[0] == b"" and len(frames) == 3
                assert refusal_reason(frames[1]) is not None
                decode_clock_reply(frames[2])
                refusals += 1
            assert refusals == len(bodies) == 1000

            # No envelope at all: nothing to answer on, so dropped and counted.
            raw = ctx.socket(zmq.DEALER)
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(endpoint)
            for _ in range(20):
                raw.send(encode_handshake_request(0, 0))
            # Huge frames: libzmq cuts the connection before Python sees them.
            huge = ctx.socket(zmq.DEALER)
            huge.setsockopt(zmq.LINGER, 0)
            huge.connect(endpoint)
            for _ in range(5):
                huge.send_multipart([b"", b"z" * (4 << 20)])
            _wait_until(lambda: listener.stats().dropped == 20)
            for sock in (dealer, raw, huge):
                sock.close(linger=0)
        finally:
            ctx.destroy(linger=0)

        stats = listener.stats()
        assert stats.served == 0
        assert stats.refused_unknown_rank == 150
        assert stats.refused_oversize == 100
        assert stats.refused_malformed == 1000 - 150 - 100
        assert listener.running

        with HandshakeClient(RetryPolicy(timeout=10.0)) as client:
            replies = client.fetch_payloads("127.0.0.1", listener.port, [(0, 1), (1, 0)])
        assert replies.replies[(0, 1)].payload == PAYLOADS[(0, 1)]
        assert replies.replies[(1, 0)].payload == PAYLOADS[(1, 0)]
        assert listener.stats().served == 2


def test_refusal_is_a_handshake_error_naming_the_rank() -> None:
    with HandshakeListener(PAYLOADS) as listener, HandshakeClient() as client:
        with pytest.raises(HandshakeError, match=r"\(3, 3\)"):
            client.fetch_payloads("127.0.0.1", listener.port, [(3, 3)])
        assert listener.stats().refused_unknown_rank == 1


def test_silent_peer_times_out_after_retries_with_backoff() -> None:
    delays: list[float] = []
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # accepts connections, never answers
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        policy = RetryPolicy(timeout=0.05, retries=3, backoff=0.01, backoff_max=0.02)
        with (
            HandshakeClient(policy, sleep=delays.append) as client,
            pytest.raises(HandshakeTimeoutError, match="4 attempts"),
        ):
            client.fetch_payloads("127.0.0.1", port, [(0, 0)])
        assert delays == [0.01, 0.02, 0.02]
    finally:
        silent.close(linger=0)
        ctx.term()


def test_a_refused_connection_fails_at_once_and_a_later_handshake_succeeds() -> None:
    """Nothing listening is final for that handshake (no retry, well under a second); the
    next handshake, once the listener is up, succeeds."""
    probe = zmq.Context()
    s = probe.socket(zmq.ROUTER)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    s.close(linger=0)
    probe.term()
    policy = RetryPolicy(timeout=0.5, retries=5, backoff=0.01)
    t0 = time.monotonic()
    with HandshakeClient(policy) as client, pytest.raises(PeerUnreachableError, match="refused"):
        client.fetch_payloads("127.0.0.1", port, [(0, 0)])
    assert time.monotonic() - t0 < 1.0
    listener = HandshakeListener(PAYLOADS, port=port).start()
    try:
        with HandshakeClient(policy) as client:
            replies = client.fetch_payloads("127.0.0.1", port, [(0, 0)])
        assert replies.replies[(0, 0)].payload == PAYLOADS[(0, 0)]
    finally:
        listener.close()


def test_close_is_prompt_and_leaves_no_thread() -> None:
    import threading

    before = {t.ident for t in threading.enumerate()}
    listener = HandshakeListener(PAYLOADS).start()
    t0 = time.monotonic()
    listener.close()
    assert time.monotonic() - t0 < 2.0
    assert not listener.running
    assert {t.ident for t in threading.enumerate()} <= before
    listener.close()  # twice is fine


def test_set_payloads_takes_effect() -> None:
    with HandshakeListener(PAYLOADS) as listener, HandshakeClient() as client:
        listener.set_payloads({(0, 0): b"new"})
        got = client.fetch_payloads("127.0.0.1", listener.port, [(0, 0)])
        assert got.replies[(0, 0)].payload == b"new"


def test_port_in_use_is_a_handshake_error() -> None:
    with (
        HandshakeListener(PAYLOADS) as first,
        pytest.raises(HandshakeError, match="cannot listen"),
    ):
        HandshakeListener(PAYLOADS, port=first.port).start()
