"""Vectorised descriptor bookkeeping: which registered region holds each row, and coalescing.

Both run on whole descriptor arrays with numpy, so the only per-row work left on the hot
path is the one ctypes call per (coalesced) row inside the binding.
"""

from __future__ import annotations

import bisect

import numpy as np
import numpy.typing as npt

from kvwire.errors import DescriptorError

Int64s = npt.NDArray[np.int64]


class RegionTable:
    """Registered address ranges, sorted by start, each tagged with an ``int64`` value.

    The value is whatever the caller needs per region on the hot path: the address of a
    request-parameter block naming the local ``memh``, or an unpacked remote key.
    """

    def __init__(self, starts: Int64s, lengths: Int64s, values: Int64s) -> None:
        order = np.argsort(starts, kind="stable")
        self.starts = np.ascontiguousarray(starts[order], dtype=np.int64)
        self.ends = self.starts + np.ascontiguousarray(lengths[order], dtype=np.int64)
        self.values = np.ascontiguousarray(values[order], dtype=np.int64)
        # Plain lists for the few-row path, where one numpy call costs more than the work.
        self._start_list: list[int] = self.starts.tolist()
        self._end_list: list[int] = self.ends.tolist()
        self.value_list: list[int] = self.values.tolist()

    @classmethod
    def empty(cls) -> RegionTable:
        none = np.zeros(0, dtype=np.int64)
        return cls(none, none, none)

    def __len__(self) -> int:
        return int(self.starts.shape[0])

    def find(self, addr: int, length: int, *, side: str, row: int) -> int:
        """:meth:`locate` for one row, without numpy (for transfers of a few rows)."""
        i = bisect.bisect_right(self._start_list, addr) - 1
        if i >= 0 and addr + length <= self._end_list[i]:
            return i
        for j, (start, end) in enumerate(zip(self._start_list, self._end_list, strict=True)):
            if start <= addr and addr + length <= end:
                return j
        raise DescriptorError(
            f"{side} descriptor {row} ({addr:#x}, {length} bytes) "
            "is outside every registered region"
        )

    def locate(self, addrs: Int64s, lengths: Int64s, *, side: str) -> Int64s:
        """Index of the region that wholly contains each ``[addr, addr + length)`` row.

        Raises :class:`DescriptorError` naming the first row outside every region.
        """
        n = addrs.shape[0]
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        if len(self) == 0:
            raise DescriptorError(f"{side} descriptor 0 ({int(addrs[0]):#x}) is not registered")
        idx = np.searchsorted(self.starts, addrs, side="right").astype(np.int64) - 1
        clipped = np.maximum(idx, 0)
        ok = (idx >= 0) & (addrs + lengths <= self.ends[clipped])
        if not ok.all():
            # Overlapping registrations: the nearest start may not be the containing one.
            for row in np.flatnonzero(~ok):
                a, end = int(addrs[row]), int(addrs[row] + lengths[row])
                hits = np.flatnonzero((self.starts <= a) & (self.ends >= end))
                if hits.shape[0] == 0:
                    raise DescriptorError(
                        f"{side} descriptor {int(row)} ({a:#x}, {int(lengths[row])} bytes) "
                        "is outside every registered region"
                    )
                clipped[row] = hits[0]
        return clipped


def coalesce(
    local_addrs: Int64s,
    remote_addrs: Int64s,
    lengths: Int64s,
    local_region: Int64s,
    remote_region: Int64s,
) -> tuple[Int64s, Int64s, Int64s, Int64s, Int64s]:
    """Merge runs of rows that continue each other on both sides inside the same regions.

    KV blocks of consecutive block ids usually sit next to each other on both engines, so a
    transfer of N blocks often becomes a handful of large rows: fewer calls into UCX and
    bigger, faster copies. Rows keep their order; nothing is merged across regions.
    """
    n = lengths.shape[0]
    if n <= 1:
        return local_addrs, remote_addrs, lengths, local_region, remote_region
    follows = (
        (local_addrs[:-1] + lengths[:-1] == local_addrs[1:])
        & (remote_addrs[:-1] + lengths[:-1] == remote_addrs[1:])
        & (local_region[:-1] == local_region[1:])
        & (remote_region[:-1] == remote_region[1:])
    )
    if not follows.any():
        return local_addrs, remote_addrs, lengths, local_region, remote_region
    heads = np.flatnonzero(np.concatenate(([True], ~follows)))
    return (
        local_addrs[heads],
        remote_addrs[heads],
        np.add.reduceat(lengths, heads),
        local_region[heads],
        remote_region[heads],
    )
