"""Deliberately broken shm variants: the conformance suite must fail each of them.

Loaded by name (``kvwire_broken_shm:<factory>``) in the suite's subprocesses, so this file
sits on their PYTHONPATH rather than being imported by the tests.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kvwire_shm import ShmTransport

from kvwire.faults import DelegatingTransport
from kvwire.transport import Descs, Transport, XferState


class _DropsLastDescriptor(DelegatingTransport):
    def read(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        return self.inner.read(peer, local[:-1], remote[:-1], notify)

    def write(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        return self.inner.write(peer, local[:-1], remote[:-1], notify)


class _DoneBeforeCopy(DelegatingTransport):
    def poll(self, handle: object) -> XferState:
        state = self.inner.poll(handle)
        return XferState.DONE if state is XferState.PENDING else state


class _NotifiesBeforeData(DelegatingTransport):
    """Sends the notification, then holds the data back a while before moving it.

    The hold widens the window in which the peer, woken by the early notification, reads
    stale memory: without it, this bug is a race the suite would usually (not always) win.
    """

    HOLD_S = 0.3

    def read(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        if notify is not None:
            self.inner.notify(peer, notify)
            time.sleep(self.HOLD_S)
        return self.inner.read(peer, local, remote)

    def write(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        if notify is not None:
            self.inner.notify(peer, notify)
            time.sleep(self.HOLD_S)
        return self.inner.write(peer, local, remote)


class _LeaksThreadOnClose(DelegatingTransport):
    def close(self) -> None:
        self.inner.close()
        threading.Thread(target=threading.Event().wait, name="forgotten", daemon=True).start()


def drops_last_descriptor(name: str, **options: Any) -> Transport:
    return _DropsLastDescriptor(ShmTransport(name, **options))


def done_before_copy(name: str, **options: Any) -> Transport:
    return _DoneBeforeCopy(ShmTransport(name, **options))


def notifies_before_data(name: str, **options: Any) -> Transport:
    return _NotifiesBeforeData(ShmTransport(name, **options))


def leaks_thread_on_close(name: str, **options: Any) -> Transport:
    return _LeaksThreadOnClose(ShmTransport(name, **options))
