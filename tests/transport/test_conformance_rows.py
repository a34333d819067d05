"""The conformance suite's rows for transfers in flight together never share a byte.

Transfers posted at once have no order, so a suite test that predicts memory after several
of them is deterministic only if no two touch the same byte; one that drew each transfer
on its own failed in CI when UCX finished two overlapping READs the other way round.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from kvwire_conformance.paths import Mirror, Rows, disjoint_rows


def _mirrors(sizes: list[int]) -> list[Mirror]:
    return [Mirror(addr=0, nbytes=n, expected=np.zeros(0, np.uint8)) for n in sizes]


def _touched(rows: list[Rows], local: bool, regions: int, sizes: list[int]) -> list[np.ndarray]:
    """How many transfers touch each byte of each region on one side."""
    counts = [np.zeros(n, np.int32) for n in sizes]
    for r in rows:
        which, offsets = (r.li, r.loff) if local else (r.ri, r.roff)
        for region in range(regions):
            mask = which == region
            for off, length in zip(offsets[mask], r.length[mask], strict=True):
                counts[region][off : off + length] += 1
    return counts


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    batches=st.integers(2, 6),
    per=st.integers(1, 16),
    local_sizes=st.lists(st.integers(64 << 10, 1 << 20), min_size=1, max_size=3),
    remote_sizes=st.lists(st.integers(64 << 10, 1 << 20), min_size=1, max_size=3),
)
def test_no_byte_is_touched_by_two_transfers(
    seed: int, batches: int, per: int, local_sizes: list[int], remote_sizes: list[int]
) -> None:
    max_length = min(local_sizes + remote_sizes) // (batches * per)
    rows = disjoint_rows(
        np.random.default_rng(seed),
        batches,
        per,
        max_length,
        _mirrors(local_sizes),
        _mirrors(remote_sizes),
    )
    assert len(rows) == batches
    assert all(r.length.shape[0] == per for r in rows)
    for local, sizes in ((True, local_sizes), (False, remote_sizes)):
        for counts in _touched(rows, local, len(sizes), sizes):
            assert int(counts.max(initial=0)) <= 1, "two transfers in flight share a byte"
