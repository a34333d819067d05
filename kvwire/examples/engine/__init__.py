"""A reference serving engine for kvwire: a small paged-attention transformer in torch (CPU).

Needs torch (``pip install 'kvwire[torch]'``); ``import kvwire`` never imports this package.
It exists to prove, by generation, that kvwire moves the *right* bytes: prefill on one
engine, decode on another with a different TP size or cache layout, and the greedy tokens
equal those of one engine doing both. See docs/engine-integration.md.
"""

from __future__ import annotations

from kvwire.examples.engine.blocks import BlockAllocator, OutOfBlocksError, SequenceState
from kvwire.examples.engine.engine import Engine, LocalRanks, RankGroup
from kvwire.examples.engine.kvcache import RankKVCache
from kvwire.examples.engine.rank import RankWorker, cached_heads, query_heads
from kvwire.examples.engine.settings import CacheConfig, ModelConfig
from kvwire.examples.engine.weights import Weights, init_weights

__all__ = [
    "BlockAllocator",
    "CacheConfig",
    "Engine",
    "LocalRanks",
    "ModelConfig",
    "OutOfBlocksError",
    "RankGroup",
    "RankKVCache",
    "RankWorker",
    "SequenceState",
    "Weights",
    "cached_heads",
    "init_weights",
    "query_heads",
]
