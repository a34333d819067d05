"""The worker half of ``KVWireConnector``: one TP rank's Producer or Consumer over the
rank's KV tensors, fed from the scheduler's metadata each step."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kvwire.config import KVWireConfig
from kvwire.integrations.vllm.config import is_producer
from kvwire.integrations.vllm.geometry import layer_geometry
from kvwire.integrations.vllm.messages import KVWireHandshake, KVWireMetadata, KVWireStats
from kvwire.runtime import Consumer, Producer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Under vLLM's logger, so a vLLM deployment's logging configuration shows it.
log = logging.getLogger("vllm.kvwire")


class WorkerSide:
    """One rank: a Producer (a ``kv_producer`` engine) or a Consumer (``kv_consumer``) over
    the rank's KV tensors."""

    def __init__(
        self, vllm_config: VllmConfig, config: KVWireConfig, kv_cache_config: KVCacheConfig
    ) -> None:
        self.vllm_config = vllm_config
        self.config = config
        self.kv_cache_config = kv_cache_config
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        if is_producer(vllm_config):
            self.producer = Producer(config)
        else:
            self.consumer = Consumer(config)
        self.recving: set[str] = set()
        self.sending: set[str] = set()
        self.invalid: set[int] = set()

    @property
    def endpoint(self) -> Producer | Consumer:
        endpoint = self.producer or self.consumer
        assert endpoint is not None
        return endpoint

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        geometry = layer_geometry(kv_caches, self.kv_cache_config, self.config, self.vllm_config)
        self.endpoint.register_kv_caches(geometry)

    def handshake(self) -> KVWireHandshake:
        return KVWireHandshake(self.endpoint.handshake_payload())

    def start(self, meta: KVWireMetadata) -> None:
        if self.producer is not None:
            for rid in meta.started:
                if rid not in meta.to_send:
                    self.producer.request_started(rid)
            for rid, (groups, num_tokens) in meta.to_send.items():
                self.producer.prefill_finished(rid, groups, num_tokens=num_tokens)
                self.sending.add(rid)
            for rid in meta.to_abort:
                self.producer.abort(rid)
        if self.consumer is not None:
            for rid, (params, local, prompt) in meta.to_recv.items():
                self.consumer.add_request(rid, params, local, num_tokens=prompt)
                if local:
                    self.recving.add(rid)
            for rid in meta.to_abort:
                self.consumer.abort(rid)

    def finished(self) -> tuple[set[str] | None, set[str] | None]:
        sent: set[str] = set()
        received: set[str] = set()
        if self.producer is not None:
            sent = {f.request_id for f in self.producer.get_finished()} & self.sending
            self.sending -= sent
        if self.consumer is not None:
            got = self.consumer.get_finished()
            received = set(got.done)
            for rid, failure in got.failed.items():
                log.warning("KV of %s not received (%s): %s", rid, failure.reason, failure.detail)
                received.add(rid)
                for group in failure.invalid_block_ids:
                    self.invalid.update(group)
            received &= self.recving
            self.recving -= received
        return sent or None, received or None

    def take_invalid(self) -> set[int]:
        out, self.invalid = self.invalid, set()
        return out

    def stats(self) -> KVWireStats:
        return KVWireStats(data=dict(self.endpoint.metrics.snapshot()["totals"]))

    def close(self) -> None:
        self.endpoint.close()
