"""Glm5Next's KV caches as vLLM's own code makes them, for the interop harness: its KDA
layers' states (``MambaBase``'s spec, through the KDA layer's own), and per sparse-attention
layer the indexer's pooled keys and tail ring (``common/attention.py``'s classes) beside
the MLA latent; then vLLM's own hybrid alignment, the model runner's spec pass, layout
resolution, grouping and allocation.

The package's ``__init__`` imports the multimodal model, which needs ``torchvision`` (not
in the CPU venvs): its modules are imported through a package without that ``__init__``.
The stand-ins, each where vLLM cannot build a layer here: the KDA layer and the MLA
attention are their classes without ``__init__`` (which builds weights, kernels and, for
the attention, a sparse MLA backend that the CPU platform refuses), holding the attributes
their cache methods read, set as ``__init__`` sets them; the attention's backend is the
one vLLM's CUDA priorities put first on SM90 for a 512-wide NoPE latent (FlashInfer's
sparse MLA for SM90); and in the hybrid alignment, the model class's state shape and dtype
are answered by a KDA layer (the class's module needs ``torchvision``), whose methods call
the same calculators with the same arguments. Four of the calls are to vLLM's private
functions (the hybrid alignment, the non-state backends, the KDA prefill kernel's and the
sparse MLA cache dtype's resolution): its own code, run as its engine runs it, which a
release may rename.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from built_caches import align_hybrid_block_size, resolve_layout

KDA, MLA = "linear_attention", "full_attention"
"""Layer types as the checkpoint names them (``layer_types``); vLLM tells only KDA apart."""

PACKAGE = "vllm.models.glm5next"


def layer_types(layers: int) -> list[str]:
    """The model's pattern: every fourth layer sparse attention, the rest KDA."""
    return [MLA if (i + 1) % 4 == 0 else KDA for i in range(layers)]


def hf_config(layers: int, kpool: int = 4) -> Any:
    """The facts the caches are made of, as the text config gives them to vLLM: the
    checkpoint's NoPE latent (512 values, no rope part), its indexer's key head of 128
    (``kpool`` tokens pooled into one key) and KDA heads of 128 with 4-tap convolutions
    and a bounded gate; head counts and widths cut down (2 KDA heads: one a rank at TP 2)."""
    return SimpleNamespace(
        model_type="glm5_next_text", architectures=["Glm5NextForCausalLM"],
        num_hidden_layers=layers, layer_types=layer_types(layers), hidden_size=256,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=256, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=0, v_head_dim=128, mla_use_nope=True,
        linear_num_heads=2, linear_head_dim=128, linear_conv_kernel_dim=4,
        linear_lower_bound=-5.0, index_topk=64, index_n_heads=4, index_head_dim=128,
        index_kpool=kpool, index_kpool_always_select_tail=True, rope_parameters=None,
    )  # fmt: skip


def configure(vllm_config: Any, hf: Any) -> None:
    """What vLLM's config makes of a Glm5NextForCausalLM: MLA with one latent head of
    ``kv_lora_rank`` + rope values (vLLM's own reading of the text config), a hybrid model
    (its class is ``IsHybrid``) with no hook of its own, so vLLM's hooks set the Mamba
    cache mode and block size as for any hybrid. The CPU platform keeps states in float32
    for its own kernels; a GPU engine keeps "auto" (KDA's recurrent state is float32 either
    way)."""
    from functools import partial

    from vllm.config import ModelConfig
    from vllm.transformers_utils.model_arch_config_convertor import (
        ModelArchConfigConvertorBase,
    )

    arch = ModelArchConfigConvertorBase(hf, hf)
    model = vllm_config.model_config
    model.hf_config = model.hf_text_config = hf
    model.architecture = "Glm5NextForCausalLM"
    model.is_hybrid = True
    model.convert_type = "none"
    model.use_mla = arch.is_deepseek_mla()
    model.get_head_size = arch.get_head_size
    model.get_num_kv_heads = partial(ModelConfig.get_num_kv_heads, model)
    vllm_config.cache_config.mamba_ssm_cache_dtype = "auto"
    vllm_config.try_verify_and_update_config()


