"""One vLLM engine in one process: vLLM's real ``Scheduler`` and one worker (TP 1), the
way vLLM's in-process executor runs them, with the KV connector each side builds through
vLLM's own ``KVConnectorFactory`` (``KVWireConnector`` by module path, or stock
``NixlConnector``).

Forked by interop/vllm_peer.py's zygote (``part: engine``). The KV cache is vLLM's: its
``get_kv_cache_config_from_groups`` plans it and its ``allocate_kv_cache`` allocates it (one
backing allocation for every layer, as on a GPU). Stood in for, and nothing else: the model
facts (``model_config``), the attention-backend lookup (``CPU_ATTN``) and the model
runner — which, each step, runs the connector's worker calls in vLLM's order
(``bind_connector_metadata``; per layer ``wait_for_layer_load`` and ``save_kv_layer``;
``start_load_kv``, after the layers unless the step has a synchronous load, then before
them; ``wait_for_save``, ``get_finished``, ``get_block_ids_with_load_errors``,
``clear_connector_metadata``), fills P's scheduled blocks with ``kvwire.demo.content``, checks
D's blocks the moment D would first read them, and samples one token per request. A
DeepSeek-V4 engine (``deepseek_v4``) fills and checks each layer's page of a block instead
(:class:`PagedGroup`): its groups' pages are of too many shapes for the demo content. With
``layerwise``, P computes as a model does: each layer's share of the step's chunk is written
just before that layer's ``save_kv_layer``, and not before (see :meth:`EnginePart._layer`).
For interop/bench_layerwise.py a layer also takes a set time (``compute``), threads are
placed on CPUs (``pin``), D steps until a request's KV is in (``run_until``), and both
sides report their clocks (``clocks``).

Why one module: it is one engine process; the engine loop, the stand-in model and the
commands the harness sends share that engine's state, and each is a few short methods.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import glm5next
import numpy as np
import qwen4exp
import torch
import vllm_peer
from yardstick import IDLE_STEP_S, ConnectorClock, FetchClock

from kvwire.demo.content import blocks_view, expected, fill, scribble
from kvwire.demo.models import preset


def build_vllm_config(start: dict[str, Any]) -> Any:
    """A real VllmConfig (scheduler, cache, parallel, kv_transfer configs are vLLM's own);
    only ``model_config`` is a stand-in holding the model facts."""
    from vllm.config import CacheConfig, KVTransferConfig, SchedulerConfig, VllmConfig

    spec = vllm_peer.cache_spec(start)
    model = spec.model
    max_len = spec.num_blocks * spec.block_tokens
    connector = start["connector"]
    role = start.get("kv_role") or ("kv_producer" if start["role"] == "P" else "kv_consumer")
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
            # None: vLLM resolves it (on, for a connector that supports the hybrid manager).
            disable_hybrid_kv_cache_manager=None if start.get("hma") is None else not start["hma"],
        ),
        cache_config=CacheConfig(
            block_size=spec.block_tokens,
            enable_prefix_caching=bool(start.get("prefix_caching", True)),
        ),
        kv_transfer_config=kv,
    )
    model_config = SimpleNamespace(
        model=model.hf_name,
        dtype=torch.bfloat16,
        use_mla=model.mla,
        uses_mrope=False,
        runner_type="generate",
        is_encoder_decoder=False,
        is_diffusion=False,
        supports_multimodal_inputs=bool(start.get("multimodal")),
        multimodal_config=None,
        return_sampling_mask=False,
        original_max_model_len=max_len,
        max_model_len=max_len,
        revision=None,
        code_revision=None,
        hf_config=SimpleNamespace(),
        get_total_num_kv_heads=lambda: 1 if model.mla else model.kv_heads,
        get_head_size=lambda: model.latent_dim if model.mla else model.head_dim,
        get_total_num_hidden_layers=lambda: model.num_layers,
        get_layers_start_end_indices=lambda *_a, **_k: (0, spec.layers),
    )
    object.__setattr__(vllm_config, "model_config", model_config)
    if start.get("deepseek_v4"):
        model_config.hf_config = model_config.hf_text_config = deepseek_v4_hf_config(start)
        # What V4's attention resolves its cache dtype to on CPU and FlashMLA, and writes
        # back (the packed fp8 latents the stock hash and both connectors then see).
        vllm_config.cache_config.cache_dtype = "auto" if start.get("bf16") else "fp8_ds_mla"
    if start.get("drafter"):
        object.__setattr__(vllm_config, "speculative_config", drafter_config(start))
    vllm_config.cache_config.num_gpu_blocks = spec.num_blocks
    vllm_config.cache_config.num_gpu_blocks_override = spec.num_blocks
    vllm_config.cache_config.kv_cache_layout = start.get("layout", "LBHNC")
    if start.get("mamba"):
        # What vLLM's hybrid-model config makes of its defaults: with prefix caching a state
        # per block boundary ("align"), a Mamba block as long as an attention block.
        cache = vllm_config.cache_config
        cache.mamba_cache_mode = "align" if cache.enable_prefix_caching else "none"
        cache.mamba_block_size = spec.block_tokens if cache.enable_prefix_caching else max_len
    return vllm_config


DEEPSEEK_V4_BLOCK = 256
"""Tokens a block: the only size V4's sparse-MLA and indexer backends run (and CPU's)."""


def deepseek_v4_start(start: dict[str, Any]) -> dict[str, Any]:
    """``start`` of a DeepSeek-V4 engine (``deepseek_v4``: each layer's compress ratio),
    refused unless it is one vLLM runs V4 in: 256-token blocks, a block-outermost layout
    (the indexer's backend takes no other), a layer per ratio and the hybrid manager,
    without which vLLM cannot keep V4's groups of five block sizes apart."""
    ratios = [int(r) for r in start["deepseek_v4"]]
    block_size = int(start["block_size"]) == DEEPSEEK_V4_BLOCK
    if wrong := rows_unfit(
        start, block_size=block_size, layers=int(start["layers"]) == len(ratios)
    ):
        raise ValueError(
            f"a DeepSeek-V4 engine runs {DEEPSEEK_V4_BLOCK}-token blocks in BLHNC or BLNHC, "
            f"a layer per ratio, the hybrid manager, not layerwise: not {wrong}"
        )
    return {**start, "deepseek_v4": ratios}


def rows_unfit(start: dict[str, Any], **more: bool) -> list[str]:
    """The keys of ``start`` a model of rows (DeepSeek-V4's, Qwen4Exp's, Glm5Next's) does
    not run with, of a block-outermost layout (their indexers' backends take no other),
    the hybrid manager (without which vLLM cannot keep their groups apart), not layerwise,
    and ``more`` (each key: whether it fits)."""
    fits = {
        "layout": start.get("layout") in ("BLHNC", "BLNHC"),
        "hma": start.get("hma") is not False,
        "layerwise": not start.get("layerwise"),
        **more,
    }
    return sorted(key for key, ok in fits.items() if not ok)


def deepseek_v4_hf_config(start: dict[str, Any]) -> Any:
    """V4's model facts as its HF config gives them to vLLM (the ones
    :func:`deepseek_v4_specs` builds the caches with), for vLLM code that tells V4 apart
    by its model type."""
    ratios = list(start["deepseek_v4"])
    return SimpleNamespace(
        model_type="deepseek_v4", compress_ratios=ratios, num_hidden_layers=len(ratios),
        head_dim=512, qk_rope_head_dim=64, sliding_window=128, index_head_dim=128,
        index_n_heads=64, index_topk=512, num_nextn_predict_layers=0,
    )  # fmt: skip


def _encoder_budget() -> None:
    """A multimodal model's encoder budget, which vLLM's scheduler sizes from the model's
    processor (the model's files, not here): room for a few images of up to 64 tokens.
    What the scheduler does with it (which images to encode when) is vLLM's own."""
    from vllm.v1.core.sched import scheduler

    class Budget:
        def __init__(self, *_a: Any, **_k: Any) -> None:
            self.encoder_compute_budget = self.encoder_cache_size = 256
            self.mm_max_toks_per_item = {"image": 64}

    scheduler.MultiModalBudget = Budget


def _images(spans: list[list[int]], index: int) -> list[Any] | None:
    """One image per ``[offset, length]`` placeholder span of the prompt (vLLM's feature
    specs; the encoder's input data is not needed to schedule it)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=f"image-{index}-{i}",
            mm_position=PlaceholderRange(offset=int(offset), length=int(length)),
        )
        for i, (offset, length) in enumerate(spans)
    ]
    return features or None


MAMBA_HEADS, MAMBA_HEAD_DIM, MAMBA_STATE, MAMBA_GROUPS, MAMBA_CONV = 8, 16, 16, 32, 4
"""A Mamba2 mixer's sizes (Nemotron-H's shape, scaled down): heads x head dim make the
intermediate size, ``MAMBA_GROUPS`` B and C columns each, a conv kernel of 4."""


def drafter_config(start: dict[str, Any]) -> Any:
    """vLLM's SpeculativeConfig of a drafter ``method:k`` (``eagle:1``, ``mtp:3``: that many
    speculative tokens, an MTP drafter with as many modules), with every other field at
    vLLM's default. Building one the usual way loads the draft model's config from its hub,
    so its fields are set directly; its methods (lookahead, block drop, MTP modules) are
    vLLM's own. The drafter's KV layer is the engine's last (EAGLE and MTP name theirs
    after the target's)."""
    from dataclasses import MISSING, fields

    from vllm.config import SpeculativeConfig

    method, count = str(start["drafter"]).split(":")
    config = object.__new__(SpeculativeConfig)
    for f in fields(SpeculativeConfig):
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        object.__setattr__(config, f.name, None if default is MISSING else default)
    hf_config = SimpleNamespace(num_nextn_predict_layers=int(count))
    draft = SimpleNamespace(model=f"drafter-{method}", revision=None, code_revision=None,
                            hf_config=hf_config)  # fmt: skip
    object.__setattr__(config, "method", method)
    object.__setattr__(config, "num_speculative_tokens", int(count))
    object.__setattr__(config, "draft_model_config", draft)
    return config


