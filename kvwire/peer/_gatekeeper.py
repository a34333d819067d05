"""The keeper process of a :class:`~kvwire.peer.gate.Gate`.

``python -m kvwire.peer._gatekeeper UFFD SHARED WAKE STOP``: reads the write faults
of the gated memory from the userfaultfd ``UFFD``; lets one by the test's own thread
through at once (and one of the thread named in word 5, for a gate in a peer process);
records every other one in the shared page (``SHARED``) and writes a
byte to ``WAKE``, leaving the release to the test. If the test's heartbeat stops for
``STALL_S`` while faults are held, it lets every writer through and says so in the shared
page. Exits when ``STOP`` reaches end of file (the gate closed, or the test died).

A process, not a thread: a writer blocked in a fault while it holds the GIL would stop a
thread of the test's process from ever releasing it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import struct
import sys
import time

from kvwire.peer.gate import HEADER, PAGE, PASSED, RING, STALL_S, ioctl_wp

UFFD_EVENT_PAGEFAULT = 0x12
MSG_BYTES = 32


def main(argv: list[str]) -> int:
    uffd, shared_fd, wake, stop = (int(a) for a in argv)
    shared = mmap.mmap(shared_fd, (HEADER + RING) * 8)
    words = memoryview(shared).cast("Q")
    test_tid = words[3]
    beat, beat_at = words[2], time.monotonic()
    while True:
        ready, _, _ = select.select([uffd, stop], [], [], 0.5)
        if stop in ready and not os.read(stop, 1):
            return 0
        if uffd in ready:
            _read_faults(uffd, words, test_tid, wake)
        if words[2] != beat:
            beat, beat_at = words[2], time.monotonic()
        elif time.monotonic() - beat_at > STALL_S and not words[1] and _holding(words):
            _give_up(uffd, words)  # the test's thread is stuck: let every writer go


def _holding(words: memoryview) -> bool:
    """Whether a recorded fault waits for the test (not released, not let through)."""
    count = min(int(words[0]), RING)
    return any(not words[HEADER + i] & PASSED for i in range(int(words[4]), count))


def _give_up(uffd: int, words: memoryview) -> None:
    """Let every recorded writer through and say so: the test reports no check made."""
    words[1] = 1
    for i in range(min(int(words[0]), RING)):
        ioctl_wp(uffd, int(words[HEADER + i]) & ~PASSED, PAGE, protect=False)


def _read_faults(uffd: int, words: memoryview, test_tid: int, wake: int) -> None:
    while True:
        try:
            msg = os.read(uffd, MSG_BYTES * 64)
        except BlockingIOError:
            return
        for at in range(0, len(msg), MSG_BYTES):
            if msg[at] != UFFD_EVENT_PAGEFAULT:
                continue
            _flags, address, tid = struct.unpack_from("QQI", msg, at + 8)
            page = address - address % PAGE
            count = int(words[0])
            if count >= RING:
                _give_up(uffd, words)
            if words[1]:
                ioctl_wp(uffd, page, PAGE, protect=False)
                continue
            passed = tid in (test_tid, words[5])
            # Recorded before the writer can go on: once it does, its thread (the test's)
            # may see the transfer DONE and count the page, which must be known let through.
            words[HEADER + count] = page | (PASSED if passed else 0)
            words[0] = count + 1
            if passed:
                ioctl_wp(uffd, page, PAGE, protect=False)
            with contextlib.suppress(BlockingIOError):
                os.write(wake, b"!")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
