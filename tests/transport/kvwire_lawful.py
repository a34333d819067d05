"""Adapters that keep the contract in ways a suite test must not trip over.

The broken variants (:mod:`variant_library`) prove the suite fails what breaks the
contract; these prove it passes what keeps it, where a test could otherwise depend on
timing the contract leaves open. Each wraps any adapter (``-o inner=NAME``, shm by default)
and makes one allowed behaviour happen on every run instead of now and then:

- ``late_detached_transfers``: ``release`` of a transfer whose end the caller never saw
  detaches it, and its bytes land late: copied again, from its source as it is then, just
  before the next transfer is reported DONE (the contract lets a released transfer abort
  or detach; a detached one finishes whenever it finishes).
- ``late_foreign_notifications``: every batch ``drain_notifications`` hands out carries one
  more notification from an agent this one never added, as one that closed since, or
  whose released transfer finished late, sends (notifications name senders never added).
- ``loaded_host_stalls_a_wait``: the first ``wait`` with a timeout returns a second late,
  as any call does whose process a loaded host leaves unscheduled that long (not the
  adapter's doing; ``wait_sleeps_whole_seconds`` oversleeps on every call).

``tests/transport/test_conformance_lawful.py`` runs the suite's tests they touch.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from kvwire.errors import TransportError
from kvwire.transport import DelegatingTransport, Descs, Transport, XferState, create, wait_for

LATE_SENDER = "kvwire-lawful-agent-that-closed"
"""The sender of every notification ``late_foreign_notifications`` adds."""


@dataclass
class _Posted:
    write: bool
    peer: str
    local: Descs
    remote: Descs
    ended: bool = False


class LateDetachedTransfers(DelegatingTransport):
    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self._posted: dict[int, tuple[object, _Posted]] = {}
        self._late: list[_Posted] = []

    def _post(self, write: bool, peer: str, local: Descs, remote: Descs, notify: Any) -> object:
        post = self.inner.write if write else self.inner.read
        handle = post(peer, local, remote, notify)
        self._posted[id(handle)] = (handle, _Posted(write, peer, local.copy(), remote.copy()))
        return handle

    def read(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        return self._post(False, peer, local, remote, notify)

    def write(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        return self._post(True, peer, local, remote, notify)

    def poll(self, handle: object) -> XferState:
        state = self.inner.poll(handle)
        entry = self._posted.get(id(handle))
        if state is not XferState.PENDING and entry is not None and entry[0] is handle:
            entry[1].ended = True
        if state is XferState.DONE and self._late:
            self._land_late()
        return state

    def release(self, handle: object) -> None:
        self.inner.release(handle)  # raises (the handle stays valid) or lets go
        entry = self._posted.pop(id(handle), None)
        if entry is not None and entry[0] is handle and not entry[1].ended:
            self._late.append(entry[1])

    def _land_late(self) -> None:
        """The detached transfers' bytes land now, copied again from their sources."""
        late, self._late = self._late, []
        for xfer in late:
            post = self.inner.write if xfer.write else self.inner.read
            with contextlib.suppress(TransportError):  # its peer or memory is gone: nothing
                again = post(xfer.peer, xfer.local, xfer.remote)
                wait_for(self.inner, again, 30.0)
                self.inner.release(again)


class LateForeignNotifications(DelegatingTransport):
    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self._added = 0

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        got = self.inner.drain_notifications()
        if not got:
            return got
        self._added += 1
        return [(LATE_SENDER, b"late:%d" % self._added), *got]


class LoadedHostStallsAWait(DelegatingTransport):
    STALL_S = 1.0

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self._stalled = False

    def wait(self, timeout: float) -> None:
        self.inner.wait(timeout)
        if timeout > 0 and not self._stalled:
            self._stalled = True
            time.sleep(self.STALL_S)


def late_detached_transfers(name: str, inner: str = "shm", **options: Any) -> Transport:
    return LateDetachedTransfers(create(inner, name, **options))


def late_foreign_notifications(name: str, inner: str = "shm", **options: Any) -> Transport:
    return LateForeignNotifications(create(inner, name, **options))


def loaded_host_stalls_a_wait(name: str, inner: str = "shm", **options: Any) -> Transport:
    return LoadedHostStallsAWait(create(inner, name, **options))
