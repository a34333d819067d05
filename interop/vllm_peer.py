"""One process of a vLLM engine, driving vLLM's own NIXL connector classes.

Run with the vLLM venv's python (``VLLM_TARGET_DEVICE=cpu``): ``python interop/vllm_peer.py``.
The first frame on stdin (kvwire.framing: length-prefixed msgpack, no pickle) is
``start`` with ``part`` = ``scheduler`` (the engine-core side: vLLM's
``Nixl{Pull,Push}ConnectorScheduler`` and its side-channel listener) or ``worker`` (one TP rank:
``Nixl{Pull,Push}ConnectorWorker`` with real CPU tensors registered through real NIXL). A
vLLM engine is one scheduler process plus one worker process per rank, as in vLLM; the
scheduler's per-step ``NixlConnectorMetadata`` travels to the workers as msgpack.

Stood in for, and nothing else: the model facts (``model_config``), the TP/PCP group getters,
the attention-backend lookup (CPU_ATTN, CPU_MLA for MLA) and the config objects' container
(a namespace holding vLLM's own ``KVTransferConfig``; the small cache/parallel/scheduler
configs are namespaces with the fields the connector reads). Requests are vLLM ``Request``
objects; blocks are vLLM ``KVCacheBlocks``; the KV tensors are views made by vLLM's
``create_kv_cache_views`` over memory laid out as kvwire's demo content expects, so both
sides fill and check bytes with ``kvwire.demo.content``.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import torch

from kvwire.demo.content import count_wrong_bytes, fill, scribble
from kvwire.demo.models import CacheSpec, preset
from kvwire.framing import FrameWriter, commands, read_frame

LAYER_NAME = "model.layers.{}.self_attn.attn"


class _Records(logging.Handler):
    """vLLM's warnings and errors, returned with each answer (why a handshake failed)."""

    def __init__(self) -> None:
        super().__init__(int(os.environ.get("INTEROP_VLLM_LOG_LEVEL", logging.WARNING)))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = f"{record.name}: {record.getMessage()}"
        except Exception:  # a record that cannot format is still worth a line
            line = f"{record.name}: {record.msg}"
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]  # vLLM logs a failed handshake's cause this way
            line += f" [{type(error).__name__}: {error}]"
        self.lines.append(line)

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


RECORDS = _Records()


# -- configuration stand-ins ----------------------------------------------------------


def cache_spec(start: dict[str, Any]) -> CacheSpec:
    """``kv_heads`` (when set) stands for one rank of a wider engine: the model with that many
    KV heads in all, e.g. 1 for one TP-8 rank of Llama-3-70B."""
    model = preset(start["model"])
    if start.get("kv_heads"):
        model = replace(model, kv_heads=int(start["kv_heads"]))
    return CacheSpec(
        model=model,
        layers=int(start["layers"]),
        num_blocks=int(start["num_blocks"]),
        tp_rank=int(start.get("tp_rank", 0)),
        tp_size=int(start["tp_size"]),
        block_tokens=int(start["block_size"]),
    )


def layer_names(start: dict[str, Any]) -> list[str]:
    return [LAYER_NAME.format(i) for i in range(int(start["layers"]))]


_KERNEL_BACKENDS: dict[tuple[bool, int], Any] = {}


def _backend(mla: bool, kernel_block: int = 0) -> Any:
    """vLLM's CPU attention backend; with ``kernel_block``, one that runs only kernel blocks
    of that many tokens, as a GPU backend may (vLLM then splits each block into several)."""
    if mla:
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

        base: Any = CPUMLABackend
    else:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        base = CPUAttentionBackend
    if not kernel_block:
        return base
    key = (mla, kernel_block)
    if key not in _KERNEL_BACKENDS:
        sizes = [kernel_block]
        _KERNEL_BACKENDS[key] = type(
            f"{base.__name__}Kernel{kernel_block}",
            (base,),
            {"get_supported_kernel_block_sizes": staticmethod(lambda *_a, **_k: sizes)},
        )
    return _KERNEL_BACKENDS[key]