def mamba_spec(start: dict[str, Any], page: int) -> Any:
    """vLLM's spec of one Mamba2 layer on this rank, as its mixer makes it: the conv state
    dim-first (``VLLM_SSM_CONV_STATE_LAYOUT=DS``, which stock's transfer needs), both
    states sharded by TP, the page padded to the attention page so they share the slabs."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    tp = int(start["tp_size"])
    intermediate = MAMBA_HEADS * MAMBA_HEAD_DIM
    return MambaSpec(
        block_size=int(start["block_size"]),
        shapes=(
            ((intermediate + 2 * MAMBA_GROUPS) // tp, MAMBA_CONV - 1),
            (MAMBA_HEADS // tp, MAMBA_HEAD_DIM, MAMBA_STATE),
        ),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=page,
        mamba_type=MambaAttentionBackendEnum.MAMBA2,
        mamba_cache_mode="align" if start.get("prefix_caching", True) else "none",
        # A drafter's scratch slots, one per speculative token (vLLM's hybrid-model config).
        num_speculative_blocks=int(str(start.get("drafter") or "-:0").split(":")[1]),
    )


def layer_specs(start: dict[str, Any]) -> dict[str, Any]:
    """vLLM's spec of each layer: full attention, or with ``window`` (tokens) every odd
    attention layer a sliding-window one (Gemma's and gpt-oss's interleaving), with
    ``chunk`` (tokens) three chunked-local-attention layers then a full one (Llama 4's
    interleaving), with ``rswa`` (tokens) every layer R-SWA over that decode window
    (vLLM's ``RSWASpec``, which its ``deepseek_v2`` attention makes for Unlimited-OCR),
    with ``ring`` every odd layer a ring of the latest tokens' keys (vLLM's
    ``CircularBufferSpec``: one block a request, as a compressor's or an indexer's ring in
    DeepSeek-V4.1 and Qwen4Exp, here of the attention page: its capacity the block), or
    with
    ``mamba`` (``k``) one attention layer then ``k`` Mamba2 ones, over and over (Jamba's
    and Nemotron-H's interleaving); both together interleave all three kinds. With
    ``indexer`` (an MLA model) each layer also has DeepSeek-V3.2's indexer cache beside its
    latent (:func:`indexer_spec`)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        FullAttentionSpec,
        RSWASpec,
        SlidingWindowSpec,
    )

    if start.get("indexer"):
        return sparse_mla_specs(start)

    spec = vllm_peer.cache_spec(start)
    window = int(start.get("window") or 0)
    if spec.model.mla:
        if start.get("mamba") or not window:
            raise ValueError("the harness builds an MLA model's layers with a window alone")
        return mla_window_specs(start)
    common = {
        "block_size": spec.block_tokens,
        "num_kv_heads": spec.heads_here,
        "head_size": spec.model.head_dim,
        "dtype": torch.bfloat16,
    }
    mamba = int(start.get("mamba") or 0)
    chunk = int(start.get("chunk") or 0)
    rswa = int(start.get("rswa") or 0)
    full = RSWASpec(**common, rswa_window=rswa) if rswa else FullAttentionSpec(**common)
    specs = {}
    for i, name in enumerate(vllm_peer.layer_names(start)):
        if chunk and i % 4 != 3:
            specs[name] = ChunkedLocalAttentionSpec(**common, attention_chunk_size=chunk)
        elif mamba and i % (mamba + 1):
            specs[name] = mamba_spec(start, full.page_size_bytes)
        elif window and (i // (mamba + 1)) % 2:  # every other attention layer
            specs[name] = SlidingWindowSpec(**common, sliding_window=window)
        elif start.get("ring") and i % 2:
            specs[name] = CircularBufferSpec(**common)
        else:
            specs[name] = full
    return specs


def mla_window_specs(start: dict[str, Any]) -> dict[str, Any]:
    """vLLM's specs of an MLA model whose every other layer has a sliding ``window``, as
    vLLM's MLA attention layer makes them: the full layers' ``MLAAttentionSpec`` and the
    windowed ones' ``SlidingWindowMLASpec``, one latent per token each."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    spec = vllm_peer.cache_spec(start)
    window = int(start["window"])
    latent = {
        "block_size": spec.block_tokens,
        "num_kv_heads": 1,
        "max_tp_shards": 1,
        "head_size": spec.model.latent_dim,
        "dtype": torch.bfloat16,
    }
    return {
        name: SlidingWindowMLASpec(**latent, sliding_window=window)
        if i % 2
        else MLAAttentionSpec(**latent)
        for i, name in enumerate(vllm_peer.layer_names(start))
    }


def deepseek_v4_specs(vllm_config: Any, ratios: list[int], fp8_ds_mla: bool) -> dict[str, Any]:
    """vLLM's spec of every cache DeepSeek-V4's layers make, layer ``i`` compressing by
    ``ratios[i]``: from vLLM's own cache modules (windowed latents, compressor states,
    indexer keys) and its attention layer's own ``get_kv_cache_spec``, called on a
    stand-in of the four fields it reads (the layer itself loads weights). The model's
    facts are V4's: 512-value latents, a 128-token window, 128-value indexer keys."""
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v4.attention import (
        DeepseekV4Attention,
        DeepseekV4IndexerCache,
        _resolve_dsv4_kv_cache_dtype,
    )
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    head, window, index_head = 512, 128, 128
    cache = vllm_config.cache_config
    specs: dict[str, Any] = {}
    with set_current_vllm_config(vllm_config):
        dtype_name, dtype = _resolve_dsv4_kv_cache_dtype(fp8_ds_mla, cache.cache_dtype, cache)
        for i, ratio in enumerate(ratios):
            prefix = f"model.layers.{i}.attn"
            swa = DeepseekV4SWACache(
                head_dim=head, window_size=window, dtype=dtype, prefix=f"{prefix}.swa_cache",
                cache_config=cache,
            )  # fmt: skip
            specs[swa.prefix] = swa.get_kv_cache_spec(vllm_config)
            layer = SimpleNamespace(
                compress_ratio=max(1, ratio), head_dim=head, kv_cache_dtype=dtype_name,
                kv_cache_torch_dtype=dtype,
            )  # fmt: skip
            compressed = DeepseekV4Attention.get_kv_cache_spec(layer, vllm_config)
            if compressed is not None:  # layers of ratio 1 keep their window alone
                specs[prefix] = compressed
            if ratio > 1:
                state = CompressorStateCache(
                    state_dim=2 * (1 + (ratio == 4)) * head, dtype=torch.float32,
                    compress_ratio=ratio, prefix=f"{prefix}.compressor.state_cache",
                )  # fmt: skip
                specs[state.prefix] = state.get_kv_cache_spec(vllm_config)
            if ratio == 4:
                keys = DeepseekV4IndexerCache(
                    head_dim=index_head + index_head // 128 * 4, dtype=torch.uint8,
                    prefix=f"{prefix}.indexer.k_cache", cache_config=cache, compress_ratio=ratio,
                )  # fmt: skip
                specs[keys.prefix] = keys.get_kv_cache_spec(vllm_config)
                state = CompressorStateCache(
                    state_dim=4 * index_head, dtype=torch.float32, compress_ratio=ratio,
                    prefix=f"{prefix}.indexer.compressor.state_cache",
                )  # fmt: skip
                specs[state.prefix] = state.get_kv_cache_spec(vllm_config)
    return specs


def deepseek_v41_specs(vllm_config: Any, ratios: list[int]) -> dict[str, Any]:
    """vLLM's spec of every cache DeepSeek-V4.1's layers make, layer ``i`` compressing by
    ``ratios[i]`` (0: its window alone, 1 or 2): from V4.1's own cache modules (windowed
    latents in 32-token blocks, the compressor's ring at ratio 2, indexer keys) and its
    attention layer's own ``get_kv_cache_spec``, called on a stand-in of the fields it
    reads, in the order a layer registers them (its compressed latent, its indexer's keys,
    its window, its compressor's ring): vLLM orders its groups by their first cache, so a
    first layer that compresses puts the compressed group first. Every compressing layer
    is a kv source and those of ratio 2 index sources (the config's
    ``kv_source_layer_ids`` and ``index_source_layer_ids``)."""
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v41 import attention as v41
    from vllm.models.deepseek_v41.compressor import CompressorStateCache
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    head, window, index_head = 512, 128, 128
    cache = vllm_config.cache_config
    specs: dict[str, Any] = {}
    with set_current_vllm_config(vllm_config):
        dtype_name, dtype = v41._resolve_dsv4_kv_cache_dtype(True, cache.cache_dtype, cache)
        record = 528 if v41._use_v41_mxfp8_kv_record() else 584
        align = 512 if v41._use_v41_mxfp8_kv_record() else 576
        for i, ratio in enumerate(ratios):
            prefix = f"model.layers.{i}.attn"
            if ratio:
                layer = SimpleNamespace(
                    is_kv_source=True, kv_cache_dtype=dtype_name, head_dim=head,
                    kv_cache_torch_dtype=dtype, compress_ratio=ratio, kv_page_alignment=align,
                    compressed_bytes_per_token=record,
                )  # fmt: skip
                specs[prefix] = v41.DeepseekV4Attention.get_kv_cache_spec(layer, vllm_config)
            if ratio == 2:
                keys = v41.DeepseekV4IndexerCache(
                    head_dim=v41._indexer_k_cache_head_dim(index_head, False), dtype=torch.uint8,
                    prefix=f"{prefix}.indexer.k_cache", cache_config=cache, compress_ratio=ratio,
                )  # fmt: skip
                specs[keys.prefix] = keys.get_kv_cache_spec(vllm_config)
            swa = DeepseekV4SWACache(
                head_dim=head, window_size=window, dtype=dtype, prefix=f"{prefix}.swa_cache",
                cache_config=cache, block_size=32, packed_bytes_per_token=record,
                packed_page_alignment=align,
            )  # fmt: skip
            specs[swa.prefix] = swa.get_kv_cache_spec(vllm_config)
            if ratio == 2:
                ring = CompressorStateCache(
                    state_dim=2 * head, dtype=torch.float32,
                    prefix=f"{prefix}.compressor.state_cache",
                )  # fmt: skip
                specs[ring.prefix] = ring.get_kv_cache_spec(vllm_config)
    return specs