def _import_package() -> None:
    """The model's package without its ``__init__``: its subpackages import as usual."""
    import sys
    from types import ModuleType

    import vllm.models

    if PACKAGE not in sys.modules:
        package = ModuleType(PACKAGE)
        package.__path__ = [f"{path}/glm5next" for path in vllm.models.__path__]
        sys.modules[PACKAGE] = package


def _bare(cls: type, **attributes: Any) -> Any:
    """A layer of ``cls`` holding ``attributes`` only: what its cache methods read, where
    its ``__init__`` would build what this machine cannot."""
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    for name, value in attributes.items():
        setattr(layer, name, value)
    return layer


def _kda_layer(vllm_config: Any, hf: Any) -> Any:
    """A KDA layer, this rank's shard, its prefill kernel resolved by vLLM from the default
    choice: Triton here, so its spec has no prefill checkpoint (0.32.0 adds one for
    FlashKDA, which it resolves on an SM90 or SM10x GPU)."""
    from vllm.models.glm5next.common import kda

    model = vllm_config.model_config
    return _bare(
        kda.Glm5NextLinearAttention,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        num_heads=hf.linear_num_heads, head_dim=hf.linear_head_dim,
        conv_size=hf.linear_conv_kernel_dim, num_spec=vllm_config.num_speculative_tokens,
        model_config=model, cache_config=vllm_config.cache_config,
        kda_prefill_backend=kda._resolve_kda_prefill_backend(
            "auto", hf.linear_head_dim, model.dtype, hf.linear_lower_bound
        ),
    )  # fmt: skip


def _mla_backend() -> Any:
    """The sparse MLA backend an SM90 engine runs (0.31.0's takes LBHNC only, 0.32.0's any
    layout)."""
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90 import (
        FlashInferMLASparseSM90Backend,
    )

    return FlashInferMLASparseSM90Backend


def _mla_layer(vllm_config: Any, hf: Any, indexer: Any) -> Any:
    """The sparse MLA attention: one latent a token, led by its indexer, in the cache
    dtype its backend takes the configured one as."""
    from vllm.model_executor.layers.attention.mla_attention import (
        MLAAttention,
        _canonicalize_sparse_mla_kv_cache_dtype,
    )

    backend = _mla_backend()
    dtype = _canonicalize_sparse_mla_kv_cache_dtype(backend, vllm_config.cache_config.cache_dtype)
    return _bare(
        MLAAttention, attn_backend=backend, kv_cache_dtype=dtype,
        head_size=hf.kv_lora_rank + hf.qk_rope_head_dim, sliding_window=None,
        indexer=indexer, non_causal_multi_token_decode=False,
    )  # fmt: skip


def _layers(vllm_config: Any) -> dict[str, Any]:
    """The layers that hold caches, registered where vLLM finds them, in the order the
    model's construction registers them: a KDA layer, or an indexer's keys and tail ring,
    then the attention it leads."""
    from vllm.config import set_current_vllm_config

    _import_package()
    from vllm.models.glm5next.common.attention import Glm5NextIndexerCache, Glm5NextTailCache

    hf = vllm_config.model_config.hf_text_config
    context = vllm_config.compilation_config.static_forward_context
    context.clear()
    common = {"cache_config": vllm_config.cache_config, "index_kpool": hf.index_kpool}
    with set_current_vllm_config(vllm_config):
        for i, kind in enumerate(hf.layer_types):
            prefix = f"model.layers.{i}.self_attn"
            if kind == KDA:
                context[prefix] = _kda_layer(vllm_config, hf)
                continue
            # The indexer's fp8 keys carry a 4-byte scale per 128 values.
            keys = Glm5NextIndexerCache(
                head_dim=hf.index_head_dim + hf.index_head_dim // 128 * 4, dtype=torch.uint8,
                prefix=f"{prefix}.indexer.k_cache", **common,
            )  # fmt: skip
            tail = Glm5NextTailCache(
                head_dim=hf.index_head_dim, dtype=torch.bfloat16,
                prefix=f"{prefix}.indexer.tail_cache", **common,
            )  # fmt: skip
            indexer = SimpleNamespace(k_cache=keys, tail_cache=tail)
            context[f"{prefix}.attn"] = _mla_layer(vllm_config, hf, indexer)
    return dict(context)