def build_configs(start: dict[str, Any]) -> tuple[Any, Any]:
    """(vllm_config, kv_cache_config) for one engine, from the facts in ``start``."""
    from vllm.config import KVTransferConfig
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MLAAttentionSpec,
    )

    spec = cache_spec(start)
    model = spec.model
    head_size = model.latent_dim if model.mla else model.head_dim
    total_heads = 1 if model.mla else model.kv_heads
    model_config = SimpleNamespace(
        model=model.hf_name,
        dtype=torch.bfloat16,
        use_mla=model.mla,
        revision=None,
        code_revision=None,
        hf_config=SimpleNamespace(),
        get_total_num_kv_heads=lambda: total_heads,
        get_head_size=lambda: head_size,
        get_total_num_hidden_layers=lambda: model.num_layers,
        get_layers_start_end_indices=lambda *_a, **_k: (0, spec.layers),
    )
    role = "kv_producer" if start["role"] == "P" else "kv_consumer"
    extra: dict[str, Any] = {"kv_lease_duration": int(start.get("lease", 30)), "backends": ["UCX"]}
    extra.update(start.get("extra_config") or {})
    kv_transfer_config = KVTransferConfig(
        kv_connector="NixlPushConnector" if start["mode"] == "push" else "NixlConnector",
        kv_role=role,
        engine_id=start["engine_id"],
        kv_buffer_device="cpu",
        kv_connector_extra_config=extra,
    )
    # HMA resolution as vLLM's VllmConfig does it (vllm/config/vllm.py): off where the
    # platform does not support the hybrid manager, else on for NixlConnector (which
    # supports HMA). CpuPlatform does support it, so a CPU engine resolves it on.
    hma = start.get("hma")
    if hma is None:
        hma = bool(current_platform.support_hybrid_kv_cache())
    cache_config = SimpleNamespace(
        block_size=spec.block_tokens,
        cache_dtype="auto",
        enable_prefix_caching=True,
        mamba_cache_mode="none",
        kv_cache_layout=start.get("layout", "LBHNC"),
        get_resolved_kv_cache_layout=lambda: _layout(start.get("layout", "LBHNC")),
    )
    parallel_config = SimpleNamespace(
        tensor_parallel_size=spec.tp_size,
        pipeline_parallel_size=1,
        decode_context_parallel_size=int(start.get("dcp_size", 1)),
        prefill_context_parallel_size=1,
        data_parallel_index=0,
        data_parallel_rank=0,
    )
    vllm_config = SimpleNamespace(
        model_config=model_config,
        cache_config=cache_config,
        parallel_config=parallel_config,
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=not hma),
        kv_transfer_config=kv_transfer_config,
        speculative_config=None,
        num_prefill_lookahead_tokens=0,
    )
    if model.mla:
        kv_spec: Any = MLAAttentionSpec(
            block_size=spec.block_tokens,
            num_kv_heads=1,
            head_size=head_size,
            dtype=torch.bfloat16,
        )
    else:
        kv_spec = FullAttentionSpec(
            block_size=spec.block_tokens,
            num_kv_heads=spec.heads_here,
            head_size=head_size,
            dtype=torch.bfloat16,
        )
    names = layer_names(start)
    page = spec.block_len
    tensors = [
        KVCacheTensor(
            size=spec.region_bytes, layers=[name], layer_stride=spec.region_bytes, block_stride=page
        )
        for name in names
    ]
    kv_cache_config = KVCacheConfig(
        num_blocks=spec.num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(names, kv_spec)],
        kv_cache_layout=start.get("layout", "LBHNC"),
    )
    return vllm_config, kv_cache_config


def _layout(name: str) -> Any:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return KVCacheLayout[name]


def kv_cache_views(
    spec: Any, buffer: np.ndarray[Any, Any], kv_cache_config: Any, layout: str
) -> dict[str, torch.Tensor]:
    """One region of ``buffer`` per KV-cache tensor, viewed by vLLM's own
    ``create_kv_cache_views``; by layer name. The bytes sit where vLLM's ``allocate_kv_cache``
    puts them for LBHNC (layer after layer in one buffer), but each view has a storage object
    of its own: right for code that reads a view's address, as the stock worker does, and
    not for code that reads its storage (interop/vllm_engine.py uses vLLM's allocator)."""
    from vllm.v1.kv_cache_interface import create_kv_cache_views

    group = kv_cache_config.kv_cache_groups[0]
    caches: dict[str, torch.Tensor] = {}
    for i, tensor in enumerate(kv_cache_config.kv_cache_tensors):
        region = buffer[i * spec.region_bytes : (i + 1) * spec.region_bytes]
        raw = torch.from_numpy(region).view(torch.int8)
        (view,) = create_kv_cache_views(
            raw, group.kv_cache_spec, spec.num_blocks, _layout(layout), tensor
        )
        caches[tensor.layers[0]] = view
    return caches


