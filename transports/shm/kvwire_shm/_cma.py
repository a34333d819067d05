"""Cross-memory attach: copy between this process and another one in one syscall per batch.

``process_vm_readv`` / ``process_vm_writev`` take arrays of iovecs on both sides, so a
transfer of N descriptors costs ceil(N / IOV_MAX) syscalls and no Python work per
descriptor (with the C helper, :func:`native_chunks`, the iovecs are built in C too). The
kernel checks ptrace permission; :func:`allow_any_ptracer` opts this
process in where Yama would otherwise refuse its peers.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvwire_shm._memcopy import CHUNK_BYTES, group_bounds, split_long
from kvwire_shm._native_load import NATIVE

IOV_MAX = 1024
"""Linux's UIO_MAXIOV: the most iovecs one process_vm_* call accepts per side."""

_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_CMA_ARGTYPES: list[Any] = [
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_ulong,
]
_readv = _libc.process_vm_readv
_readv.argtypes = _CMA_ARGTYPES
_readv.restype = ctypes.c_ssize_t
_writev = _libc.process_vm_writev
_writev.argtypes = _CMA_ARGTYPES
_writev.restype = ctypes.c_ssize_t
_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
Addresses = npt.NDArray[np.integer[Any]]


def allow_any_ptracer() -> None:
    """Let any process of ours attach memory (Yama ptrace_scope=1); harmless without Yama."""
    _prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)


class CmaError(OSError):
    """A process_vm_* call failed; ``errno`` says why (ESRCH: the peer is gone)."""


def cma_copy(
    pid: int,
    local: Addresses,
    remote: Addresses,
    lengths: Addresses,
    *,
    write: bool,
) -> None:
    """Copy ``lengths[i]`` bytes between ``local[i]`` here and ``remote[i]`` in ``pid``,
    IOV_MAX descriptors per call. Short counts (the kernel caps one call near 2 GiB) resume
    where they stopped; a call that moves nothing, or fails, raises :class:`CmaError`."""
    call = _writev if write else _readv
    la = local.astype(np.uint64, copy=True)
    ra = remote.astype(np.uint64, copy=True)
    ln = lengths.astype(np.uint64, copy=True)
    n = int(ln.shape[0])
    iov_l = np.empty((IOV_MAX, 2), dtype=np.uint64)
    iov_r = np.empty((IOV_MAX, 2), dtype=np.uint64)
    p_l = iov_l.ctypes.data
    p_r = iov_r.ctypes.data
    i = 0
    while i < n:
        j = min(n, i + IOV_MAX)
        k = j - i
        iov_l[:k, 0] = la[i:j]
        iov_l[:k, 1] = ln[i:j]
        iov_r[:k, 0] = ra[i:j]
        iov_r[:k, 1] = ln[i:j]
        want = int(ln[i:j].sum())
        got = int(call(pid, p_l, k, p_r, k, 0))
        if got < 0:
            err = ctypes.get_errno()
            raise CmaError(err, f"process_vm_{'writev' if write else 'readv'}: {os.strerror(err)}")
        if got == want:
            i = j
            continue
        if got == 0:
            raise CmaError(0, "process_vm_* moved no bytes")
        # Partial: skip the iovecs that completed, trim the one in progress, go again.
        done = np.cumsum(ln[i:j], dtype=np.uint64)
        full = int(np.searchsorted(done, got, side="right"))
        into = got - (int(done[full - 1]) if full else 0)
        i += full
        la[i] += np.uint64(into)
        ra[i] += np.uint64(into)
        ln[i] -= np.uint64(into)


def native_cma(
    pid: int, local: Addresses | list[int], remote: Addresses | list[int],
    lengths: Addresses | list[int], *, write: bool, first: int = 0, last: int = -1,
) -> None:  # fmt: skip
    """:func:`cma_copy` in the C helper (contiguous int64 arrays, or lists) of the spans
    ``[first, last)`` (``last`` -1: to the end): every batch of IOV_MAX iovecs built and
    issued without the interpreter, the GIL released throughout."""
    assert NATIVE is not None
    err = NATIVE.cma(pid, local, remote, lengths, write, first, last)
    if err > 0:
        raise CmaError(err, f"process_vm_{'writev' if write else 'readv'}: {os.strerror(err)}")
    if err < 0:
        raise CmaError(0, "process_vm_* moved no bytes")


