"""One vLLM engine in one process: vLLM's real ``Scheduler`` and one worker (TP 1), the
way vLLM's in-process executor runs them, with the KV connector each side builds through
vLLM's own ``KVConnectorFactory`` (``KVWireConnector`` by module path, or stock
``NixlConnector``).

Forked by interop/vllm_peer.py's zygote (``part: engine``). Stood in for, and nothing
else: the model facts (``model_config``), the attention-backend lookup (``CPU_ATTN``) and
the model runner — which, each step, runs the connector's worker calls in vLLM's order
(``bind_connector_metadata``, ``start_load_kv``, per layer ``wait_for_layer_load`` and
``save_kv_layer``, ``wait_for_save``, ``get_finished``, ``get_block_ids_with_load_errors``,
``clear_connector_metadata``), fills P's scheduled blocks with ``kvwire.demo.content``, checks
D's blocks the moment D would first read them, and samples one token per request.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import vllm_peer

from kvwire.demo.content import count_wrong_bytes, fill, scribble


def build_vllm_config(start: dict[str, Any]) -> Any:
    """A real VllmConfig (scheduler, cache, parallel, kv_transfer configs are vLLM's own);
    only ``model_config`` is a stand-in holding the model facts."""
    from vllm.config import CacheConfig, KVTransferConfig, SchedulerConfig, VllmConfig

    spec = vllm_peer.cache_spec(start)
    model = spec.model
    max_len = spec.num_blocks * spec.block_tokens
    connector = start["connector"]
    role = "kv_producer" if start["role"] == "P" else "kv_consumer"
    extra: dict[str, Any] = {"kv_lease_duration": int(start.get("lease", 30)), "backends": ["UCX"]}
    extra.update(start.get("extra_config") or {})
    if extra.get("transport") == "shm":
        del extra["backends"]  # a NIXL plugin list means nothing to shared memory
    kv = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=(
            "kvwire.integrations.vllm" if connector == "KVWireConnector" else None
        ),
        kv_role=role,
        engine_id=start["engine_id"],
        kv_buffer_device="cpu",
        kv_connector_extra_config=extra,
    )
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=int(start.get("batch_tokens") or max_len),
            long_prefill_token_threshold=int(start.get("chunk_tokens") or 0),
            enable_chunked_prefill=True,
            max_model_len=max_len,
            is_encoder_decoder=False,
            disable_hybrid_kv_cache_manager=True,
        ),
        cache_config=CacheConfig(block_size=spec.block_tokens, enable_prefix_caching=True),
        kv_transfer_config=kv,
    )
    model_config = SimpleNamespace(
        model=model.hf_name,
        dtype=torch.bfloat16,
        use_mla=False,
        uses_mrope=False,
        is_encoder_decoder=False,
        is_diffusion=False,
        supports_multimodal_inputs=False,
        multimodal_config=None,
        return_sampling_mask=False,
        original_max_model_len=max_len,
        max_model_len=max_len,
        revision=None,
        code_revision=None,
        hf_config=SimpleNamespace(),
        get_total_num_kv_heads=lambda: model.kv_heads,
        get_head_size=lambda: model.head_dim,
        get_total_num_hidden_layers=lambda: model.num_layers,
        get_layers_start_end_indices=lambda *_a, **_k: (0, spec.layers),
    )
    object.__setattr__(vllm_config, "model_config", model_config)
    vllm_config.cache_config.num_gpu_blocks = spec.num_blocks
    vllm_config.cache_config.kv_cache_layout = "LBHNC"
    return vllm_config


def _starts_loads(meta: Any) -> bool:
    """Whether this step's metadata starts a fetch (either connector's)."""
    return bool(getattr(meta, "to_recv", None) or getattr(meta, "reqs_to_recv", None))


class _NoGrammar:
    """No structured output in these requests: every token is acceptable."""

    def accept_tokens(self, *_a: Any) -> bool:
        return True

    def validate_tokens(self, _request: Any, tokens: list[int]) -> list[int]:
        return tokens

    def grammar_bitmask(self, *_a: Any, **_k: Any) -> None:
        return None


class EnginePart:
    def __init__(self, start: dict[str, Any]) -> None:
        from vllm.distributed.kv_transfer.kv_connector import utils
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler

        start = {**start, "tp_rank": 0, "tp_size": 1, "layout": "LBHNC"}
        vllm_peer.stand_in_parallel_state(start)
        utils.get_current_attn_backends = lambda *_a, **_k: [vllm_peer._backend(False)]
        self.start_role = start["role"]
        self.spec = vllm_peer.cache_spec(start)
        self.vllm_config = build_vllm_config(start)
        _unused, kv_cache_config = vllm_peer.build_configs(start)
        self.kv_cache_config = kv_cache_config
        from vllm.utils.hashing import sha256

        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(self.spec.block_tokens, sha256)
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=_NoGrammar(),
            block_size=self.spec.block_tokens,
        )
        self.hits: dict[str, int] = {}
        manager = self.scheduler.kv_cache_manager
        for name in ("get_computed_blocks", "get_computed_blocks_for_connector"):
            setattr(manager, name, self._counted(getattr(manager, name)))
        self.worker = KVConnectorFactory.create_connector(
            self.vllm_config, KVConnectorRole.WORKER, kv_cache_config
        )
        self.buffer = np.zeros(self.spec.total_bytes, dtype=np.uint8)
        scribble(self.spec, self.buffer, list(range(self.spec.num_blocks)))
        caches = vllm_peer.kv_cache_views(self.spec, self.buffer, kv_cache_config, "LBHNC")
        self.layers = list(caches)
        self.worker.register_kv_caches(caches)
        handshake = self.worker.get_handshake_metadata()
        sched_connector = self.scheduler.connector
        assert sched_connector is not None
        if handshake is None:  # stock NixlConnector keeps it on its worker object
            handshake = self.worker.connector_worker.xfer_handshake_metadata
        sched_connector.set_xfer_handshake_metadata_pp_aware({(0, 0): handshake})
        self.index: dict[str, int] = {}
        self.outputs: dict[str, Any] = {}
        self.checked: dict[str, tuple[int, int]] = {}
        self.sent: set[str] = set()
        self.received: set[str] = set()
        self.invalid: set[int] = set()
        self.connector_class = type(sched_connector).__name__
        self.requests: dict[str, Any] = {}
        self.load_calls: list[float] = []
        """D: seconds each start_load_kv that began fetches took (where posts happen)."""

    def _counted(self, lookup: Any) -> Any:
        def counted(request: Any) -> Any:
            """The local prefix-cache hit of each request (tokens), as the scheduler saw it."""
            found = lookup(request)
            self.hits[request.request_id] = int(found[1])
            return found

        return counted

    # -- the engine loop --------------------------------------------------------------
    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        w = self.worker
        if meta is not None:
            w.bind_connector_metadata(meta)
        began = time.perf_counter()
        w.start_load_kv(None)
        if meta is not None and self.start_role == "D" and _starts_loads(meta):
            self.load_calls.append(time.perf_counter() - began)
        req_ids: list[str] = []
        for new in out.scheduled_new_reqs:
            req_ids.append(new.req_id)
        req_ids.extend(out.scheduled_cached_reqs.req_ids)
        for rid in req_ids:
            self._compute(rid)
        for name in self.layers:
            w.wait_for_layer_load(name)
            w.save_kv_layer(name, None, None)
        w.wait_for_save()
        sending, recving = w.get_finished(out.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        self.sent |= set(sending or ())
        self.received |= set(recving or ())
        self.invalid |= invalid
        sampled = []
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            # schedule() already counted this step's tokens as computed: a token is
            # sampled once the whole prompt has been (a partial prefill samples none).
            sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending, finished_recving=recving, invalid_block_ids=invalid
            ),
        )
        results = self.scheduler.update_from_output(out, runner)
        for outputs in results.values():
            for o in outputs.outputs:
                if o.finished:
                    self.outputs[o.request_id] = o.kv_transfer_params

    def _compute(self, rid: str) -> None:
        """The model's forward for this request: P writes its KV; D checks the KV it was
        given (prefix hits included) the first time it reads it."""
        blocks = list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])
        index = self.index[rid]
        if self.start_role == "P":
            fill(self.spec, self.buffer, index, blocks)
        elif rid not in self.checked:
            n = self.scheduler.requests[rid].num_prompt_tokens // self.spec.block_tokens
            self.checked[rid] = count_wrong_bytes(self.spec, self.buffer, index, blocks[:n])

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        op = cmd["op"]
        if op == "add":
            rid = cmd["rid"]
            params = dict(cmd.get("params") or {})
            if self.start_role == "P":
                params.setdefault("do_remote_decode", True)
            # Token ids derive from the content index: requests of one index share a
            # prefix (and may hit the prefix cache), requests of different ones do not.
            first = int(cmd["index"]) * 1_000_000
            req = Request(
                rid,
                list(range(first, first + int(cmd["num_tokens"]))),
                SamplingParams(max_tokens=1),
                None,
                block_hasher=self.hasher,
            )
            req.kv_transfer_params = params
            self.index[rid] = int(cmd["index"])
            self.scheduler.add_request(req)
            self.requests[rid] = req
            return {}
        if op == "abort":
            from vllm.v1.request import RequestStatus

            self.scheduler.finish_requests([cmd["rid"]], RequestStatus.FINISHED_ABORTED)
            return {}
        if op == "step":
            for _ in range(int(cmd.get("n", 1))):
                self.step()
            return self.state()
        if op == "debug":
            side = self.worker._worker.endpoint
            return {
                "machine": side.machine_stats(),
                "errors": side.errors,
                "metrics": side.metrics.snapshot()["totals"],
            }
        if op == "fragment":
            # A long-running engine's pool: free blocks come back in no particular order.
            # Reorders vLLM's free-block queue (the order it allocates in) with a seed.
            queue = self.scheduler.kv_cache_manager.block_pool.free_block_queue
            blocks = queue.popleft_n(queue.num_free_blocks)
            np.random.default_rng(int(cmd.get("seed", 0))).shuffle(blocks)
            queue.append_n(blocks)
            return {}
        if op == "stats":
            stats = self.worker.get_kv_connector_stats()
            data = dict(stats.data) if stats is not None else {}
            return {"stats": data, "load_calls": self.load_calls}
        if op == "state":
            return self.state()
        raise ValueError(f"unknown op {op!r}")

    def state(self) -> dict[str, Any]:
        return {
            "outputs": self.outputs,
            "checked": {k: list(v) for k, v in self.checked.items()},
            "hits": self.hits,
            "preemptions": {rid: r.num_preemptions for rid, r in self.requests.items()},
            "sent": sorted(self.sent),
            "received": sorted(self.received),
            "invalid": sorted(self.invalid),
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "free_blocks": self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
            "connector": self.connector_class,
        }

    def close(self) -> None:
        self.worker.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()
