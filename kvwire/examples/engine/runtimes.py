"""The kvwire runtime of one rank, behind the few calls the engine's scheduler makes.

:class:`LocalRuntime` wraps a :class:`~kvwire.runtime.Producer` (P) or
:class:`~kvwire.runtime.Consumer` (D) living in the same process as the rank's KV tensors.
When ranks run in their own processes (:mod:`kvwire.examples.engine.rankproc`), the same
object lives there and the scheduler reaches it through the rank's pipe.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any, Literal, Protocol

from kvwire.config import KVWireConfig
from kvwire.errors import ConfigError
from kvwire.examples.engine.kvcache import BACKEND_NAME
from kvwire.examples.engine.settings import ModelConfig
from kvwire.layout.geometry import KVGeometry
from kvwire.runtime import Consumer, Producer
from kvwire.wire.compat import CompatFactors

Role = Literal["prefill", "decode"]


def model_fingerprint(model: ModelConfig) -> str:
    """A model name for the compatibility hash: engines built from different configs (or
    seeds) compute different functions and must refuse to exchange KV."""
    text = ",".join(f"{k}={v}" for k, v in sorted(asdict(model).items()))
    return "kvwire-reference-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def compat_factors(model: ModelConfig, mode: str) -> CompatFactors:
    return CompatFactors.build(
        vllm_version="kvwire-reference-engine",
        model=model_fingerprint(model),
        dtype="float32",
        num_kv_heads=model.cached_kv_heads,
        head_size=model.head_dim,
        num_hidden_layers=model.layers,
        attn_backend_name=BACKEND_NAME,
        transfer_mode="push" if mode == "push" else "pull",
    )


class RankRuntime(Protocol):
    """What the scheduler asks of one rank's transfer runtime."""

    def request_started(self, request_id: str) -> None: ...

    def prefill_finished(
        self, request_id: str, block_ids: Sequence[int], num_tokens: int
    ) -> dict[str, Any]: ...

    def freed(self) -> list[str]:
        """P: requests this rank no longer needs the blocks of, since the last call."""
        ...

    def add_request(
        self, request_id: str, params: Mapping[str, Any], block_ids: Sequence[int]
    ) -> None: ...

    def finished(self, timeout: float) -> tuple[list[str], dict[str, str]]:
        """D: (requests received, {request: failure reason}) since the last call, waiting up
        to ``timeout`` seconds for there to be any."""
        ...

    def abort(self, request_id: str) -> None: ...

    def handshake_payload(self) -> bytes: ...

    def errors(self) -> list[str]: ...

    def close(self) -> None: ...


class LocalRuntime:
    """A rank's Producer or Consumer, registered on that rank's KV geometry."""

    def __init__(
        self,
        role: Role,
        config: KVWireConfig,
        geometry: KVGeometry,
        transport: str,
        transport_options: Mapping[str, Any],
    ) -> None:
        options = dict(transport_options)
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        if role == "prefill":
            self.producer = Producer(config, transport, transport_options=options)
            self.producer.register_kv_caches(geometry)
        elif role == "decode":
            self.consumer = Consumer(config, transport, transport_options=options)
            self.consumer.register_kv_caches(geometry)
        else:
            raise ConfigError(f"a rank runtime is 'prefill' or 'decode', got {role!r}")

    def _p(self) -> Producer:
        if self.producer is None:
            raise ConfigError("not a prefill rank")
        return self.producer

    def _c(self) -> Consumer:
        if self.consumer is None:
            raise ConfigError("not a decode rank")
        return self.consumer

    def request_started(self, request_id: str) -> None:
        self._p().request_started(request_id)

    def prefill_finished(
        self, request_id: str, block_ids: Sequence[int], num_tokens: int
    ) -> dict[str, Any]:
        return self._p().prefill_finished(request_id, [list(block_ids)], num_tokens=num_tokens)

    def freed(self) -> list[str]:
        return [f.request_id for f in self._p().get_finished()]

    def add_request(
        self, request_id: str, params: Mapping[str, Any], block_ids: Sequence[int]
    ) -> None:
        self._c().add_request(request_id, params, [list(block_ids)])

    def finished(self, timeout: float) -> tuple[list[str], dict[str, str]]:
        consumer = self._c()
        if timeout > 0:
            consumer.wait_finished(timeout)
        done = consumer.get_finished()
        failed = {rid: f"{f.reason} {f.detail}".strip() for rid, f in done.failed.items()}
        return list(done.done), failed

    def abort(self, request_id: str) -> None:
        if self.producer is not None:
            self.producer.abort(request_id)
        else:
            self._c().abort(request_id)

    def handshake_payload(self) -> bytes:
        runtime = self.producer or self._c()
        return runtime.handshake_payload()

    def errors(self) -> list[str]:
        runtime = self.producer or self._c()
        return runtime.errors

    def close(self) -> None:
        runtime = self.producer or self._c()
        runtime.close()
