"""The two knobs of the reference engine: what the model is, and how its KV cache is laid out.

Both are frozen dataclasses of plain values, so a P engine, a D engine and a monolithic
engine built from the same :class:`ModelConfig` compute the same function, whatever their
:class:`CacheConfig` (TP size, layout, block size, capacity) says.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwire.errors import ConfigError
from kvwire.layout.geometry import KVLayout, parse_layout


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A small decoder-only transformer, randomly initialised from ``seed``.

    Dense attention is GQA: ``q_heads`` query heads share ``kv_heads`` KV heads. With
    ``mla=True`` the model caches one latent vector per token instead (``latent_dim``
    compressed KV plus a ``rope_dim`` shared rotary key), which every TP rank replicates.
    """

    vocab_size: int = 256
    hidden: int = 64
    layers: int = 2
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    mla: bool = False
    latent_dim: int = 32
    rope_dim: int = 8
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden", "layers", "q_heads", "kv_heads", "head_dim", "ffn")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"model {name} must be positive, got {getattr(self, name)}")
        if self.q_heads % self.kv_heads:
            raise ConfigError(
                f"q_heads {self.q_heads} must be a multiple of kv_heads {self.kv_heads}"
            )
        if self.head_dim % 2 or self.rope_dim % 2:
            raise ConfigError("head_dim and rope_dim must be even (rotary halves)")

    @property
    def cached_kv_heads(self) -> int:
        """KV heads the cache stores: the latent cache of MLA counts as one head."""
        return 1 if self.mla else self.kv_heads

    @property
    def query_dim(self) -> int:
        """Width of one query head (MLA queries carry a rotary part next to the content)."""
        return self.head_dim + self.rope_dim if self.mla else self.head_dim

    @property
    def cache_content(self) -> int:
        """float32 values one cached head stores per token (K and V, or latent + rope key)."""
        return self.latent_dim + self.rope_dim if self.mla else 2 * self.head_dim


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """One engine instance's KV cache and parallelism.

    ``kv_split`` keeps K and V of a layer in two regions (``[2, blocks, ...]``, as vLLM's
    FlashAttention cache does) instead of packing them side by side in one region.
    """

    block_size: int = 16
    num_blocks: int = 64
    layout: KVLayout | str = KVLayout.HND
    tp_size: int = 1
    kv_split: bool = False
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", parse_layout(self.layout))
        if self.block_size <= 0 or self.num_blocks <= 0 or self.tp_size <= 0:
            raise ConfigError("block_size, num_blocks and tp_size must be positive")

    @property
    def kv_layout(self) -> KVLayout:
        return parse_layout(self.layout)

    def check_model(self, model: ModelConfig) -> None:
        """Reject TP sizes the model's heads cannot be sharded over."""
        tp = self.tp_size
        if model.q_heads % tp:
            raise ConfigError(f"q_heads {model.q_heads} cannot be split over tp_size {tp}")
        heads = model.cached_kv_heads
        if max(tp, heads) % min(tp, heads):
            raise ConfigError(f"kv heads {heads} and tp_size {tp} must divide one another")
        if model.mla and self.kv_split:
            raise ConfigError("an MLA latent cache has no K/V halves to split")