def stand_in_parallel_state(start: dict[str, Any], backends: dict[str, Any] | None = None) -> None:
    """The TP/PCP group getters and the backend lookup the worker module imported.
    ``backends``: per cache layer, in the order a model registers them, the backend its
    layer runs (a model whose caches run several, DeepSeek-V4's); else every layer runs
    the one CPU backend of the model's kind."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    rank, size = int(start["tp_rank"]), int(start["tp_size"])
    mla = preset(start["model"]).mla
    kernel = int(start.get("kernel_block") or 0)
    base_worker.get_tensor_model_parallel_rank = lambda: rank  # type: ignore[attr-defined]
    base_worker.get_tensor_model_parallel_world_size = lambda: size  # type: ignore[attr-defined]
    base_worker.get_pcp_group = lambda: SimpleNamespace(rank_in_group=0)  # type: ignore[attr-defined]
    if backends is not None:
        from vllm.distributed.kv_transfer.kv_connector import utils

        distinct = list(dict.fromkeys(backends.values()))
        base_worker.get_current_attn_backends = lambda *_a, **_k: distinct  # type: ignore[attr-defined]
        # vLLM's own lookups (0.32's kernel sizes by backend and spec among them) find
        # each layer's backend through its layer objects: those of a model not loaded.
        utils.get_layers_from_vllm_config = (  # type: ignore[attr-defined]
            lambda _config, _kind, names=None: {
                name: SimpleNamespace(get_attn_backend=lambda b=backends[name]: b)
                for name in (backends if names is None else names)
                if name in backends
            }
        )
        return
    base_worker.get_current_attn_backends = (  # type: ignore[attr-defined]
        lambda *_a, **_k: [_backend(mla, kernel)]
    )
    if hasattr(base_worker, "get_current_attn_backends_and_specs"):  # vLLM 0.32 and later
        base_worker.get_current_attn_backends_and_specs = (  # type: ignore[attr-defined]
            lambda _vllm_config, kv_cache_config, _fallback: (
                [_backend(mla, kernel)],
                [kv_cache_config.kv_cache_groups[0].kv_cache_spec],
            )
        )


def _meta_types() -> dict[str, Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        HeartbeatInfo,
        ReqMeta,
    )

    def reqs(raw: dict[str, Any]) -> dict[str, Any]:
        return {rid: _req_meta(ReqMeta, fields) for rid, fields in raw.items()}

    def heartbeats(raw: dict[str, Any]) -> dict[str, Any]:
        return {
            engine: HeartbeatInfo(**{**fields, "req_ids": set(fields["req_ids"])})
            for engine, fields in raw.items()
        }

    def block_ids(raw: dict[str, Any]) -> dict[str, Any]:
        return {rid: tuple(list(g) for g in groups) for rid, groups in raw.items()}

    return {
        "reqs_to_recv": reqs,
        "reqs_to_save": reqs,
        "reqs_to_send": lambda raw: {k: float(v) for k, v in raw.items()},
        "scheduler_clock": float,
        "reqs_in_batch": set,
        "reqs_not_processed": set,
        "heartbeat_by_engine": heartbeats,
        "push_registrations": dict,
        "push_finished_blocks": block_ids,
    }


def _req_meta(cls: Any, fields: dict[str, Any]) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import RemoteMeta

    fields = dict(fields)
    for key in ("local_block_ids", "local_physical_block_ids", "region_blocks_to_zero"):
        if fields.get(key) is not None:
            fields[key] = tuple(list(g) for g in fields[key])
    fields["local_num_computed_blocks"] = tuple(fields.get("local_num_computed_blocks", ()))
    if fields.get("remote") is not None:
        remote = dict(fields["remote"])
        remote["block_ids"] = tuple(list(g) for g in remote["block_ids"])
        fields["remote"] = RemoteMeta(**remote)
    return cls(**fields)


def encode_meta(meta: Any) -> bytes:
    return msgspec.msgpack.encode({k: getattr(meta, k) for k in _meta_types()})


def decode_meta(data: bytes) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlConnectorMetadata,
    )

    raw = msgspec.msgpack.decode(data)
    meta = NixlConnectorMetadata()
    for key, convert in _meta_types().items():
        setattr(meta, key, convert(raw[key]))
    return meta


# -- the scheduler process --------------------------------------------------------------


class SchedulerPart:
    def __init__(self, start: dict[str, Any]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
            NixlPullConnectorScheduler,
            NixlPushConnectorScheduler,
        )

        self.start = start
        self.block_size = int(start["block_size"])
        vllm_config, kv_cache_config = build_configs(start)
        cls = NixlPushConnectorScheduler if start["mode"] == "push" else NixlPullConnectorScheduler
        self.sched = cls(vllm_config, start["engine_id"], kv_cache_config)
        self.requests: dict[str, Any] = {}
        self.blocks: dict[str, list[int]] = {}

    def _request(self, rid: str, num_tokens: int, params: dict[str, Any]) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        req = Request(rid, list(range(num_tokens)), SamplingParams(max_tokens=1), None)
        req.kv_transfer_params = params
        self.requests[rid] = req
        return req

    def _kv_blocks(self, blocks: list[int], hit: int) -> Any:
        """The engine's allocation: ``hit`` leading blocks are prefix-cache hits (hashed)."""
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        cached = []
        for i, block_id in enumerate(blocks):
            block = KVCacheBlock(block_id)
            if i < hit:
                block.set_block_hash(b"hit-%d" % block_id)  # type: ignore[arg-type]
            cached.append(block)
        return KVCacheBlocks((cached,))

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "serve":
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
                NixlHandshakePayload,
            )

            payloads = {
                (0, int(rank)): msgspec.msgpack.decode(blob, type=NixlHandshakePayload)
                for rank, blob in cmd["payloads"].items()
            }
            self.sched.set_xfer_handshake_metadata(payloads)
            return {"port": self.sched.side_channel_port}
        if op == "prefill":
            # P: the prompt is scheduled (blocks allocated) ...
            rid, n = cmd["rid"], int(cmd["num_tokens"])
            req = self._request(rid, n, {"do_remote_decode": True, **(cmd.get("params") or {})})
            self.sched.on_new_request(req)
            self.sched.get_num_new_matched_tokens(req, 0)
            self.sched.update_state_after_alloc(req, self._kv_blocks(cmd["blocks"], 0), 0)
            self.blocks[rid] = list(cmd["blocks"])
            return {}
        if op == "finish":
            # ... and finishes (max_tokens=1): request_finished decides on delay-free.
            from vllm.v1.request import RequestStatus

            rid = cmd["rid"]
            req = self.requests[rid]
            req.status = RequestStatus(cmd.get("status", RequestStatus.FINISHED_LENGTH_CAPPED))
            req.num_computed_tokens = req.num_prompt_tokens
            delay, params = self.sched.request_finished(req, (self.blocks[rid],))
            return {"delay": delay, "params": params}
        if op == "add":
            # D: the proxy's request arrives with P's params; ``hit`` blocks are local.
            rid, n = cmd["rid"], int(cmd["num_tokens"])
            req = self._request(rid, n, dict(cmd["params"]))
            self.sched.on_new_request(req)
            if cmd.get("blocks") is None:
                return {}  # waiting for blocks: heartbeats keep P's lease alive meanwhile
            return self.handle({**cmd, "op": "alloc"})
        if op == "alloc":
            rid, hit = cmd["rid"], int(cmd.get("hit", 0))
            req = self.requests[rid]
            count, is_async = self.sched.get_num_new_matched_tokens(req, hit * self.block_size)
            req.num_computed_tokens = hit * self.block_size
            blocks = list(cmd["blocks"])
            self.blocks[rid] = blocks
            self.sched.update_state_after_alloc(req, self._kv_blocks(blocks, hit), count or 0)
            return {"count": count, "async": is_async}
        if op == "meta":
            return {"meta": encode_meta(self.sched.build_connector_meta(_empty_output()))}
        if op == "output":
            from vllm.v1.outputs import KVConnectorOutput

            self.sched.update_connector_output(
                KVConnectorOutput(
                    finished_sending=set(cmd.get("sending", [])) or None,
                    finished_recving=set(cmd.get("recving", [])) or None,
                )
            )
            return {"pending_push": bool(self.sched.has_pending_push_work())}
        if op == "done":
            # D: the request ran to its end; vLLM calls request_finished then too.
            from vllm.v1.request import RequestStatus

            req = self.requests.pop(cmd["rid"])
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            delay, params = self.sched.request_finished(req, (self.blocks.pop(cmd["rid"]),))
            return {"delay": delay, "params": params}
        raise ValueError(f"unknown op {op!r}")

    def close(self) -> None:
        # Stock's shutdown joins its listener thread, which wakes once a second; the process
        # exits right after this, so a test need not wait out that poll.
        threading.Thread(target=self.sched.shutdown, daemon=True).start()