def specs(vllm_config: Any) -> dict[str, Any]:
    """vLLM's spec of every cache the layers make, in the order they register them (vLLM
    orders its groups by their first cache), as the model runner reads them: each layer's
    own, an attention's as its backend customizes it."""
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    _layers(vllm_config)
    return dict(get_kv_cache_spec(vllm_config))


def backends(caches: dict[str, Any]) -> dict[str, Any]:
    """Per cache, the backend its layer runs it with: the indexer's keys Glm5Next's own in
    vLLM 0.32.0 (DeepSeek-V3.2's in 0.31.0), the tail ring a storage-only one that takes
    one layout (BLHNC in 0.32.0, LBHNC in 0.31.0)."""
    _import_package()
    from vllm.models.glm5next.common.attention import Glm5NextIndexerCache, Glm5NextTailCache
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.attention.selector import get_mamba_attn_backend

    # Each cache class names its backend without reading its layer.
    by_suffix = {
        ".indexer.k_cache": Glm5NextIndexerCache.get_attn_backend(None),
        ".indexer.tail_cache": Glm5NextTailCache.get_attn_backend(None),
        ".self_attn.attn": _mla_backend(),
        ".self_attn": get_mamba_attn_backend(MambaAttentionBackendEnum.GDN_ATTN),
    }
    return {
        name: next(b for suffix, b in by_suffix.items() if name.endswith(suffix)) for name in caches
    }


def align_block_size(vllm_config: Any) -> None:
    """vLLM's own hybrid alignment over the registered layers (the attention block grows
    to a multiple of 128 tokens whose latent page holds a KDA state, every state page
    padded to it), the model class's state shape and dtype answered by a KDA layer. With
    pools of 4 tokens, the 128-token floor MLA sets is the 32 pools the indexer's kernel
    pages take; 0.31.0 aligns to larger pools on CUDA only, which this is not."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.platforms.interface import Platform

    layers = vllm_config.compilation_config.static_forward_context.values()
    state = next(layer for layer in layers if isinstance(layer, MambaBase))
    model_cls = SimpleNamespace(
        get_mamba_state_shape_from_config=lambda _config: state.get_state_shape(),
        get_mamba_state_dtype_from_config=lambda _config: state.get_state_dtype(),
    )
    first = Platform._find_non_ssm_backends(vllm_config)[0]
    align_hybrid_block_size(vllm_config, model_cls, "Glm5NextForCausalLM", first)


def build(vllm_config: Any, layers: int, kpool: int = 4) -> tuple[dict, dict]:
    """The model's specs and backends, configured, aligned and laid out as vLLM does: the
    layers are made before the block is aligned and their specs read after, as vLLM's
    worker does (0.31.0's indexer refuses a block that is not a multiple of 32 pools).
    The layout is the one vLLM resolves (a configured other one is refused)."""
    configure(vllm_config, hf_config(layers, kpool))
    _layers(vllm_config)
    align_block_size(vllm_config)
    caches = specs(vllm_config)
    by_cache = backends(caches)
    # vLLM takes a configured layout as it is, the tail's backend taking one only.
    configured = vllm_config.cache_config.kv_cache_layout
    vllm_config.cache_config.kv_cache_layout = None
    layout = resolve_layout(vllm_config, caches, by_cache)
    if configured is not None and str(getattr(configured, "name", configured)) != layout:
        raise ValueError(f"Glm5Next's tail ring takes {layout} in this vLLM, not {configured}")
    return caches, by_cache
