"""Host memory that a peer can map: the syscall-free path of the shm transport.

:func:`allocate` backs a numpy array with an anonymous ``memfd``. A peer maps the same pages
by opening ``/proc/<pid>/fd/<fd>`` of the owner, so a copy between the two processes is one
``memmove`` with no syscall. memfd rather than a named ``/dev/shm`` file: nothing is left
in the filesystem when a process is killed, because the pages die with the last mapping.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import uuid
import weakref
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvwire.errors import RegistrationError

_PAGE = mmap.PAGESIZE
_MADV_POPULATE_READ = 22
"""Linux 5.14+: fault a range of a mapping in now (not in the mmap module's constants)."""
_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise  # through ctypes, unlike mmap.madvise, it lets go of the GIL
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int


@dataclass(frozen=True)
class SegmentInfo:
    """Where a span lives inside a kvwire segment of this process."""

    fd: int
    token: str
    base: int
    size: int


_lock = threading.Lock()
_live: dict[int, SegmentInfo] = {}


def _forget(base: int, fd: int) -> None:
    with _lock:
        _live.pop(base, None)
    with contextlib.suppress(OSError):
        os.close(fd)


def allocate(nbytes: int) -> npt.NDArray[np.uint8]:
    """A zeroed ``uint8`` array a peer can map; register it like any other array.

    The segment lives as long as the array (or any view of it) does.
    """
    if nbytes <= 0:
        raise RegistrationError(f"cannot allocate {nbytes} bytes")
    size = -(-nbytes // _PAGE) * _PAGE
    token = f"kvwire-shm-{uuid.uuid4().hex}"
    fd = os.memfd_create(token, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        os.close(fd)
        raise RegistrationError(f"cannot allocate a shared segment of {size} bytes: {exc}") from exc
    array = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
    base = int(array.ctypes.data)
    with _lock:
        _live[base] = SegmentInfo(fd=fd, token=token, base=base, size=size)
    weakref.finalize(mm, _forget, base, fd)
    return array


def segment_of(addr: int, length: int) -> SegmentInfo | None:
    """The live segment that holds ``[addr, addr + length)``, if any."""
    with _lock:
        for info in _live.values():
            if info.base <= addr and addr + length <= info.base + info.size:
                return info
    return None


class PeerMapping:
    """A peer's segment mapped into this process; ``close`` unmaps it."""

    def __init__(self, pid: int, info: SegmentInfo) -> None:
        path = f"/proc/{pid}/fd/{info.fd}"
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            target = os.readlink(path)
            if info.token not in target:
                raise OSError(f"{path} is not the peer's segment any more ({target})")
            if os.fstat(fd).st_size < info.size:
                raise OSError(f"{path} is smaller than the peer announced")
            self._mm: mmap.mmap | None = mmap.mmap(
                fd, info.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)
        view = np.frombuffer(self._mm, dtype=np.uint8)
        self.addr = int(view.ctypes.data)
        del view
        self.peer_base = info.base
        self.size = info.size

    def populate(self, offset: int, length: int) -> None:
        """Fill this process's page tables for ``[offset, offset + length)`` of the segment
        now, so the first copies there take no page faults; a no-op once closed.

        Raises OSError where the kernel lacks MADV_POPULATE_READ (before 5.14).
        """
        if self._mm is None:
            return
        start = offset - offset % _PAGE
        end = min(self.size, offset + length)
        if end > start and _madvise(self.addr + start, end - start, _MADV_POPULATE_READ) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_POPULATE_READ): {os.strerror(err)}")

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
