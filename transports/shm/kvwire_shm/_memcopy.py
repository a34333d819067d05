"""Copies between two views mapped in this process, cut into chunks that threads share.

A transfer's spans are grouped into chunks of about CHUNK_BYTES, each one call that the
worker, or a thread helping it (see :mod:`kvwire_shm._executor`), runs. Inside a chunk
the spans are copied by ``map`` over a ctypes ``memmove``, so the iteration runs in C:

* in a transfer of SHARE_FROM bytes or more whose spans average CONCURRENT_FROM or more,
  each copy drops the GIL (~0.4 us a call) so two threads copy at once: out of cache one
  thread moves scattered 64 KiB spans at about half the machine's bandwidth;
* spans averaging RELEASE_FROM or more drop it too, so a long copy never holds off the
  caller's thread;
* other spans keep the GIL (~0.15 us a call): a second thread would only take turns,
  paying a thread wake-up to take the GIL back each time (measured at 16 MiB of 64 KiB
  spans: no gain from sharing, see SHARE_FROM);
* spans averaging under GATHER_BELOW bytes are gathered with numpy index arithmetic,
  which beats one call per span there.

With the C helper (``_native``) :func:`native_chunks` makes the same chunks, each one C
call over all its spans with the GIL released, streaming long spans past the cache.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import functools
import itertools
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from kvwire_shm._native_load import NATIVE

I64 = npt.NDArray[np.int64]

CHUNK_BYTES = 2 << 20
"""Bytes per chunk: small enough that two threads share a 16 MiB READ evenly and a
release is noticed within ~0.2 ms, large enough that claiming one (a few us) is noise."""
CONCURRENT_FROM = 16 << 10
"""Mean span length from which a shared transfer's copies drop the GIL."""
SHARE_FROM = 32 << 20
"""Transfer size from which a second thread helps: below it the bytes sit in cache and one
thread copies as fast as two (measured: 16 MiB of 64 KiB spans, 10.9 vs 11.0 GB/s), above
it copies wait on memory and two threads move ~1.5x (64 MiB: 10.0 vs 6.8 GB/s)."""
RELEASE_FROM = 256 << 10
"""Mean span length from which even a copy not shared drops the GIL for each span, so the
caller's thread is not held off for a whole chunk."""
GATHER_BELOW = 32
"""Mean span length under which one numpy gather/scatter beats one memmove per span."""

NT_SPAN_FROM = 4 << 10
"""Span length from which the C helper writes with streaming stores (measured: 256 spans of
4 KiB, 1.6x glibc's memmove; 64 KiB spans 1.2-1.5x; 2 MiB spans 1.6x)."""
NT_TRANSFER_FROM = 512 << 10
"""Transfer size from which streaming stores are used: a smaller one fits in one core's
L2 cache, where a reader finds it soon after."""

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


def group_bounds(ends: list[int], limit: int = CHUNK_BYTES, most: int | None = None) -> list[int]:
    """Where each group of about ``limit`` bytes (and at most ``most`` spans) starts, then
    the span count, given the running totals ``ends`` of the span lengths; a span never
    splits, so one larger than ``limit`` is a group of its own."""
    n = len(ends)
    bounds = [0]
    while bounds[-1] < n:
        start = bounds[-1]
        stop = bisect.bisect_right(ends, (ends[start - 1] if start else 0) + limit, lo=start)
        if most is not None:
            stop = min(stop, start + most)
        bounds.append(max(start + 1, stop))
    return bounds


def _memmove_all(
    move: Callable[[int, int, int], object], dst: list[int], src: list[int], length: list[int]
) -> None:
    collections.deque(map(move, dst, src, length), maxlen=0)


