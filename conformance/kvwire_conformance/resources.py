"""What a process holds that a closed transport must give back: threads, fds, mappings."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Snapshot:
    python_threads: frozenset[str]
    os_threads: int
    fds: frozenset[tuple[int, str]]
    shared_mappings: frozenset[str]

    def leaks_since(self, before: Snapshot) -> list[str]:
        """What this snapshot holds that ``before`` did not, in words; empty if nothing."""
        out: list[str] = []
        extra_threads = self.python_threads - before.python_threads
        if extra_threads:
            out.append(f"threads left running: {sorted(extra_threads)}")
        if self.os_threads > before.os_threads:
            out.append(f"OS threads: {before.os_threads} before, {self.os_threads} after")
        extra_fds = self.fds - before.fds
        if extra_fds:
            out.append(f"file descriptors left open: {sorted(extra_fds)}")
        extra_maps = self.shared_mappings - before.shared_mappings
        if extra_maps:
            out.append(f"shared mappings left: {sorted(extra_maps)}")
        return out


def _fds() -> frozenset[tuple[int, str]]:
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            out.add((int(name), os.readlink(f"/proc/self/fd/{name}")))
        except OSError:
            continue  # the fd listdir itself used, already closed
    return frozenset(out)


def _shared_mappings() -> frozenset[str]:
    out = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) >= 2 and fields[1].endswith("s"):
                out.add(line.strip())
    return frozenset(out)


def snapshot() -> Snapshot:
    return Snapshot(
        python_threads=frozenset(f"{t.name}#{t.ident}" for t in threading.enumerate()),
        os_threads=len(os.listdir("/proc/self/task")),
        fds=_fds(),
        shared_mappings=_shared_mappings(),
    )


def leaks_after(before: Snapshot, timeout: float) -> list[str]:
    """Leaks relative to ``before``, giving native threads up to ``timeout`` to finish exiting."""
    deadline = time.monotonic() + timeout
    while True:
        leaks = snapshot().leaks_since(before)
        if not leaks or time.monotonic() >= deadline:
            return leaks
        time.sleep(0.05)