def copy_few(
    pid: int, local: list[int], remote: list[int], lengths: list[int], *, write: bool
) -> None:
    """Copy a few spans given as lists (a small transfer, on the caller's thread)."""
    if NATIVE is not None:
        native_cma(pid, local, remote, lengths, write=write)
    else:
        as_array = functools.partial(np.array, dtype=np.int64)
        cma_copy(pid, as_array(local), as_array(remote), as_array(lengths), write=write)


def chunks(
    pid: int, local: Addresses, remote: Addresses, lengths: Addresses, *, write: bool
) -> list[Callable[[], object]]:
    """:func:`cma_copy` of every descriptor, as calls of about CHUNK_BYTES (and at most
    IOV_MAX descriptors) that any threads may run; the syscall drops the GIL.

    The iovecs of every call are built here at once, so the thread that runs one holds
    the GIL only to make the call; a short count is redone by :func:`cma_copy` (copying a
    span twice leaves the same bytes).
    """
    if lengths.shape[0] and int(lengths.max()) > CHUNK_BYTES:
        local, remote, lengths = split_long(
            local.astype(np.int64),
            remote.astype(np.int64),
            lengths.astype(np.int64),
            same_space=False,
        )
    n = int(lengths.shape[0])
    if n == 0:
        return []
    iov = np.empty((2, n, 2), dtype=np.uint64)
    iov[0, :, 0], iov[1, :, 0] = local, remote
    iov[0, :, 1] = iov[1, :, 1] = lengths
    ends = list(itertools.accumulate(lengths.tolist()))
    call = _writev if write else _readv
    p_local, p_remote = iov[0].ctypes.data, iov[1].ctypes.data
    stride = iov.strides[1]

    def run(a: int, b: int) -> object:
        want = ends[b - 1] - (ends[a - 1] if a else 0)
        if call(pid, p_local + a * stride, b - a, p_remote + a * stride, b - a, 0) == want:
            return iov  # (and keeps the iovecs alive as long as a call may read them)
        cma_copy(pid, local[a:b], remote[a:b], lengths[a:b], write=write)
        return iov

    one = n <= IOV_MAX and ends[-1] <= CHUNK_BYTES
    bounds = [0, n] if one else group_bounds(ends, CHUNK_BYTES, IOV_MAX)
    return [functools.partial(run, a, b) for a, b in itertools.pairwise(bounds)]


def native_chunks(
    pid: int, local: Addresses, remote: Addresses, lengths: Addresses, *, write: bool
) -> list[Callable[[], object]]:
    """:func:`chunks` through the C helper: the same groups, each one call that builds its
    iovecs in C."""
    flat = functools.partial(np.ascontiguousarray, dtype=np.int64)
    la, ra, ln = flat(local), flat(remote), flat(lengths)
    if ln.shape[0] and int(ln.max()) > CHUNK_BYTES:
        la, ra, ln = split_long(la, ra, ln, same_space=False)
    n = int(ln.shape[0])
    if n == 0:
        return []
    ends = list(itertools.accumulate(ln.tolist()))
    one = n <= IOV_MAX and ends[-1] <= CHUNK_BYTES
    bounds = [0, n] if one else group_bounds(ends, CHUNK_BYTES, IOV_MAX)
    return planned_chunks(pid, la, ra, ln, bounds, write=write)


def planned_chunks(
    pid: int, local: I64, remote: I64, lengths: I64, bounds: list[int], *, write: bool
) -> list[Callable[[], object]]:
    """One C call per group of spans ``bounds`` marks (as :func:`group_bounds` makes them,
    or the C helper's ``plan``); the arrays contiguous int64."""
    return [
        functools.partial(native_cma, pid, local, remote, lengths, write=write, first=a, last=b)
        for a, b in itertools.pairwise(bounds)
    ]
