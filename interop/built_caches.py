"""What the harness does alike for the models whose caches it builds from vLLM's own
classes (``qwen4exp``, ``glm5next``): the layout vLLM resolves for them, and what a D rank
checks of a prompt."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def align_hybrid_block_size(
    vllm_config: Any, model_cls: Any, architecture: str, backend: Any
) -> None:
    """vLLM's own hybrid alignment (the attention block grows until its page holds the
    largest state, every state page padded to it), with ``backend`` the first non-state
    one, the model class answered by ``model_cls`` (the real class's module needs a
    package the CPU venvs lack)."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.interface import Platform

    resolve = ModelRegistry.resolve_model_cls
    ModelRegistry.resolve_model_cls = lambda *_a, **_k: (model_cls, architecture)
    try:
        Platform._align_hybrid_block_size(vllm_config, backend)
    finally:
        ModelRegistry.resolve_model_cls = resolve


def resolve_layout(vllm_config: Any, caches: dict[str, Any], by_cache: dict[str, Any]) -> str:
    """The layout vLLM's engine core resolves from the backends and the specs (each of
    these models has a backend that takes block-outermost layouts only, or one), recorded
    on the cache config."""
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )

    distinct = list(dict.fromkeys(by_cache.values()))
    names = [layout.name for layout in get_supported_kv_cache_layouts(distinct)]
    layout = resolve_kv_cache_layout(vllm_config, [names], list(caches.values()))
    return str(layout.name)


def checked_pages(vllm_config: Any, caches: dict[str, Any]) -> tuple[list, int]:
    """(per token group vLLM makes of the caches: block tokens, 0 (no window), each
    layer's page bytes; the bytes of every ring's and state's page, moved whole), from
    the specs and vLLM's own grouping: what a D rank checks of a prompt."""
    import math

    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm_engine import ring_specs

    def real(spec: Any) -> int:
        if isinstance(spec, MambaSpec):
            sizes = zip(spec.shapes, spec.dtypes, strict=True)
            return sum(math.prod(shape) * dtype.itemsize for shape, dtype in sizes)
        return int(spec.real_page_size_bytes)

    tokens, running = [], 0
    for group in get_kv_cache_groups(vllm_config, caches):
        first = caches[group.layer_names[0]]
        pages = [real(caches[name]) for name in group.layer_names]
        if isinstance(first, (*ring_specs(), MambaSpec)):
            running += sum(pages)
        else:
            tokens.append((int(first.block_size), 0, pages))
    return tokens, running


def checked_bytes(
    start: dict[str, Any], build: Callable[[Any], dict[str, Any]], prompt: int
) -> int:
    """What one D rank of an engine started with ``start`` checks of a prompt whose last
    token D computes (a state's rule): from the specs ``build`` makes on vLLM's config (the
    model's own classes) and vLLM's own grouping."""
    import vllm_engine
    from harness import held_bytes

    config = vllm_engine.build_vllm_config(start)
    config.parallel_config.tensor_parallel_size = int(start["tp_size"])
    tokens, running = checked_pages(config, build(config))
    return held_bytes(tokens, prompt - 1) + running
