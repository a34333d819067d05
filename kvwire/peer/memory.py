"""Oracle access to a process's memory, by address, with numpy.

The oracle reads and writes memory straight through numpy, never through the transport
being driven, so a transport cannot vouch for itself: the peer process answers its
commander's reads and fills this way, and checkers compare against the same bytes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]

_LOOP_LIMIT = 4096
"""Above this many spans, gather/scatter through one index vector instead of slices."""


def view(addr: int, nbytes: int) -> U8:
    """A writable uint8 view of ``nbytes`` of this process's memory at ``addr``."""
    buf = (ctypes.c_uint8 * nbytes).from_address(addr)
    return np.frombuffer(memoryview(buf), dtype=np.uint8)


def pattern(seed: int, nbytes: int) -> U8:
    """Deterministic random bytes: the same in every process for the same seed."""
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8)


def _index(offsets: I64, lengths: I64) -> I64:
    total = int(lengths.sum())
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(offsets, lengths) + within


def gather(buf: U8, offsets: I64, lengths: I64) -> U8:
    """The bytes of every span ``buf[offsets[i] : offsets[i] + lengths[i]]``, concatenated."""
    if offsets.shape[0] == 0:
        return np.zeros(0, dtype=np.uint8)
    if offsets.shape[0] > _LOOP_LIMIT:
        return buf[_index(offsets, lengths)]
    spans = zip(offsets.tolist(), lengths.tolist(), strict=True)
    return np.concatenate([buf[o : o + n] for o, n in spans])


def scatter(buf: U8, offsets: I64, lengths: I64, data: U8) -> None:
    """Inverse of :func:`gather`: write ``data`` span by span into ``buf``."""
    if offsets.shape[0] == 0:
        return
    if offsets.shape[0] > _LOOP_LIMIT:
        buf[_index(offsets, lengths)] = data
        return
    pos = 0
    for o, n in zip(offsets.tolist(), lengths.tolist(), strict=False):
        buf[o : o + n] = data[pos : pos + n]
        pos += n


def read_descs(descs: I64) -> bytes:
    """Oracle read of every ``(addr, length, dev)`` row of this process, concatenated."""
    return reader(descs)()


def reader(descs: I64) -> Callable[[], bytes]:
    """A prepared oracle read: all bookkeeping done now, so calling it only copies bytes.

    Lets a peer check memory the instant a notification arrives.
    """
    if descs.shape[0] == 0:
        return lambda: b""
    base = int(descs[:, 0].min())
    span = int((descs[:, 0] + descs[:, 1]).max()) - base
    buf = view(base, span)
    offsets, lengths = descs[:, 0] - base, descs[:, 1]
    if offsets.shape[0] > _LOOP_LIMIT:
        index = _index(offsets, lengths)
        return lambda: buf[index].tobytes()
    return lambda: gather(buf, offsets, lengths).tobytes()


def allocate(spec: str, nbytes: int) -> Any:
    """Host memory from an allocator spec: ``numpy`` or ``module:function(nbytes)``."""
    if spec == "numpy":
        return np.zeros(nbytes, dtype=np.uint8)
    module_name, _, attr = spec.partition(":")
    module = __import__(module_name, fromlist=[attr])
    array = getattr(module, attr)(nbytes)
    return array
