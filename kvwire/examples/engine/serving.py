"""One engine group serving requests through kvwire: the reference engine as P, D or both.

:class:`EngineServer` is what a serving engine's kvwire integration looks like, in one
file: one :class:`~kvwire.runtime.Producer` (prefill) or :class:`~kvwire.runtime.Consumer`
(decode) per TP rank, each registering that rank's own KV tensors, and one
:class:`~kvwire.sidechannel.HandshakeListener` for the whole engine serving every rank's
handshake payload. The scheduler side is the engine's: it allocates blocks, tells the
runtime which blocks hold (P) or must receive (D) a request, and frees or schedules when
the runtime says every rank is finished.

All ranks of the group live in this process (each with separate KV buffers, its own
transport agent and its own runtime), so a P/D pair is two processes exchanging real bytes
over a real transport, and the head split across ranks is physical.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvwire.config import KVWireConfig
from kvwire.errors import ConfigError, KVWireError
from kvwire.examples.engine.engine import Engine
from kvwire.examples.engine.rankproc import ProcessRanks
from kvwire.examples.engine.runtimes import LocalRuntime, RankRuntime, compat_factors
from kvwire.examples.engine.settings import CacheConfig, ModelConfig
from kvwire.sidechannel import HandshakeListener

Role = Literal["prefill", "decode", "both"]
Emit = Callable[[dict[str, Any]], None]


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    role: Role
    engine_id: str
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    mode: Literal["pull", "push"] = "pull"
    transport: str = "shm"
    transport_options: Mapping[str, Any] = field(default_factory=dict)
    host: str = "127.0.0.1"
    lease_s: float = 30.0
    transfer_timeout_s: float = 60.0
    rank_processes: bool = False
    """Run every TP rank in its own process (with its own runtime) instead of in-process."""


class EngineServer:
    """An :class:`Engine` plus the kvwire runtime of each of its ranks."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._lock = threading.RLock()
        self.runtimes: list[RankRuntime] = []
        self.listener: HandshakeListener | None = None
        self._freed: dict[str, int] = {}
        self._held: set[str] = set()
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        if config.role == "both":
            self.engine = Engine(config.model, config.cache)
            return
        self.listener = HandshakeListener({}, host=config.host, port=0).start()
        try:
            self._start_runtime(self.listener)
        except BaseException:
            self.close()
            raise

    # -- setup ----------------------------------------------------------------------

    def _start_runtime(self, listener: HandshakeListener) -> None:
        """One runtime per rank, registered on that rank's tensors; one listener for all."""
        cfg = self.config
        settings: dict[str, Any] = {
            "engine_id": cfg.engine_id,
            "mode": cfg.mode,
            "side_channel_host": cfg.host,
            "side_channel_port": listener.port,
            "lease_s": cfg.lease_s,
        }
        if cfg.rank_processes:
            ranks = ProcessRanks(
                cfg.model,
                cfg.cache,
                role=cfg.role,
                runtime=settings,
                transport=cfg.transport,
                transport_options=cfg.transport_options,
            )
            self.engine = Engine(cfg.model, cfg.cache, ranks=ranks)
            self.runtimes = list(ranks.ranks)
        else:
            self.engine = Engine(cfg.model, cfg.cache)
            compat = compat_factors(cfg.model, cfg.mode)
            for rank, geometry in enumerate(self.engine.geometries()):
                runtime_cfg = KVWireConfig(
                    tp_rank=rank, tp_size=cfg.cache.tp_size, compat=compat, **settings
                )
                role: Literal["prefill", "decode"] = (
                    "prefill" if cfg.role == "prefill" else "decode"
                )
                self.runtimes.append(
                    LocalRuntime(role, runtime_cfg, geometry, cfg.transport, cfg.transport_options)
                )
        listener.set_payloads(
            {(0, r): rt.handshake_payload() for r, rt in enumerate(self.runtimes)}
        )
        for r, rt in enumerate(self.runtimes):
            producer = getattr(rt, "producer", None)  # in-process ranks: their lease tables
            if producer is not None:
                listener.set_lease_source((0, r), producer.lease_deadlines)
        if cfg.role == "prefill":
            self._reaper = threading.Thread(target=self._reap, name="engine-reaper", daemon=True)
            self._reaper.start()

    @property
    def port(self) -> int:
        return self.listener.port if self.listener is not None else 0

    # -- prefill (P) ----------------------------------------------------------------

    def prefill(self, request_id: str, prompt: Sequence[int]) -> dict[str, Any]:
        """Compute the prompt, hold its blocks for consumers, answer like vLLM's P does
        (one token, ``max_tokens=1``, and the ``kv_transfer_params``)."""
        if self.config.role != "prefill":
            raise ConfigError(f"engine {self.config.engine_id} is not a prefill engine")
        with self._lock:
            seq = self.engine.admit(request_id, prompt)
            for runtime in self.runtimes:
                runtime.request_started(request_id)
            start = time.perf_counter()
            token = self.engine.step(request_id)
            prefill_s = time.perf_counter() - start
            blocks = list(self.engine.requests[request_id].block_ids)
            self._held.add(request_id)
            params: dict[str, Any] = {}
            for runtime in self.runtimes:
                params = runtime.prefill_finished(request_id, blocks, len(prompt))
        return {
            "request_id": request_id,
            "first_token": token,
            "kv_transfer_params": params,
            "prefill_s": prefill_s,
            "num_cached": seq.num_cached,
        }

    def _reap(self) -> None:
        """Free a prompt's blocks once *every* rank's producer has let go of it."""
        ranks = len(self.runtimes)
        while not self._stop.wait(0.02):
            for runtime in self.runtimes:
                try:
                    freed = runtime.freed()
                except KVWireError:
                    return  # shutting down
                for request_id in freed:
                    count = self._freed.get(request_id, 0) + 1
                    self._freed[request_id] = count
                    if count == ranks:
                        del self._freed[request_id]
                        with self._lock:
                            self._held.discard(request_id)
                            self.engine.release(request_id)

    # -- decode (D) -----------------------------------------------------------------

    def decode(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        kv_transfer_params: Mapping[str, Any],
        emit: Emit,
    ) -> None:
        """Receive the prompt's KV from the producer, then stream ``max_tokens`` tokens.

        Emits ``{"event": "token", ...}`` per token and ends with ``done`` (timings) or
        ``failed`` (the transfer failed on some rank; nothing is generated from bad KV).
        """
        if self.config.role != "decode":
            raise ConfigError(f"engine {self.config.engine_id} is not a decode engine")
        with self._lock:
            seq = self.engine.admit(request_id, prompt)
        try:
            start = time.perf_counter()
            blocks = self.engine.blocks_to_receive(request_id)
            for runtime in self.runtimes:
                runtime.add_request(request_id, kv_transfer_params, blocks)
            failure = self._wait_received(request_id)
            transfer_s = time.perf_counter() - start
            if failure is not None:
                emit({"event": "failed", "request_id": request_id, "reason": failure})
                return
            self.engine.mark_received(request_id)
            tokens: list[int] = []
            first_step_s = 0.0
            for index in range(max_tokens):
                t0 = time.perf_counter()
                with self._lock:
                    token = self.engine.step(request_id)
                if index == 0:
                    first_step_s = time.perf_counter() - t0
                assert token is not None
                tokens.append(token)
                emit({"event": "token", "request_id": request_id, "token": token})
            emit(
                {
                    "event": "done",
                    "request_id": request_id,
                    "tokens": tokens,
                    "num_cached": seq.num_cached,
                    "received_blocks": len(blocks),
                    "transfer_s": transfer_s,
                    "first_step_s": first_step_s,
                }
            )
        finally:
            with self._lock:
                self.engine.release(request_id)

    def _wait_received(self, request_id: str) -> str | None:
        """Wait until every rank received the request (None) or one failed (the reason)."""
        pending = set(range(len(self.runtimes)))
        deadline = time.monotonic() + self.config.transfer_timeout_s
        failure: str | None = None
        while pending and failure is None:
            if time.monotonic() > deadline:
                failure = f"timeout after {self.config.transfer_timeout_s} s"
                break
            for rank in sorted(pending):
                wait = 0.05 if rank == min(pending) else 0.0
                done, failed = self.runtimes[rank].finished(wait)
                if request_id in failed:
                    failure = f"rank {rank}: {failed[request_id]}"
                    break
                if request_id in done:
                    pending.discard(rank)
        if failure is not None:
            for runtime in self.runtimes:
                runtime.abort(request_id)
        return failure

    # -- monolithic -----------------------------------------------------------------

    def generate(self, request_id: str, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
        with self._lock:
            start = time.perf_counter()
            self.engine.admit(request_id, prompt)
            try:
                tokens = [self.engine.step(request_id)]
                first_s = time.perf_counter() - start
                tokens += [self.engine.step(request_id) for _ in range(max_tokens - 1)]
            finally:
                self.engine.release(request_id)
        return {"request_id": request_id, "tokens": tokens, "first_token_s": first_s}

    # -- introspection and teardown ---------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {
                "engine_id": self.config.engine_id,
                "free_blocks": self.engine.allocator.num_free,
                "num_blocks": self.config.cache.num_blocks,
                "active_requests": sorted(self.engine.requests),
                "held_requests": sorted(self._held),
            }
        out["runtime_errors"] = [e for r in self.runtimes for e in r.errors()]
        return out

    def close(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(5.0)
        for runtime in self.runtimes:
            with contextlib.suppress(KVWireError):
                runtime.close()
        if self.listener is not None:
            self.listener.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
