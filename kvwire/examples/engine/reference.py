"""The same model computed the textbook way: whole sequence at once, no cache, no paging.

An independent check on the engine's paged, per-token, per-rank arithmetic: the engine must
agree with it to float32 tolerance and produce the same greedy tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvwire.examples.engine.settings import ModelConfig
from kvwire.examples.engine.weights import Weights, apply_rope, mlp, rms_norm, rope_tables


def _attention(cfg: ModelConfig, w: Weights, layer: int, x: torch.Tensor) -> torch.Tensor:
    lw = w.layers[layer]
    t = x.shape[0]
    positions = torch.arange(t)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    q = torch.stack([x @ m for m in lw.wq])  # [q_heads, t, query_dim]
    if cfg.mla:
        assert lw.w_dkv is not None and lw.w_kr is not None
        d = cfg.head_dim
        cos, sin = rope_tables(positions, cfg.rope_dim, cfg.rope_base)
        latent = x @ lw.w_dkv
        rope_k = apply_rope(x @ lw.w_kr, cos, sin)
        k = torch.stack([torch.cat((latent @ m, rope_k), dim=-1) for m in lw.w_uk])
        v = torch.stack([latent @ m for m in lw.w_uv])
        q = torch.cat((q[..., :d], apply_rope(q[..., d:], cos, sin)), dim=-1)
    else:
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_base)
        group = cfg.q_heads // cfg.kv_heads
        k = torch.stack([apply_rope(x @ m, cos, sin) for m in lw.wk]).repeat_interleave(group, 0)
        v = torch.stack([x @ m for m in lw.wv]).repeat_interleave(group, 0)
        q = apply_rope(q, cos, sin)
    scores = (q @ k.transpose(1, 2)) / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    heads = probs @ v  # [q_heads, t, head_dim]
    wo = torch.cat(lw.wo, dim=0)  # [q_heads * head_dim, hidden]
    return heads.transpose(0, 1).reshape(t, -1) @ wo


def reference_logits(cfg: ModelConfig, w: Weights, tokens: Sequence[int]) -> torch.Tensor:
    """``[len(tokens), vocab]`` logits of a plain causal forward pass."""
    h = w.embed[torch.tensor(list(tokens), dtype=torch.long)]
    for index, layer in enumerate(w.layers):
        h = h + _attention(cfg, w, index, rms_norm(h, layer.attn_norm, cfg.norm_eps))
        h = h + mlp(rms_norm(h, layer.mlp_norm, cfg.norm_eps), layer)
    return rms_norm(h, w.final_norm, cfg.norm_eps) @ w.lm_head


def reference_generate(
    cfg: ModelConfig, w: Weights, prompt: Sequence[int], max_tokens: int
) -> list[int]:
    """Greedy continuation by full recomputation at every step."""
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        token = int(torch.argmax(reference_logits(cfg, w, tokens)[-1]).item())
        out.append(token)
        tokens.append(token)
    return out