def _empty_output() -> Any:
    from vllm.v1.core.sched.output import SchedulerOutput

    return SchedulerOutput.make_empty()


# -- a worker (one TP rank) -------------------------------------------------------------


class WorkerPart:
    def __init__(self, start: dict[str, Any]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
            NixlPullConnectorWorker,
            NixlPushConnectorWorker,
        )

        stand_in_parallel_state(start)
        self.spec = cache_spec(start)
        vllm_config, kv_cache_config = build_configs(start)
        cls = NixlPushConnectorWorker if start["mode"] == "push" else NixlPullConnectorWorker
        self.worker = cls(vllm_config, start["engine_id"], kv_cache_config)
        # Views made by vLLM, one per layer (see kv_cache_views).
        self.buffer = np.zeros(self.spec.total_bytes, dtype=np.uint8)
        caches = kv_cache_views(self.spec, self.buffer, kv_cache_config, start["layout"])
        self.worker.register_kv_caches(caches)
        self.sending: set[str] = set()
        self.recving: set[str] = set()

    def payload(self) -> bytes:
        return msgspec.msgpack.encode(self.worker.xfer_handshake_metadata)

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "fill":
            fill(self.spec, self.buffer, int(cmd["index"]), list(cmd["blocks"]))
            return {}
        if op == "prepare":
            # D: prefix-hit blocks hold the content already, the rest is garbage.
            blocks, hit = list(cmd["blocks"]), int(cmd.get("hit", 0))
            if hit:
                fill(self.spec, self.buffer, int(cmd["index"]), blocks)
            scribble(self.spec, self.buffer, blocks[hit:])
            return {}
        if op == "check":
            wrong, checked = count_wrong_bytes(
                self.spec, self.buffer, int(cmd["index"]), list(cmd["blocks"])
            )
            return {"wrong": wrong, "checked": checked}
        if op == "step":
            if cmd.get("meta") is not None:
                self.worker.start_load_kv(decode_meta(cmd["meta"]))
            sending, recving = self.worker.get_finished()
            invalid = sorted(self.worker.get_block_ids_with_load_errors())
            return {"sending": sorted(sending), "recving": sorted(recving), "invalid": invalid}
        if op == "stats":
            w = self.worker
            return {
                "reqs_to_send": sorted(w._reqs_to_send),
                "consumer_counts": dict(w.consumer_notification_counts_by_req),
                "expected": dict(w.expected_consumer_notifications_by_req),
                "layout": w.kv_cache_layout,
                "region_names": list(w.region_names),
            }
        raise ValueError(f"unknown op {op!r}")

    def close(self) -> None:
        self.worker.shutdown()


