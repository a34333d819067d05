"""A transport wrapper that injects faults, around any transport, for tests and drills.

``FaultyTransport(inner, drop_notifications=0.1, ...)`` behaves like ``inner`` except that,
with the given probabilities and a seeded random source, it drops, duplicates, delays or
reorders the notifications it hands out, fails posts, polls or releases, and turns DONE into
FAILED. It builds on :class:`kvwire.transport.DelegatingTransport`, the plain forwarding
base, handy for writing other deliberately broken variants. The factory :func:`faulty`
makes the wrapper loadable by name, so a conformance run can target it::

    kvwire conformance kvwire.testing.faulty_transport:faulty \
        -o inner=shm -o duplicate_notifications=0.2
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

from kvwire.errors import ConfigError, TransferFailedError, TransportError
from kvwire.transport import DelegatingTransport, Descs, Transport, XferState, create

_PROBABILITIES = (
    "drop_notifications",
    "duplicate_notifications",
    "delay_notifications",
    "fail_posts",
    "fail_polls",
    "fail_releases",
    "done_to_failed",
)


class FaultyTransport(DelegatingTransport):
    """``inner`` with injected faults; every probability defaults to 0 (no fault).

    Notification faults act where notifications are handed out (``drain_notifications``),
    so wrap the receiving agent. A delayed notification is held for ``delay_s`` seconds;
    ``reorder_notifications`` shuffles every batch a drain returns. A handle flipped from
    DONE to FAILED stays FAILED.
    """

    def __init__(
        self,
        inner: Transport,
        *,
        seed: int = 0,
        drop_notifications: float = 0.0,
        duplicate_notifications: float = 0.0,
        delay_notifications: float = 0.0,
        delay_s: float = 0.05,
        reorder_notifications: bool = False,
        fail_posts: float = 0.0,
        fail_polls: float = 0.0,
        fail_releases: float = 0.0,
        done_to_failed: float = 0.0,
    ) -> None:
        super().__init__(inner)
        self.p = {
            "drop_notifications": drop_notifications,
            "duplicate_notifications": duplicate_notifications,
            "delay_notifications": delay_notifications,
            "fail_posts": fail_posts,
            "fail_polls": fail_polls,
            "fail_releases": fail_releases,
            "done_to_failed": done_to_failed,
        }
        for key, value in self.p.items():
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{key} must be a probability in [0, 1], got {value}")
        self.delay_s = delay_s
        self.reorder = reorder_notifications
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._held: list[tuple[float, tuple[str, bytes]]] = []
        self._flipped: set[int] = set()
        self.injected: dict[str, int] = dict.fromkeys(_PROBABILITIES, 0)
        """How many times each fault fired, for a test to assert on."""

    def _roll(self, fault: str) -> bool:
        with self._lock:
            hit = self._rng.random() < self.p[fault]
            if hit:
                self.injected[fault] += 1
            return hit

    def read(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        if self._roll("fail_posts"):
            raise TransferFailedError("injected fault: READ post failed")
        return self.inner.read(peer, local, remote, notify)

    def write(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        if self._roll("fail_posts"):
            raise TransferFailedError("injected fault: WRITE post failed")
        return self.inner.write(peer, local, remote, notify)

    def poll(self, handle: object) -> XferState:
        if self._roll("fail_polls"):
            raise TransportError("injected fault: poll failed")
        state = self.inner.poll(handle)
        if id(handle) in self._flipped:
            return XferState.FAILED
        if state is XferState.DONE and self._roll("done_to_failed"):
            self._flipped.add(id(handle))
            return XferState.FAILED
        return state

    def failure_reason(self, handle: object) -> str | None:
        if id(handle) in self._flipped:
            return "injected fault: DONE turned FAILED"
        return super().failure_reason(handle)

    def release(self, handle: object) -> None:
        if self._roll("fail_releases"):
            raise TransportError("injected fault: release failed")
        self.inner.release(handle)
        self._flipped.discard(id(handle))

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        now = time.monotonic()
        out: list[tuple[str, bytes]] = []
        with self._lock:
            due = [item for when, item in self._held if when <= now]
            self._held = [(when, item) for when, item in self._held if when > now]
        out.extend(due)
        for item in self.inner.drain_notifications():
            if self._roll("drop_notifications"):
                continue
            if self._roll("delay_notifications"):
                with self._lock:
                    self._held.append((now + self.delay_s, item))
                continue
            out.append(item)
            if self._roll("duplicate_notifications"):
                out.append(item)
        if self.reorder and len(out) > 1:
            with self._lock:
                self._rng.shuffle(out)
        return out

    def wait(self, timeout: float) -> None:
        with self._lock:
            soonest = min((when for when, _ in self._held), default=None)
        if soonest is not None:
            timeout = max(0.0, min(timeout, soonest - time.monotonic()))
        self.inner.wait(timeout)


def faulty(
    name: str, *, inner: str, inner_options: dict[str, Any] | None = None, **faults: Any
) -> Transport:
    """Factory form: ``faulty(name, inner="shm", drop_notifications=0.1, ...)``."""
    agent = create(inner, name, **(inner_options or {}))
    try:
        return FaultyTransport(agent, **faults)
    except TypeError as exc:
        agent.close()
        raise ConfigError(f"faulty transport: {exc}") from exc
    except ConfigError:
        agent.close()
        raise
