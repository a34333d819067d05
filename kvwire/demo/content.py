"""KV content the demo can check byte for byte: every value encodes where it belongs.

A 16-bit value is a mix of the request, the layer, the global KV head, the token position
and the element index, so a byte landing in the wrong request, layer, head, token or offset
is caught. P fills its blocks with it; D recomputes it for *its* heads and compares. Both
sides use only this function, never the descriptor code, so the check is independent of
what is being checked.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import numpy.typing as npt

from kvwire.demo.models import CacheSpec
from kvwire.layout.geometry import rank_heads

U16 = npt.NDArray[np.uint16]
Memory = npt.NDArray[np.uint8] | U16
"""A rank's KV as :func:`blocks_view` takes it."""


def expected(spec: CacheSpec, request_index: int, num_blocks: int) -> U16:
    """The rank's view of a request's KV: ``[layers, blocks, heads, tokens, elements]``."""
    return _pattern(spec, num_blocks) + _seed(request_index)


def _seed(request_index: int) -> np.uint16:
    return np.uint16((request_index * 40503 + 17) & 0xFFFF)


@lru_cache(maxsize=8)
def _pattern(spec: CacheSpec, num_blocks: int) -> U16:
    """Everything but the request's seed; the same for every request of a length."""
    elements = spec.model.content_bytes // 2
    if spec.model.mla:
        heads = np.zeros(1, dtype=np.uint32)
    else:
        heads = rank_heads(spec.tp_rank, spec.tp_size, spec.model.kv_heads).astype(np.uint32)
    layer = np.arange(spec.layers, dtype=np.uint32) * np.uint32(2654)
    tokens = spec.block_tokens
    pos = np.arange(num_blocks * tokens, dtype=np.uint32).reshape(num_blocks, tokens)
    elem = np.arange(elements, dtype=np.uint32)
    value = (
        layer[:, None, None, None, None]
        + (heads * np.uint32(977))[None, None, :, None, None]
        + (pos * np.uint32(131))[None, :, None, :, None]
        + (elem * np.uint32(7))[None, None, None, None, :]
    )
    pattern: U16 = np.asarray(value, dtype=np.uint16)
    pattern.flags.writeable = False
    return pattern


def blocks_view(spec: CacheSpec, buffer: Memory) -> U16:
    """The rank's KV memory as ``[layers, num_blocks, heads, tokens, elements]`` uint16.

    ``buffer`` is either the rank's bytes packed layer after layer, heads before tokens
    (vLLM's LBHNC, what the demo allocates), or already that 5-axis view: a strided one is
    how a caller with another layout (interop/vllm_engine.py) has its bytes checked where
    that layout puts them.
    """
    elements = spec.model.content_bytes // 2
    if buffer.ndim == 5:
        shape = (spec.layers, spec.num_blocks, spec.heads_here, spec.block_tokens, elements)
        if buffer.dtype != np.uint16 or buffer.shape != shape:
            raise ValueError(f"a KV view must be uint16 {shape}, got {buffer.dtype} {buffer.shape}")
        return buffer.view(np.uint16)  # the same array, typed as what it is
    flat = buffer[: spec.total_bytes].view(np.uint16)
    return flat.reshape(spec.layers, spec.num_blocks, spec.heads_here, spec.block_tokens, elements)


def fill(spec: CacheSpec, buffer: Memory, request_index: int, blocks: list[int]) -> None:
    """Write a request's KV into its blocks (what a prefill would have computed)."""
    view = blocks_view(spec, buffer)
    index = np.asarray(blocks, dtype=np.int64)
    if _contiguous(index):
        np.add(
            _pattern(spec, len(blocks)), _seed(request_index), out=view[:, index[0] : index[-1] + 1]
        )
    else:
        view[:, index] = expected(spec, request_index, len(blocks))


def count_wrong_bytes(
    spec: CacheSpec, buffer: Memory, request_index: int, blocks: list[int]
) -> tuple[int, int]:
    """``(wrong bytes, checked bytes)`` of a request's KV in this rank's blocks."""
    view = blocks_view(spec, buffer)
    index = np.asarray(blocks, dtype=np.int64)
    got = view[:, index[0] : index[-1] + 1] if _contiguous(index) else view[:, index]
    # Subtracting the seed (mod 2**16) leaves the pattern exactly when every value is right.
    unseeded = got - _seed(request_index)
    pattern = _pattern(spec, len(blocks))
    if np.array_equal(unseeded, pattern):
        return 0, int(pattern.nbytes)
    wrong = unseeded.view(np.uint8) != pattern.view(np.uint8)
    return int(np.count_nonzero(wrong)), int(pattern.nbytes)


def _contiguous(index: npt.NDArray[np.int64]) -> bool:
    return (
        bool(index.size)
        and int(index[-1]) - int(index[0]) + 1 == index.size
        and bool((np.diff(index) == 1).all())
    )


def scribble(spec: CacheSpec, buffer: Memory, blocks: list[int]) -> None:
    """Overwrite blocks with a pattern no request produces, so stale data cannot pass."""
    view = blocks_view(spec, buffer)
    view[:, np.asarray(blocks, dtype=np.int64)] = 0xDEAD
