"""A transport wrapper that silently corrupts received KV: the failure no transport reports.

``corrupting(name, inner="shm", rows=1)`` behaves like ``inner`` except that when one of
its READs completes, it overwrites the first bytes of the first ``rows`` local descriptor
rows (the start of the first block that transfer landed) with seeded noise, and still says
DONE. Only a check above the transport — the engine's output — can catch it; the engine
tests use it to show that a wrong block never goes unnoticed as a match.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kvwire.errors import ConfigError
from kvwire.transport import DelegatingTransport, Descs, Transport, XferState, create

CORRUPT_BYTES = 256


class CorruptingTransport(DelegatingTransport):
    """Scribbles on the local memory of completed READs (pull mode, consumer side)."""

    def __init__(self, inner: Transport, *, rows: int = 1, seed: int = 0) -> None:
        super().__init__(inner)
        if rows < 1:
            raise ConfigError(f"rows must be >= 1, got {rows}")
        self.rows = rows
        self._rng = np.random.default_rng(seed)
        self._reads: dict[int, Descs] = {}
        self.corrupted_bytes = 0

    def read(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        handle = self.inner.read(peer, local, remote, notify)
        self._reads[id(handle)] = np.array(local[: self.rows], dtype=np.int64)
        return handle

    def poll(self, handle: object) -> XferState:
        state = self.inner.poll(handle)
        rows = self._reads.pop(id(handle), None) if state is XferState.DONE else None
        if rows is not None:
            for addr, length, _ in rows.tolist():
                count = min(int(length), CORRUPT_BYTES) // 4
                noise = self._rng.standard_normal(count).astype(np.float32) * 8.0
                ctypes.memmove(int(addr), noise.ctypes.data, count * 4)
                self.corrupted_bytes += count * 4
        return state

    def release(self, handle: object) -> None:
        self._reads.pop(id(handle), None)
        self.inner.release(handle)


def corrupting(
    name: str, *, inner: str = "shm", inner_options: dict[str, Any] | None = None, rows: int = 1
) -> Transport:
    """Factory form, loadable as ``kvwire.examples.engine.corrupting_transport:corrupting``."""
    return CorruptingTransport(create(inner, name, **(inner_options or {})), rows=int(rows))