def serve(reader: Any, writer: Any) -> int:
    """Answer one peer's frames until ``exit`` or end of stream."""
    logging.getLogger("vllm").addHandler(RECORDS)
    logging.getLogger("vllm").setLevel(min(RECORDS.level, logging.INFO))
    logging.getLogger("kvwire").addHandler(RECORDS)  # the runtime's own (a refused peer)
    out = FrameWriter(writer)
    start = read_frame(reader)
    if start is None:
        return 1
    os.environ.update(start.get("env") or {})
    try:
        part: Any
        if start["part"] == "engine":
            from vllm_engine import EnginePart

            part = EnginePart(start)
            out.send({"ok": True, "pid": os.getpid(), "log": RECORDS.take()})
        elif start["part"] == "scheduler":
            part = SchedulerPart(start)
            out.send({"ok": True, "pid": os.getpid(), "log": RECORDS.take()})
        else:
            part = WorkerPart(start)
            out.send({"ok": True, "pid": os.getpid(), "payload": part.payload(),
                      "log": RECORDS.take()})  # fmt: skip
    except Exception as exc:
        traceback.print_exc()
        out.send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "log": RECORDS.take()})
        return 1
    try:
        for cmd in commands(reader):
            try:
                answer = part.handle(cmd)
                out.send({"ok": True, **answer, "log": RECORDS.take(), "t": time.time()})
            except Exception as exc:
                traceback.print_exc()
                out.send({"ok": False, "error": f"{type(exc).__name__}: {exc}",
                          "log": RECORDS.take()})  # fmt: skip
    finally:
        part.close()
    return 0


