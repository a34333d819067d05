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

import bisect
import collections
import ctypes
import itertools
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]

GROUP_BYTES = 4 << 20
"""Bytes copied per group: the longest the worker keeps the GIL in one stretch (~0.3 ms),
and how often a running transfer checks whether it was released."""
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


def group_bounds(ends: list[int]) -> list[int]:
    """Where each group of about GROUP_BYTES starts, then the span count, given the running
    totals ``ends`` of the span lengths; a span never splits, so one larger than a group
    is a group of its own."""
    n = len(ends)
    bounds = [0]
    while bounds[-1] < n:
        start = bounds[-1]
        limit = (ends[start - 1] if start else 0) + GROUP_BYTES
        bounds.append(max(start + 1, bisect.bisect_right(ends, limit, lo=start)))
    return bounds


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
    bounds = group_bounds(list(itertools.accumulate(ln)))
    some_large = max(ln) >= RELEASE_AT
    sink: collections.deque[object] = collections.deque(maxlen=0)
    for a, b in itertools.pairwise(bounds):
        if aborted():
            return False
        if a > 0 or b < n:
            gd, gs, gn = d[a:b], s[a:b], ln[a:b]
        else:
            gd, gs, gn = d, s, ln
        large = some_large and max(gn) >= RELEASE_AT
        sink.extend(map(_memmove_dropping_gil if large else _memmove_keeping_gil, gd, gs, gn))
    return True
