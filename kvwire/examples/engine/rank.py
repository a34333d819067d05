"""One tensor-parallel rank: the attention of its heads over its own paged KV cache.

A rank owns ``q_heads / tp`` query heads and the KV heads they read (GQA: with more ranks
than KV heads, several ranks hold the same KV head, each in its own buffer). For one token
and one layer it projects its heads, writes their K/V (or, for MLA, the latent it
replicates) into its cache, attends over the request's blocks, and returns each query
head's share of the output projection. The driver sums the shares in global head order.

Everything is computed one token at a time with per-head calls of fixed shapes, so a token's
result depends only on the tokens before it: not on the TP size, the layout, how the prompt
was chunked, which blocks came from a prefix cache or from another engine.
"""

from __future__ import annotations

import math

import torch

from kvwire.examples.engine.kvcache import RankKVCache, fresh
from kvwire.examples.engine.settings import CacheConfig, ModelConfig
from kvwire.examples.engine.weights import Weights, apply_rope, rope_tables


def query_heads(model: ModelConfig, tp_rank: int, tp_size: int) -> tuple[int, ...]:
    """The query heads of a rank: an even, contiguous share."""
    per_rank = model.q_heads // tp_size
    return tuple(range(tp_rank * per_rank, (tp_rank + 1) * per_rank))


def cached_heads(model: ModelConfig, tp_rank: int, tp_size: int) -> tuple[int, ...]:
    """The KV heads a rank caches: exactly those its query heads read (MLA: the latent)."""
    if model.mla:
        return (0,)
    group = model.q_heads // model.kv_heads
    return tuple(sorted({q // group for q in query_heads(model, tp_rank, tp_size)}))


class RankWorker:
    """Attention for one rank's heads, over that rank's :class:`RankKVCache`."""

    def __init__(
        self, model: ModelConfig, cache: CacheConfig, tp_rank: int, weights: Weights
    ) -> None:
        cache.check_model(model)
        self.model = model
        self.config = cache
        self.tp_rank = tp_rank
        self.weights = weights
        self.q_heads = query_heads(model, tp_rank, cache.tp_size)
        self.kv = RankKVCache(model, cache, tp_rank, cached_heads(model, tp_rank, cache.tp_size))

    def attend(
        self, layer: int, x: torch.Tensor, position: int, block_ids: list[int]
    ) -> torch.Tensor:
        """Cache token ``position``'s KV from the normalised input ``x`` (``[1, hidden]``)
        and return ``[len(q_heads), hidden]``: each local query head's output share."""
        bs = self.config.block_size
        self.kv.write(
            layer, block_ids[position // bs], position % bs, self._new_kv(layer, x, position)
        )
        cached = self.kv.gather(layer, block_ids[: position // bs + 1], position + 1)
        if self.model.mla:
            return self._attend_latent(layer, x, position, cached)
        return self._attend_dense(layer, x, position, cached)

    def _rope(self, position: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(torch.tensor([position]), dim, self.model.rope_base)

    def _new_kv(self, layer: int, x: torch.Tensor, position: int) -> torch.Tensor:
        """``[cached heads, content]`` for the new token."""
        w = self.weights.layers[layer]
        if self.model.mla:
            assert w.w_dkv is not None and w.w_kr is not None
            cos, sin = self._rope(position, self.model.rope_dim)
            return torch.cat((x @ w.w_dkv, apply_rope(x @ w.w_kr, cos, sin)), dim=-1)
        cos, sin = self._rope(position, self.model.head_dim)
        rows = [
            torch.cat((apply_rope(x @ w.wk[g], cos, sin), x @ w.wv[g]), dim=-1)
            for g in self.kv.heads
        ]
        return torch.cat(rows, dim=0)

    def _attend_dense(
        self, layer: int, x: torch.Tensor, position: int, cached: torch.Tensor
    ) -> torch.Tensor:
        w = self.weights.layers[layer]
        d = self.model.head_dim
        cos, sin = self._rope(position, d)
        keys = [fresh(cached[j, :, :d]) for j in range(len(self.kv.heads))]
        values = [fresh(cached[j, :, d:]) for j in range(len(self.kv.heads))]
        group = self.model.q_heads // self.model.kv_heads
        scale = 1.0 / math.sqrt(d)
        shares = []
        for q_head in self.q_heads:
            j = self.kv.heads.index(q_head // group)
            query = apply_rope(x @ w.wq[q_head], cos, sin)
            scores = torch.mv(keys[j], query[0]) * scale
            probs = torch.softmax(scores, dim=0)
            out = probs[None, :] @ values[j]
            shares.append(out @ w.wo[q_head])
        return torch.cat(shares, dim=0)

    def _attend_latent(
        self, layer: int, x: torch.Tensor, position: int, cached: torch.Tensor
    ) -> torch.Tensor:
        w = self.weights.layers[layer]
        d, r = self.model.head_dim, self.model.latent_dim
        cos, sin = self._rope(position, self.model.rope_dim)
        latent, rope_keys = fresh(cached[0, :, :r]), fresh(cached[0, :, r:])
        scale = 1.0 / math.sqrt(d + self.model.rope_dim)
        shares = []
        for q_head in self.q_heads:
            query = x @ w.wq[q_head]
            q_content = fresh(query[:, :d])
            q_rope = apply_rope(query[:, d:], cos, sin)
            keys = latent @ w.w_uk[q_head]
            values = latent @ w.w_uv[q_head]
            scores = (torch.mv(keys, q_content[0]) + torch.mv(rope_keys, q_rope[0])) * scale
            probs = torch.softmax(scores, dim=0)
            shares.append((probs[None, :] @ values) @ w.wo[q_head])
        return torch.cat(shares, dim=0)
