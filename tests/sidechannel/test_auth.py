"""The shared-secret handshake: only holders of the secret get metadata, plain mode unchanged.

Every "gets nothing" test checks the raw answer frames for the payload's bytes, not only
the exception, so a listener that leaked the payload next to a refusal would fail them.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from kvwire import cli, encode_handshake_request
from kvwire.config import KVWireConfig, RetryPolicy
from kvwire.config.secret import load_secret
from kvwire.errors import ConfigError, HandshakeAuthError
from kvwire.sidechannel import (
    ERROR_PREFIX,
    HandshakeClient,
    HandshakeListener,
    refusal_reason,
)
from kvwire.sidechannel.auth import CHALLENGE_PREFIX, ClientAuth, encode_hello, encode_proof

SECRET = b"kvwire-test-secret-0123456789abcdef"
OTHER = b"a-different-secret-0123456789abcdef"
VECTORS = Path(__file__).resolve().parents[1] / "vectors"
# A real handshake payload (vLLM 0.31.0), so decoding clients see real metadata.
VLLM_PAYLOAD = bytes.fromhex(
    json.loads((VECTORS / "vllm-0.31.0-nixl-v13.json").read_text())["handshake_payload"][0][
        "msgpack"
    ]
)
PAYLOADS = {(0, 0): VLLM_PAYLOAD, (0, 1): secrets.token_bytes(4096)}
FAST = RetryPolicy(timeout=10.0, retries=0)


@pytest.fixture
def auth_listener() -> Iterator[HandshakeListener]:
    with HandshakeListener(PAYLOADS, secret=SECRET) as listener:
        yield listener


@pytest.fixture
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _req(ctx: zmq.Context[zmq.Socket[bytes]], port: int) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _ask(sock: zmq.Socket[bytes], frame: bytes) -> list[bytes]:
    sock.send(frame)
    return sock.recv_multipart()


def _challenge(sock: zmq.Socket[bytes], auth: ClientAuth, pp_rank: int, tp_rank: int) -> bytes:
    """Send a hello; the challenge of its answer, which carries nothing of a payload."""
    hello = _ask(sock, encode_hello(pp_rank, tp_rank))
    challenge = auth.challenge_of(hello[0])
    assert challenge is not None and not _leaks(hello)
    return challenge


def _leaks(frames: list[bytes]) -> bool:
    """Whether any payload's bytes (or a 64-byte piece of one) appear in the frames."""
    blob = b"".join(frames)
    return any(p[i : i + 64] in blob for p in PAYLOADS.values() for i in (0, len(p) // 2))


# -- with the secret ----------------------------------------------------------------------


def test_client_with_the_secret_gets_every_payload(auth_listener: HandshakeListener) -> None:
    with HandshakeClient(FAST, secret=SECRET) as client:
        got = client.fetch_payloads("127.0.0.1", auth_listener.port, [(0, 0), (0, 1)])
    assert {k: r.payload for k, r in got.replies.items()} == PAYLOADS
    assert got.attempts == 2
    assert 0 < got.best_rtt < 10.0
    stats = auth_listener.stats()
    assert (stats.served, stats.challenges, stats.refused_auth) == (2, 2, 0)
    assert auth_listener.authenticated


def test_the_payload_never_crosses_the_wire_in_clear(
    auth_listener: HandshakeListener, zctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """Even the authenticated answer carries the payload sealed, not in clear."""
    auth = ClientAuth(SECRET)
    sock = _req(zctx, auth_listener.port)
    proof = auth.prove(0, 1, _challenge(sock, auth, 0, 1))
    answer = _ask(sock, encode_proof(proof))
    assert len(answer) == 3 and not _leaks(answer)
    assert auth.open(proof, *answer) == PAYLOADS[(0, 1)]


# -- without it ---------------------------------------------------------------------------


def test_client_without_the_secret_gets_nothing(
    auth_listener: HandshakeListener, zctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    with (
        HandshakeClient(FAST) as client,
        pytest.raises(HandshakeAuthError, match="authentication required"),
    ):
        client.fetch_payloads("127.0.0.1", auth_listener.port, [(0, 0)])
    # vLLM's request, byte for byte, straight off a REQ socket: a refusal, no payload.
    sock = _req(zctx, auth_listener.port)
    for rank in PAYLOADS:
        frames = _ask(sock, encode_handshake_request(*rank))
        assert len(frames) == 2 and frames[0].startswith(ERROR_PREFIX)
        assert not _leaks(frames)
    # A hello gets a challenge and nothing else; a made-up proof gets a refusal.
    auth_without = ClientAuth(b"x" * 32)
    forged = auth_without.prove(0, 1, _challenge(sock, auth_without, 0, 1))
    frames = _ask(sock, encode_proof(forged))
    assert len(frames) == 2 and not _leaks(frames)
    assert (refusal_reason(frames[0]) or "").startswith("authentication failed")
    stats = auth_listener.stats()
    assert stats.served == 0
    assert stats.refused_auth == 1 + len(PAYLOADS) + 1


def test_wrong_secret_is_refused(auth_listener: HandshakeListener) -> None:
    with (
        HandshakeClient(FAST, secret=OTHER) as client,
        pytest.raises(HandshakeAuthError, match="wrong proof"),
    ):
        client.fetch_payloads("127.0.0.1", auth_listener.port, [(0, 0)])
    stats = auth_listener.stats()
    assert (stats.served, stats.refused_auth) == (0, 1)


# -- replays -------------------------------------------------------------------------------


def test_replayed_proof_is_refused(
    auth_listener: HandshakeListener, zctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """An eavesdropper who replays a client's proof gets a refusal, not a second answer."""
    auth = ClientAuth(SECRET)
    sock = _req(zctx, auth_listener.port)
    proof_frame = encode_proof(auth.prove(0, 0, _challenge(sock, auth, 0, 0)))
    assert len(_ask(sock, proof_frame)) == 3
    replayer = _req(zctx, auth_listener.port)
    frames = _ask(replayer, proof_frame)
    assert refusal_reason(frames[0]) == "authentication failed: challenge already used (replay)"
    assert not _leaks(frames)


def test_expired_and_foreign_challenges_are_refused(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    now = [1000.0]
    auth = ClientAuth(SECRET)
    with (
        HandshakeListener(PAYLOADS, secret=SECRET, monotonic=lambda: now[0]) as listener,
        HandshakeListener(PAYLOADS, secret=SECRET) as other,
    ):
        sock = _req(zctx, listener.port)
        challenge = _challenge(sock, auth, 0, 0)
        now[0] += 11.0  # past the 10 s challenge TTL
        frames = _ask(sock, encode_proof(auth.prove(0, 0, challenge)))
        assert refusal_reason(frames[0]) == "authentication failed: challenge expired"
        # A challenge from another listener (or this one before a restart) is not ours.
        other_sock = _req(zctx, other.port)
        foreign = _challenge(other_sock, auth, 0, 0)
        frames = _ask(sock, encode_proof(auth.prove(0, 0, foreign)))
        assert "not issued by this listener" in (refusal_reason(frames[0]) or "")
        assert listener.stats().served == 0


class _ReplayingListener:
    """An impostor without the secret: a fresh challenge, then a recorded answer."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], answer: list[bytes]) -> None:
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._answer = answer
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ident, _, _hello = self._sock.recv_multipart()
        challenge = CHALLENGE_PREFIX + os.urandom(40)
        self._sock.send_multipart([ident, b"", challenge, msgspec.msgpack.encode(1.0)])
        ident, _, _proof = self._sock.recv_multipart()
        self._sock.send_multipart([ident, b"", *self._answer])

    def close(self) -> None:
        self._thread.join(10)
        self._sock.close(linger=0)


@pytest.mark.parametrize("tamper", ["replay", "flip_payload", "flip_clock", "flip_tag"])
def test_replayed_or_tampered_answer_is_rejected(
    auth_listener: HandshakeListener, zctx: zmq.Context[zmq.Socket[bytes]], tamper: str
) -> None:
    auth = ClientAuth(SECRET)
    sock = _req(zctx, auth_listener.port)
    proof = auth.prove(0, 1, _challenge(sock, auth, 0, 1))
    sealed, clock, tag = _ask(sock, encode_proof(proof))
    assert auth.open(proof, sealed, clock, tag) == PAYLOADS[(0, 1)]
    if tamper == "flip_payload":
        sealed = bytes([sealed[0] ^ 1]) + sealed[1:]
    elif tamper == "flip_clock":
        clock = msgspec.msgpack.encode(msgspec.msgpack.decode(clock) + 1.0)
    elif tamper == "flip_tag":
        tag = tag[:-1] + bytes([tag[-1] ^ 0x80])
    if tamper != "replay":
        with pytest.raises(HandshakeAuthError, match="failed authentication"):
            auth.open(proof, sealed, clock, tag)
    impostor = _ReplayingListener(zctx, [sealed, clock, tag])
    try:
        with (
            HandshakeClient(FAST, secret=SECRET) as client,
            pytest.raises(HandshakeAuthError, match="failed authentication"),
        ):
            client.fetch_payloads("127.0.0.1", impostor.port, [(0, 1)])
    finally:
        impostor.close()


# -- mixing modes --------------------------------------------------------------------------


def test_plain_mode_is_byte_identical_to_vllm(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Without a secret: vLLM's request bytes out, the bare payload and clock back."""
    golden_request = b"\x93\xc4\x0cget_meta_msg\x00\x01"  # msgpack [bin "get_meta_msg", 0, 1]
    seen: list[list[bytes]] = []
    fake = zctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")

    def answer_once() -> None:
        frames = fake.recv_multipart()
        seen.append(frames[1:])
        fake.send_multipart([frames[0], b"", b"opaque", msgspec.msgpack.encode(2.5)])

    thread = threading.Thread(target=answer_once, daemon=True)
    thread.start()
    with HandshakeClient(FAST) as client:
        got = client.fetch_payloads("127.0.0.1", port, [(0, 1)])
    thread.join(10)
    fake.close(linger=0)
    assert seen == [[b"", golden_request]]
    assert got.replies[(0, 1)].payload == b"opaque"

    with HandshakeListener(PAYLOADS) as plain:
        frames = _ask(_req(zctx, plain.port), golden_request)
    assert frames[0] == PAYLOADS[(0, 1)]
    assert len(frames) == 2 and isinstance(msgspec.msgpack.decode(frames[1]), float)
    assert frames[1][0] == 0xCB  # a msgpack float64, as vLLM sends


def test_authenticated_client_refuses_listeners_that_do_not_authenticate(
    zctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with (
        HandshakeListener(PAYLOADS) as plain,
        HandshakeClient(FAST, secret=SECRET) as client,
        pytest.raises(HandshakeAuthError, match="not enabled on this listener"),
    ):
        client.fetch_payloads("127.0.0.1", plain.port, [(0, 0)])

    # vLLM's listener loop answers any three-element request with the rank's payload and
    # only logs an unknown tag: our hello must neither crash it nor be trusted.
    vllm = zctx.socket(zmq.ROUTER)
    vllm.setsockopt(zmq.LINGER, 0)
    port = vllm.bind_to_random_port("tcp://127.0.0.1")
    tags: list[bytes] = []

    def vllm_loop() -> None:
        for _ in range(2):
            ident, _, msg = vllm.recv_multipart()
            tag, pp, tp = msgspec.msgpack.decode(msg)
            tags.append(tag)
            vllm.send_multipart([ident, b"", PAYLOADS[(pp, tp)], msgspec.msgpack.encode(1.0)])

    thread = threading.Thread(target=vllm_loop, daemon=True)
    thread.start()
    with (
        HandshakeClient(FAST, secret=SECRET) as client,
        pytest.raises(HandshakeAuthError, match="without authenticating"),
    ):
        client.fetch_payloads("127.0.0.1", port, [(0, 1)])
    with HandshakeClient(FAST) as client:  # the "vLLM listener" still serves plain clients
        assert client.fetch_payloads("127.0.0.1", port, [(0, 1)]).replies[(0, 1)].payload
    thread.join(10)
    vllm.close(linger=0)
    assert tags == [b"kvwire_auth_v1", b"get_meta_msg"]


# -- the secret file -------------------------------------------------------------------------


def test_secret_file_is_checked_and_never_echoed(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o600)
    assert load_secret(path) == SECRET
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600") as world:
        load_secret(path)
    short = tmp_path / "short"
    short.write_bytes(b"hunter2\n")
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="at least 16") as too_short:
        load_secret(short)
    with pytest.raises(ConfigError, match="cannot read"):
        load_secret(tmp_path / "missing")
    for exc in (world.value, too_short.value):
        assert SECRET.decode() not in str(exc) and "hunter2" not in str(exc)
    config = KVWireConfig(engine_id="e", compat_hash="h", secret=SECRET)
    assert SECRET.decode() not in repr(config)
    assert "secret" not in repr(ClientAuth(SECRET)).replace("secret hidden", "")
    with pytest.raises(ConfigError, match="at least 16"):
        KVWireConfig(engine_id="e", compat_hash="h", secret=b"short")


# -- the CLI, end to end --------------------------------------------------------------------


def _secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "kvwire.secret"
    path.write_bytes(secrets.token_hex(32).encode() + b"\n")  # as `openssl rand -hex 32`
    path.chmod(0o600)
    return path


def test_probe_with_secret_file(
    auth_listener: HandshakeListener, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address = f"127.0.0.1:{auth_listener.port}"
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o600)
    assert cli.main(["probe", address, "--secret-file", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["authenticated"] is True
    assert (
        report["compatibility_hash"] == msgspec.msgpack.decode(VLLM_PAYLOAD)["compatibility_hash"]
    )
    code = cli.main(["probe", address, "--timeout", "10", "--retries", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "authentication required" in err and err[-1] == "\n"


def test_demo_with_secret_file_pulls_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _secret_file(tmp_path)
    args = ["demo", "--requests", "4", "--tokens", "64", "--layers", "1", "--concurrency", "2"]
    code = cli.main([*args, "--secret-file", str(path), "--json", "--no-progress"])
    out = capsys.readouterr().out
    summary = json.loads(out)
    assert code == 0, out
    assert summary["done"] == 4 and summary["failed"] == 0
    assert summary["bytes_wrong"] == 0 and summary["bytes_moved"] > 0 and summary["verified"]
    assert summary["handshakes"] >= 1
    path.chmod(0o604)
    assert cli.main([*args, "--secret-file", str(path)]) == 2
    assert "chmod 600" in capsys.readouterr().err


def test_demo_engines_with_different_secrets_move_nothing() -> None:
    """Decode ranks holding another secret fail every request at the handshake."""
    import dataclasses

    from kvwire.demo.engines import DecodeEngine, PrefillEngine
    from kvwire.demo.run import DemoOptions, drive

    options = DemoOptions(requests=2, tokens=64, layers=1, concurrency=2, progress=False)
    prefill = PrefillEngine(dataclasses.replace(options, secret=SECRET).engine("prefill", 1))
    decode = DecodeEngine(dataclasses.replace(options, secret=OTHER).engine("decode", 1))
    try:
        prefill.start()
        decode.start()
        summary = drive(options, prefill, decode)
    finally:
        decode.close()
        prefill.close()
    assert (summary.done, summary.failed, summary.bytes_checked) == (0, 2, 0), summary.failures
    assert summary.handshakes == 0
    assert prefill._listener.stats().refused_auth >= 1
    assert prefill._listener.stats().served == 0