def split_long(dst: I64, src: I64, length: I64, *, same_space: bool = True) -> tuple[I64, I64, I64]:
    """Spans longer than CHUNK_BYTES cut into CHUNK_BYTES pieces, so one long span is shared
    by threads too. In one address space (``same_space``) a span whose source and
    destination overlap stays whole: memmove copies it as a unit."""
    cut = length > CHUNK_BYTES
    if same_space:
        cut &= np.abs(dst - src) >= length
    if not cut.any():
        return dst, src, length
    pieces = np.where(cut, -(-length // CHUNK_BYTES), 1)
    which = np.repeat(np.arange(length.shape[0]), pieces)
    offset = (np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * (
        CHUNK_BYTES
    )
    rest = length[which] - offset
    return (
        dst[which] + offset,
        src[which] + offset,
        np.where(cut[which], np.minimum(rest, CHUNK_BYTES), rest),
    )


def native_chunks(dst: I64, src: I64, length: I64) -> tuple[list[Callable[[], object]], bool]:
    """:func:`chunks` through the C helper: one call per chunk, the GIL released for all of
    it, so sharing pays from the same sizes on without a cost per span. Streaming stores
    for spans of NT_SPAN_FROM bytes or more in transfers of NT_TRANSFER_FROM or more."""
    assert NATIVE is not None
    n = int(length.shape[0])
    if n == 0:
        return [], False
    total = int(length.sum())
    dst, src, length = split_long(dst, src, length)
    flat = functools.partial(np.ascontiguousarray, dtype=np.int64)
    dst, src, length = flat(dst), flat(src), flat(length)
    bounds = group_bounds(list(itertools.accumulate(length.tolist())))
    return planned_chunks(dst, src, length, bounds, total=total, merged=n)


def planned_chunks(
    dst: I64, src: I64, length: I64, bounds: list[int], *, total: int, merged: int
) -> tuple[list[Callable[[], object]], bool]:
    """:func:`native_chunks` of spans already cut and grouped (``bounds``, as
    :func:`group_bounds` makes them, or the C helper's ``plan``): ``total`` bytes in
    ``merged`` spans before long ones were cut decide sharing and streaming."""
    assert NATIVE is not None
    concurrent = total >= SHARE_FROM and total >= CONCURRENT_FROM * merged
    nt_from = NT_SPAN_FROM if total >= NT_TRANSFER_FROM else -1
    copy = NATIVE.copy
    out: list[Callable[[], object]] = [
        functools.partial(copy, dst, src, length, nt_from, a, b)
        for a, b in itertools.pairwise(bounds)
    ]
    return out, concurrent


def copy_few(dst: list[int], src: list[int], length: list[int]) -> None:
    """Copy a few spans given as lists (a small transfer, on the caller's thread)."""
    if NATIVE is not None:
        NATIVE.copy(dst, src, length, -1)
    else:
        _memmove_all(_memmove_keeping_gil, dst, src, length)


def chunks(dst: I64, src: I64, length: I64) -> tuple[list[Callable[[], object]], bool]:
    """Calls that together do ``memmove(dst[i], src[i], length[i])`` for every i, in any
    order (the spans must not overlap each other), and whether they run well on several
    threads at once."""
    if int(length.shape[0]) == 0:
        return [], False
    total = int(length.sum())
    concurrent = total >= SHARE_FROM and total >= CONCURRENT_FROM * int(length.shape[0])
    dst, src, length = split_long(dst, src, length)
    d, s, ln = dst.tolist(), src.tolist(), length.tolist()
    ends = list(itertools.accumulate(ln))
    out: list[Callable[[], object]] = []
    for a, b in itertools.pairwise(group_bounds(ends)):
        size = ends[b - 1] - (ends[a - 1] if a else 0)
        if b - a > 64 and size < GATHER_BELOW * (b - a):
            out.append(functools.partial(gather_copy, dst[a:b], src[a:b], length[a:b]))
            continue
        drop = concurrent or size >= RELEASE_FROM * (b - a)
        move = _memmove_dropping_gil if drop else _memmove_keeping_gil
        out.append(functools.partial(_memmove_all, move, d[a:b], s[a:b], ln[a:b]))
    return out, concurrent
