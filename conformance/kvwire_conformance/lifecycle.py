"""What an agent does over time: transfers released (running, finished, many), handles
polled and refused, ``wait`` bounded, and ``close`` leaving nothing and refusing after.

Each test names the clause of the contract it checks in its docstring. Resources are
measured through ``/proc/self`` (:mod:`kvwire_conformance.resources`), through weak
references to released handles, and through the adapter's own ``resource_counts()``
(:class:`~kvwire_conformance.extras.CountsResources`) when it has one.
"""

from __future__ import annotations

import contextlib
import gc
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvwire.errors import TransportError
from kvwire.transport import XferState, create, region_of_array, wait_for
from kvwire_conformance import memory
from kvwire_conformance.base import SuiteBase
from kvwire_conformance.capabilities import capability
from kvwire_conformance.extras import counts
from kvwire_conformance.link import Link
from kvwire_conformance.resources import leaks_after, snapshot

WAIT_SLACK_S = 0.5
"""How far past its timeout ``wait`` may return: scheduling on a loaded host, never a
deliberate sleep (an adapter that sleeps whole seconds, or 1000x, fails)."""
WAIT_TRIES = 3
"""Tries of each ``wait`` timeout, one of which must return within the slack."""
ROUNDS = 200
"""Transfers and releases between two resource measurements."""


def small_rows(link: Link, i: int) -> tuple[memory.I64, memory.I64]:
    lr, pr = link.local_regions["numpy"], link.peer_regions["numpy"]
    at = np.array([(i % 512) * 4096 + 7])
    return (
        memory.descs(lr.addr, at, np.array([1000])),
        memory.descs(pr.addr, at + 5, np.array([1000])),
    )


