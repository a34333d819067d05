"""Descriptor arrays: the ``(address, length, device)`` rows every transport moves, and the
array operations on them that the plans and the adapters share (one coalesce, one place).

Everything here is vectorised numpy: no Python runs per block or per descriptor.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvwire.layout.geometry import SHARED_GROUP_ID

Descs = npt.NDArray[np.int64]
"""``(N, 3)`` int64 rows of ``(address, length, device_id)``."""
IntArray = npt.NDArray[np.int64]
BlockIds = Sequence[Sequence[int]] | Sequence[npt.NDArray[np.integer]]
"""Logical block ids per KV-cache group (``kv_transfer_params["remote_block_ids"]`` shape)."""


def empty_descs() -> Descs:
    return np.zeros((0, 3), dtype=np.int64)


def expand_to_kernel_blocks(logical_ids: npt.ArrayLike, ratio: int) -> IntArray:
    """Kernel block ids of logical blocks: ``id * ratio + k`` for ``k`` in ``range(ratio)``."""
    ids = np.asarray(logical_ids, dtype=np.int64).reshape(-1)
    if ratio == 1:
        return ids
    return (ids[:, None] * ratio + np.arange(ratio, dtype=np.int64)[None, :]).reshape(-1)


def descriptor_ids(
    kernel_block_ids: BlockIds,
    region_num_blocks: Sequence[int],
    region_group_ids: Sequence[int] | None = None,
) -> IntArray:
    """vLLM-style descriptor ids of region-major descriptor lists: ``offset[r] + block``.

    ``offset[r]`` is the cumulative capacity of the regions before ``r``; a region takes
    the ids of its KV-cache group, or of every group when shared. Useful to transports that
    pre-register one descriptor per block and address them by index.
    """
    groups = as_groups(kernel_block_ids)
    every = np.concatenate(groups) if groups else np.zeros(0, dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(region_num_blocks[:-1]))).astype(np.int64)
    group_ids = list(region_group_ids) if region_group_ids is not None else None
    # Every region taking the same ids is one broadcast; with several groups that holds only
    # when every region is shared (one group id of its own still picks that group's list).
    if group_ids is None or len(groups) <= 1 or set(group_ids) <= {SHARED_GROUP_ID}:
        return (offsets[:, None] + every[None, :]).reshape(-1)
    parts = [
        offsets[r] + (every if g == SHARED_GROUP_ID else groups[g]) for r, g in enumerate(group_ids)
    ]
    return np.concatenate(parts)


# ---------------------------------------------------------------------------------------
# Coalescing
# ---------------------------------------------------------------------------------------


def run_starts(joins: npt.NDArray[np.bool_]) -> IntArray:
    """Indices of the rows that begin a run, given whether each row continues the previous."""
    return np.flatnonzero(np.concatenate(([True], ~joins)))


def coalesce(local: Descs, remote: Descs) -> tuple[Descs, Descs]:
    """Merge consecutive rows that continue each other on *both* sides into one row."""
    n = local.shape[0]
    if n <= 1:
        return local, remote
    ll = local[:, 1]
    joins = (
        (local[1:, 0] == local[:-1, 0] + ll[:-1])
        & (remote[1:, 0] == remote[:-1, 0] + ll[:-1])
        & (local[1:, 2] == local[:-1, 2])
        & (remote[1:, 2] == remote[:-1, 2])
    )
    if not joins.any():
        return local, remote
    starts = run_starts(joins)
    lengths = np.add.reduceat(ll, starts)
    new_local = local[starts]
    new_remote = remote[starts]
    new_local[:, 1] = lengths
    new_remote[:, 1] = lengths
    return new_local, new_remote


def coalesce_columns(
    dst: IntArray, src: IntArray, length: IntArray
) -> tuple[IntArray, IntArray, IntArray]:
    """:func:`coalesce` for a transport that keeps spans as separate columns of one memory
    kind (no device column): merges spans contiguous on both sides and drops empty ones.

    Returns its inputs untouched when there is nothing to merge or drop (the common case of
    scattered blocks), sparing the copies; the destination side is tested first because
    alone it rules out most merges.
    """
    if not length.all():
        keep = length > 0
        dst, src, length = dst[keep], src[keep], length[keep]
    if dst.shape[0] <= 1:
        return dst, src, length
    joins = (dst + length)[:-1] == dst[1:]
    if not joins.any():
        return dst, src, length
    joins &= (src + length)[:-1] == src[1:]
    if not joins.any():
        return dst, src, length
    starts = run_starts(joins)
    return dst[starts], src[starts], np.add.reduceat(length, starts)


def coalesce_ranges(ranges: Descs) -> Descs:
    """Merge consecutive ``(address, length, device)`` rows that continue each other."""
    n = ranges.shape[0]
    if n <= 1:
        return ranges
    joins = (ranges[1:, 0] == ranges[:-1, 0] + ranges[:-1, 1]) & (ranges[1:, 2] == ranges[:-1, 2])
    if not joins.any():
        return ranges
    starts = run_starts(joins)
    out = ranges[starts]
    out[:, 1] = np.add.reduceat(ranges[:, 1], starts)
    return out


# ---------------------------------------------------------------------------------------
# Byte patterns inside one chunk
# ---------------------------------------------------------------------------------------


def as_groups(block_ids: BlockIds) -> list[IntArray]:
    return [np.asarray(g, dtype=np.int64).reshape(-1) for g in block_ids]
