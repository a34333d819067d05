"""kvwire as a vLLM KV connector: ``KVWireConnector``, loaded by module path.

A vLLM deployment switches to it with one JSON change::

    --kv-transfer-config '{"kv_connector": "KVWireConnector",
      "kv_connector_module_path": "kvwire.integrations.vllm", "kv_role": "kv_producer"}'

vLLM builds the connector twice: once beside its scheduler (role SCHEDULER: decides which
requests hold or load KV and says so in each step's metadata; runs the engine's one
handshake listener) and once per worker (role WORKER: a :class:`~kvwire.runtime.Producer` on a
``kv_producer`` engine, a :class:`~kvwire.runtime.Consumer` on a ``kv_consumer`` one, over the
worker's KV tensors). Everything between
the steps — handshakes, READs or WRITEs, notifications, leases — is the runtime's; the
worker calls only feed it and drain what ended. Settings are one
:class:`~kvwire.config.KVWireConfig` built from vLLM's ``kv_transfer_config`` (see
docs/vllm.md for every ``kv_connector_extra_config`` key).

The ``kv_transfer_params`` in and out are vLLM's own, so a stock ``NixlConnector`` engine
on the other side interoperates (with the ``nixl`` transport and matching factors).

This module imports vLLM and torch; nothing in kvwire's core imports it (extra ``vllm``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvwire.config import KVWireConfig
from kvwire.errors import ConfigError
from kvwire.integrations.vllm_geometry import attn_backend_name, layer_geometry
from kvwire.runtime import Consumer, Producer
from kvwire.sidechannel import HandshakeListener
from kvwire.sidechannel.advertise import advertised_host
from kvwire.wire.compat import CompatFactors

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

BlockIds = list[list[int]]

# Under vLLM's logger, so a vLLM deployment's logging configuration shows it.
log = logging.getLogger("vllm.kvwire")


@dataclass
class KVWireHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """One worker's handshake answer, as kvwire encodes it; the scheduler's listener
    serves it to peers at (pp, tp)."""

    payload: bytes


@dataclass
class KVWireMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """What the scheduler side tells every worker in one step."""

    to_send: dict[str, tuple[BlockIds, int]] = field(default_factory=dict)
    """P: requests whose blocks to hold for consumers, with their token counts."""
    to_recv: dict[str, tuple[dict[str, Any], BlockIds, int | None]] = field(default_factory=dict)
    """D: requests to fetch, with P's params, the local blocks to fill (may be empty: a full
    local prefix hit still tells P it may free) and the prompt's length (which places the
    lists when P's blocks are larger than ours and P's params do not carry it)."""
    to_abort: list[str] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    """P: requests scheduled for prefill; their producer knows them from here (an abort
    before the prefill ends is then the machine's to forget)."""


class KVWireStats(KVConnectorStats):  # type: ignore[misc]
    """The runtime's counters for vLLM's stats logger (a snapshot, so aggregation keeps the
    latest)."""

    data: dict[str, Any]

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.data = dict(other.data) or self.data
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, (int, float))}

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data


def kvwire_config(vllm_config: VllmConfig, *, tp_rank: int = 0) -> KVWireConfig:
    """The one KVWireConfig of this engine: vLLM's kv_transfer_config layer, the rank facts
    and the listener vLLM's side-channel variables name, and the factors vLLM hashes."""
    import vllm.envs as envs

    transfer = vllm_config.kv_transfer_config
    parallel = vllm_config.parallel_config
    as_dict = {
        "kv_connector": transfer.kv_connector,
        "engine_id": transfer.engine_id,
        "kv_connector_extra_config": dict(transfer.kv_connector_extra_config or {}),
    }
    base = KVWireConfig(kv_transfer_config=as_dict)
    return KVWireConfig(
        kv_transfer_config=as_dict,
        tp_rank=tp_rank,
        tp_size=parallel.tensor_parallel_size,
        side_channel_host=envs.VLLM_NIXL_SIDE_CHANNEL_HOST,
        side_channel_port=envs.VLLM_NIXL_SIDE_CHANNEL_PORT
        + getattr(parallel, "data_parallel_index", 0),
        compat=compat_factors(vllm_config, str(base.mode)),
    )


