"""The random descriptor sets the suite moves, beside the oracle memory access it uses.

The oracle itself (``view``, ``pattern``, ``gather``, ``scatter``, ``read_descs``,
``reader``, ``allocate``) lives in :mod:`kvwire.peer.memory`, shared with ``kvwire bench``;
it is re-exported here so ``kvwire_conformance.memory`` keeps its names.
"""

from __future__ import annotations

import functools
import mmap

import numpy as np

from kvwire.peer.memory import (
    I64,
    U8,
    allocate,
    gather,
    pattern,
    read_descs,
    reader,
    scatter,
    view,
)

__all__ = [
    "DEFAULT_ALLOCATORS",
    "I64",
    "U8",
    "allocate",
    "anonymous_mmap",
    "cached_pattern",
    "descs",
    "gather",
    "pattern",
    "place",
    "random_spans",
    "read_descs",
    "reader",
    "scatter",
    "view",
]


DEFAULT_ALLOCATORS = ("numpy", "kvwire_conformance.memory:anonymous_mmap")
"""Host memory every adapter is tested over, whatever its factory declares: numpy's heap
and a page-aligned private mapping of its own (no slack before the first byte)."""


def anonymous_mmap(nbytes: int) -> U8:
    """A zeroed, page-aligned, private anonymous mapping as a uint8 array (kept mapped
    while the array lives)."""
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


@functools.lru_cache(maxsize=4)
def cached_pattern(seed: int, nbytes: int) -> U8:
    """:func:`pattern`, kept for the few seeds a test reuses (read-only arrays)."""
    return pattern(seed, nbytes)


def random_spans(
    rng: np.random.Generator, region_bytes: int, count: int, min_len: int, max_len: int
) -> tuple[I64, I64]:
    """``count`` non-overlapping spans at unaligned offsets inside a region, in random order.

    The region is cut into ``count`` equal slots; each span sits at a random offset in a
    randomly chosen slot, so spans never overlap and their order is shuffled.
    """
    lengths = rng.integers(min_len, max_len + 1, size=count, dtype=np.int64)
    return place(rng, region_bytes, lengths), lengths


def place(rng: np.random.Generator, region_bytes: int, lengths: I64) -> I64:
    """Random non-overlapping, shuffled, unaligned offsets for spans of ``lengths``."""
    count = lengths.shape[0]
    slot = region_bytes // count
    if int(lengths.max()) > slot:
        raise ValueError(f"{count} spans of up to {lengths.max()} B do not fit {region_bytes} B")
    slots = rng.permutation(count).astype(np.int64)
    jitter = (rng.random(count) * (slot - lengths + 1)).astype(np.int64)
    offsets: I64 = slots * slot + jitter
    return offsets


def descs(addr: int, offsets: I64, lengths: I64, device: int = 0) -> I64:
    """A descriptor array for spans of a region that starts at ``addr``."""
    out = np.empty((offsets.shape[0], 3), dtype=np.int64)
    out[:, 0] = addr + offsets
    out[:, 1] = lengths
    out[:, 2] = device
    return out
