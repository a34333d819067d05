"""The reference engine: a scheduler (block tables, prefix reuse) driving TP ranks.

:class:`Engine` runs the dense parts of the model (embedding, norms, MLP, LM head) and asks
its :class:`RankGroup` for the attention of each layer; every rank returns its query heads'
output shares and the engine adds them in global head order, a fixed-order all-reduce.
Decoding is greedy.

The engine speaks in tokens and *steps*: :meth:`Engine.admit` allocates a request (taking
prefix-cache hits), :meth:`Engine.step` computes every token not yet in the cache and
appends the greedy next token. That one verb serves all three roles of disaggregated
serving:

* monolithic: ``admit`` + ``step`` x ``max_tokens`` (see :meth:`Engine.generate`);
* prefill (P): ``admit`` + one ``step``; the prompt's blocks stay allocated until kvwire
  says the consumer has them (:meth:`Engine.release`);
* decode (D): :meth:`Engine.admit` of the prompt, kvwire fills :meth:`Engine.blocks_to_receive`,
  :meth:`Engine.mark_received` records them (all but the last prompt token, which D
  recomputes to get the first token's logits, as vLLM does), then ``step`` as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvwire.errors import ConfigError
from kvwire.examples.engine.blocks import BlockAllocator, SequenceState
from kvwire.examples.engine.rank import RankWorker
from kvwire.examples.engine.settings import CacheConfig, ModelConfig
from kvwire.examples.engine.weights import Weights, init_weights, mlp, rms_norm
from kvwire.layout.geometry import KVGeometry


class RankGroup(Protocol):
    """The TP ranks of one engine, wherever they run."""

    def attend(
        self, layer: int, x: torch.Tensor, position: int, block_ids: list[int]
    ) -> torch.Tensor:
        """``[q_heads, hidden]``: every query head's output share, in global head order."""
        ...

    def geometries(self) -> list[KVGeometry]:
        """Each rank's KV cache as kvwire sees it, in rank order."""
        ...

    def close(self) -> None: ...


class LocalRanks:
    """All ranks in this process, each with its own KV buffers (the head split is physical)."""

    def __init__(self, model: ModelConfig, cache: CacheConfig, weights: Weights) -> None:
        self.workers = [RankWorker(model, cache, r, weights) for r in range(cache.tp_size)]

    def attend(
        self, layer: int, x: torch.Tensor, position: int, block_ids: list[int]
    ) -> torch.Tensor:
        return torch.cat([w.attend(layer, x, position, block_ids) for w in self.workers], dim=0)

    def geometries(self) -> list[KVGeometry]:
        return [w.kv.geometry() for w in self.workers]

    def close(self) -> None:
        self.workers = []


class Engine:
    """A paged-attention decoder with greedy sampling; see the module docstring."""

    def __init__(
        self,
        model: ModelConfig,
        cache: CacheConfig,
        *,
        ranks: RankGroup | None = None,
        weights: Weights | None = None,
    ) -> None:
        cache.check_model(model)
        torch.set_num_threads(1)
        self.model = model
        self.cache = cache
        self.weights = init_weights(model) if weights is None else weights
        self.ranks: RankGroup = LocalRanks(model, cache, self.weights) if ranks is None else ranks
        self.allocator = BlockAllocator(
            cache.num_blocks, cache.block_size, prefix_caching=cache.prefix_caching
        )
        self.requests: dict[str, SequenceState] = {}

    # -- requests -------------------------------------------------------------------------

    def admit(self, request_id: str, prompt: Sequence[int]) -> SequenceState:
        """Allocate a request's prompt blocks, reusing cached prefix blocks."""
        if request_id in self.requests:
            raise ConfigError(f"request {request_id!r} is already admitted")
        if not prompt:
            raise ConfigError(f"request {request_id!r} has an empty prompt")
        bad = [t for t in prompt if not 0 <= int(t) < self.model.vocab_size]
        if bad:
            raise ConfigError(
                f"token {bad[0]} is outside the vocabulary of {self.model.vocab_size}"
            )
        seq = self.allocator.admit(request_id, prompt)
        self.requests[request_id] = seq
        return seq

    def release(self, request_id: str) -> None:
        """Free a request's blocks (they stay in the prefix cache until reused)."""
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            self.allocator.release(seq)

    def blocks_to_receive(self, request_id: str) -> list[int]:
        """D: the request's blocks a producer must fill (everything after prefix hits)."""
        seq = self.requests[request_id]
        return seq.block_ids[seq.num_cached // self.cache.block_size :]

    def mark_received(self, request_id: str) -> None:
        """D: the producer's KV has landed; all prompt tokens but the last count as computed."""
        seq = self.requests[request_id]
        seq.num_computed = max(seq.num_computed, len(seq.tokens) - 1)
        self.allocator.publish(seq)

    # -- compute --------------------------------------------------------------------------

    def step(self, request_id: str, *, max_tokens: int | None = None) -> int | None:
        """Compute uncomputed tokens (at most ``max_tokens`` of them: chunked prefill);
        once every token is cached, append and return the greedy next token, else None."""
        seq = self.requests[request_id]
        end = len(seq.tokens)
        if max_tokens is not None:
            end = min(end, seq.num_computed + max_tokens)
        self.allocator.grow(seq, end)
        logits = None
        for position in range(seq.num_computed, end):
            logits = self.forward_token(seq.tokens[position], position, seq.block_ids)
            seq.num_computed = position + 1
        self.allocator.publish(seq)
        if seq.num_computed < len(seq.tokens) or logits is None:
            return None
        token = int(torch.argmax(logits).item())
        seq.tokens.append(token)
        return token

    def forward_token(self, token: int, position: int, block_ids: list[int]) -> torch.Tensor:
        """Logits after ``token`` at ``position``; caches its KV on every rank."""
        w = self.weights
        eps = self.model.norm_eps
        h = w.embed[token][None, :].clone()
        for index, layer in enumerate(w.layers):
            shares = self.ranks.attend(
                index, rms_norm(h, layer.attn_norm, eps), position, block_ids
            )
            attn = shares[0:1].clone()
            for head in range(1, shares.shape[0]):
                attn = attn + shares[head : head + 1]
            h = h + attn
            h = h + mlp(rms_norm(h, layer.mlp_norm, eps), layer)
        return (rms_norm(h, w.final_norm, eps) @ w.lm_head)[0]

    def generate(
        self, prompt: Sequence[int], max_tokens: int, *, request_id: str = ""
    ) -> list[int]:
        """Monolithic greedy generation of ``max_tokens`` tokens; frees the request after."""
        rid = request_id or f"gen-{len(self.requests)}-{id(prompt)}"
        self.admit(rid, prompt)
        try:
            out = []
            for _ in range(max_tokens):
                token = self.step(rid)
                assert token is not None
                out.append(token)
            return out
        finally:
            self.release(rid)

    def geometries(self) -> list[KVGeometry]:
        return self.ranks.geometries()

    def close(self) -> None:
        self.ranks.close()
