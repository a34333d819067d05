"""Copies between two views mapped in this process: many spans, little interpreter time each.

A Python loop of ``ctypes.memmove`` costs about 0.4 us per span (argument conversion,
dropping and retaking the GIL), which is 10% of the time of a 64 KiB copy. Here the spans
of a group are copied by ``map`` over a memmove that keeps the GIL, so the iteration runs
in C (about 0.15 us per span) and the caller's thread cannot take the GIL between two
spans and hold the copy hostage to its switch interval. A group is bounded in bytes, so a
caller that wants the GIL waits for one group at most; groups holding a large span drop the
GIL for each call instead, letting the caller's thread run alongside a long copy. Spans
averaging under a few dozen bytes are gathered with numpy index arithmetic, which beats
one call per span there.
"""

from __future__ import annotations

import collections
import ctypes
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]

GROUP_BYTES = 1 << 20
"""Bytes copied per group: the longest the worker keeps the GIL in one stretch (~0.1 ms)."""
RELEASE_AT = 256 << 10
"""A group holding a span this large drops the GIL for each of its copies."""
GATHER_BELOW = 32
"""Mean span length under which one numpy gather/scatter beats one memmove per span."""

_MEMMOVE_ADDR: int = ctypes.cast(ctypes.memmove, ctypes.c_void_p).value or 0
_SIGNATURE = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memmove_keeping_gil = ctypes.PYFUNCTYPE(*_SIGNATURE)(_MEMMOVE_ADDR)
_memmove_dropping_gil = ctypes.CFUNCTYPE(*_SIGNATURE)(_MEMMOVE_ADDR)


def _view(base: int, span: int) -> npt.NDArray[np.uint8]:
    buf = (ctypes.c_uint8 * span).from_address(base)
    return np.frombuffer(memoryview(buf), dtype=np.uint8)


def gather_copy(dst: I64, src: I64, length: I64) -> None:
    """Copy many tiny spans with vectorized index operations, no call per span."""
    total = int(length.sum())
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(length) - length, length)
    d_base, s_base = int(dst.min()), int(src.min())
    d_view = _view(d_base, int((dst + length).max()) - d_base)
    s_view = _view(s_base, int((src + length).max()) - s_base)
    d_view[np.repeat(dst - d_base, length) + within] = s_view[
        np.repeat(src - s_base, length) + within
    ]


def group_starts(length: I64) -> I64:
    """Index of the first span of each group of about GROUP_BYTES (a span never splits)."""
    offsets = np.cumsum(length) - length
    bucket = offsets // GROUP_BYTES
    starts = np.flatnonzero(bucket[1:] != bucket[:-1]) + 1
    return np.concatenate(([0], starts)).astype(np.int64)


def copy_spans(dst: I64, src: I64, length: I64, aborted: Callable[[], bool]) -> bool:
    """``memmove(dst[i], src[i], length[i])`` for every i; False if ``aborted()`` turned
    true between two groups (the remaining spans are not copied)."""
    n = int(length.shape[0])
    if n == 0:
        return True
    if n > 64 and int(length.sum()) < GATHER_BELOW * n:
        if aborted():
            return False
        gather_copy(dst, src, length)
        return True
    d, s, ln = dst.tolist(), src.tolist(), length.tolist()
    if sum(ln) <= GROUP_BYTES:  # one group: skip the grouping arithmetic
        if aborted():
            return False
        collections.deque(map(_memmove_keeping_gil, d, s, ln), maxlen=0)
        return True
    starts = group_starts(length)
    dropping = (np.maximum.reduceat(length, starts) >= RELEASE_AT).tolist()
    bounds = [*starts.tolist(), n]
    sink: collections.deque[object] = collections.deque(maxlen=0)
    for g, drop in enumerate(dropping):
        if aborted():
            return False
        a, b = bounds[g], bounds[g + 1]
        move = _memmove_dropping_gil if drop else _memmove_keeping_gil
        sink.extend(map(move, d[a:b], s[a:b], ln[a:b]))
    return True
