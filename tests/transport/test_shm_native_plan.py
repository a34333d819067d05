"""The C helper's ``plan`` of a host transfer against the Python path it stands in for.

``ShmTransport`` plans a transfer between host memory here and one kind of the peer's host
memory in one C call. Both must give the same copies (the same spans, merged, cut and
grouped alike), and the C call must refuse (None) every transfer the Python path refuses, so
that path can word the error.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from kvwire_shm._cma import IOV_MAX
from kvwire_shm._memcopy import CHUNK_BYTES, group_bounds, split_long
from kvwire_shm._native_load import NATIVE
from kvwire_shm._planning import Request, checked_pair, plan
from kvwire_shm._tables import CMA, DRAM, LOCAL, MAPPED, Row, Table

from kvwire.errors import DescriptorError

pytestmark = pytest.mark.skipif(NATIVE is None, reason="kvwire_shm._native is off here")

NO_LIMIT = 1 << 62
MiB = 1 << 20


def _tables(route: int) -> tuple[Table, Table]:
    """Three local regions (two touching) and three of the peer, with mapping deltas."""
    local = Table(
        [
            Row(0x10_0000_0000, 64 * MiB, 0, DRAM, LOCAL),
            Row(0x10_0400_0000, 8 * MiB, 0, DRAM, LOCAL),  # starts where the first ends
            Row(0x20_0000_0000, 32 * MiB, 0, DRAM, LOCAL),
        ]
    )
    delta = (0x7F00_0000_0000 - 0x30_0000_0000) if route == MAPPED else 0
    remote = Table(
        [
            Row(0x30_0000_0000, 64 * MiB, 0, DRAM, route, delta),
            Row(0x40_0000_0000, 16 * MiB, 0, DRAM, route, delta + 4096),
            Row(0x50_0000_0000, 48 * MiB, 0, DRAM, route, delta - 8192),
        ]
    )
    return local, remote


def _descs(rng: np.random.Generator, table: Table, lengths: np.ndarray) -> np.ndarray:
    """Spans of ``lengths`` inside ``table``'s regions; runs of neighbours, so some merge."""
    n = lengths.shape[0]
    out = np.zeros((n, 3), dtype=np.int64)
    region = np.asarray(rng.integers(0, table.starts.shape[0], n))
    at: np.ndarray = table.starts[region] + rng.integers(0, 1 << 16, n) * 64
    for i in range(1, n):  # a third of the rows continue the previous one
        if rng.random() < 0.33 and region[i] == region[i - 1]:
            at[i] = at[i - 1] + lengths[i - 1]
    room = table.ends[region] - at
    out[:, 0] = np.where(room >= lengths, at, table.ends[region] - lengths)
    out[:, 1] = lengths
    return out


def _lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    kinds = rng.integers(0, 4, n)
    return np.select(
        [kinds == 0, kinds == 1, kinds == 2],
        [np.zeros(n), rng.integers(1, 4096, n), rng.integers(1, 128, n) * 4096],
        rng.integers(CHUNK_BYTES, 3 * CHUNK_BYTES, n),  # long: cut into pieces
    ).astype(np.int64)


def _python_plan(
    local_t: Table, remote_t: Table, local: np.ndarray, remote: np.ndarray, *, write: bool
) -> tuple[list[np.ndarray], list[int], int, int]:
    """What the transport does without the helper: check, locate, plan, cut and group."""
    local, remote = checked_pair(local, remote)
    li = local_t.locate(local, "local")
    ri = remote_t.locate(remote, "remote")
    batches = plan(Request(local_t, remote_t, li, ri, local, remote), write)
    if not batches:
        return [np.zeros(0, dtype=np.int64)] * 3, [0], 0, 0
    (batch,) = batches
    total, merged = int(batch.length.sum()), int(batch.length.shape[0])
    cma = remote_t.route == CMA
    dst, src, length = split_long(batch.dst, batch.src, batch.length, same_space=not cma)
    ends = list(itertools.accumulate(length.tolist()))
    bounds = group_bounds(ends, CHUNK_BYTES, IOV_MAX if cma else None)
    return [dst, src, length], bounds, total, merged


def _native_plan(
    local_t: Table, remote_t: Table, local: np.ndarray, remote: np.ndarray, *, write: bool
) -> tuple[list[np.ndarray], list[int], int, int] | None:
    assert NATIVE is not None
    cma = remote_t.route == CMA
    planned = NATIVE.plan(
        local, remote, local_t.starts, local_t.ends, remote_t.starts, remote_t.ends,
        remote_t.deltas, not cma, write, CHUNK_BYTES, IOV_MAX if cma else NO_LIMIT,
    )  # fmt: skip
    if planned is None:
        return None
    spans, bounds, total, merged = planned
    return list(np.frombuffer(spans, dtype=np.int64).reshape(3, -1)), bounds, total, merged


