"""Memory the suite can hold back: a write into it waits until the test lets it through.

Ordering bugs (DONE, or a notification, before the last byte landed) hide behind timing:
over a fast adapter the late bytes usually land before anyone looks. A :class:`Gate` takes
timing out of it. It is an anonymous mapping whose pages are write-protected with
``userfaultfd`` (Linux): the first write into each page, by any thread of this process, by
the kernel for a syscall (``process_vm_readv``) or by another process writing into this
one, stops in the kernel until the test releases that page. The test releases only the
faults it had seen *before* a poll that answered PENDING, so while it holds one, the bytes
behind it cannot have landed and a transfer that polls DONE then has lied, on every run.

The conformance suite gates a READ's destination in its own process, and a WRITE's in the
peer agent process (:mod:`kvwire.peer.process`, the ``Gate*`` commands), where the gate's
owner thread is the peer's command loop.

The faults are read by a keeper *process* (:mod:`kvwire.peer._gatekeeper`), never a
thread of this one: a writer that stops in a fault while holding the GIL must not stop the
code that would release it. The keeper lets a fault by the test's own thread through at
once (a transport that copies inside ``read`` or ``poll`` must not wait on itself) and
records every other one in a shared page the test reads without a system call.

Needs ``userfaultfd`` with write-protect and kernel faults: root, ``CAP_SYS_PTRACE`` or
``vm.unprivileged_userfaultfd=1``. Where it is missing, :func:`open_gate` raises
:class:`GateUnavailable` and the tests that need it report the check as not made.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import select
import struct
import subprocess
import sys
import threading

import numpy as np

from kvwire.peer.memory import I64, U8

PAGE = mmap.PAGESIZE
SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}
UFFD_API = 0xAA
UFFDIO_API = 0xC018AA3F
UFFDIO_REGISTER = 0xC020AA00
UFFDIO_UNREGISTER = 0x8010AA01
UFFDIO_WRITEPROTECT = 0xC018AA06
UFFDIO_REGISTER_MODE_WP = 2
UFFDIO_WRITEPROTECT_MODE_WP = 1
UFFD_FEATURE_PAGEFAULT_FLAG_WP = 1 << 0
UFFD_FEATURE_THREAD_ID = 1 << 8
MADV_NOHUGEPAGE = 15

RING = 1 << 16
"""Faults the shared page records; beyond it the keeper lets every writer through and
reports a stall (the check is then not made)."""
PASSED = 1
"""Set in a recorded page address the keeper let through itself (an owner's fault)."""
HEADER = 6
"""u64 words before the ring: recorded, stalled, heartbeat, owner thread id, released,
and one more thread id let through (the commander's, for a gate in a peer process)."""
STALL_S = 2.0
"""How long the keeper waits for a test whose heartbeat stopped while it holds faults
before letting every writer through until the gate is armed again: the test's ``poll`` is
waiting on the held writer (a lock the adapter holds while it copies, or the GIL). The
transfer is then checked against its bytes when DONE, without the hold."""


class GateUnavailable(Exception):
    """This host cannot hold writes back (no userfaultfd, or not allowed)."""


def ioctl_wp(fd: int, addr: int, nbytes: int, protect: bool) -> None:
    """Write-protect (or release, waking its waiters) ``[addr, addr + nbytes)``."""
    mode = UFFDIO_WRITEPROTECT_MODE_WP if protect else 0
    fcntl.ioctl(fd, UFFDIO_WRITEPROTECT, bytearray(struct.pack("QQQ", addr, nbytes, mode)))


def _userfaultfd() -> int:
    number = SYS_USERFAULTFD.get(os.uname().machine)
    if not sys.platform.startswith("linux") or number is None:
        raise GateUnavailable(f"userfaultfd is Linux-only here, not {sys.platform}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    fd = int(libc.syscall(number, os.O_CLOEXEC | os.O_NONBLOCK))
    if fd < 0:
        err = ctypes.get_errno()
        raise GateUnavailable(
            f"userfaultfd: {os.strerror(err)} (needs root, CAP_SYS_PTRACE or "
            "vm.unprivileged_userfaultfd=1)"
        )
    want = UFFD_FEATURE_PAGEFAULT_FLAG_WP | UFFD_FEATURE_THREAD_ID
    try:
        api = bytearray(struct.pack("QQQ", UFFD_API, want, 0))
        fcntl.ioctl(fd, UFFDIO_API, api)
    except OSError as exc:
        os.close(fd)
        raise GateUnavailable(f"userfaultfd without write-protect faults: {exc}") from None
    return fd


class Gate:
    """``nbytes`` of page-aligned memory (:attr:`array`) whose writes the test can hold."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = -(-nbytes // PAGE) * PAGE
        self._map = mmap.mmap(-1, self.nbytes)
        self.array: U8 = np.frombuffer(self._map, dtype=np.uint8)
        self.addr = int(self.array.ctypes.data)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(self.addr), ctypes.c_size_t(self.nbytes), MADV_NOHUGEPAGE)
        self.array[:] = 0  # every page present before it is protected
        self._fd = _userfaultfd()
        self._keeper: subprocess.Popen[bytes] | None = None
        try:
            reg = bytearray(struct.pack("QQQQ", self.addr, self.nbytes, UFFDIO_REGISTER_MODE_WP, 0))
            fcntl.ioctl(self._fd, UFFDIO_REGISTER, reg)
            shared_fd = os.memfd_create("kvwire-gate", os.MFD_CLOEXEC)
            os.ftruncate(shared_fd, (HEADER + RING) * 8)
            self._shared = mmap.mmap(shared_fd, (HEADER + RING) * 8)
            self._words = np.frombuffer(self._shared, dtype=np.uint64)
            self._words[3] = threading.get_native_id()
            self._wake_r, wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
            fds = (self._fd, shared_fd, wake_w, stop_r)
            self._keeper = subprocess.Popen(
                [sys.executable, "-m", "kvwire.peer._gatekeeper", *map(str, fds)],
                pass_fds=fds,
            )
            for fd in (shared_fd, wake_w, stop_r):
                os.close(fd)
        except BaseException:
            self.close()
            raise
        self._released = 0
        self._seen = 0
        self._beat = 0
        self._protected: set[int] = set()
        """Pages whose first write has not been let through (what :meth:`held` counts)."""

    # -- what the test does ------------------------------------------------------------

    def protect(self, offsets: I64, lengths: I64) -> None:
        """Hold the first write into every page that these spans touch."""
        first = (offsets // PAGE) * PAGE
        last = ((offsets + np.maximum(lengths, 1) - 1) // PAGE) * PAGE
        pages = np.unique(np.concatenate([np.arange(a, b + PAGE, PAGE) for a, b in zip(
            first.tolist(), last.tolist(), strict=True)]))  # fmt: skip
        for start, stop in _runs(pages):
            ioctl_wp(self._fd, self.addr + start, stop - start, protect=True)
        self._protected.update((self.addr + pages).tolist())
        self._words[1] = 0  # armed again: hold writers even after a stall

    def recorded(self) -> int:
        """Faults the keeper has recorded (and holds, until released) so far."""
        self._beat += 1
        self._words[2] = self._beat  # the heartbeat the keeper watches
        return int(self._words[0])

    def let_through(self, tid: int) -> None:
        """Never hold thread ``tid`` either (any process's): a gate in a peer process must
        not hold the commanding test's own thread, which may write into it from inside
        ``write`` or ``poll`` (cross-memory attach) and would then never poll again."""
        self._words[5] = tid

    def held(self) -> int:
        """Protected pages whose first write has not been let through: writers waiting on
        the gate, or writes that have not even started. A transfer that is DONE, or
        notified, while one of its pages is held has not landed all its bytes. (Counting
        pages, not fault messages, leaves out a second writer's message for a page
        already released.)"""
        if self._words[1]:
            self._protected.clear()  # the keeper let every writer through
        count = min(int(self._words[0]), RING)
        for i in range(self._seen, count):
            entry = int(self._words[HEADER + i])
            if entry & PASSED:  # the keeper let it through itself
                self._protected.discard(entry - PASSED)
        self._seen = max(self._seen, count)
        return len(self._protected)

    def stalled(self) -> bool:
        """Whether the keeper let every writer through since the gate was armed
        (:data:`STALL_S`)."""
        return bool(self._words[1])

    def release(self, upto: int) -> None:
        """Let through the faults recorded before ``upto`` (an earlier :meth:`recorded`)."""
        upto = min(upto, RING)
        for i in range(self._released, upto):
            page = int(self._words[HEADER + i])
            if not page & PASSED and page in self._protected:
                ioctl_wp(self._fd, page, PAGE, protect=False)
                self._protected.discard(page)
        self._released = max(self._released, upto)
        self._words[4] = self._released

    def wait_fault(self, timeout: float) -> None:
        """Return when the keeper recorded a fault, or after ``timeout`` seconds."""
        select.select([self._wake_r], [], [], timeout)
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def open(self) -> None:
        """Protect nothing any more: every waiting writer goes on, and no new one waits."""
        ioctl_wp(self._fd, self.addr, self.nbytes, protect=False)
        self._protected.clear()
        self._released = self._seen = min(int(self._words[0]), RING)
        self._words[4] = self._released

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            self.open()
            fcntl.ioctl(
                self._fd, UFFDIO_UNREGISTER, bytearray(struct.pack("QQ", self.addr, self.nbytes))
            )
        except (OSError, AttributeError):
            pass
        if self._keeper is not None:
            os.close(self._stop_w)
            try:
                self._keeper.wait(10)
            except subprocess.TimeoutExpired:
                self._keeper.kill()
                self._keeper.wait()
            os.close(self._wake_r)
        os.close(self._fd)
        self._fd = -1


def _runs(pages: I64) -> list[tuple[int, int]]:
    """Sorted page offsets as ``[start, stop)`` runs of consecutive pages."""
    if not pages.shape[0]:
        return []
    breaks = np.flatnonzero(np.diff(pages) != PAGE) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [pages.shape[0]]])
    return [(int(pages[a]), int(pages[b - 1]) + PAGE) for a, b in zip(starts, stops, strict=True)]


def open_gate(nbytes: int) -> Gate:
    """A :class:`Gate`, or :class:`GateUnavailable` saying why this host has none."""
    try:
        return Gate(nbytes)
    except OSError as exc:
        raise GateUnavailable(f"cannot write-protect memory: {exc}") from None
