"""Region lookup and coalescing of the ucx adapter (pure numpy, no UCX)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvwire_ucx.tables import RegionTable, coalesce

from kvwire.errors import DescriptorError


def table(*spans: tuple[int, int]) -> RegionTable:
    starts = np.array([s for s, _ in spans], dtype=np.int64)
    lengths = np.array([n for _, n in spans], dtype=np.int64)
    return RegionTable(starts, lengths, np.arange(len(spans), dtype=np.int64) * 10)


def test_locate_finds_containing_region_and_rejects_outside() -> None:
    t = table((5000, 100), (1000, 100))
    idx = t.locate(np.array([1000, 5050]), np.array([100, 50]), side="local")
    assert t.values[idx].tolist() == [10, 0]
    assert t.find(5050, 50, side="local", row=0) == int(idx[1])
    with pytest.raises(DescriptorError, match="remote descriptor 1"):
        t.locate(np.array([1000, 1090]), np.array([10, 20]), side="remote")
    with pytest.raises(DescriptorError):
        t.find(999, 2, side="local", row=3)


def test_locate_handles_overlapping_registrations() -> None:
    t = table((0, 1000), (100, 10))
    idx = t.locate(np.array([500]), np.array([100]), side="local")
    assert (t.starts[idx[0]], t.ends[idx[0]]) == (0, 1000)
    assert t.find(500, 100, side="local", row=0) == int(idx[0])


def test_coalesce_merges_only_runs_adjacent_on_both_sides() -> None:
    la = np.array([0, 10, 20, 100, 110], dtype=np.int64)
    ra = np.array([500, 510, 600, 700, 710], dtype=np.int64)
    ln = np.full(5, 10, dtype=np.int64)
    region = np.zeros(5, dtype=np.int64)
    out_la, out_ra, out_ln, _, _ = coalesce(la, ra, ln, region, region)
    assert out_la.tolist() == [0, 20, 100]
    assert out_ra.tolist() == [500, 600, 700]
    assert out_ln.tolist() == [20, 10, 20]


def test_coalesce_never_crosses_regions() -> None:
    la = np.array([0, 10], dtype=np.int64)
    ra = np.array([0, 10], dtype=np.int64)
    ln = np.array([10, 10], dtype=np.int64)
    out = coalesce(la, ra, ln, np.array([0, 1]), np.array([0, 0]))
    assert out[2].tolist() == [10, 10]


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4)), min_size=1, max_size=40))
def test_coalesce_preserves_every_byte_pairing(rows: list[tuple[int, int]]) -> None:
    # Build rows with random gaps; the byte-to-byte mapping must be unchanged by merging.
    la, ra, ln = [], [], []
    lpos = rpos = 0
    for gap, length in rows:
        la.append(lpos)
        ra.append(rpos + gap)
        ln.append(length)
        lpos += length + (gap % 2)
        rpos += length + gap
    zeros = np.zeros(len(rows), dtype=np.int64)
    out_la, out_ra, out_ln, _, _ = coalesce(
        np.array(la, dtype=np.int64),
        np.array(ra, dtype=np.int64),
        np.array(ln, dtype=np.int64),
        zeros,
        zeros,
    )

    def pairs(a: list[int], b: list[int], n: list[int]) -> list[tuple[int, int]]:
        return [(x + k, y + k) for x, y, m in zip(a, b, n, strict=True) for k in range(m)]

    assert pairs(out_la.tolist(), out_ra.tolist(), out_ln.tolist()) == pairs(la, ra, ln)
