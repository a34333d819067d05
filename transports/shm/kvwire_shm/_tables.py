"""Sorted region tables that check and translate whole descriptor arrays at once."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvwire.errors import DescriptorError
from kvwire.transport import Descs

DRAM, VRAM = 0, 1
"""Memory kinds as small integers, for vectorized masks."""

CMA, MAPPED, CUDA, LOCAL = 0, 1, 2, 3
"""How bytes of a region are reached: cross-memory attach, a mapped segment, CUDA IPC, or
directly (the region is ours)."""

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Row:
    addr: int
    length: int
    device_id: int
    kind: int
    route: int
    delta: int = 0
    """Added to an address of this region to get one usable in this process."""


class Table:
    """Regions sorted by address; ``locate`` maps each descriptor to the region holding it.

    Summary flags (``has_vram``, ``route``) let a transfer over a uniform table skip the
    per-descriptor route and kind lookups: most agents register one kind of memory.
    """

    def __init__(self, rows: Sequence[Row]) -> None:
        ordered = sorted(rows, key=lambda r: r.addr)
        self.starts = np.array([r.addr for r in ordered], dtype=np.int64)
        self.ends = np.array([r.addr + r.length for r in ordered], dtype=np.int64)
        self.devs = np.array([r.device_id for r in ordered], dtype=np.int64)
        self.kinds = np.array([r.kind for r in ordered], dtype=np.int8)
        self.routes = np.array([r.route for r in ordered], dtype=np.int8)
        self.deltas = np.array([r.delta for r in ordered], dtype=np.int64)
        self.has_vram = any(r.kind == VRAM for r in ordered)
        routes = {r.route for r in ordered}
        self.route = routes.pop() if len(routes) == 1 else -1
        """The route every region shares, or -1 when they differ."""
        self._one = (
            (ordered[0].addr, ordered[0].addr + ordered[0].length) if len(ordered) == 1 else None
        )
        self.delta = ordered[0].delta if len(ordered) == 1 else None
        """The one region's address delta, when there is one region."""
        self._start_list = self.starts.tolist()
        self._end_list = self.ends.tolist()
        self.delta_list: list[int] = self.deltas.tolist()

    def find(self, addr: int, length: int) -> int:
        """:meth:`locate` of one host descriptor in plain Python (a transfer of a few
        descriptors pays more for numpy calls than for the work): its region's index,
        or -1 when no region holds it (``locate`` then words the error)."""
        i = bisect.bisect_right(self._start_list, addr) - 1
        return i if i >= 0 and self._end_list[i] - addr >= length else -1

    def locate(self, descs: Descs, side: str) -> I64:
        """Index of the region holding each descriptor; DescriptorError names the first miss."""
        n = descs.shape[0]
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        addr = descs[:, 0]
        length = descs[:, 1]
        if self.starts.shape[0] == 0:
            raise DescriptorError(f"{side} descriptor 0 names memory but no region is registered")
        if self._one is not None and not self.has_vram:
            start, end = self._one
            if addr.min() >= start and (end - addr >= length).all():
                return np.zeros(n, dtype=np.int64)
            idx = np.where(addr >= start, 0, -1)
        else:
            idx = np.searchsorted(self.starts, addr, side="right").astype(np.int64) - 1
        safe = np.maximum(idx, 0)
        # end - addr >= length instead of addr + length <= end: no int64 overflow.
        ok = (idx >= 0) & (self.ends[safe] - addr >= length)
        if self.has_vram:
            ok &= (self.kinds[safe] != VRAM) | (descs[:, 2] == self.devs[safe])
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise DescriptorError(
                f"{side} descriptor {bad} (addr=0x{int(addr[bad]):x}, length={int(length[bad])}, "
                f"device={int(descs[bad, 2])}) is outside every registered region"
            )
        return idx