@pytest.mark.parametrize("route", [CMA, MAPPED], ids=["cma", "mapped"])
@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
@pytest.mark.parametrize("seed", range(6))
def test_the_c_plan_is_the_python_plan(route: int, write: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    local_t, remote_t = _tables(route)
    n = int(rng.choice([1, 5, 300, IOV_MAX + 300]))
    lengths = _lengths(rng, n)
    local = _descs(rng, local_t, lengths)
    remote = _descs(rng, remote_t, lengths)
    if seed % 2:  # identical neighbours on both sides: long merged runs
        remote[:, 0] = remote[0, 0] + np.concatenate(([0], np.cumsum(lengths)[:-1]))
        local[:, 0] = local[0, 0] + np.concatenate(([0], np.cumsum(lengths)[:-1]))
        local[:, 0] = np.minimum(local[:, 0], local_t.ends[0] - lengths)
        remote[:, 0] = np.minimum(remote[:, 0], remote_t.ends[0] - lengths)
    expected = _python_plan(local_t, remote_t, local, remote, write=write)
    got = _native_plan(local_t, remote_t, local, remote, write=write)
    assert got is not None
    for column, (want, have) in enumerate(zip(expected[0], got[0], strict=True)):
        np.testing.assert_array_equal(have, want, err_msg=f"column {column}")
    assert got[1:] == expected[1:]
    if route == CMA:  # every chunk fits one process_vm_* call
        assert max(b - a for a, b in itertools.pairwise(got[1])) <= IOV_MAX


def test_a_span_overlapping_its_own_copy_is_not_cut() -> None:
    """In one address space (mapped) a span whose source and destination overlap stays
    whole, as memmove needs; through CMA (two address spaces) it is cut."""
    local_t = Table([Row(0x1000_0000, 64 * MiB, 0, DRAM, LOCAL)])
    for route, pieces in ((MAPPED, 1), (CMA, 3)):
        delta = 4096 if route == MAPPED else 0  # the peer's span maps 4 KiB past ours
        remote_t = Table([Row(0x1000_0000, 64 * MiB, 0, DRAM, route, delta)])
        one = np.array([[0x1000_0000, 2 * CHUNK_BYTES + 5, 0]], dtype=np.int64)
        got = _native_plan(local_t, remote_t, one, one.copy(), write=False)
        assert got is not None and got[0][2].shape[0] == pieces
        assert got[1:] == _python_plan(local_t, remote_t, one, one.copy(), write=False)[1:]


BAD: dict[str, tuple[int, int, int, bool]] = {
    "negative local address": (0, 0, -1, False),
    "negative length": (2, 1, -5, False),
    "lengths differ": (1, 1, 777, False),
    "negative remote address": (1, 0, -1, False),
    "outside every local region": (0, 0, 0x7000_0000_0000, False),
    "outside every remote region": (1, 0, 0x7000_0000_0000, False),
    "past the end of a region": (0, 0, 0x20_0000_0000 + 32 * MiB - 100, False),
    "across two touching regions": (0, 0, 0x10_0400_0000 - 100, False),
    "empty, but outside every region": (0, 0, 0x7000_0000_0000, True),
}
"""How to spoil row 5: side (0 local, 1 remote, 2 both), column, value, and whether the
row is emptied first."""


@pytest.mark.parametrize("route", [CMA, MAPPED], ids=["cma", "mapped"])
@pytest.mark.parametrize("bad", sorted(BAD))
def test_the_c_plan_refuses_what_the_python_path_refuses(route: int, bad: str) -> None:
    local_t, remote_t = _tables(route)
    rng = np.random.default_rng(0)
    lengths = np.full(8, 4096, dtype=np.int64)
    local = _descs(rng, local_t, lengths)
    remote = _descs(rng, remote_t, lengths)
    side, column, value, empty = BAD[bad]
    row = 5
    if empty:
        local[row, 1] = remote[row, 1] = 0
    for descs in (local, remote)[1 if side == 1 else 0 : 1 if side == 0 else 2]:
        descs[row, column] = value
    with pytest.raises(DescriptorError):
        _python_plan(local_t, remote_t, local, remote, write=False)
    assert _native_plan(local_t, remote_t, local, remote, write=False) is None


def test_the_c_plan_refuses_arrays_of_the_wrong_shape() -> None:
    assert NATIVE is not None
    local_t, remote_t = _tables(CMA)
    table = (local_t.starts, local_t.ends, remote_t.starts, remote_t.ends, remote_t.deltas)
    rows = np.zeros((4, 3), dtype=np.int64)
    with pytest.raises(ValueError):
        NATIVE.plan(rows, rows[:3], *table, False, False, CHUNK_BYTES, IOV_MAX)
    with pytest.raises(ValueError):
        NATIVE.plan(rows[:, :2].copy(), rows[:, :2].copy(), *table, False, False, 1, 1)
    with pytest.raises(ValueError):
        NATIVE.plan(rows, rows, *table, False, False, 0, IOV_MAX)
    with pytest.raises(TypeError):
        NATIVE.plan(rows.astype(np.int32), rows, *table, False, False, CHUNK_BYTES, IOV_MAX)


TOP = (1 << 63) - 1


@pytest.mark.parametrize(
    ("local_row", "remote_row", "local", "remote"),
    [
        # near the top of int64, spans cut
        (
            Row(TOP - 8 * CHUNK_BYTES, 8 * CHUNK_BYTES, 0, DRAM, LOCAL),
            Row(TOP - 8 * CHUNK_BYTES, 8 * CHUNK_BYTES, 0, DRAM, CMA),
            [[TOP - 8 * CHUNK_BYTES, 8 * CHUNK_BYTES, 0]],
            [[TOP - 8 * CHUNK_BYTES, 8 * CHUNK_BYTES, 0]],
        ),
        # an empty row at the very end of a region, then a real one
        (
            Row(1 << 40, 8 * CHUNK_BYTES, 0, DRAM, LOCAL),
            Row(0, 8 * CHUNK_BYTES, 0, DRAM, CMA),
            [[(1 << 40) + 8 * CHUNK_BYTES, 0, 0], [1 << 40, 5, 0]],
            [[8 * CHUNK_BYTES, 0, 0], [0, 5, 0]],
        ),
        # |dst - src| past int64 (a negative delta): both paths wrap alike, and do not cut
        (
            Row((1 << 62) + (1 << 40), 4 * CHUNK_BYTES, 0, DRAM, LOCAL),
            Row(1 << 20, 4 * CHUNK_BYTES, 0, DRAM, MAPPED, -(1 << 62) - (1 << 41)),
            [[(1 << 62) + (1 << 40), 3 * CHUNK_BYTES, 0]],
            [[1 << 20, 3 * CHUNK_BYTES, 0]],
        ),
    ],
    ids=["top-of-int64", "empty-row-at-the-end", "gap-past-int64"],
)
def test_the_c_plan_is_the_python_plan_at_the_edges(
    local_row: Row, remote_row: Row, local: list[list[int]], remote: list[list[int]]
) -> None:
    local_t, remote_t = Table([local_row]), Table([remote_row])
    ld, rd = np.array(local, dtype=np.int64), np.array(remote, dtype=np.int64)
    expected = _python_plan(local_t, remote_t, ld, rd, write=False)
    got = _native_plan(local_t, remote_t, ld, rd, write=False)
    assert got is not None
    for want, have in zip(expected[0], got[0], strict=True):
        np.testing.assert_array_equal(have, want)
    assert got[1:] == expected[1:]


def test_a_transfer_too_large_to_list_is_left_to_the_python_path() -> None:
    """More bytes than int64 counts, or more pieces than memory holds: None, not a crash
    (the transport's general path then fails the transfer)."""
    assert NATIVE is not None
    local_t, remote_t = Table([Row(0, TOP, 0, DRAM, LOCAL)]), Table([Row(0, TOP, 0, DRAM, CMA)])
    cols = (local_t.starts, local_t.ends, remote_t.starts, remote_t.ends, remote_t.deltas)
    two = np.array([[0, 3 << 61, 0], [0, 3 << 61, 0]], dtype=np.int64)  # each one fits
    assert NATIVE.plan(two, two.copy(), *cols, False, False, TOP, IOV_MAX) is None
    one = np.array([[0, 1 << 62, 0]], dtype=np.int64)
    assert NATIVE.plan(one, one.copy(), *cols, False, False, 1, IOV_MAX) is None  # 2^62 pieces
    assert NATIVE.plan(one, one.copy(), *cols, False, False, CHUNK_BYTES, IOV_MAX) is None


def test_no_region_registered_is_refused() -> None:
    empty, (_, remote_t) = Table([]), _tables(CMA)
    one = np.array([[4096, 64, 0]], dtype=np.int64)
    remote = np.array([[0x30_0000_0000, 64, 0]], dtype=np.int64)
    with pytest.raises(DescriptorError, match="no region is registered"):
        _python_plan(empty, remote_t, one, remote, write=False)
    assert _native_plan(empty, remote_t, one, remote, write=False) is None


@pytest.mark.parametrize("seed", range(4))
def test_chunks_hold_at_most_most_spans_and_chunk_bytes(seed: int) -> None:
    """Small limits, as group_bounds draws them: many short spans, neighbours merged."""
    assert NATIVE is not None
    rng = np.random.default_rng(seed)
    n = 200
    lengths = rng.integers(0, 120, n).astype(np.int64)
    at = 10_000 + np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    at[::7] += 5000  # break some runs
    local = np.stack([at, lengths, np.zeros(n, dtype=np.int64)], axis=1)
    remote = local.copy()
    remote[:, 0] += 1 << 30
    region = np.array([0], dtype=np.int64), np.array([1 << 40], dtype=np.int64)
    chunk, most = int(rng.integers(1, 50)), int(rng.integers(1, 6))
    planned = NATIVE.plan(
        local, remote, *region, *region, np.zeros(1, dtype=np.int64), False, False, chunk, most
    )
    assert planned is not None
    spans, bounds, _, _ = planned
    length = np.frombuffer(spans, dtype=np.int64).reshape(3, -1)[2]
    ends = list(itertools.accumulate(length.tolist()))
    assert bounds == group_bounds(ends, chunk, most)
    assert length.max() <= chunk