class LifecycleTests(SuiteBase):
    """Release, poll, wait and close, and the resources each must give back."""

    def _churn(self, link: Link, rounds: int) -> None:
        """``rounds`` small transfers, each waited for and released, some notifying."""
        for i in range(rounds):
            local, remote = small_rows(link, i)
            post = link.local.write if i % 2 else link.local.read
            note = f"churn:{i}".encode() if link.caps.notifications and i % 4 == 0 else None
            handle = post(link.peer_name, local, remote, note)
            assert link.wait(handle) is XferState.DONE, "a small transfer failed"
            link.local.release(handle)
        if link.caps.notifications:
            link.peer.drain(at_least=(rounds + 3) // 4, timeout=self.timeout)

    @capability("read", "dram")
    def test_release_of_a_running_transfer(self, link: Link) -> None:
        """Contract: ``release`` of a running transfer is safe (it aborts or detaches, or
        raises and the handle stays valid); afterwards ``poll`` and ``release`` raise.

        A detached transfer may go on landing bytes after ``release``, after the next
        transfer is DONE, even into a later test: its destination is memory of its own,
        kept registered and alive until the agent closes, that nothing else reads."""
        pr = link.peer_regions["numpy"]
        lengths = np.full(8192, 4096, dtype=np.int64)
        offsets = np.arange(8192, dtype=np.int64) * 4096
        target = memory.allocate("numpy", int(lengths.sum()))
        link.local.register([region_of_array(target)])
        link.detached.append(target)
        handle = link.local.read(
            link.peer_name,
            memory.descs(int(target.ctypes.data), offsets, lengths),
            memory.descs(pr.addr, offsets, lengths),
        )
        try:
            link.local.release(handle)
        except TransportError:
            # Allowed: a transport that cannot abort says so; it must then finish and let go.
            assert link.wait(handle) is not XferState.PENDING
            link.local.release(handle)
        with pytest.raises(TransportError):
            link.local.poll(handle)
        with pytest.raises(TransportError):
            link.local.release(handle)
        self.roundtrip(link, tag="after-release")

    @capability("read", "write", "dram")
    def test_release_lets_go_of_each_transfer(self, link: Link) -> None:
        """Contract: after ``release`` the agent keeps nothing of the transfer: released
        handles are garbage once the caller drops them, and the adapter's own counts of
        what it holds return to where they were."""
        self._churn(link, 8)
        before = counts(link.local)
        refs: list[weakref.ref[Any]] = []
        for i in range(ROUNDS):
            local, remote = small_rows(link, i)
            handle = link.local.read(link.peer_name, local, remote)
            assert link.wait(handle) is XferState.DONE
            link.local.release(handle)
            with contextlib.suppress(TypeError):  # ints and such cannot be weakly referenced
                refs.append(weakref.ref(handle))
            del handle
        if not refs and not before:
            pytest.skip(
                "could not check: handles are not weakly referenceable and the adapter "
                "offers no resource_counts()"
            )
        deadline = time.monotonic() + 5.0
        while True:
            gc.collect()
            alive = sum(ref() is not None for ref in refs)
            after = counts(link.local)
            if (alive <= 1 and after == before) or time.monotonic() > deadline:
                break
            link.local.wait(0.05)
        assert alive <= 1, f"{alive} of {len(refs)} released transfers are still held"
        assert after == before, f"resource_counts() {before} before, {after} after release"

    @capability("read", "write", "dram")
    def test_transfers_and_releases_return_resources_to_baseline(self, link: Link) -> None:
        """Contract: a run of transfers, releases and notifications leaves the process's
        threads, file descriptors and shared mappings, and the adapter's own counts, as
        they were."""
        self._churn(link, 16)  # lets lazily started machinery start
        before, own = snapshot(), counts(link.local)
        self._churn(link, ROUNDS)
        leaks = leaks_after(before, timeout=5.0)
        assert not leaks, f"after {ROUNDS} transfers: " + "; ".join(leaks)
        assert counts(link.local) == own, f"resource_counts() grew: {own} -> {counts(link.local)}"

    @capability("read", "dram")
    def test_a_finished_handle_polls_the_same_every_time(self, link: Link) -> None:
        """Contract: DONE and FAILED are final; ``poll`` may be called any number of times
        before ``release`` (every ``link.wait`` in the suite also re-polls)."""
        local, remote = small_rows(link, 1)
        handle = link.local.read(link.peer_name, local, remote)
        assert link.wait(handle) is XferState.DONE
        states = [link.local.poll(handle) for _ in range(5)]
        link.local.release(handle)
        assert states == [XferState.DONE] * 5, [s.name for s in states]

    def test_foreign_handles_are_rejected(self, link: Link) -> None:
        for bogus in (object(), None, 12345, "handle"):
            with pytest.raises(TransportError):
                link.local.poll(bogus)
            with pytest.raises(TransportError):
                link.local.release(bogus)

    def test_wait_returns_within_its_timeout(self, link: Link) -> None:
        """Contract: ``wait(timeout)`` returns after at most ``timeout`` seconds when
        nothing happens (plus scheduling slack), and at once for 0.

        Each timeout gets :data:`WAIT_TRIES` tries and one must keep the bound: a loaded
        host may stall any single call past the slack, never every one, while an adapter
        that oversleeps does so each time."""
        with contextlib.suppress(TransportError):
            link.local.drain_notifications()
        for timeout in (0.0, 0.001, 0.02, 0.1, 0.02):
            took: list[float] = []
            while len(took) < WAIT_TRIES:
                start = time.monotonic()
                link.local.wait(timeout)
                took.append(time.monotonic() - start)
                if took[-1] <= timeout + WAIT_SLACK_S:
                    break
            else:
                pytest.fail(
                    f"wait({timeout}) took " + ", ".join(f"{t:.3f}" for t in took) + " s",
                    pytrace=False,
                )

    def _full_cycle(self, link: Link, tag: str) -> None:
        agent = create(
            link.spec.transport,
            f"kvwire-conformance-{tag}-{uuid.uuid4().hex[:6]}",
            **link.spec.options,
        )
        try:
            array = np.zeros(1 << 20, dtype=np.uint8)
            handle = agent.register([region_of_array(array)])
            peer = agent.add_peer(link.peer.metadata())
            pr = link.peer_regions.get("numpy")
            if pr is not None and agent.capabilities.read:
                xfer = agent.read(
                    peer,
                    memory.descs(int(array.ctypes.data), np.array([0]), np.array([4096])),
                    memory.descs(pr.addr, np.array([0]), np.array([4096])),
                    b"cycle",
                )
                assert wait_for(agent, xfer, self.timeout) is XferState.DONE
                agent.release(xfer)
            if agent.capabilities.notifications:
                agent.notify(peer, b"cycle-plain")
                link.peer.drain(at_least=2, timeout=self.timeout)
            agent.remove_peer(peer)
            agent.deregister(handle)
        finally:
            agent.close()

    @capability("dram", group="close")
    def test_close_leaves_no_threads_fds_or_mappings(self, link: Link) -> None:
        self._full_cycle(link, "warmup")  # lets libraries set up their process-wide state
        before = snapshot()
        self._full_cycle(link, "measured")
        leaks = leaks_after(before, timeout=5.0)
        assert not leaks, "after close(): " + "; ".join(leaks)

    @capability(group="close")
    def test_a_closed_agent_refuses_every_call(self, link: Link) -> None:
        """Contract: after ``close()`` (idempotent) every call raises TransportError."""
        agent = create(
            link.spec.transport,
            f"kvwire-conformance-closed-{uuid.uuid4().hex[:6]}",
            **link.spec.options,
        )
        array = np.zeros(1 << 16, dtype=np.uint8)
        registration = agent.register([region_of_array(array)])
        peer = agent.add_peer(link.peer.metadata())
        one = memory.descs(int(array.ctypes.data), np.array([0]), np.array([64]))
        pr = next(iter(link.peer_regions.values()), None)
        remote = memory.descs(pr.addr, np.array([0]), np.array([64])) if pr else one
        handle: object = None
        if agent.capabilities.read and pr is not None:
            handle = agent.read(peer, one, remote)
            wait_for(agent, handle, self.timeout)
        agent.close()
        agent.close()  # closing twice is harmless
        calls: list[tuple[str, Callable[[], object]]] = [
            ("register", lambda: agent.register([region_of_array(array)])),
            ("deregister", lambda: agent.deregister(registration)),
            ("local_metadata", agent.local_metadata),
            ("add_peer", lambda: agent.add_peer(link.peer.metadata())),
            ("remove_peer", lambda: agent.remove_peer(peer)),
            ("read", lambda: agent.read(peer, one, remote)),
            ("write", lambda: agent.write(peer, one, remote)),
            ("poll", lambda: agent.poll(handle)),
            ("release", lambda: agent.release(handle)),
            ("notify", lambda: agent.notify(peer, b"x")),
            ("drain_notifications", agent.drain_notifications),
            ("wait", lambda: agent.wait(0.0)),
        ]
        wrong = []
        for what, call in calls:
            try:
                call()
            except TransportError:
                continue
            except Exception as exc:
                wrong.append(f"{what} raised {type(exc).__name__}")
            else:
                wrong.append(f"{what} returned")
        assert not wrong, "after close(), not a TransportError: " + ", ".join(wrong)