def compat_factors(vllm_config: VllmConfig, mode: str) -> CompatFactors:
    """The factors a stock NixlConnector engine of this model hashes, so the two kinds of
    engine accept each other. The hybrid manager is off: vLLM refuses a connector without
    HMA support otherwise."""
    import vllm

    model = vllm_config.model_config
    return CompatFactors.build(
        vllm_version=vllm.__version__,
        model=model.model,
        dtype=str(model.dtype).removeprefix("torch."),
        num_kv_heads=model.get_total_num_kv_heads(),
        head_size=model.get_head_size(),
        num_hidden_layers=model.get_total_num_hidden_layers(),
        attn_backend_name=attn_backend_name(vllm_config),
        cache_dtype=str(vllm_config.cache_config.cache_dtype),
        is_hma_enabled=False,
        transfer_mode=mode,
    )


class _SchedulerSide:
    """Engine-core half: decisions per request, the step's metadata, the listener."""

    def __init__(self, vllm_config: VllmConfig, config: KVWireConfig) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.block_size = int(vllm_config.cache_config.block_size)
        self.listener = HandshakeListener(
            {}, host=config.side_channel_host, port=config.side_channel_port, secret=config.secret
        ).start()
        self.host = advertised_host(config.side_channel_host, config.advertise_host)
        """The address P's params name (a wildcard bind resolved once, here)."""
        self.meta = KVWireMetadata()
        self.sending: set[str] = set()
        self.started: set[str] = set()
        self.loading: set[str] = set()
        """D: requests whose KV is being fetched (vLLM holds their blocks until the
        worker reports them received, aborted ones included)."""

    @property
    def port(self) -> int:
        return self.listener.port

    def set_handshakes(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        payloads = {}
        for rank, meta in metadata.items():
            if not isinstance(meta, KVWireHandshake):
                raise ConfigError(f"worker {rank} sent {type(meta).__name__}, not kvwire's")
            payloads[(0, int(rank))] = meta.payload
        self.listener.set_payloads(payloads)

    def get_num_new_matched_tokens(self, request: Request, computed: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or []) - computed
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            if request.request_id not in self.started:  # once, not per prefill chunk
                self.started.add(request.request_id)
                self.meta.started.append(request.request_id)
            return
        if not params or not params.get("do_remote_prefill"):
            return
        local: BlockIds = []
        if num_external_tokens > 0:
            local = [list(g) for g in blocks.get_unhashed_block_ids_all_groups()]
            self.loading.add(request.request_id)
        prompt = int(request.num_prompt_tokens) or None
        self.meta.to_recv[request.request_id] = (dict(params), local, prompt)
        params["do_remote_prefill"] = False  # one transfer per request

    def request_finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        rid = request.request_id
        self.started.discard(rid)
        if rid in self.loading:
            # D: aborted while its KV is in flight; the worker ends the fetch and reports
            # the request received, which is when vLLM frees its blocks.
            self.meta.to_abort.append(rid)
            return False, None
        if params.get("do_remote_prefill"):
            # D: never allocated (aborted while queued): P must still free its blocks.
            self.meta.to_recv[rid] = (dict(params), [], None)
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            self.meta.to_abort.append(rid)
            return False, None
        groups = _groups(block_ids)
        if not any(groups):
            return False, None
        self.meta.to_send[rid] = (groups, int(request.num_computed_tokens))
        self.sending.add(rid)
        cfg = self.config
        parallel = self.vllm_config.parallel_config
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": groups,
            "remote_engine_id": cfg.engine_id,
            "remote_request_id": rid,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": cfg.tp_size,
            "dcp_size": parallel.decode_context_parallel_size,
            "pp_size": parallel.pipeline_parallel_size,
            "remote_num_tokens": int(request.num_computed_tokens),
            "remote_blocks_expiry_time": (
                time.perf_counter() + cfg.lease_s if cfg.mode == "pull" else None
            ),
        }

    def build_meta(self) -> KVWireMetadata:
        meta, self.meta = self.meta, KVWireMetadata()
        return meta

    def update_output(self, output: KVConnectorOutput) -> None:
        self.sending -= set(output.finished_sending or ())
        self.loading -= set(output.finished_recving or ())

    def close(self) -> None:
        self.listener.close()


