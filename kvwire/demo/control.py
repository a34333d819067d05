"""The proxy's line to a prefill engine in another process (``--role prefill/decode``).

A ZMQ REP socket on the prefill side answers ``hello`` (what the engine runs), ``prefill``
(returns ``kv_transfer_params``, as P's HTTP answer would), ``stats`` and ``bye``. Messages
are msgpack maps; malformed ones get an error answer.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import zmq

from kvwire.demo.engines import PrefillEngine
from kvwire.errors import ConfigError, HandshakeTimeoutError, KVWireError, PeerUnreachableError
from kvwire.sidechannel import tcp_endpoint
from kvwire.sidechannel.client import dial

log = logging.getLogger(__name__)
_decoder = msgspec.msgpack.Decoder(dict[str, Any])


class ControlServer:
    """The bound REP socket of the prefill side; bound before the engine starts, so a
    taken port is a one-line error and not a traceback after "listening on"."""

    def __init__(self, host: str, port: int) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self._ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        if ":" in host.strip("[]"):
            self.sock.setsockopt(zmq.IPV6, 1)
        try:
            self.sock.bind(tcp_endpoint(host, port))
        except zmq.ZMQError as exc:
            self.close()
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None

    def close(self) -> None:
        self.sock.close(linger=0)
        self._ctx.term()


def bind(host: str, port: int) -> ControlServer:
    return ControlServer(host, port)


def serve(engine: PrefillEngine, server: ControlServer, *, poll_s: float = 0.5) -> None:
    """Answer control requests until ``bye``; reclaims blocks while idle."""
    sock = server.sock
    while True:
        if not sock.poll(int(poll_s * 1000)):
            engine.reclaim()
            continue
        try:
            msg = _decoder.decode(sock.recv())
            answer, stop = _handle(engine, msg)
        except (msgspec.DecodeError, msgspec.ValidationError, KeyError, TypeError) as exc:
            answer, stop = {"ok": False, "error": f"bad control message: {exc}"}, False
        except KVWireError as exc:
            answer, stop = {"ok": False, "error": str(exc)}, False
        sock.send(msgspec.msgpack.encode(answer))
        if stop:
            return


def _handle(engine: PrefillEngine, msg: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    op = msg["op"]
    opts = engine.options
    if op == "hello":
        return {"ok": True, "model": opts.model, "layers": opts.layers, "tp": opts.tp,
                "mode": opts.mode, "transport": opts.transport,
                "engine_id": opts.engine_id,
                "authenticated": opts.secret is not None}, False  # fmt: skip
    if op == "prefill":
        params = engine.prefill(str(msg["rid"]), int(msg["index"]), int(msg["num_tokens"]))
        return {"ok": True, "params": params}, False
    if op == "stats":
        return {"ok": True, "ranks": engine.stats()}, False
    if op == "bye":
        return {"ok": True}, True
    return {"ok": False, "error": f"unknown op {op!r}"}, False


class PrefillClient:
    """The decode side's handle on a remote prefill engine (same calls as PrefillEngine)."""

    def __init__(self, host: str, port: int, *, timeout: float = 60.0) -> None:
        try:
            dial(host, port, min(timeout, 5.0))  # refused / unknown host: say so now
        except ConnectionRefusedError:
            raise PeerUnreachableError(
                f"connection refused by {host}:{port} (no prefill side listens there)"
            ) from None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = self._ctx.socket(zmq.REQ)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
        self._sock.connect(tcp_endpoint(host, port))
        self._where = f"{host}:{port}"

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._sock.send(msgspec.msgpack.encode(msg))
        try:
            answer = _decoder.decode(self._sock.recv())
        except zmq.Again:
            raise HandshakeTimeoutError(f"prefill engine at {self._where} did not answer") from None
        if not answer.get("ok"):
            raise KVWireError(f"prefill engine: {answer.get('error')}")
        return answer

    def hello(self) -> dict[str, Any]:
        return self.call({"op": "hello"})

    def prefill(self, rid: str, index: int, num_tokens: int) -> dict[str, Any]:
        params: dict[str, Any] = self.call(
            {"op": "prefill", "rid": rid, "index": index, "num_tokens": num_tokens}
        )["params"]
        return params

    def stats(self) -> list[dict[str, Any]]:
        ranks: list[dict[str, Any]] = self.call({"op": "stats"})["ranks"]
        return ranks

    def bye(self) -> None:
        self.call({"op": "bye"})

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
