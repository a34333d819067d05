"""Qwen4Exp's KV caches as vLLM's own code makes them, for the interop harness: its
indexers' raw-key rings and compressed keys (``qsa_cache``'s classes), its GDN layers' and
per-layer embeddings' states (``MambaBase.get_kv_cache_spec``), its attention's GQA pages;
then vLLM's own block-size alignment, layout resolution, grouping and allocation.

The few stand-ins, each where vLLM's module cannot be imported here (both import the
``compressed_tensors`` package, which the CPU venvs lack): the QSA attention's spec is
built with the fields its ``get_kv_cache_spec`` passes and its backend's parent
(``FlashAttentionBackend``, which declares the same layouts: none); the GDN state's shapes
and dtypes come from vLLM's calculators with the arguments the GDN layer passes them (and
in 0.32.0 the embedding state's, whose layer module imports the same package).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from built_caches import align_hybrid_block_size, resolve_layout

GDN, QSA = "linear_attention", "qwen_sparse_attention"
"""Layer types as Qwen4Exp's HF config names them (``layer_types``)."""


def layer_types(layers: int) -> list[str]:
    """The model's pattern: every fourth layer sparse attention, the rest GDN."""
    return [QSA if (i + 1) % 4 == 0 else GDN for i in range(layers)]


def hf_config(layers: int, kv_heads: int, head_dim: int) -> Any:
    """The facts the caches are made of, as the text config gives them to vLLM: the
    checkpoint's head sizes of GDN (128) and of the indexer (one 128-value key head, 4
    tokens a compressed key), its 4-tap convolutions and 4 hyper-connection streams, and
    per-layer embeddings on layer 0 (one-based ids); head counts and widths cut down."""
    types = layer_types(layers)
    return SimpleNamespace(
        model_type="qwen4_exp_text", architectures=["Qwen4ExpForCausalLM"],
        num_hidden_layers=layers, layer_types=types, hidden_size=256,
        num_attention_heads=2 * kv_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, hc_count=4, ple_layer_ids=[1],
        ple_conv_kernel_size=4, ngram_size=3, indexer_n_heads=16, indexer_kv_heads=1,
        indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4, rope_parameters={},
    )  # fmt: skip


def configure(vllm_config: Any, hf: Any) -> None:
    """What vLLM's config makes of a Qwen4ExpForCausalLM: its per-architecture and
    hybrid-model hooks set the Mamba cache mode and block size. The CPU platform keeps GDN
    states in float32 for its own kernels; a GPU engine keeps the model's dtype."""
    from vllm.model_executor.models.config import (
        HybridAttentionMambaModelConfig,
        Qwen4ExpForCausalLMConfig,
    )

    model = vllm_config.model_config
    model.hf_config = model.hf_text_config = hf
    model.architecture = "Qwen4ExpForCausalLM"
    model.is_hybrid = True
    model.get_num_kv_heads = lambda parallel: max(
        1, hf.num_key_value_heads // parallel.tensor_parallel_size
    )
    vllm_config.cache_config.mamba_ssm_cache_dtype = "auto"
    Qwen4ExpForCausalLMConfig.verify_and_update_config(vllm_config)
    HybridAttentionMambaModelConfig.verify_and_update_config(vllm_config)


def _ple_state(vllm_config: Any, hf: Any) -> tuple[Any, Any]:
    """The embeddings' short-conv state: its layer's own methods where its module imports
    (0.31.0), else vLLM's calculators with what that layer passes them."""
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )

    hc_hidden = hf.hidden_size * hf.hc_count
    state_len = (hf.ple_conv_kernel_size - 1) * hf.ngram_size
    spec_tokens = vllm_config.num_speculative_tokens
    try:
        from vllm.models.qwen4_exp.nvidia.ple_layer import Qwen4ExpPLELayer
    except ImportError:
        shape = MambaStateShapeCalculator.short_conv_state_shape(
            tp_world_size=1, intermediate_size=hc_hidden, conv_kernel=state_len + 1,
            num_spec=spec_tokens,
        )  # fmt: skip
        dtype = MambaStateDtypeCalculator.short_conv_state_dtype(
            vllm_config.model_config.dtype, vllm_config.cache_config.mamba_cache_dtype
        )
        return shape, dtype
    layer = SimpleNamespace(
        hc_hidden_size=hc_hidden, conv_state_len=state_len, num_spec_tokens=spec_tokens,
        model_config=vllm_config.model_config, cache_config=vllm_config.cache_config,
    )  # fmt: skip
    return Qwen4ExpPLELayer.get_state_shape(layer), Qwen4ExpPLELayer.get_state_dtype(layer)


def _gdn_state(vllm_config: Any, hf: Any) -> tuple[Any, Any]:
    """A GDN layer's conv and temporal states, this rank's shard."""
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )

    cache = vllm_config.cache_config
    shape = MambaStateShapeCalculator.gated_delta_net_state_shape(
        vllm_config.parallel_config.tensor_parallel_size, hf.linear_num_key_heads,
        hf.linear_num_value_heads, hf.linear_key_head_dim, hf.linear_value_head_dim,
        hf.linear_conv_kernel_dim, vllm_config.num_speculative_tokens,
    )  # fmt: skip
    dtype = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype
    )
    return shape, dtype