def _groups(block_ids: Any) -> BlockIds:
    """vLLM hands a connector without hybrid-manager support one group's flat id list;
    the params (vLLM's own format) carry a list per group."""
    ids = list(block_ids)
    if ids and not isinstance(ids[0], int):
        return [[int(b) for b in group] for group in ids]
    return [[int(b) for b in ids]]


class _WorkerSide:
    """One rank: a Producer (a ``kv_producer`` engine) or a Consumer (``kv_consumer``) over
    the rank's KV tensors."""

    def __init__(
        self, vllm_config: VllmConfig, config: KVWireConfig, kv_cache_config: KVCacheConfig
    ) -> None:
        self.vllm_config = vllm_config
        self.config = config
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        if _is_producer(vllm_config):
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
        geometry = layer_geometry(kv_caches, self.num_blocks, self.config, self.vllm_config)
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


def _is_producer(vllm_config: VllmConfig) -> bool:
    """kvwire runs one side per engine; ``kv_both`` would need two agents behind one
    handshake, which vLLM's peers cannot address."""
    transfer = vllm_config.kv_transfer_config
    if transfer.kv_role not in ("kv_producer", "kv_consumer"):
        raise ConfigError(
            f"KVWireConnector needs kv_role kv_producer or kv_consumer, got {transfer.kv_role!r}"
        )
    return bool(transfer.kv_role == "kv_producer")


def _tp_rank(vllm_config: VllmConfig) -> int:
    """The worker's TP rank; 0 in a process without vLLM's parallel groups (TP 1)."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    if vllm_config.parallel_config.tensor_parallel_size != 1:
        raise ConfigError("TP > 1 needs vLLM's parallel groups initialised")
    return 0


class KVWireConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """kvwire's vLLM v1 connector (both roles); see the module docstring."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(vllm_config, kvwire_config(vllm_config))
        else:
            config = kvwire_config(vllm_config, tp_rank=_tp_rank(vllm_config))
            self._worker = _WorkerSide(vllm_config, config, kv_cache_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The layout a stock NixlConnector engine asks for, so that both kinds resolve the
        same one (vLLM otherwise picks each backend's first preference, and a mixed pair
        would differ in layout). Head-major pages also move in fewer, longer spans when TP
        sizes differ. MLA has one head: any layout is the same bytes."""
        model = vllm_config.model_config
        if model is None or model.use_mla:
            return None
        return "LBHNC"

    # -- scheduler side ------------------------------------------------------------

    def _sched(self) -> _SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on a worker connector"
        return self._scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_meta()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self._sched().set_handshakes(metadata)

    @property
    def side_channel_port(self) -> int:
        return self._sched().port

    # -- worker side ---------------------------------------------------------------

    def _work(self) -> _WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._work().handshake()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVWireMetadata)
        self._work().start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous (between steps): nothing to wait for per layer."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """P's blocks are read (or written out) from the KV cache itself after the request
        finishes: nothing to copy per layer."""

    def wait_for_save(self) -> None:
        """See :meth:`save_kv_layer`."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work().finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_invalid()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._work().stats() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()


__all__ = ["KVWireConnector", "KVWireHandshake", "KVWireMetadata", "kvwire_config"]