PRELOADED = (
    "vllm",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl",
    "vllm.distributed.nixl_utils",
    "vllm.v1.core.sched.output",
    "vllm.v1.request",
    "vllm_engine",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.executor.uniproc_executor",
    "vllm.distributed.aux_output_connector.connector",
    "kvwire.integrations.vllm",
    "kvwire_nixl",
    "kvwire_shm",
)
"""Everything a peer imports, once: each peer is then a fork of this process. From
``vllm_engine`` on, what every peer still imported after its fork until they were
preloaded: about 60 modules (the scheduler's, the connectors', the transports'), 19 of
the 74 s the peers of ``test_vllm_connector.py`` spent outside waiting for frames.
Preloaded, that module kept this 2-core machine's CPUs busy 83 s instead of 104, and
took 66 s instead of 84."""


def preload() -> None:
    """:data:`PRELOADED` and the two CPU attention backends, imported here."""
    for name in PRELOADED:
        importlib.import_module(name)
    _backend(True)
    _backend(False)
    _check_nothing_env_cached()


def _check_nothing_env_cached() -> None:
    """Each peer sets its own environment after the fork (its side-channel port, its conv
    state layout): a value vLLM cached here would be every peer's."""
    from vllm import envs
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    if envs._is_envs_cache_enabled() or get_conv_state_layout.cache_info().currsize:
        raise RuntimeError("the zygote cached vLLM's environment before forking its peers")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def install_ucx_hooks() -> None:
    """Create and drop one NIXL agent, so UCX installs its memory hooks here, once: each
    peer then inherits them. UCX patches them into the relocation tables of every library
    loaded (torch's are many), which took 0.14 s of a peer's first agent (0.03 s with them
    inherited); ``test_vllm_connector.py``'s 102 tests start 202 agents. The agent's threads end
    with it; one left running would be forked while it might hold a lock."""
    import gc

    from kvwire_nixl._loader import load_nixl

    # kvwire's loader, as a kvwire peer loads NIXL: UCX reads UCX_MODULES once, when it
    # first loads its modules (here, for every peer), and without RDMA devices the loader
    # keeps the InfiniBand ones out.
    api, _bindings = load_nixl()
    before = _threads()
    agent = api.nixl_agent("zygote-ucx-hooks", api.nixl_agent_config(backends=["UCX"]))
    del agent
    gc.collect()
    if _threads() != before:
        raise RuntimeError(f"the NIXL agent left {_threads() - before} threads running")


def zygote(path: str) -> int:
    """Fork server: vLLM takes tens of seconds to import on a busy 2-core machine, so one
    process imports it and forks a fresh child per peer. A client connects to the Unix
    socket at ``path`` and passes one end of a socketpair: the child's frame stream."""
    import signal
    import socket

    preload()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    ready = os.dup(1)
    os.dup2(2, 1)  # children's stray prints (and NIXL's logs) go to stderr, never a frame
    install_ucx_hooks()
    os.write(ready, b"ready\n")  # a failure above is "zygote did not start"
    os.close(ready)
    while True:
        conn, _ = listener.accept()
        try:
            msg, fds, _flags, _addr = socket.recv_fds(conn, 16, 1)
        finally:
            conn.close()
        if not fds:
            if msg == b"quit":
                listener.close()
                return 0
            continue
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            stream = socket.socket(fileno=fds[0])
            reader, writer = stream.makefile("rb"), stream.makefile("wb")
            code = 1
            try:
                code = serve(reader, writer)
            finally:
                os._exit(code)
        os.close(fds[0])


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--zygote":
        return zygote(sys.argv[2])
    writer = sys.stdout.buffer
    sys.stdout = sys.stderr  # only frames on the frame stream
    return serve(sys.stdin.buffer, writer)


if __name__ == "__main__":
    raise SystemExit(main())
