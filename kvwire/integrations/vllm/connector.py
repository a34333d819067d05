"""``KVWireConnector``, the class vLLM instantiates: one object per role, delegating to
:class:`~kvwire.integrations.vllm.scheduler.SchedulerSide` (role SCHEDULER) or
:class:`~kvwire.integrations.vllm.worker.WorkerSide` (role WORKER)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvwire.errors import ConfigError
from kvwire.integrations.vllm import staging
from kvwire.integrations.vllm.config import kvwire_config, tp_rank
from kvwire.integrations.vllm.groups import group_kinds
from kvwire.integrations.vllm.messages import KVWireMetadata
from kvwire.integrations.vllm.scheduler import SchedulerSide
from kvwire.integrations.vllm.worker import WorkerSide
from kvwire.layout.geometry import RegionKind

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KVWireConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """kvwire's vLLM v1 connector (both roles); see the module docstring."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # A group kvwire cannot move fails the engine's startup, on either role.
        kinds = group_kinds(kv_cache_config, int(vllm_config.cache_config.block_size))
        if RegionKind.RING in kinds and staging.wants_host_buffer(vllm_config):
            raise ConfigError(
                "a ring group (CircularBufferSpec) with a host buffer (kv_buffer_device "
                '"cpu"): KVWireConnector, as stock, does not stage such a model'
            )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                vllm_config, kvwire_config(vllm_config), kv_cache_config
            )
        else:
            config = kvwire_config(vllm_config, tp_rank=tp_rank(vllm_config))
            self._worker = WorkerSide(vllm_config, config, kv_cache_config)

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """Yes, as stock: a D that loads a prompt moves every state and ring group whole,
        whatever its local hit, so vLLM may keep a hit its full-attention group reaches
        though a state group's is shorter (D never holds a state at a block boundary of a
        loaded prompt: without this a hybrid model's D reuses none of its cache). A load
        that fails resets the request, which then takes the hit every group agrees on."""
        return True

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

    def _sched(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on a worker connector"
        return self._scheduler

    def on_new_request(self, request: Request) -> None:
        self._sched().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Every transfer group (vLLM 0.32 asks; its default, the prefix-cacheable groups,
        fits a hash-addressed store): a load writes the request's own blocks of each, and
        vLLM must not zero a group's blocks while the load is writing them."""
        return tuple(self._kv_cache_config.transfer_group_ids)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """vLLM's scheduler binds its cache manager: a streaming P reads where each
        computing prompt's blocks are from it."""
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = kv_cache_manager

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid manager calls this instead of :meth:`request_finished`, with a
        list per KV-cache group; both reach one decision."""
        return self._sched().request_finished(request, block_ids)

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        self._sched().set_handshakes(metadata)

    @property
    def side_channel_port(self) -> int:
        return self._sched().port

    # -- worker side ---------------------------------------------------------------

    def _work(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._work().handshake()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward: a P takes the step's chunks, preemptions and finished
        prompts here, since vLLM calls ``start_load_kv`` after the forward (unless a load
        must finish before it) and the forward's ``save_kv_layer`` calls report layers of
        this step's chunks."""
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KVWireMetadata)
        self._work().bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVWireMetadata)
        self._work().start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous (between steps): nothing to wait for per layer."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """vLLM calls this after each attention layer of a step. Streaming push (a P in
        push mode, ``stream_layers`` on): the layer is computed for the step's prompts, and
        the runtime writes what that completes in the background. Otherwise nothing: P's
        blocks are read (or written out) from the KV cache itself after the request
        finishes.

        Not overriding ``requires_piecewise_for_cudagraph``: the replay of a full CUDA
        graph makes no call here, so such a step's layers are reported by the next chunk
        (which tells the runtime the one before is computed) or the prompt's end. Nothing
        goes early; the stream is coarser. vLLM's default graph mode runs prefills
        piecewise, which calls here per layer; forcing it would cost a decode engine its
        full graphs (the setting cannot tell P from D)."""
        self._work().layer_saved(layer_name)

    def wait_for_save(self) -> None:
        """Nothing to wait for: writes run in the background and read P's blocks, which
        vLLM keeps until the worker reports the request sent (the completion goes only
        after the prompt finished, on the write that carries its last layer). With a host
        buffer, the step's blocks are copied to it here."""
        self._work().saved()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work().finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Failed loads of a model with several KV-cache groups go by request (vLLM
        recomputes or fails the request, by its ``kv_load_failure_policy``); with one
        group by block (:meth:`get_block_ids_with_load_errors`), so vLLM recomputes only
        the blocks that did not arrive. A failed request is reported received too, which
        releases it from waiting for its KV."""
        sent, received = self._work().finished()
        return KVConnectorTransferResults(
            finished_sending=set(sent or ()),
            finished_recving=set(received or ()),
            failed_recving=self._work().take_failed(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().take_invalid()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._work().stats() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
