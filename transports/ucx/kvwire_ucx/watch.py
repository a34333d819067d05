"""Watching a same-host peer process through a pidfd.

UCX's peer error handling (``UCP_ERR_HANDLING_MODE_PEER``) makes UCX 1.22 give up shared
memory and CMA on one host, so same-host peers run without it; measured here, a CMA get
from a peer that has exited then *completes* without copying anything. A pidfd tells us
for certain whether the peer process has exited (it becomes readable, and unlike a pid it
cannot be reused), so a transfer is only reported DONE if the peer was still alive after
its flush finished, i.e. during every copy.
"""

from __future__ import annotations

import os
import select

from kvwire_ucx.metadata import process_start_time


class ProcessWatch:
    """A pidfd on a peer process, verified against its start time."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)

    @classmethod
    def open(cls, pid: int, start_time: int) -> ProcessWatch | None:
        """A watch on ``pid``, or None if it cannot be had (then use UCX error handling)."""
        pidfd_open = getattr(os, "pidfd_open", None)
        if pid <= 0 or not start_time or pidfd_open is None:
            return None
        try:
            fd = pidfd_open(pid)
        except OSError:
            return None
        # The pid might have been reused before we opened it: the start time must match.
        if process_start_time(pid) != start_time:
            os.close(fd)
            return None
        return cls(fd)

    def alive(self) -> bool:
        if self._fd is None:
            return False
        return not self._poller.poll(0)

    def close(self) -> None:
        if self._fd is not None:
            self._poller.unregister(self._fd)
            os.close(self._fd)
            self._fd = None