def deepseek_v4_backends(specs: dict[str, Any]) -> dict[str, Any]:
    """Per cache of :func:`deepseek_v4_specs` (in its order, the model's), the backend
    vLLM's CPU V4 model runs it with: a layer's window and compressed latents, its
    compressor's states, its indexer's keys each have their own."""
    from vllm.models.deepseek_v4.compressor import CompressorBackend
    from vllm.models.deepseek_v4.cpu.cpu_mla import (
        DeepseekV4CPUIndexerBackend,
        DeepseekV4CPUSparseBackend,
    )
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekSparseSWABackend

    by_suffix = {
        ".swa_cache": DeepseekSparseSWABackend,
        ".state_cache": CompressorBackend,  # the indexer's compressor's too
        ".indexer.k_cache": DeepseekV4CPUIndexerBackend,
        ".attn": DeepseekV4CPUSparseBackend,
    }
    return {
        name: next(b for suffix, b in by_suffix.items() if name.endswith(suffix)) for name in specs
    }


def allocate_rows(
    vllm_config: Any, specs: dict[str, Any], num_blocks: int, backends: dict[str, Any]
) -> tuple[Any, dict[str, torch.Tensor]]:
    """vLLM's plan and allocation of a model of several block sizes (DeepSeek-V4's,
    Qwen4Exp's, Glm5Next's), as its engine core and model runner make them: its own
    grouping (V4: five groups of four block sizes; in a block-outermost layout every
    group's layers over one row a block id) and each group's kernel block as its model
    runner chooses it from the group's backends (vLLM splits none of a block-outermost
    layout; 0.31.0 splits Glm5Next's layer-outermost latents)."""
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.worker.utils import allocate_kv_cache, prepare_kernel_block_sizes

    groups = get_kv_cache_groups(vllm_config, dict(specs))
    memory = num_blocks * sum(spec.page_size_bytes for spec in specs.values())
    kv_cache_config = get_kv_cache_config_from_groups(vllm_config, groups, memory)
    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    runner_groups = [
        [
            SimpleNamespace(backend=backend, kv_cache_spec=g.kv_cache_spec)
            for backend in dict.fromkeys(backends[name] for name in g.layer_names)
        ]
        for g in kv_cache_config.kv_cache_groups
    ]
    sizes = prepare_kernel_block_sizes(kv_cache_config, runner_groups)
    caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, sizes)
    return kv_cache_config, caches


def engine_core_block_size(vllm_config: Any, kv_cache_config: Any) -> None:
    """What vLLM's engine core makes of the cache config's block size once it has planned
    the cache, before it builds the scheduler and the workers' connectors: the smallest
    block of the groups that cache prefixes (for V4, 4 tokens, not 256)."""
    groups = kv_cache_config.kv_cache_groups
    sizes = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
    vllm_config.cache_config.block_size = min(sizes or [g.kv_cache_spec.block_size for g in groups])


@dataclass
class PagedGroup:
    """One KV-cache group of an engine whose groups are filled and checked page by page
    (DeepSeek-V4's, Qwen4Exp's, Glm5Next's): each layer's page of a block id (its bytes in
    the block's row, or in its layer's slab) holds content of its own."""

    group: int
    block_tokens: int
    window: int
    """Tokens (0: every token's block is kept), by the group's first layer's spec, as
    vLLM's manager keeps the group's blocks."""
    pages: list[np.ndarray[Any, Any]]
    """Per layer of the group, its ``[blocks, page bytes]`` over the backing."""
    running: bool = False
    """A ring or a state: its page is the latest tokens' or the state after them, written
    whole, in the ring's one block or the state's (:func:`running_block`)."""
    state: bool = False
    rank: int = 0
    """The TP rank whose content the pages hold: 0 where every rank holds the same (MLA
    pages, rings of them), the rank's own where its pages are (GQA heads, states)."""
    parts: tuple[int, ...] = ()
    """A TP-sharded state's: this rank's bytes of each part of its page, each part the
    rank's slice of the whole model's (GDN's or KDA's conv columns of q, k and v, then the
    temporal state, sharded by head); empty: the page is the rank's own, whole."""
    tp: int = 1


