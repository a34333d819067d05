"""TP ranks as separate processes: each holds its KV tensors and its kvwire runtime.

``ProcessRanks`` is a :class:`~kvwire.examples.engine.engine.RankGroup` whose ranks are child
processes (``python -m kvwire.examples.engine.rankproc``). Per token and layer the engine
sends every rank the normalised hidden state and collects each rank's head shares — the
ranks compute in parallel, like GPUs of one TP group. Each rank process owns a
:class:`~kvwire.examples.engine.runtimes.LocalRuntime`, so KV moves between the P and D
rank processes directly; the engine process reaches the runtime through the same pipe
(:class:`RemoteRank` is a :class:`~kvwire.examples.engine.runtimes.RankRuntime`).

Messages are length-prefixed msgpack maps; tensors travel as raw float32 bytes, so nothing
is rounded on the way.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import IO, Any

import torch

from kvwire.errors import ConfigError, KVWireError
from kvwire.examples.engine.settings import CacheConfig, ModelConfig
from kvwire.framing import close_pipes, read_frame, spawn, wait_or_kill, write_frame
from kvwire.layout.geometry import BlockRegion, KVGeometry, RegionKind


class RankProcessError(KVWireError):
    """A rank process died or answered with an error."""


def receive(stream: IO[bytes]) -> dict[str, Any]:
    """The next message from a rank pipe; a closed pipe is a RankProcessError."""
    message = read_frame(stream)
    if message is None:
        raise RankProcessError("rank pipe closed")
    return message


def geometry_to_dict(geometry: KVGeometry) -> dict[str, Any]:
    regions = [
        {
            "base_addr": r.base_addr,
            "block_len": r.block_len,
            "num_blocks": r.num_blocks,
            "name": r.name,
            "mem_kind": r.mem_kind,
            "kind": r.kind.value,
        }
        for r in geometry.regions
    ]
    return {
        "regions": regions,
        "layout": geometry.layout.value,
        "block_size": geometry.block_size,
        "total_kv_heads": geometry.total_kv_heads,
        "tp_rank": geometry.tp_rank,
        "tp_size": geometry.tp_size,
        "is_mla": geometry.is_mla,
        "backend": geometry.attn_backend_name,
    }


def geometry_from_dict(data: Mapping[str, Any]) -> KVGeometry:
    regions = [
        BlockRegion(
            base_addr=r["base_addr"],
            block_len=r["block_len"],
            num_blocks=r["num_blocks"],
            name=r["name"],
            mem_kind=r["mem_kind"],
            kind=RegionKind(r["kind"]),
        )
        for r in data["regions"]
    ]
    return KVGeometry(
        regions=regions,
        kv_cache_layout=data["layout"],
        block_size=data["block_size"],
        total_kv_heads=data["total_kv_heads"],
        tp_rank=data["tp_rank"],
        tp_size=data["tp_size"],
        is_mla=data["is_mla"],
        attn_backend_name=data["backend"],
    )


class RemoteRank:
    """The engine's handle on one rank process (its compute and its runtime)."""

    def __init__(self, spec: Mapping[str, Any], env: Mapping[str, str] | None = None) -> None:
        self.tp_rank = int(spec["tp_rank"])
        self._proc = spawn("kvwire.examples.engine.rankproc", env=env)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._in, self._out = self._proc.stdin, self._proc.stdout
        self.lock = threading.Lock()
        write_frame(self._in, spec)
        self._payload = b""

    def wait_ready(self) -> None:
        ready = self._receive()
        self._payload = bytes(ready.get("payload", b""))

    def post(self, message: Mapping[str, Any]) -> None:
        try:
            write_frame(self._in, message)
        except OSError as exc:
            raise RankProcessError(f"rank {self.tp_rank} is gone: {exc}") from exc

    def _receive(self) -> dict[str, Any]:
        reply = receive(self._out)
        if "error" in reply:
            raise RankProcessError(f"rank {self.tp_rank}: {reply['error']}")
        return reply

    def collect(self) -> dict[str, Any]:
        return self._receive()

    def call(self, message: Mapping[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.post(message)
            return self._receive()

    # -- RankRuntime ----------------------------------------------------------------

    def request_started(self, request_id: str) -> None:
        self.call({"op": "request_started", "request_id": request_id})

    def prefill_finished(
        self, request_id: str, block_ids: Sequence[int], num_tokens: int
    ) -> dict[str, Any]:
        reply = self.call(
            {
                "op": "prefill_finished",
                "request_id": request_id,
                "block_ids": list(block_ids),
                "num_tokens": num_tokens,
            }
        )
        params: dict[str, Any] = reply["params"]
        return params

    def freed(self) -> list[str]:
        return [str(r) for r in self.call({"op": "freed"})["freed"]]

    def add_request(
        self, request_id: str, params: Mapping[str, Any], block_ids: Sequence[int]
    ) -> None:
        self.call(
            {
                "op": "add_request",
                "request_id": request_id,
                "params": dict(params),
                "block_ids": list(block_ids),
            }
        )

    def finished(self, timeout: float) -> tuple[list[str], dict[str, str]]:
        reply = self.call({"op": "finished", "timeout": timeout})
        return list(reply["done"]), dict(reply["failed"])

    def abort(self, request_id: str) -> None:
        self.call({"op": "abort", "request_id": request_id})

    def handshake_payload(self) -> bytes:
        return self._payload

    def errors(self) -> list[str]:
        return [str(e) for e in self.call({"op": "errors"})["errors"]]

    def close(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(RankProcessError, OSError):
                self.call({"op": "shutdown"})
            wait_or_kill(self._proc, 10)
        close_pipes(self._proc)


class ProcessRanks:
    """A :class:`RankGroup` of rank processes (also the engine's rank runtimes)."""

    def __init__(
        self,
        model: ModelConfig,
        cache: CacheConfig,
        *,
        role: str,
        runtime: Mapping[str, Any],
        transport: str,
        transport_options: Mapping[str, Any],
    ) -> None:
        cache.check_model(model)
        self.model = model
        base = {
            "model": asdict(model),
            "cache": {**asdict(cache), "layout": cache.kv_layout.value},
            "role": role,
            "runtime": dict(runtime),
            "transport": transport,
            "transport_options": dict(transport_options),
        }
        self.ranks = [RemoteRank({**base, "tp_rank": r}) for r in range(cache.tp_size)]
        try:
            for rank in self.ranks:  # all started at once; wait for each in turn
                rank.wait_ready()
        except KVWireError:
            self.close()
            raise

    def attend(
        self, layer: int, x: torch.Tensor, position: int, block_ids: list[int]
    ) -> torch.Tensor:
        message = {
            "op": "attend",
            "layer": layer,
            "position": position,
            "block_ids": block_ids,
            "x": x.contiguous().numpy().tobytes(),
        }
        for rank in self.ranks:
            rank.lock.acquire()
        try:
            for rank in self.ranks:
                rank.post(message)
            shares = [rank.collect()["shares"] for rank in self.ranks]
        finally:
            for rank in self.ranks:
                rank.lock.release()
        rows = [
            torch.frombuffer(bytearray(s), dtype=torch.float32).reshape(-1, self.model.hidden)
            for s in shares
        ]
        return torch.cat(rows, dim=0)

    def geometries(self) -> list[KVGeometry]:
        return [geometry_from_dict(r.call({"op": "geometry"})["geometry"]) for r in self.ranks]

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()


def _serve_rank(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    """The rank process: build the rank from the spec, then answer until shutdown."""
    from kvwire.config import KVWireConfig
    from kvwire.examples.engine.rank import RankWorker
    from kvwire.examples.engine.runtimes import LocalRuntime, compat_factors
    from kvwire.examples.engine.weights import init_weights

    torch.set_num_threads(1)
    spec = receive(stdin)
    model = ModelConfig(**spec["model"])
    cache = CacheConfig(**spec["cache"])
    worker = RankWorker(model, cache, int(spec["tp_rank"]), init_weights(model))
    runtime: LocalRuntime | None = None
    if spec["role"] in ("prefill", "decode"):
        rt = dict(spec["runtime"])
        compat = compat_factors(model, str(rt["mode"]))
        config = KVWireConfig(tp_rank=worker.tp_rank, tp_size=cache.tp_size, compat=compat, **rt)
        runtime = LocalRuntime(
            spec["role"],
            config,
            worker.kv.geometry(),
            spec["transport"],
            spec["transport_options"],
        )
    write_frame(stdout, {"payload": runtime.handshake_payload() if runtime else b""})

    def need() -> LocalRuntime:
        if runtime is None:
            raise ConfigError("this rank has no kvwire runtime")
        return runtime

    try:
        while True:
            try:
                msg = receive(stdin)
            except RankProcessError:
                return
            op = msg.get("op")
            try:
                reply: dict[str, Any] = {}
                if op == "attend":
                    x = torch.frombuffer(bytearray(msg["x"]), dtype=torch.float32)
                    shares = worker.attend(
                        msg["layer"], x.reshape(1, model.hidden), msg["position"], msg["block_ids"]
                    )
                    reply = {"shares": shares.numpy().tobytes()}
                elif op == "request_started":
                    need().request_started(msg["request_id"])
                elif op == "prefill_finished":
                    reply = {
                        "params": need().prefill_finished(
                            msg["request_id"], msg["block_ids"], msg["num_tokens"]
                        )
                    }
                elif op == "freed":
                    reply = {"freed": need().freed()}
                elif op == "add_request":
                    need().add_request(msg["request_id"], msg["params"], msg["block_ids"])
                elif op == "finished":
                    done, failed = need().finished(float(msg["timeout"]))
                    reply = {"done": done, "failed": failed}
                elif op == "abort":
                    need().abort(msg["request_id"])
                elif op == "errors":
                    reply = {"errors": need().errors() if runtime else []}
                elif op == "geometry":
                    reply = {"geometry": geometry_to_dict(worker.kv.geometry())}
                elif op == "shutdown":
                    write_frame(stdout, {})
                    return
                else:
                    raise ConfigError(f"unknown rank op {op!r}")
                write_frame(stdout, reply)
            except (KVWireError, KeyError, ValueError, TypeError) as exc:
                write_frame(stdout, {"error": f"{type(exc).__name__}: {exc}"})
    finally:
        if runtime is not None:
            runtime.close()


if __name__ == "__main__":
    _stdout = sys.stdout.buffer
    sys.stdout = sys.stderr  # only protocol frames on the real stdout
    _serve_rank(sys.stdin.buffer, _stdout)
