"""Random weights from a seed, split per head, plus the few elementwise functions both the
paged engine and the dense reference use.

Every process that builds weights from the same :class:`ModelConfig` gets the same tensors
(one ``torch.Generator`` drawn in a fixed order). Projections are stored **per head** as
separate contiguous matrices: a rank computes exactly its heads with calls whose shapes do
not depend on the TP size, which is what keeps the engine's output TP-invariant bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvwire.examples.engine.settings import ModelConfig


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: torch.Tensor
    wq: tuple[torch.Tensor, ...]
    """Per query head ``[hidden, query_dim]``."""
    wk: tuple[torch.Tensor, ...]
    """Per KV head ``[hidden, head_dim]`` (dense attention only)."""
    wv: tuple[torch.Tensor, ...]
    wo: tuple[torch.Tensor, ...]
    """Per query head ``[head_dim, hidden]``: a head's share of the output projection."""
    w_dkv: torch.Tensor | None
    """MLA: ``[hidden, latent_dim]`` down-projection to the cached latent."""
    w_kr: torch.Tensor | None
    """MLA: ``[hidden, rope_dim]`` shared rotary key."""
    w_uk: tuple[torch.Tensor, ...]
    """MLA: per query head ``[latent_dim, head_dim]`` key up-projection."""
    w_uv: tuple[torch.Tensor, ...]
    """MLA: per query head ``[latent_dim, head_dim]`` value up-projection."""
    mlp_norm: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


@dataclass(frozen=True)
class Weights:
    embed: torch.Tensor
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor
    lm_head: torch.Tensor


def init_weights(cfg: ModelConfig) -> Weights:
    """The model's parameters, drawn from ``cfg.seed`` (no downloads, no files)."""
    gen = torch.Generator().manual_seed(cfg.seed)

    def draw(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, dtype=torch.float32) / math.sqrt(rows)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(cfg.hidden, generator=gen, dtype=torch.float32)

    def heads(count: int, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
        return tuple(draw(rows, cols) for _ in range(count))

    embed = torch.randn(cfg.vocab_size, cfg.hidden, generator=gen, dtype=torch.float32)
    layers = []
    for _ in range(cfg.layers):
        attn_norm = norm()
        wq = heads(cfg.q_heads, cfg.hidden, cfg.query_dim)
        if cfg.mla:
            wk: tuple[torch.Tensor, ...] = ()
            wv: tuple[torch.Tensor, ...] = ()
            w_dkv: torch.Tensor | None = draw(cfg.hidden, cfg.latent_dim)
            w_kr: torch.Tensor | None = draw(cfg.hidden, cfg.rope_dim)
            w_uk = heads(cfg.q_heads, cfg.latent_dim, cfg.head_dim)
            w_uv = heads(cfg.q_heads, cfg.latent_dim, cfg.head_dim)
        else:
            wk = heads(cfg.kv_heads, cfg.hidden, cfg.head_dim)
            wv = heads(cfg.kv_heads, cfg.hidden, cfg.head_dim)
            w_dkv = w_kr = None
            w_uk = w_uv = ()
        wo = heads(cfg.q_heads, cfg.head_dim, cfg.hidden)
        mlp_norm = norm()
        w_up = draw(cfg.hidden, cfg.ffn)
        w_down = draw(cfg.ffn, cfg.hidden)
        layers.append(
            LayerWeights(attn_norm, wq, wk, wv, wo, w_dkv, w_kr, w_uk, w_uv, mlp_norm, w_up, w_down)
        )
    final_norm = norm()
    lm_head = draw(cfg.hidden, cfg.vocab_size)
    return Weights(embed, tuple(layers), final_norm, lm_head)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square normalisation over the last axis."""
    scale = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x * scale * weight


def rope_tables(
    positions: torch.Tensor, dim: int, base: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of the rotary angles, ``[len(positions), dim // 2]`` float32.

    Angles are computed in float64 and rounded once, so a position's table does not depend
    on which other positions were computed with it.
    """
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    inv_freq = 1.0 / (base**exponents)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(angles).to(torch.float32), torch.sin(angles).to(torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the last axis of ``x`` (``[..., tokens, dim]``)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def mlp(x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
    """SiLU feed-forward block (no KV involved: it runs once, outside the TP ranks)."""
    return torch.nn.functional.silu(x @ layer.w_up) @ layer.w_down