def paged_groups(
    kv_cache_config: Any,
    caches: dict[str, torch.Tensor],
    buffer: np.ndarray[Any, Any],
    rank: int = 0,
    tp: int = 1,
) -> list[PagedGroup]:
    """A rank's groups of rows, each layer's pages read through vLLM's own view of it (a
    block's page is ``view[block]``, its bytes one span, less than the padded page)."""
    from vllm.v1.kv_cache_interface import (
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    out = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        layers = getattr(spec, "kv_cache_specs", None) or dict.fromkeys(group.layer_names, spec)
        first = layers[group.layer_names[0]]
        window = int(first.sliding_window) if isinstance(first, SlidingWindowSpec) else 0
        blocks = kv_cache_config.num_blocks
        pages = [page_view(caches[name], buffer, blocks) for name in group.layer_names]
        running = isinstance(first, (*ring_specs(), MambaSpec))
        mla = (MLAAttentionSpec, SlidingWindowMLASpec, *ring_specs())
        replicated = all(isinstance(s, mla) for s in layers.values())
        shared = replicated or getattr(first, "tp_replicated", False)
        owner = 0 if shared else rank
        state = isinstance(first, MambaSpec)
        size = int(first.block_size)
        parts = sharded_parts(first) if state and not shared else ()
        out.append(PagedGroup(g, size, window, pages, running, state, owner, parts, tp))
    return out


def sharded_parts(spec: Any) -> tuple[int, ...]:
    """A GDN-kind state's parts on this rank (vLLM's GDN and KDA layers): its conv state,
    dim-first (``VLLM_SSM_CONV_STATE_LAYOUT=DS``), q's, k's and v's columns (v as wide as
    the value heads times their dim), then its temporal state; () for other kinds."""
    if getattr(spec.mamba_type, "name", "") != "GDN_ATTN":
        return ()
    (columns, taps), temporal = spec.shapes
    conv, state = (torch.empty((), dtype=d).element_size() for d in spec.dtypes)
    v = temporal[0] * temporal[1]
    qk = (columns - v) // 2
    return (qk * taps * conv, qk * taps * conv, v * taps * conv, int(np.prod(temporal)) * state)


def running_content(paged: PagedGroup, index: int, layer: int, tokens: int, size: int) -> Any:
    """A ring's or a state's page after ``tokens`` tokens: a sharded state's parts each
    this rank's slice of the whole part (a rank of another TP size holds other slices of
    the same), any other page :func:`page_content`."""
    if not paged.parts:
        return page_content(index, paged.group, layer, tokens, size, paged.rank)
    out = []
    for part, width in enumerate(paged.parts):
        rng = np.random.default_rng((index, paged.group, layer, tokens, part))
        whole = np.frombuffer(rng.bytes(width * paged.tp), np.uint8)
        out.append(whole[paged.rank * width : (paged.rank + 1) * width])
    return np.concatenate(out)


def running_block(paged: PagedGroup, blocks: list[int], tokens: int) -> int:
    """The block of a ring's or a state's page after ``tokens`` tokens: the ring's one, the
    state's where vLLM keeps it (:func:`state_block`)."""
    return state_block(blocks, tokens, paged.block_tokens) if paged.state else blocks[0]


def page_view(
    view: torch.Tensor, buffer: np.ndarray[Any, Any], blocks: int
) -> np.ndarray[Any, Any]:
    """One layer's pages of its ``blocks`` blocks as ``[blocks, bytes]`` uint8 over
    ``buffer``: a block's page is one span whatever order its axes take in it (a BLNHC
    attention page's tokens before its K/V halves), and where vLLM split each block into
    kernel blocks (the view's first axis a multiple of ``blocks``), they abut and the page
    is all of them."""
    page = view[0]
    span = sum((n - 1) * st for n, st in zip(page.shape, page.stride(), strict=True)) + 1
    assert span * view.element_size() == page.nbytes, "a page that is not one span"
    start = view.data_ptr() - buffer.ctypes.data
    row = view.stride(0) * view.element_size()
    kernels, rest = divmod(view.shape[0], blocks)
    assert not rest and (kernels == 1 or row == page.nbytes), "kernel blocks that do not abut"
    row, shape = row * kernels, (blocks, page.nbytes * kernels)
    assert start + (shape[0] - 1) * row + shape[1] <= buffer.nbytes
    return np.lib.stride_tricks.as_strided(buffer[start:], shape, (row, 1), writeable=True)


def page_content(
    index: int, group: int, layer: int, position: int, size: int, rank: int = 0
) -> Any:
    """The page of one layer of one group at one block position of a prompt of content
    ``index`` on TP rank ``rank``: a page of another request, group, layer, position or
    rank differs."""
    rng = np.random.default_rng((index, group, layer, position, rank))
    return np.frombuffer(rng.bytes(size), np.uint8)


def fill_pages(paged: PagedGroup, index: int, blocks: list[int], start: int, stop: int) -> None:
    """P's pages of the blocks that prompt tokens ``[start, stop)`` fall in, each page
    filling as its block's tokens are computed (the share of its bytes those tokens
    make): a block moved before its last tokens are computed, and not again after,
    fails the check. vLLM's null block (a window's dropped ones) is skipped."""
    size = paged.block_tokens
    if paged.running:  # the ring or the state after ``stop`` tokens, whatever it held
        block = running_block(paged, blocks, stop)
        for layer, pages in enumerate(paged.pages):
            pages[block] = running_content(paged, index, layer, stop, pages.shape[1])
        return
    for position in range(start // size, -(-stop // size)):
        block = blocks[position]
        if block == 0:
            continue
        first, last = max(start - position * size, 0), min(stop - position * size, size)
        for layer, pages in enumerate(paged.pages):
            width = pages.shape[1]
            lo, hi = width * first // size, width * last // size
            want = page_content(index, paged.group, layer, position, width, paged.rank)
            pages[block, lo:hi] = want[lo:hi]


def check_pages(paged: PagedGroup, index: int, blocks: list[int], prompt: int) -> tuple[int, int]:
    """(wrong, checked) bytes of the pages D's next token reads: every block of the
    prompt, or with a window those from the one holding token ``prompt - window + 1`` on,
    each page's share of the prompt's tokens (the last block's share ends with the
    prompt, as P's filling does). A null block (or none) where a page must be is wrong
    whole."""
    size = paged.block_tokens
    if paged.running:  # the ring or the state after the prompt
        wrong = checked = 0
        block = running_block(paged, blocks, prompt)
        for layer, pages in enumerate(paged.pages):
            want = running_content(paged, index, layer, prompt, pages.shape[1])
            wrong += int(np.count_nonzero(pages[block] != want))
            checked += want.size
        return wrong, checked
    first = max(0, prompt - paged.window + 1) // size if paged.window else 0
    wrong = checked = 0
    for position in range(first, -(-prompt // size)):
        block = blocks[position] if position < len(blocks) else 0
        tokens = min(prompt - position * size, size)
        for layer, pages in enumerate(paged.pages):
            share = pages.shape[1] * tokens // size
            checked += share
            if block == 0:
                wrong += share
                continue
            want = page_content(index, paged.group, layer, position, pages.shape[1], paged.rank)
            wrong += int(np.count_nonzero(pages[block, :share] != want[:share]))
    return wrong, checked


INDEXER_BYTES = 132
"""Bytes per token of DeepSeek-V3.2's indexer key cache: 128 fp8 values and one fp32
scale, stored as uint8 in one head, the same on every TP rank."""


def sparse_mla_specs(start: dict[str, Any]) -> dict[str, Any]:
    """vLLM's specs of a sparse MLA model's layers, as DeepSeek-V3.2's modules make them:
    per layer the MLA latent (``...self_attn.attn``) and the indexer's key cache
    (``...self_attn.indexer.k_cache``), both MLA specs of one block size and other pages,
    which vLLM's grouping puts in one group of per-layer specs."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    spec = vllm_peer.cache_spec(start)
    block = spec.block_tokens
    specs = {}
    for name in vllm_peer.layer_names(start):
        specs[name] = MLAAttentionSpec(
            block_size=block, num_kv_heads=1, head_size=spec.model.latent_dim, dtype=torch.bfloat16
        )
        specs[name.replace(".attn", ".indexer.k_cache")] = MLAAttentionSpec(
            block_size=block,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=INDEXER_BYTES,
            dtype=torch.uint8,
            cache_role=SparseCacheRole.INDEXER,
        )
    return specs


def state_groups(kv_cache_config: Any) -> list[bool]:
    """Per KV-cache group, whether it holds Mamba state (no tokens: one state per
    request, the harness's own content)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    return _of_kind(kv_cache_config, MambaSpec)


def ring_specs() -> tuple[type, ...]:
    """vLLM's specs of rings: ``CircularBufferSpec``, and 0.31.0's ``KpoolTailSpec`` (a
    sliding window of one block a request, Glm5Next's indexer's tail)."""
    from vllm.v1 import kv_cache_interface

    names = ("CircularBufferSpec", "KpoolTailSpec")
    return tuple(getattr(kv_cache_interface, n) for n in names if hasattr(kv_cache_interface, n))


def ring_groups(kv_cache_config: Any) -> list[bool]:
    """Per KV-cache group, whether it is a ring (one block a request, slot ``t % block``
    holding token ``t``'s keys: the latest ``block`` tokens')."""
    return _of_kind(kv_cache_config, ring_specs())


def _of_kind(kv_cache_config: Any, kind: type | tuple[type, ...]) -> list[bool]:
    """Per group, whether its (first layer's) spec is a ``kind``."""
    out = []
    for group in kv_cache_config.kv_cache_groups:
        layers = getattr(group.kv_cache_spec, "kv_cache_specs", None)
        spec = layers[group.layer_names[0]] if layers else group.kv_cache_spec
        out.append(isinstance(spec, kind))
    return out


def ring_values(spec: Any, seed: int, tokens: int) -> tuple[Any, Any]:
    """(slots, values) of one rank's ring layers after a prompt's first ``tokens`` tokens:
    the latest ``block`` tokens, each the values a full-attention layer would hold for it
    (``expected``), in slot ``t % block``; values ``[tokens, layers, heads, elements]``.
    A ring of another request, layer or count differs."""
    size = spec.block_tokens
    at = np.arange(max(0, tokens - size), tokens)
    want = expected(spec, seed, -(-tokens // size))
    return at % size, want[:, at // size, :, at % size]


def fill_ring(spec: Any, kv: Any, seed: int, block: int, tokens: int) -> None:
    """P's ring layers after computing ``tokens`` of the prompt."""
    slots, values = ring_values(spec, seed, tokens)
    blocks_view(spec, kv)[:, block, :, slots] = values


def check_ring(spec: Any, kv: Any, seed: int, block: int, tokens: int) -> tuple[int, int]:
    """(wrong, checked) bytes of the ring D's next token reads after the ``tokens`` it
    loaded: every slot holding one of them, in every layer."""
    slots, values = ring_values(spec, seed, tokens)
    got = blocks_view(spec, kv)[:, block, :, slots]
    return int(np.count_nonzero(got.view(np.uint8) != values.view(np.uint8))), int(values.nbytes)


def chunks(kv_cache_config: Any) -> list[int]:
    """Per KV-cache group, its attention chunk in tokens (0: none): a token attends only
    to its own chunk's tokens (the harness's reading of chunked local attention)."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    return _spans(kv_cache_config, ChunkedLocalAttentionSpec, "attention_chunk_size")


def windows(kv_cache_config: Any) -> list[int]:
    """Per KV-cache group, its sliding window in tokens (0: full attention): which of a
    prompt's tokens D must hold is the harness's own reading of the window, not the
    connector's."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return _spans(kv_cache_config, SlidingWindowSpec, "sliding_window")


def _spans(kv_cache_config: Any, kind: type, field: str) -> list[int]:
    """Per KV-cache group, ``field`` of a group of ``kind`` (0 for any other group)."""
    return [
        int(getattr(g.kv_cache_spec, field)) if isinstance(g.kv_cache_spec, kind) else 0
        for g in kv_cache_config.kv_cache_groups
    ]


def allocate(vllm_config: Any, start: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
    """vLLM's KV cache plan and allocation for this engine's layers, as its model runner
    makes them: (kv_cache_config, views). One group of the harness's spec; with a
    ``window``, the groups vLLM's own grouping makes of :func:`layer_specs` (on the hybrid
    manager: a group per kind, every group's layer ``j`` in one slab)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = vllm_peer.cache_spec(start)
    if any(start.get(k) for k in ("window", "chunk", "rswa", "ring", "mamba", "indexer")):
        groups = get_kv_cache_groups(vllm_config, layer_specs(start))
    else:
        groups = vllm_peer.build_configs(start)[1].kv_cache_groups
    page = groups[0].kv_cache_spec.page_size_bytes
    memory = spec.num_blocks * page * spec.layers
    kv_cache_config = get_kv_cache_config_from_groups(vllm_config, groups, memory)
    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    # A Mamba group's blocks are never split (vLLM's prepare_kernel_block_sizes).
    sizes = [
        spec.block_tokens if state else kernel_size(start)
        for state in state_groups(kv_cache_config)
    ]
    caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, sizes)
    return kv_cache_config, caches


def kernel_size(start: dict[str, Any]) -> int:
    """Tokens per kernel block, chosen by vLLM's own rule from what the attention backend
    runs (``kernel_block``: a backend that runs only that size), as its model runner
    chooses them for the allocation."""
    from vllm.v1.worker.utils import select_common_block_size

    backend = vllm_peer._backend(preset(start["model"]).mla, int(start.get("kernel_block") or 0))
    return int(select_common_block_size(int(start["block_size"]), [backend]))


def kernel_ratio(start: dict[str, Any]) -> int:
    """Kernel blocks per block."""
    return int(start["block_size"]) // kernel_size(start)


def expand(blocks: list[int], ratio: int) -> list[int]:
    """A request's kernel block ids, in token order, from the ids vLLM's manager gave it."""
    return [b * ratio + j for b in blocks for j in range(ratio)] if ratio > 1 else blocks


def backing_bytes(caches: dict[str, torch.Tensor]) -> np.ndarray[Any, Any]:
    """The one allocation behind every layer's view, as bytes (the views keep it alive)."""
    storage = next(iter(caches.values())).untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    return flat.numpy()


def kv_view(caches: dict[str, torch.Tensor], buffer: np.ndarray[Any, Any]) -> Any:
    """Every layer's KV as one ``[layers, blocks, heads, tokens, elements]`` uint16 array
    over ``buffer``, through the strides of vLLM's own per-layer ``[B, H, N, C]`` views: in
    any layout, ``kvwire.demo.content`` then writes and checks each value where vLLM's
    attention would read it, whatever the connector registered."""
    views = list(caches.values())
    first = views[0]
    item = first.element_size()
    start, step = layer_spacing(views, buffer)
    assert all(v.stride() == first.stride() and v.shape == first.shape for v in views)
    assert first.dim() == 4 and first.stride(3) == 1 and (first.shape[3] * item) % 2 == 0
    shape = (len(views), *first.shape[:3], first.shape[3] * item // 2)
    strides = (step, *(s * item for s in first.stride()[:3]), 2)
    flat = buffer.view(np.uint16)[start // 2 :]
    return np.lib.stride_tricks.as_strided(flat, shape, strides, writeable=True)


def layer_spacing(views: list[torch.Tensor], buffer: np.ndarray[Any, Any]) -> tuple[int, int]:
    """(offset of the first layer's view in ``buffer``, bytes from one layer to the next):
    vLLM places a group's layers evenly in its allocation."""
    offsets = [view.data_ptr() - buffer.ctypes.data for view in views]
    step = offsets[1] - offsets[0] if len(offsets) > 1 else 0
    assert offsets == [offsets[0] + i * step for i in range(len(views))], "layers not evenly spaced"
    return offsets[0], step


class _NoGrammar:
    """No structured output in these requests: every token is acceptable."""

    def accept_tokens(self, *_a: Any) -> bool:
        return True

    def validate_tokens(self, _request: Any, tokens: list[int]) -> list[int]:
        return tokens

    def grammar_bitmask(self, *_a: Any, **_k: Any) -> None:
        return None


@dataclass
class Rank:
    """One TP rank's worker: its share of the heads, its own KV allocation, its connector."""

    spec: Any
    buffer: np.ndarray[Any, Any]
    caches: dict[str, torch.Tensor]
    groups: list[Content]
    """What the rank's layers hold, filled and checked content by content."""
    worker: Any
    paged: list[PagedGroup] | None = None
    """DeepSeek-V4: its groups, filled and checked page by page instead (``groups`` empty)."""


@dataclass
class Content:
    """Layers of one KV-cache group and one page shape, filled and checked as one: at the
    group's own block ids (a block id names one group's page at a time in a shared slab),
    with a seed of their own (:func:`group_seed`)."""

    group: int
    names: list[str]
    spec: Any
    """``kvwire.demo.content``'s spec of these layers (None: a Mamba group's states)."""
    kv: Any
    """Their KV (:func:`kv_view`) or states (:func:`state_view`)."""


def group_views(
    spec: Any, kv_cache_config: Any, caches: dict[str, torch.Tensor], buffer: Any
) -> list[Content]:
    """The rank's contents: one per KV-cache group, or per page shape in a group of
    per-layer specs (a sparse MLA model's latents and indexer keys)."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    out: list[Content] = []
    for g, (group, state) in enumerate(
        zip(kv_cache_config.kv_cache_groups, state_groups(kv_cache_config), strict=True)
    ):
        names = list(group.layer_names)
        if state:
            out.append(Content(g, names, None, state_view([caches[n] for n in names], buffer)))
            continue
        per_layer = group.kv_cache_spec
        if not isinstance(per_layer, UniformTypeKVCacheSpecs):
            view = kv_view({n: caches[n] for n in names}, buffer)
            out.append(Content(g, names, replace(spec, layers=len(names)), view))
            continue
        shapes: dict[Any, list[str]] = {}
        for n in names:
            shapes.setdefault(per_layer.kv_cache_specs[n].page_size_bytes, []).append(n)
        for layers in shapes.values():
            layer = per_layer.kv_cache_specs[layers[0]]
            content = layer.head_size * layer.dtype.itemsize  # one head: MLA
            model = replace(spec.model, latent_dim=content // 2)
            view = kv_view({n: caches[n] for n in layers}, buffer)
            out.append(Content(g, layers, replace(spec, layers=len(layers), model=model), view))
    return out


def state_view(views: list[torch.Tensor], buffer: np.ndarray[Any, Any]) -> Any:
    """A Mamba group's states as one ``[layers, blocks, state bytes]`` uint8 array over
    ``buffer``, through vLLM's own per-layer views of them (``[B, 1, 1, state bytes]``)."""
    first = views[0]
    start, step = layer_spacing(views, buffer)
    shape = (len(views), first.shape[0], first[0].numel())
    flat = buffer[start:]
    return np.lib.stride_tricks.as_strided(flat, shape, (step, first.stride(0), 1), writeable=True)


def mamba_parts() -> tuple[int, ...]:
    """The whole model's bytes of each part of one Mamba2 layer's state, in a rank's page
    order: the conv state's x, B and C columns (bf16, dim-first), the temporal state
    (fp32). A TP rank holds its slice of each."""
    rows = (MAMBA_CONV - 1) * 2
    x, groups = MAMBA_HEADS * MAMBA_HEAD_DIM, MAMBA_GROUPS
    return (x * rows, groups * rows, groups * rows, x * MAMBA_STATE * 4)


def state_values(seed: int, layer: int, tokens: int, rank: int, tp: int) -> np.ndarray[Any, Any]:
    """One rank's page of one layer's Mamba state after a prompt's first ``tokens``
    tokens: the model's state names the request, the group, the layer and the token count
    (a state of another request, group, layer or length fails the check), and the rank
    holds its slice of each part, as a Mamba2 mixer shards it."""
    pages = []
    for k, size in enumerate(mamba_parts()):
        whole = np.random.default_rng((seed, layer, tokens, k)).integers(0, 256, size, np.uint8)
        pages.append(whole[rank * size // tp : (rank + 1) * size // tp])
    return np.concatenate(pages)


def state_block(blocks: list[int], tokens: int, block_tokens: int) -> int:
    """Where vLLM keeps the state after ``tokens`` tokens (``mamba_cache_mode`` "align",
    its default with prefix caching): in the block of the last of them."""
    return blocks[-(-tokens // block_tokens) - 1]


def fill_state(
    kv: Any, seed: int, blocks: list[int], tokens: int, block_tokens: int, rank: tuple[int, int]
) -> None:
    """P's Mamba layers on one rank (``rank``: its index and the TP size) after computing
    ``tokens`` of the prompt: each layer's state."""
    block = state_block(blocks, tokens, block_tokens)
    for layer in range(kv.shape[0]):
        kv[layer, block] = state_values(seed, layer, tokens, *rank)


def check_state(
    kv: Any, seed: int, blocks: list[int], tokens: int, block_tokens: int, rank: tuple[int, int]
) -> tuple[int, int]:
    """(wrong, checked) bytes of the states D's next token starts from on one rank: every
    layer's state after the ``tokens`` D loaded, in the block vLLM reads it from."""
    block = state_block(blocks, tokens, block_tokens)
    wrong = 0
    for layer in range(kv.shape[0]):
        want = state_values(seed, layer, tokens, *rank)
        wrong += int(np.count_nonzero(kv[layer, block] != want))
    return wrong, kv.shape[0] * kv.shape[2]


def group_seed(index: int, group: int) -> int:
    """The content index of one group's KV: a group's bytes landing in another's blocks
    (the slab is shared) then fail the check."""
    return index + 4099 * group


def fill_group(spec: Any, kv: Any, seed: int, blocks: list[int]) -> None:
    """P's KV into a group's blocks; vLLM's null block (id 0, a sliding window's dropped
    blocks) is skipped."""
    positions = [i for i, b in enumerate(blocks) if b != 0]
    if len(positions) == len(blocks):
        fill(spec, kv, seed, blocks)
    elif positions:
        want = expected(spec, seed, len(blocks))
        kv[:, [blocks[i] for i in positions]] = want[:, positions]


def fill_tokens(
    spec: Any, kv: Any, want: Any, blocks: list[int], layer: int, start: int, stop: int
) -> None:
    """One layer's values of the prompt's tokens [start, stop), as a model's layer writes
    them into the request's blocks: the blocks the range fills whole in one scatter, a
    slice of each block it only touches. ``want``: the request's values (``expected``)."""
    tokens = spec.block_tokens
    view = blocks_view(spec, kv)
    whole = range(-(-start // tokens), stop // tokens)
    if whole:
        view[layer, blocks[whole.start : whole.stop]] = want[layer, whole.start : whole.stop]
    for b in {start // tokens, -(-stop // tokens) - 1} - set(whole):
        t0, t1 = max(start - b * tokens, 0), min(stop - b * tokens, tokens)
        view[layer, blocks[b], :, t0:t1] = want[layer, b, :, t0:t1]


def check_group(
    spec: Any, kv: Any, seed: int, blocks: list[int], prompt: int, window: int, chunk: int = 0
) -> tuple[int, int]:
    """(wrong, checked) bytes of the prompt's KV that D's next token attends to: every
    prompt token, or with a ``window`` the tokens from ``prompt - window + 1`` on, or with
    a ``chunk`` those of the next token's chunk, in whole blocks (a block the window
    reaches into holds P's whole block), the last block's prompt tokens included. A null
    block where KV must be fails the check."""
    tokens = spec.block_tokens
    if chunk:
        first = prompt // chunk * chunk // tokens
    else:
        first = max(0, prompt - window + 1) // tokens if window else 0
    whole, rest = divmod(prompt, tokens)
    want = expected(spec, seed, whole + (1 if rest else 0))
    view = blocks_view(spec, kv)
    pairs = [(view[:, blocks[first:whole]], want[:, first:whole])]
    if rest:
        pairs.append((view[:, blocks[whole], :, :rest], want[:, whole, :, :rest]))
    wrong = checked = 0
    for got, ought in pairs:
        wrong += int(np.count_nonzero(got.view(np.uint8) != ought.view(np.uint8)))
        checked += int(ought.nbytes)
    return wrong, checked


def check_tokens(
    spec: Any, kv: Any, seed: int, blocks: list[int], start: int, stop: int
) -> tuple[int, int]:
    """(wrong, checked) bytes of tokens ``[start, stop)`` of a request's blocks."""
    tokens = spec.block_tokens
    want = expected(spec, seed, -(-stop // tokens))
    view = blocks_view(spec, kv)
    wrong = checked = 0
    for b in range(start // tokens, -(-stop // tokens)):
        t0, t1 = max(start - b * tokens, 0), min(stop - b * tokens, tokens)
        got, ought = view[:, blocks[b], :, t0:t1], want[:, b, :, t0:t1]
        wrong += int(np.count_nonzero(got.view(np.uint8) != ought.view(np.uint8)))
        checked += int(ought.nbytes)
    return wrong, checked


DECODED = 30011
"""Added to a request's content index for the KV of the tokens a decode engine computes
(what it generated): a stale copy of the prompt's blocks then does not pass for it. Odd,
so its content differs in every value (the content's seed is the index times an odd
number, modulo 2**16)."""


CPUS = sorted(os.sched_getaffinity(0))
"""The CPUs the engine may use, read before any thread is pinned."""


def pin(role: str) -> set[str]:
    """The bench's compute stands for a GPU's, which no copy slows down: P's engine thread
    (this one) alone on the first CPU, every other thread (and all of D) on the rest. The
    threads placed; none with fewer than 2 CPUs."""
    from kvwire.bench.layerwise_peer import pin_threads

    tasks = set(os.listdir("/proc/self/task"))
    engine = threading.get_native_id() if role == "P" else None
    return tasks if pin_threads(CPUS, engine) else set()


def _as_rank(
    start: dict[str, Any], rank: int, tp_size: int, backends: dict[str, Any] | None = None
) -> None:
    """What vLLM's parallel groups tell a worker of its rank, for either connector (the
    stand-in for process groups, in this one process); ``backends``: per layer, its own
    (see ``vllm_peer.stand_in_parallel_state``)."""
    from vllm.distributed import parallel_state

    vllm_peer.stand_in_parallel_state({**start, "tp_rank": rank, "tp_size": tp_size}, backends)
    parallel_state.model_parallel_is_initialized = lambda: True  # type: ignore[attr-defined]
    parallel_state.get_tensor_model_parallel_rank = lambda: rank  # type: ignore[attr-defined]


class EnginePart:
    def __init__(self, start: dict[str, Any]) -> None:
        from vllm.distributed.kv_transfer.kv_connector import utils
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            get_request_block_hasher,
            init_none_hash,
            resolve_kv_cache_block_sizes,
        )
        from vllm.v1.core.sched.scheduler import Scheduler

        start = {"layout": "LBHNC", "tp_size": 1, **start, "tp_rank": 0}
        if start.get("deepseek_v4"):
            start = deepseek_v4_start(start)
        v4 = start.get("deepseek_v4")
        by_classes = next((m for m in ("qwen4exp", "glm5next") if start.get(m)), "")
        """Qwen4Exp or Glm5Next: caches built by the model's own classes (the module of
        that name)."""
        # Glm5Next's layout is the one its vLLM resolves (glm5next.build checks it).
        resolved = {"layout": True} if by_classes == "glm5next" else {}
        if by_classes and (wrong := rows_unfit(start, **resolved)):
            raise ValueError(
                f"a {by_classes} engine runs BLHNC or BLNHC, the hybrid manager, not "
                f"layerwise: not {wrong}"
            )
        rows = bool(v4 or by_classes)
        """The model's groups are filled and checked page by page: rows of one buffer, or
        (Glm5Next in vLLM 0.31.0) slabs of layers."""
        if start.get("host_buffer"):
            from kvwire.integrations.vllm import staging

            # A CPU platform stages nothing (stock's rule); here its cache stands for a
            # device's, so a kvwire engine stages through a host copy as on a GPU.
            staging.wants_host_buffer = lambda _vllm_config: True
        tp = int(start["tp_size"])
        kernel = int(start.get("kernel_block") or 0)
        mla = preset(start["model"]).mla
        utils.get_current_attn_backends = lambda *_a, **_k: [vllm_peer._backend(mla, kernel)]
        self.ratio = 1 if rows else kernel_ratio(start)
        self.start_role = start["role"]
        self.spec = vllm_peer.cache_spec(start)
        self.vllm_config = build_vllm_config(start)
        self.vllm_config.parallel_config.tensor_parallel_size = tp
        self.layout = start["layout"]
        backends: dict[str, Any] | None = None
        if by_classes == "glm5next":
            row_specs, backends = glm5next.build(self.vllm_config, self.spec.layers)
        elif by_classes == "qwen4exp":
            model = self.spec.model
            row_specs, backends = qwen4exp.build(
                self.vllm_config, self.spec.layers, model.kv_heads, model.head_dim
            )
        elif start.get("v41"):
            row_specs = deepseek_v41_specs(self.vllm_config, v4)
        else:
            row_specs = deepseek_v4_specs(self.vllm_config, v4, not start.get("bf16")) if v4 else {}
        if v4:
            backends = deepseek_v4_backends(row_specs)
        if backends is not None:
            distinct = list(dict.fromkeys(backends.values()))
            utils.get_current_attn_backends = lambda *_a, **_k: distinct
        self.ranks: list[Rank] = []
        for r in range(tp):
            at_rank = {**start, "tp_rank": r}
            if rows:
                assert backends is not None
                kv_cache_config, caches = allocate_rows(
                    self.vllm_config, row_specs, self.spec.num_blocks, backends
                )
                engine_core_block_size(self.vllm_config, kv_cache_config)
            else:
                kv_cache_config, caches = allocate(self.vllm_config, at_rank)
            _as_rank(start, r, tp, backends)
            worker = KVConnectorFactory.create_connector(
                self.vllm_config, KVConnectorRole.WORKER, kv_cache_config
            )
            buffer = backing_bytes(caches)
            rank_spec = vllm_peer.cache_spec(at_rank)
            if self.ratio > 1:  # the content is written and checked in kernel blocks
                rank_spec = replace(
                    rank_spec,
                    block_tokens=rank_spec.block_tokens // self.ratio,
                    num_blocks=rank_spec.num_blocks * self.ratio,
                )
            if rows:
                buffer[...] = 0xA5  # no page holds a prompt's content yet
                paged = paged_groups(kv_cache_config, caches, buffer, r, tp)
                rank = Rank(rank_spec, buffer, caches, [], worker, paged)
            else:
                groups = group_views(rank_spec, kv_cache_config, caches, buffer)
                rank = Rank(rank_spec, buffer, caches, groups, worker)
            for content in rank.groups:
                if content.spec is None:  # a Mamba group's states
                    content.kv[...] = 0xA5
                else:
                    scribble(content.spec, content.kv, list(range(rank_spec.num_blocks)))
            worker.register_kv_caches(caches)
            self.ranks.append(rank)
        self.kv_cache_config = kv_cache_config
        self.windows = windows(kv_cache_config)
        self.chunks = chunks(kv_cache_config)
        self.states = state_groups(kv_cache_config)
        self.rings = ring_groups(kv_cache_config)
        lookahead = int(self.vllm_config.num_prefill_lookahead_tokens)
        self.backoff = max(1 if any(self.states) else 0, lookahead - 1)
        """The prompt's last tokens D computes itself: a Mamba layer's next token starts
        from the state before the last prompt token, and a multi-module MTP drafter's
        lookahead must not reach P's cache (vLLM's rules, read from vLLM's config; both
        connectors follow them, and so P never computes those tokens)."""
        self.layerwise = bool(start.get("layerwise")) and self.start_role == "P"
        local = self.windows + self.chunks + self.states + self.rings
        assert not (self.layerwise and any(local)), "layerwise: dense"
        self.layer_at = {
            name: (c, j)
            for c, content in enumerate(self.ranks[0].groups)
            for j, name in enumerate(content.names)
        }
        """Per layer name: its content and its index among the content's layers."""
        self.worker = self.ranks[0].worker
        self.caches = self.ranks[0].caches
        self.buffer = self.ranks[0].buffer
        self.layers = list(self.caches)
        from vllm.utils.hashing import sha256

        init_none_hash(sha256)
        # vLLM's engine core hands its scheduler one spec per group (a group of per-layer
        # specs, by its first layer's).
        scheduler_config = generate_scheduler_kv_cache_config([kv_cache_config])
        sizes: dict[str, int] = {"block_size": self.spec.block_tokens}
        if rows:
            # Groups of several block sizes: the scheduler aligns to their lcm, and hashes
            # a prompt in blocks of their gcd (its engine core's resolution).
            block, hashed = resolve_kv_cache_block_sizes(scheduler_config, self.vllm_config)
            sizes = {"block_size": block, "hash_block_size": hashed}
        self.hasher = get_request_block_hasher(
            sizes.get("hash_block_size", sizes["block_size"]), sha256
        )
        if start.get("multimodal"):
            _encoder_budget()
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=scheduler_config,
            structured_output_manager=_NoGrammar(),
            **sizes,
        )
        self.hits: dict[str, int] = {}
        manager = self.scheduler.kv_cache_manager
        for name in ("get_computed_blocks", "get_computed_blocks_for_connector"):
            setattr(manager, name, self._counted(getattr(manager, name)))
        sched_connector = self.scheduler.connector
        assert sched_connector is not None
        handshakes = {}
        for r, rank in enumerate(self.ranks):
            handshake = rank.worker.get_handshake_metadata()
            if handshake is None:  # stock NixlConnector keeps it on its worker object
                handshake = rank.worker.connector_worker.xfer_handshake_metadata
            handshakes[(0, r)] = handshake
        sched_connector.set_xfer_handshake_metadata_pp_aware(handshakes)
        self.aggregator = KVOutputAggregator.from_connector(self.worker, tp)
        """vLLM's executor's: a request is finished once every rank reported it."""
        self.index: dict[str, int] = {}
        self.encoded: dict[str, list[int]] = {}
        """Per request, the encoder inputs (images) vLLM scheduled this engine to encode."""
        self.acts: dict[str, str] = {}
        """Per request, the side this engine is for it (``P`` fills its KV, ``D`` checks
        it): a ``kv_both`` engine, or one reading back a conversation, is either."""
        self.held: dict[str, tuple[int, int]] = {}
        """P, reading back: per request, the tokens of it a decode engine kept and the first
        of them it computed itself (generated), checked once read (before the engine
        computes the rest)."""
        self.scheduled: dict[str, int] = {}
        """This step's tokens per request."""
        self.outputs: dict[str, Any] = {}
        self.checked: dict[str, tuple[int, int]] = {}
        self.pending_checks: dict[str, tuple[int, int]] = {}
        """This step's checks, summed over ranks (recorded once every rank has checked)."""
        self.sent: set[str] = set()
        self.received: set[str] = set()
        self.invalid: set[int] = set()
        self.failed: set[str] = set()
        """D: requests whose load failed, as vLLM's output aggregator reported them."""
        self.connector_class = type(sched_connector).__name__
        self.requests: dict[str, Any] = {}
        self.fetch = FetchClock()
        self.compute: tuple[Any, float, float] | None = None
        """P, layerwise: (Burn, seconds per layer, seconds per Burn row); see set_compute."""
        self.wants: dict[tuple[str, int, int], Any] = {}
        """P, layerwise: per (request, rank, group) the prompt's values, while it computes."""
        self.computed_at: dict[str, list[float]] = {}
        """P, layerwise: per request, its first layer's start and its last layer's end."""
        self.pinned: set[str] = set()
        """The bench's: the threads :func:`pin` placed (none: not pinned)."""
        self.layer_s: list[float] = []
        """P, layerwise: how long each layer of each step took (the batch's)."""
        self.save_s = 0.0
        """Wall time in ``save_kv_layer`` calls (streaming: the runtime's layer calls)."""
        self.cpu = ConnectorClock()
        self.cpu_at_done: dict[str, dict[str, float]] = {}
        """D: the connector's CPU from the mark to the step that received each request."""
        for connector in (sched_connector, *(rank.worker for rank in self.ranks)):
            self.cpu.wrap(connector)

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
        self.scheduled = dict(out.num_scheduled_tokens)
        for rid, inputs in out.scheduled_encoder_inputs.items():
            self.encoded.setdefault(rid, []).extend(inputs)
        req_ids: list[str] = []
        for new in out.scheduled_new_reqs:
            req_ids.append(new.req_id)
        req_ids.extend(out.scheduled_cached_reqs.req_ids)
        sampled = []
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            # schedule() already counted this step's tokens as computed: a token is
            # sampled once the whole prompt has been (a partial prefill samples none).
            sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
        outputs = []
        for r, rank in enumerate(self.ranks):
            w = rank.worker
            # vLLM's executor hands each worker process its own copy of the metadata
            # (stock 0.31.0's pull worker rewrites a request's block ids in place).
            meta = copy.deepcopy(out.kv_connector_metadata) if r else out.kv_connector_metadata
            w.bind_connector_metadata(meta)
            # vLLM starts the step's loads after the forward, off its critical path, unless
            # a load must finish before it (has_sync_kv_loads).
            if out.has_sync_kv_loads:
                self._start_loads(w, meta)
            if not self.layerwise:
                for rid in req_ids:
                    self._compute(rank, rid)
            # A step that schedules no tokens runs no forward, so no layers: vLLM's runner
            # then makes only the connector's step calls (kv_connector_no_forward).
            for name in self.layers if out.total_num_scheduled_tokens else ():
                if self.layerwise:
                    self._layer(rank, name, req_ids, out.num_scheduled_tokens)
                w.wait_for_layer_load(name)
                began = time.perf_counter()
                w.save_kv_layer(name, rank.caches[name], None)
                self.save_s += time.perf_counter() - began
            if not out.has_sync_kv_loads:
                self._start_loads(w, meta)
            w.wait_for_save()
            # vLLM's model-runner mixin: completions and failed loads together, then the
            # blocks that failed to load.
            transfer = w.get_transfer_results(out.finished_req_ids)
            invalid = w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
            outputs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                    sampled_token_ids=sampled,
                    kv_connector_output=KVConnectorOutput(
                        finished_sending=transfer.finished_sending or None,
                        finished_recving=transfer.finished_recving or None,
                        failed_recving=transfer.failed_recving,
                        invalid_block_ids=invalid,
                    ),
                )
            )
        runner = self.aggregator.aggregate(outputs)
        kv = runner.kv_connector_output
        self.fetch.received(kv.finished_recving, time.perf_counter())
        for rid in kv.finished_recving or ():
            self.cpu_at_done.setdefault(rid, self.cpu.read())
        self.sent |= set(kv.finished_sending or ())
        self.received |= set(kv.finished_recving or ())
        self.invalid |= kv.invalid_block_ids
        self.failed |= kv.failed_recving
        self.checked.update(self.pending_checks)
        self.pending_checks = {}
        results = self.scheduler.update_from_output(out, runner)
        for finished in results.values():
            for o in finished.outputs:
                if o.finished:
                    self.outputs[o.request_id] = o.kv_transfer_params
                    self._forget_values(o.request_id)

    def _start_loads(self, worker: Any, meta: Any) -> None:
        if self.start_role == "D":
            self.fetch.step_began(meta, time.perf_counter())
        worker.start_load_kv(None)

    def _compute(self, rank: Rank, rid: str) -> None:
        """The model's forward for this request on one rank: P writes its KV; D checks the
        KV it was given (prefix hits included) the first time it reads it."""
        if rank.paged is not None:
            self._compute_pages(rank, rid)
            return
        all_blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)
        index = self.index[rid]
        request = self.scheduler.requests[rid]
        block_tokens = self.spec.block_tokens
        producing = self.acts.get(rid, self.start_role) == "P"
        if producing and rid in self.held and rid not in self.checked:
            read = rid in self.received and rid not in self.failed
            if read and not self.invalid.intersection(b for g in all_blocks for b in g):
                self._check_held(rank, rid, all_blocks)
        for c, content in enumerate(rank.groups):
            g, spec, kv = content.group, content.spec, content.kv
            seed = group_seed(index, c)
            if spec is None:  # Mamba: the state after the tokens computed (P) or loaded (D)
                at = (next(i for i, r in enumerate(self.ranks) if r is rank), len(self.ranks))
                if producing:
                    done = min(int(request.num_computed_tokens), int(request.num_prompt_tokens))
                    fill_state(kv, seed, list(all_blocks[g]), done, block_tokens, at)
                elif rid not in self.checked:
                    loaded = int(request.num_prompt_tokens) - self.backoff
                    ids = list(all_blocks[g])
                    wrong, checked = check_state(kv, seed, ids, loaded, block_tokens, at)
                    before = self.pending_checks.get(rid, (0, 0))
                    self.pending_checks[rid] = (before[0] + wrong, before[1] + checked)
                continue
            if self.rings[g]:  # the ring after the tokens computed (P) or loaded (D)
                (block,) = all_blocks[g]
                if producing:
                    done = min(int(request.num_computed_tokens), int(request.num_prompt_tokens))
                    fill_ring(spec, kv, seed, block, done)
                elif rid not in self.checked:
                    loaded = int(request.num_prompt_tokens) - self.backoff
                    wrong, checked = check_ring(spec, kv, seed, block, loaded)
                    before = self.pending_checks.get(rid, (0, 0))
                    self.pending_checks[rid] = (before[0] + wrong, before[1] + checked)
                continue
            blocks = expand(list(all_blocks[g]), self.ratio)
            if producing:
                fill_group(spec, kv, seed, blocks)
                continue
            if rid not in self.checked:
                prompt = int(request.num_prompt_tokens) - self.backoff
                wrong, checked = check_group(
                    spec, kv, seed, blocks, prompt, self.windows[g], self.chunks[g]
                )
                before = self.pending_checks.get(rid, (0, 0))
                self.pending_checks[rid] = (before[0] + wrong, before[1] + checked)
            # The KV of the tokens D generated, which it computes after the prompt.
            stop = int(request.num_computed_tokens)
            start = max(stop - self.scheduled.get(rid, 0), int(request.num_prompt_tokens))
            if start < stop:
                want = expected(spec, group_seed(index + DECODED, c), -(-stop // spec.block_tokens))
                for layer in range(spec.layers):
                    fill_tokens(spec, kv, want, blocks, layer, start, stop)

    def _compute_pages(self, rank: Rank, rid: str) -> None:
        """:meth:`_compute` of a DeepSeek-V4 engine: P writes the pages of the blocks this
        step's prompt tokens fall in, group by group; D checks, the first time it reads
        them, the pages of every block the next token attends to."""
        assert rank.paged is not None
        all_blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)
        request = self.scheduler.requests[rid]
        index = self.index[rid]
        if self.acts.get(rid, self.start_role) == "P":
            # schedule() already counted this step's tokens as computed.
            stop = min(int(request.num_computed_tokens), int(request.num_prompt_tokens))
            start = int(request.num_computed_tokens) - self.scheduled.get(rid, 0)
            for paged in rank.paged:
                fill_pages(paged, index, list(all_blocks[paged.group]), start, stop)
            return
        if rid in self.checked:
            return
        prompt = int(request.num_prompt_tokens) - self.backoff
        for paged in rank.paged:
            wrong, checked = check_pages(paged, index, list(all_blocks[paged.group]), prompt)
            before = self.pending_checks.get(rid, (0, 0))
            self.pending_checks[rid] = (before[0] + wrong, before[1] + checked)

    def _check_held(self, rank: Rank, rid: str, all_blocks: Any) -> None:
        """P, reading back: the conversation's first tokens, as the decode engine kept them
        (the content of the request's index: the first turn's), before P computes the rest."""
        held, generated = self.held[rid]
        index = self.index[rid]
        for c, content in enumerate(rank.groups):
            assert content.spec is not None, "a read-back moves attention pages only"
            blocks = expand(list(all_blocks[content.group]), self.ratio)
            spec, kv = content.spec, content.kv
            prompt = check_tokens(spec, kv, group_seed(index, c), blocks, 0, min(generated, held))
            decoded = check_tokens(
                spec, kv, group_seed(index + DECODED, c), blocks, generated, held
            )
            before = self.pending_checks.get(rid, (0, 0))
            self.pending_checks[rid] = (
                before[0] + prompt[0] + decoded[0],
                before[1] + prompt[1] + decoded[1],
            )

    def _layer(self, rank: Rank, name: str, req_ids: list[str], counts: dict[str, int]) -> None:
        """P, layerwise: the model's layer ``name`` for this step's batch on one rank. It
        first lets the rank's runtime settle (:meth:`_settle`), then writes the layer's
        values of each request's chunk; the caller reports the layer after that. With a
        compute set (:meth:`set_compute`) the layer then burns CPU until it has taken that
        long, and P's writes are not waited for: they run beside the compute, as on a GPU."""
        if self.compute is None:
            self._settle(rank, req_ids)
        elif self.pinned and self.pinned != set(os.listdir("/proc/self/task")):
            self.pinned = pin(self.start_role)  # a thread started since inherited our CPU
        c, layer = self.layer_at[name]
        g, spec, kv = rank.groups[c].group, rank.groups[c].spec, rank.groups[c].kv
        chunks = []
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            # schedule() already counted this step's tokens as computed.
            stop = min(int(req.num_computed_tokens), int(req.num_prompt_tokens))
            start = int(req.num_computed_tokens) - int(counts[rid])
            if start < stop:
                chunks.append((rid, start, stop, self._want(rank, rid, c)))
        if not chunks:
            return
        began = time.perf_counter()
        for rid, start, stop, want in chunks:
            blocks = expand(list(self.scheduler.kv_cache_manager.get_block_ids(rid)[g]), self.ratio)
            fill_tokens(spec, kv, want, blocks, layer, start, stop)
        if self.compute is not None:
            burn, layer_s, row_s = self.compute
            # Products until the layer has taken its time: a product runs faster or slower
            # than its sizing beside the copies, so one is not enough to hit the time.
            while (left := layer_s - (time.perf_counter() - began)) > 0:
                burn.size(left, row_s)
                if not burn.rows:
                    break
                burn()
        ended = time.perf_counter()
        self.layer_s.append(ended - began)
        for rid, *_ in chunks:
            self.computed_at.setdefault(rid, [began, ended])[1] = ended

    def _want(self, rank: Rank, rid: str, content: int) -> Any:
        """The values of ``rid``'s whole prompt in one content on one rank, made once per
        request (before a layer's clock starts: making them is not the model's work)."""
        key = (rid, self.ranks.index(rank), content)
        if key not in self.wants:
            spec = rank.groups[content].spec
            prompt = int(self.scheduler.requests[rid].num_prompt_tokens)
            blocks = -(-prompt // spec.block_tokens)
            self.wants[key] = expected(spec, group_seed(self.index[rid], content), blocks)
        return self.wants[key]

    def _forget_values(self, rid: str) -> None:
        """The request ended (finished or aborted): its values are not needed again."""
        for key in [k for k in self.wants if k[0] == rid]:
            del self.wants[key]

    def set_compute(self, layer_s: float) -> dict[str, float]:
        """The bench's model (interop/bench_layerwise.py): each layer of a step takes
        ``layer_s`` on P's engine thread, its KV write then matrix products for the rest
        (``kvwire.bench.layerwise_peer.Burn``: each one BLAS call, the GIL released)."""
        from kvwire.bench.layerwise_peer import Burn

        burn = self.compute[0] if self.compute is not None else Burn()
        row_s = burn.row_s()
        self.compute = (burn, float(layer_s), row_s)
        return {"row_s": row_s}

    def _settle(self, rank: Rank, req_ids: list[str]) -> None:
        """Before a layer is computed: every write a streaming kvwire P posted has landed,
        and none of the batch's streams waits for its handshake with D. The stand-in model
        is then slower than the network, deterministically: a write of anything not yet
        computed reads the scribble in P's blocks, and D's check finds it."""
        from kvwire.machine import ProducerState

        side = getattr(rank.worker, "_worker", None)
        producer = getattr(side, "producer", None)
        if producer is None or not producer.streaming:
            return
        # The connector hands its producer calls to a thread: they have all run first.
        if side.in_order is not None and not side.in_order.drain():
            raise TimeoutError("the connector's producer calls still queued after 30 s")
        driver = producer._driver
        deadline = time.monotonic() + 30

        def settled() -> bool:
            with driver._lock:
                state = driver.machine.request_state
                return not driver._xfers and all(
                    state(rid) is not ProducerState.WAIT_PEER for rid in req_ids
                )

        while not settled():
            if time.monotonic() > deadline:
                raise TimeoutError(f"P's writes still in flight after 30 s: {producer.errors}")
            time.sleep(0.001)

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
                SamplingParams(max_tokens=int(cmd.get("max_tokens") or 1)),
                None,
                mm_features=_images(cmd.get("images") or [], int(cmd["index"])),
                block_hasher=self.hasher,
            )
            req.kv_transfer_params = params
            self.index[rid] = int(cmd["index"])
            if params.get("do_remote_prefill"):
                self.acts[rid] = "D"
            elif params.get("do_remote_decode"):
                self.acts[rid] = "P"
                if params.get("remote_block_ids"):  # a decode engine kept the conversation
                    held = min(int(params.get("remote_num_tokens") or 0), int(cmd["num_tokens"]))
                    self.held[rid] = (held, int(cmd.get("generated_from") or held))
            self.scheduler.add_request(req)
            self.requests[rid] = req
            return {}
        if op == "abort":
            from vllm.v1.request import RequestStatus

            self.scheduler.finish_requests([cmd["rid"]], RequestStatus.FINISHED_ABORTED)
            self._forget_values(cmd["rid"])
            return {}
        if op == "step":
            for _ in range(int(cmd.get("n", 1))):
                self.step()
            return self.state()
        if op == "debug":
            sides = [rank.worker._worker.endpoint for rank in self.ranks]
            return {
                "machine": sides[0].machine_stats(),
                "errors": sides[0].errors,
                "metrics": sides[0].metrics.snapshot()["totals"],
                "ranks": [
                    {"machine": side.machine_stats(), "errors": side.errors} for side in sides
                ],
            }
        if op == "registrations":
            # P: push registrations each kvwire rank holds, not yet matched with a prompt.
            return {
                "pending": [rank.worker._worker.producer.pending_registrations()
                            for rank in self.ranks]
            }  # fmt: skip
        if op == "resolve_layout":
            return self.resolve_layout()
        if op == "regions":
            return {
                "regions": self.regions(),
                "names": self.region_names(),
                "groups": self.region_groups(),
                "layout": self.layout,
                "blocks": self.advertised_blocks(),
                "ssm_sizes": self.ssm_sizes(),
            }
        if op == "scribble_free":
            # Free blocks vLLM caches no prefix in: what they held is gone, as when another
            # request has since been computed into them.
            queue = self.scheduler.kv_cache_manager.block_pool.free_block_queue
            free = [
                b.block_id for b in queue.get_all_free_blocks()
                if b.block_hash is None and not b.is_null
            ]  # fmt: skip
            for rank in self.ranks:
                for content in rank.groups:
                    if content.spec is not None:
                        scribble(content.spec, content.kv, expand(free, self.ratio))
                for paged in rank.paged or ():
                    for pages in paged.pages:
                        pages[free] = 0xA5
            return {"scribbled": len(free)}
        if op == "fragment":
            # A long-running engine's pool: free blocks come back in no particular order.
            # Reorders vLLM's free-block queue (the order it allocates in) with a seed.
            queue = self.scheduler.kv_cache_manager.block_pool.free_block_queue
            blocks = queue.popleft_n(queue.num_free_blocks)
            np.random.default_rng(int(cmd.get("seed", 0))).shuffle(blocks)
            queue.append_n(blocks)
            return {}
        if op == "stats":
            ranks = [rank.worker.get_kv_connector_stats() for rank in self.ranks]
            data = [dict(s.data) if s is not None else {} for s in ranks]
            return {
                "stats": data[0],
                "ranks": data,
                "cpu": self.cpu.read(),
                "cpu_at_done": self.cpu_at_done,
                "ttkv_s": self.fetch.seconds(),
            }
        if op == "cpu_mark":
            self.cpu.mark()
            return {}
        if op == "compute":
            return self.set_compute(float(cmd["seconds"]))
        if op == "pin":
            self.pinned = pin(self.start_role)
            return {"pinned": bool(self.pinned)}
        if op == "run_until":
            # D, as an engine loop: step until ``rid``'s KV is in (the time it came is the
            # end of the step that reported it: FetchClock).
            deadline = time.monotonic() + float(cmd.get("timeout", 120))
            while cmd["rid"] not in self.received:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{cmd['rid']} not received: {self.state()['invalid']}")
                self.step()
                time.sleep(IDLE_STEP_S)
            return self.state()
        if op == "clocks":
            return {
                "computed_at": self.computed_at,
                "layer_s": self.layer_s,
                "save_s": self.save_s,
                "received_at": self.fetch.done,
            }
        if op == "state":
            return self.state()
        raise ValueError(f"unknown op {op!r}")

    def resolve_layout(self) -> dict[str, str]:
        """The layout vLLM's engine core would resolve for this engine on a CUDA platform
        whose backends (FlashAttention, Triton) take any layout: with this engine's
        connector, and with no connector at all."""
        import copy

        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
        from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
        from vllm.v1.attention.backends.utils import (
            get_supported_kv_cache_layouts,
            resolve_kv_cache_layout,
        )

        out = {}
        backends = {"flash_attn": FlashAttentionBackend, "triton": TritonAttentionBackend}
        for name, backend in backends.items():
            supported = [[m.name for m in get_supported_kv_cache_layouts([backend])]]
            for label, transfer in (("", self.vllm_config.kv_transfer_config), ("none.", None)):
                config = copy.copy(self.vllm_config)
                object.__setattr__(config, "cache_config", copy.copy(config.cache_config))
                object.__setattr__(config, "kv_transfer_config", transfer)
                config.cache_config.kv_cache_layout = None
                out[label + name] = resolve_kv_cache_layout(config, supported).name
        return out

    def regions(self) -> list[list[int]]:
        """What the worker connector registered: per region, (offset into the allocation,
        bytes per block, bytes from one block to the next)."""
        base = self.buffer.ctypes.data
        connector = self.worker
        w = getattr(connector, "connector_worker", None)  # stock's worker half
        if w is not None:
            addrs = w.kv_caches_base_addr[w.engine_id][w.tp_rank]
            lens, strides = w.block_len_per_layer, w.block_stride_per_layer
            return [[a - base, n, s] for a, n, s in zip(addrs, lens, strides, strict=True)]
        geometry = connector._worker.endpoint._driver.geometry
        return [[r.base_addr - base, r.block_len, r.block_stride] for r in geometry.regions]

    def region_names(self) -> list[str]:
        """Each registered region's name, as the worker advertises it (a stock peer compares
        them by index)."""
        w = getattr(self.worker, "connector_worker", None)
        if w is not None:
            return list(w.region_names)
        return [str(r.name) for r in self.worker._worker.endpoint._driver.geometry.regions]

    def advertised_blocks(self) -> list[int]:
        """(tokens per region block, region blocks per block id, region blocks) as the
        worker advertises them to peers."""
        w = getattr(self.worker, "connector_worker", None)
        if w is not None:
            return [w.block_size, w._physical_blocks_per_logical_kv_block, w.num_blocks]
        g = self.worker._worker.endpoint._driver.geometry
        return [g.kernel_block_size, g.physical_blocks_per_logical, g.advertised_num_blocks()]

    def ssm_sizes(self) -> list[int]:
        """(conv, temporal) state bytes per layer as the worker advertises them."""
        w = getattr(self.worker, "connector_worker", None)
        if w is not None:
            return list(w._mamba_ssm_size)
        return list(self.worker._worker.endpoint._driver.geometry.ssm_sizes)

    def region_groups(self) -> list[int]:
        """The KV-cache group each registered region advertises (-1: every group's), to
        compare a kvwire worker's registration with a stock one's."""
        w = getattr(self.worker, "connector_worker", None)
        if w is not None:
            return list(w.region_group_ids)
        geometry = self.worker._worker.endpoint._driver.geometry
        return [r.group_id for r in geometry.regions]

    def state(self) -> dict[str, Any]:
        return {
            "outputs": self.outputs,
            "checked": {k: list(v) for k, v in self.checked.items()},
            "hits": self.hits,
            "preemptions": {rid: r.num_preemptions for rid, r in self.requests.items()},
            "sent": sorted(self.sent),
            "received": sorted(self.received),
            "invalid": sorted(self.invalid),
            "failed": sorted(self.failed),
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "free_blocks": self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
            "connector": self.connector_class,
            "encoded": self.encoded,
            "hma": not self.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        }

    def close(self) -> None:
        for rank in self.ranks:
            rank.worker.shutdown()
        connector = self.scheduler.connector
        if connector is None:
            return
        if self.connector_class == "KVWireConnector":
            connector.shutdown()
        else:
            # Stock's joins its listener thread, which wakes once a second; the process
            # exits right after this, so a test need not wait out that poll.
            threading.Thread(target=connector.shutdown, daemon=True).start()
