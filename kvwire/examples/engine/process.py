"""Engine groups as child processes, spoken to in JSON lines over stdin/stdout.

``python -m kvwire.examples.engine.process '<config json>'`` runs one
:class:`~kvwire.examples.engine.serving.EngineServer`; :class:`EngineProcess` starts it and
calls it. The protocol is deliberately dull — one JSON object per line, no pickle: commands
``{"op": "prefill" | "decode" | "generate" | "stats" | "shutdown", ...}`` in, replies (and,
for ``decode``, one event per token) out. Logs go to stderr.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from typing import Any

import msgspec

from kvwire.errors import ConfigError, KVWireError
from kvwire.framing import close_pipes, spawn, wait_or_kill

_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.Decoder().decode


def config_to_json(config: Any) -> str:
    """A :class:`ServerConfig` as the JSON the child process reads."""
    data = asdict(config)
    data["cache"]["layout"] = str(config.cache.kv_layout.value)
    data["transport_options"] = dict(config.transport_options)
    return _json_encode(data).decode()


def config_from_json(text: str) -> Any:
    from kvwire.examples.engine.serving import ServerConfig
    from kvwire.examples.engine.settings import CacheConfig, ModelConfig

    data = _json_decode(text)
    data["model"] = ModelConfig(**data["model"])
    data["cache"] = CacheConfig(**data["cache"])
    return ServerConfig(**data)


class EngineProcessError(KVWireError):
    """The engine child process died, timed out or answered with an error."""


class EngineProcess:
    """A running engine group: ``call`` for one reply, ``stream`` for event sequences."""

    def __init__(
        self, config: Any, *, timeout: float = 120.0, env: Mapping[str, str] | None = None
    ):
        self.config = config
        self.timeout = timeout
        child_env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        self._proc = spawn("kvwire.examples.engine.process", config_to_json(config), env=child_env)
        self._buffer = b""
        ready = self._read(timeout)
        if ready.get("event") != "ready":
            raise EngineProcessError(f"engine {config.engine_id} did not start: {ready}")
        self.port: int = int(ready["port"])
        self.engine_id: str = str(ready["engine_id"])

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineProcessError(
                    f"engine {self.config.engine_id}: no answer in {timeout} s"
                )
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                code = self._proc.wait(5)
                raise EngineProcessError(f"engine {self.config.engine_id} exited with {code}")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        reply: dict[str, Any] = _json_decode(line)
        if reply.get("event") == "error":
            raise EngineProcessError(f"engine {self.config.engine_id}: {reply.get('message')}")
        return reply

    def _send(self, command: Mapping[str, Any]) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(_json_encode(command) + b"\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise EngineProcessError(f"engine {self.config.engine_id} is gone: {exc}") from exc

    def call(self, command: Mapping[str, Any]) -> dict[str, Any]:
        self._send(command)
        return self._read(self.timeout)

    def stream(self, command: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        """Events of one command until its ``done`` or ``failed``."""
        self._send(command)
        while True:
            event = self._read(self.timeout)
            yield event
            if event.get("event") in ("done", "failed"):
                return

    def close(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(EngineProcessError):
                self.call({"op": "shutdown"})
            wait_or_kill(self._proc, 10)
        close_pipes(self._proc)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def serve(config_json: str) -> int:
    """The child's main loop: one command at a time, answers on stdout."""
    from kvwire.examples.engine.serving import EngineServer

    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but protocol lines on the real stdout

    def emit(message: Mapping[str, Any]) -> None:
        out.write(_json_encode(message) + b"\n")
        out.flush()

    try:
        server = EngineServer(config_from_json(config_json))
    except Exception as exc:  # report any startup failure as one line, then exit
        emit({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
        return 2
    emit({"event": "ready", "port": server.port, "engine_id": server.config.engine_id})
    try:
        for line in sys.stdin.buffer:
            if not line.strip():
                continue
            try:
                cmd = _json_decode(line)
                op = cmd.get("op")
                if op == "shutdown":
                    emit({"event": "bye"})
                    break
                if op == "prefill":
                    emit(server.prefill(cmd["request_id"], cmd["prompt"]))
                elif op == "decode":
                    server.decode(
                        cmd["request_id"],
                        cmd["prompt"],
                        int(cmd["max_tokens"]),
                        cmd["kv_transfer_params"],
                        emit,
                    )
                elif op == "generate":
                    emit(server.generate(cmd["request_id"], cmd["prompt"], int(cmd["max_tokens"])))
                elif op == "stats":
                    emit(server.stats())
                else:
                    raise ConfigError(f"unknown op {op!r}")
            except (KVWireError, KeyError, ValueError, TypeError) as exc:
                emit({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(
            "usage: python -m kvwire.examples.engine.process '<server config json>'",
            file=sys.stderr,
        )
        sys.exit(2)
    sys.exit(serve(sys.argv[1]))
