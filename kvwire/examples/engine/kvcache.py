"""One TP rank's paged KV cache: a contiguous float32 tensor per layer, in the engine's layout.

Per layer, with ``N`` blocks of ``B`` tokens, ``H`` heads on this rank and ``C`` values a
head caches per token:

=========  ==================  ========================
layout     packed (K | V)      ``kv_split`` (K, V apart)
=========  ==================  ========================
``HND``    ``[N, H, B, C]``    ``[2, N, H, B, C/2]``
``NHD``    ``[N, B, H, C]``    ``[2, N, B, H, C/2]``
=========  ==================  ========================

Each tensor is one kvwire region (two with ``kv_split``: K then V, as vLLM registers a
FlashAttention cache), described by :meth:`RankKVCache.geometry`. Nothing in here knows about
kvwire beyond that description: kvwire moves the bytes, this module reads them back.
"""

from __future__ import annotations

import torch

from kvwire.examples.engine.settings import CacheConfig, ModelConfig
from kvwire.layout.geometry import BlockRegion, KVGeometry, RegionKind

FLOAT_BYTES = 4
BACKEND_NAME = "KVWIRE_REFERENCE"


def fresh(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy in new storage.

    BLAS kernels may pick their reduction order by alignment and strides; feeding them
    fresh, contiguous operands makes a value depend only on the numbers, not on where in a
    block or in which layout they were cached.
    """
    return x.clone(memory_format=torch.contiguous_format)


class RankKVCache:
    """The KV tensors of one rank, holding ``heads`` cached heads (global ids, in order)."""

    def __init__(
        self, model: ModelConfig, cache: CacheConfig, tp_rank: int, heads: tuple[int, ...]
    ) -> None:
        self.model = model
        self.config = cache
        self.tp_rank = tp_rank
        self.heads = heads
        n, b, h, c = cache.num_blocks, cache.block_size, len(heads), model.cache_content
        hnd = cache.kv_layout.heads_first
        shape: tuple[int, ...]
        if cache.kv_split:
            shape = (2, n, h, b, c // 2) if hnd else (2, n, b, h, c // 2)
        else:
            shape = (n, h, b, c) if hnd else (n, b, h, c)
        self.tensors = tuple(torch.zeros(shape, dtype=torch.float32) for _ in range(model.layers))

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one region."""
        parts = 2 if self.config.kv_split else 1
        content = self.model.cache_content // parts
        return len(self.heads) * self.config.block_size * content * FLOAT_BYTES

    def regions(self) -> list[BlockRegion]:
        """One region per layer (two with ``kv_split``), in layer order."""
        out = []
        length = self.block_bytes
        n = self.config.num_blocks
        for layer, tensor in enumerate(self.tensors):
            base = tensor.data_ptr()
            parts = ("k", "v") if self.config.kv_split else ("",)
            for index, part in enumerate(parts):
                name = f"layers.{layer}.{part}" if part else f"layers.{layer}"
                out.append(
                    BlockRegion(
                        base_addr=base + index * n * length,
                        block_len=length,
                        num_blocks=n,
                        mem_kind="DRAM",
                        name=name,
                        kind=RegionKind.REPLICATED if self.model.mla else RegionKind.ATTENTION,
                    )
                )
        return out

    def geometry(self) -> KVGeometry:
        """This rank's cache as kvwire sees it (what goes into ``AgentMetadata``)."""
        return KVGeometry(
            regions=self.regions(),
            kv_cache_layout=self.config.kv_layout,
            block_size=self.config.block_size,
            total_kv_heads=self.model.cached_kv_heads,
            tp_rank=self.tp_rank,
            tp_size=self.config.tp_size,
            is_mla=self.model.mla,
            attn_backend_name=BACKEND_NAME,
        )

    def write(self, layer: int, block: int, offset: int, values: torch.Tensor) -> None:
        """Store one token's ``[heads, content]`` values at ``offset`` of ``block``."""
        t = self.tensors[layer]
        hnd = self.config.kv_layout.heads_first
        if self.config.kv_split:
            half = values.shape[-1] // 2
            for part, chunk in enumerate((values[:, :half], values[:, half:])):
                if hnd:
                    t[part, block, :, offset] = chunk
                else:
                    t[part, block, offset] = chunk
        elif hnd:
            t[block, :, offset] = values
        else:
            t[block, offset] = values

    def gather(self, layer: int, blocks: list[int], num_tokens: int) -> torch.Tensor:
        """The first ``num_tokens`` tokens stored in ``blocks``, as ``[heads, tokens, content]``."""
        t = self.tensors[layer]
        index = torch.tensor(blocks, dtype=torch.long)
        hnd = self.config.kv_layout.heads_first
        h, c = len(self.heads), self.model.cache_content
        if self.config.kv_split:
            picked = t.index_select(1, index)
            # [2, nb, H, B, c/2] (HND) or [2, nb, B, H, c/2] (NHD) -> [H, nb, B, 2, c/2]
            seq = picked.permute(2, 1, 3, 0, 4) if hnd else picked.permute(3, 1, 2, 0, 4)
            return fresh(seq.reshape(h, -1, c)[:, :num_tokens])
        picked = t.index_select(0, index)
        seq = picked.permute(1, 0, 2, 3) if hnd else picked.permute(2, 0, 1, 3)
        return fresh(seq.reshape(h, -1, c)[:, :num_tokens])
