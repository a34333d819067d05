"""Planning a shm transfer: from descriptor arrays to batches of spans to copy.

Three paths, from the fastest: a few host descriptors in plain Python (:func:`plan_few`,
where a numpy call costs more than the copy), a host transfer in one call of the C helper
(:func:`plan_host`), and numpy for everything else (:func:`checked_pair`, then ``Table``'s
``locate`` and :func:`plan`), which also words every error. Pure functions of the region
tables; the transport decides which thread runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvwire.errors import DescriptorError
from kvwire.layout import coalesce_columns
from kvwire.transport import Descs, as_descs, check_pair
from kvwire_shm._cma import IOV_MAX
from kvwire_shm._memcopy import CHUNK_BYTES
from kvwire_shm._native_load import NATIVE
from kvwire_shm._tables import CMA, CUDA, I64, MAPPED, VRAM, Table

INLINE_BYTES = 64 << 10
INLINE_ROWS = 64
"""Host transfers up to these sizes are copied in ``read``/``write`` on the caller's thread
when nothing is queued ahead of them: handing a 4 KiB copy (~2 us) to the worker cost a
wake-up and a GIL hand-over, 100-300 us on a loaded 2-core machine (measured)."""
FEW_ROWS = 4
"""Transfers of at most this many descriptors are planned without numpy (see plan_few)."""
NO_LIMIT = 1 << 62
"""No cap on the spans of one chunk (copies inside this process take any number)."""


@dataclass
class Batch:
    """Descriptors of one transfer that travel the same way, coalesced."""

    route: int
    dst: I64
    src: I64
    length: I64
    device: int = 0
    bounds: list[int] | None = None
    """Where each chunk starts (then the span count), when the C helper planned the batch:
    its long spans are cut already. ``total`` bytes were ``merged`` spans before the cut."""
    total: int = 0
    merged: int = 0


@dataclass(frozen=True)
class Request:
    """A checked transfer whose descriptors the worker still has to split and coalesce."""

    local_t: Table
    remote_t: Table
    li: I64
    ri: I64
    local: Descs
    remote: Descs


def _rows(local: Descs, remote: Descs) -> int:
    """How many rows two descriptor arrays have when both are already in shape (int64
    ``(n, 3)`` numpy arrays of one shape, the form engines pass), else -1: the fast paths
    take only those, and anything else goes the long way, which also words errors."""
    if (
        type(local) is np.ndarray
        and type(remote) is np.ndarray
        and local.dtype == np.int64
        and remote.dtype == np.int64
        and local.ndim == 2
        and local.shape == remote.shape
        and local.shape[1] == 3
    ):
        return int(local.shape[0])
    return -1


def _one_host_route(table: Table, remote_t: Table) -> bool:
    """Host memory on both sides, and every peer region reached the same way."""
    return not (table.has_vram or remote_t.has_vram) and remote_t.route in (MAPPED, CMA)


def checked_pair(local: Descs, remote: Descs) -> tuple[Descs, Descs]:
    """Both descriptor arrays checked (as ``as_descs`` and ``check_pair`` would) and copied:
    the worker reads them after ``read`` returned, when the caller may already be refilling
    its arrays. Arrays already in shape cost one copy and a handful of numpy calls; anything
    else goes the long way, which also words the error."""
    n = _rows(local, remote)
    if n >= 0:
        both = np.concatenate((local, remote))
        # Column by column: numpy reduces a (2n, 2) strided view about 5x slower than two
        # (2n,) column views, and this is on the caller's thread for every post.
        if n == 0 or (
            both[:, 0].min() >= 0 and both[:, 1].min() >= 0 and (both[:n, 1] == both[n:, 1]).all()
        ):
            return both[:n], both[n:]
    own_local = as_descs(np.array(local, dtype=np.int64, copy=True))
    own_remote = as_descs(np.array(remote, dtype=np.int64, copy=True))
    check_pair(own_local, own_remote)
    return own_local, own_remote


def plan_few(
    table: Table, remote_t: Table, local: Descs, remote: Descs, *, write: bool
) -> tuple[int, list[int], list[int], list[int]] | None:
    """(route, dst, src, length) of a small host transfer over one route, found in
    plain Python; None for anything else (larger, VRAM, mixed routes, or a descriptor
    that is bad: the general path checks it again and words the error)."""
    if not (0 < _rows(local, remote) <= FEW_ROWS and _one_host_route(table, remote_t)):
        return None
    route = remote_t.route
    dst: list[int] = []
    src: list[int] = []
    length: list[int] = []
    total = 0
    for (la, n, _), (ra, rn, _) in zip(local.tolist(), remote.tolist(), strict=True):
        if la < 0 or ra < 0 or n < 0 or n != rn:
            return None
        ri = remote_t.find(ra, n)
        if table.find(la, n) < 0 or ri < 0:
            return None
        if n == 0:
            continue
        total += n
        if route == CMA:  # CMA keeps (local, remote) order; the flag says which way
            dst.append(la)
            src.append(ra)
        else:
            ra += remote_t.delta_list[ri]
            dst.append(ra if write else la)
            src.append(la if write else ra)
        length.append(n)
    return (route, dst, src, length) if total <= INLINE_BYTES else None


def plan_host(
    table: Table, remote_t: Table, local: Descs, remote: Descs, *, write: bool
) -> list[Batch] | None:
    """The whole plan of a transfer between host memory here (``table``) and one kind of
    the peer's host memory, made by one call of the C helper: the numpy steps of
    :func:`checked_pair`, ``Table.locate`` and :func:`plan` cost ~100 us with caches cold, a
    sixth of a 16 MiB copy. None where the helper is off, for anything else, and for a
    descriptor that is not plainly valid (the general path then words the error)."""
    if NATIVE is None or _rows(local, remote) <= 0 or not _one_host_route(table, remote_t):
        return None
    route = remote_t.route
    planned = NATIVE.plan(
        np.ascontiguousarray(local),
        np.ascontiguousarray(remote),
        table.starts,
        table.ends,
        remote_t.starts,
        remote_t.ends,
        remote_t.deltas,
        route == MAPPED,
        write,
        CHUNK_BYTES,
        IOV_MAX if route == CMA else NO_LIMIT,
    )
    if planned is None:
        return None
    spans, bounds, total, merged = planned
    dst, src, length = np.frombuffer(spans, dtype=np.int64).reshape(3, -1)
    batch = Batch(route, dst, src, length, bounds=bounds, total=total, merged=merged)
    return [batch] if total else []


def plan(request: Request, write: bool) -> list[Batch]:
    """A checked transfer split by route (and, for VRAM, device), each part coalesced."""
    local_t, remote_t, li, ri = request.local_t, request.remote_t, request.li, request.ri
    local, remote = request.local, request.remote
    if local.shape[0] == 0:
        return []
    if _one_host_route(local_t, remote_t):
        # One kind of host memory on both sides: one batch, no masks.
        if remote_t.route == CMA:  # CMA batches keep (local, remote) order
            d, s = local[:, 0], remote[:, 0]
        else:
            delta = remote_t.delta if remote_t.delta is not None else remote_t.deltas[ri]
            raddr = remote[:, 0] + delta
            d, s = (raddr, local[:, 0]) if write else (local[:, 0], raddr)
        dd, ss, ll = coalesce_columns(d, s, local[:, 1])
        return [Batch(remote_t.route, dd, ss, ll)] if ll.shape[0] else []
    lkind = local_t.kinds[li]
    route = remote_t.routes[ri]
    laddr = local[:, 0]
    raddr = remote[:, 0] + remote_t.deltas[ri]
    length = local[:, 1]
    if ((lkind == VRAM) & (route == CMA)).any():
        raise DescriptorError(
            "VRAM <-> peer host memory outside a kvwire_shm.allocate segment is not supported"
        )
    batches: list[Batch] = []
    cuda_mask = (lkind == VRAM) | (route == CUDA)
    for code, mask in (
        (MAPPED, (route == MAPPED) & ~cuda_mask),
        (CMA, (route == CMA) & ~cuda_mask),
        (CUDA, cuda_mask),
    ):
        if not mask.any():
            continue
        if code == CMA:  # CMA batches keep (local, remote) order; the flag says which way
            d, s = laddr[mask], remote[mask, 0]
        elif write:
            d, s = raddr[mask], laddr[mask]
        else:
            d, s = laddr[mask], raddr[mask]
        dd, ss, ll = coalesce_columns(d, s, length[mask])
        device = 0
        if code == CUDA:
            devs = np.where(lkind[mask] == VRAM, local[mask, 2], remote[mask, 2])
            device = int(devs[0])
            if (devs != device).any():
                raise DescriptorError("one transfer may involve only one GPU")
        if ll.shape[0]:
            batches.append(Batch(code, dd, ss, ll, device))
    return batches