def _state_spec(vllm_config: Any, state: tuple[Any, Any], kind: Any, replicated: bool) -> Any:
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    shapes, dtypes = state
    layer = SimpleNamespace(
        get_state_shape=lambda: shapes, get_state_dtype=lambda: dtypes, mamba_type=kind,
        is_kv_cache_tp_replicated=replicated,
    )  # fmt: skip
    return MambaBase.get_kv_cache_spec(layer, vllm_config)


def specs(vllm_config: Any) -> dict[str, Any]:
    """vLLM's spec of every cache the layers make, in the order a layer registers them
    (vLLM orders its groups by their first cache): the embeddings' state, then a GDN
    layer's state, or an indexer's ring and compressed keys and the attention's pages."""
    from vllm.config import set_current_vllm_config
    from vllm.models.qwen4_exp.common.qsa_cache import QSACompressedKeyCache, QSAKeyStateCache
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as Kind
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    hf = vllm_config.model_config.hf_text_config
    cache = vllm_config.cache_config
    tp = vllm_config.parallel_config.tensor_parallel_size
    out: dict[str, Any] = {}
    vllm_config.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(vllm_config):
        for i, kind in enumerate(hf.layer_types):
            prefix = f"model.layers.{i}"
            if i + 1 in hf.ple_layer_ids:
                state = _ple_state(vllm_config, hf)
                out[f"{prefix}.ple"] = _state_spec(vllm_config, state, Kind.SHORT_CONV, True)
            if kind == GDN:
                state = _gdn_state(vllm_config, hf)
                out[f"{prefix}.linear_attn"] = _state_spec(vllm_config, state, Kind.GDN_ATTN, False)
                continue
            index = f"{prefix}.self_attn.indexer"
            common = {"cache_config": cache, "compress_ratio": hf.indexer_compress_ratio}
            ring = QSAKeyStateCache(
                head_size=hf.indexer_head_dim, dtype=torch.bfloat16,
                prefix=f"{index}.raw_key_cache", vllm_config=vllm_config, **common,
            )  # fmt: skip
            keys = QSACompressedKeyCache(
                head_size=hf.indexer_head_dim, dtype=torch.bfloat16,
                prefix=f"{index}.compressed_key_cache", vllm_config=vllm_config, **common,
            )  # fmt: skip
            out[ring.prefix] = ring.get_kv_cache_spec(vllm_config)
            out[keys.prefix] = keys.get_kv_cache_spec(vllm_config)
            out[f"{prefix}.self_attn.attn"] = FullAttentionSpec(
                block_size=cache.block_size, num_kv_heads=max(1, hf.num_key_value_heads // tp),
                head_size=hf.head_dim, head_size_v=hf.head_dim,
                dtype=kv_cache_dtype_str_to_dtype(cache.cache_dtype, vllm_config.model_config),
                kv_quant_mode=get_kv_quant_mode(cache.cache_dtype),
            )  # fmt: skip
    return out


def backends(caches: dict[str, Any]) -> dict[str, Any]:
    """Per cache, the backend its layer runs it with."""
    from vllm.models.qwen4_exp.common.qsa_cache import QSAStateBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.attention.backends.short_conv_attn import PleShortConvAttentionBackend
    from vllm.v1.attention.selector import get_mamba_attn_backend

    by_suffix = {
        ".ple": PleShortConvAttentionBackend,
        ".linear_attn": get_mamba_attn_backend(MambaAttentionBackendEnum.GDN_ATTN),
        ".raw_key_cache": QSAStateBackend,
        ".compressed_key_cache": QSAStateBackend,
        ".self_attn.attn": FlashAttentionBackend,
    }
    return {
        name: next(b for suffix, b in by_suffix.items() if name.endswith(suffix)) for name in caches
    }


def align_block_size(vllm_config: Any, caches: dict[str, Any], by_cache: dict[str, Any]) -> None:
    """vLLM's own hybrid alignment (the attention block grows until its page holds the
    largest state, every state page padded to it), the model class's state specs answered
    from ``caches`` (its module imports ``compressed_tensors``)."""
    states = tuple(s for s in caches.values() if type(s).__name__ == "MambaSpec")
    model_cls = SimpleNamespace(get_mamba_specs_from_config=lambda _config: states)
    first = next(b for b in by_cache.values() if not b.is_ssm())
    align_hybrid_block_size(vllm_config, model_cls, "Qwen4ExpForCausalLM", first)


def build(vllm_config: Any, layers: int, kv_heads: int, head_dim: int) -> tuple[dict, dict]:
    """The model's specs and backends, configured, aligned and laid out as vLLM does: the
    specs are made twice, once to size the block and once at the aligned size."""
    configure(vllm_config, hf_config(layers, kv_heads, head_dim))
    caches = specs(vllm_config)
    by_cache = backends(caches)
    align_block_size(vllm_config, caches, by_cache)
    caches = specs(vllm_config)
    resolve_layout(vllm_config, caches, by_cache)
    return caches, by_cache
