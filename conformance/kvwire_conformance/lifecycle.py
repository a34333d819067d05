"""Tests of what an agent does over time: calls repeated, undone, refused, and counted.

Each test names the clause of the contract it checks in its docstring. Resources are
measured through ``/proc/self`` (:mod:`kvwire_conformance.resources`), through weak
references to released handles, and through the adapter's own ``resource_counts()``
when it has one.
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
import numpy as np
import pytest

from kvwire.errors import TransportError
from kvwire.peer.agent import PeerAgent
from kvwire.transport import MemKind, XferState, region_of_array, region_of_tensor
from kvwire_conformance import memory
from kvwire_conformance.resources import leaks_after, snapshot

if TYPE_CHECKING:
    from kvwire_conformance.suite import Link

capability = pytest.mark.kvwire_capability

WAIT_SLACK_S = 0.5
"""How far past its timeout ``wait`` may return: scheduling on a loaded host, never a
deliberate sleep (an adapter that sleeps whole seconds, or 1000x, fails)."""
ROUNDS = 200
"""Transfers and releases between two resource measurements."""


def counts(agent: object) -> dict[str, int]:
    """The adapter's own ``resource_counts()`` (through wrappers' ``.inner``), or {}."""
    while agent is not None:
        count = getattr(agent, "resource_counts", None)
        if count is not None:
            return {str(k): int(v) for k, v in count().items()}
        agent = getattr(agent, "inner", None)
    return {}


def _small_rows(link: Link, i: int) -> tuple[memory.I64, memory.I64]:
    lr, pr = link.local_regions["numpy"], link.peer_regions["numpy"]
    at = np.array([(i % 512) * 4096 + 7])
    return (
        memory.descs(lr.addr, at, np.array([1000])),
        memory.descs(pr.addr, at + 5, np.array([1000])),
    )


class LifecycleTests:
    """Mixed into :class:`~kvwire_conformance.suite.TransportSuite`."""

    timeout: ClassVar[float]
    require: Any
    expect_rejected: Any
    roundtrip: Any

    def _churn(self, link: Link, rounds: int) -> None:
        """``rounds`` small transfers, each waited for and released, some notifying."""
        for i in range(rounds):
            local, remote = _small_rows(link, i)
            post = link.local.write if i % 2 else link.local.read
            note = f"churn:{i}".encode() if link.caps.notifications and i % 4 == 0 else None
            handle = post(link.peer_name, local, remote, note)
            assert link.wait(handle) is XferState.DONE, "a small transfer failed"
            link.local.release(handle)
        if link.caps.notifications:
            link.peer.drain(at_least=(rounds + 3) // 4, timeout=self.timeout)

    # -- release ----------------------------------------------------------------------

    @capability("read")
    def test_release_lets_go_of_each_transfer(self, link: Link) -> None:
        """Contract: after ``release`` the agent keeps nothing of the transfer: released
        handles are garbage once the caller drops them, and the adapter's own counts of
        what it holds return to where they were."""
        self.require(link, "read", "write", "dram")
        self._churn(link, 8)
        before = counts(link.local)
        refs: list[weakref.ref[Any]] = []
        for i in range(ROUNDS):
            local, remote = _small_rows(link, i)
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

    @capability("read")
    def test_transfers_and_releases_return_resources_to_baseline(self, link: Link) -> None:
        """Contract: a run of transfers, releases and notifications leaves the process's
        threads, file descriptors and shared mappings, and the adapter's own counts, as
        they were."""
        self.require(link, "read", "write", "dram")
        self._churn(link, 16)  # lets lazily started machinery start
        before, own = snapshot(), counts(link.local)
        self._churn(link, ROUNDS)
        leaks = leaks_after(before, timeout=5.0)
        assert not leaks, f"after {ROUNDS} transfers: " + "; ".join(leaks)
        assert counts(link.local) == own, f"resource_counts() grew: {own} -> {counts(link.local)}"

    # -- polling ----------------------------------------------------------------------

    @capability("read")
    def test_a_finished_handle_polls_the_same_every_time(self, link: Link) -> None:
        """Contract: DONE and FAILED are final; ``poll`` may be called any number of times
        before ``release`` (every ``link.wait`` in the suite also re-polls)."""
        self.require(link, "read", "dram")
        local, remote = _small_rows(link, 1)
        handle = link.local.read(link.peer_name, local, remote)
        assert link.wait(handle) is XferState.DONE
        states = [link.local.poll(handle) for _ in range(5)]
        link.local.release(handle)
        assert states == [XferState.DONE] * 5, [s.name for s in states]

    # -- wait -------------------------------------------------------------------------

    def test_wait_returns_within_its_timeout(self, link: Link) -> None:
        """Contract: ``wait(timeout)`` returns after at most ``timeout`` seconds when
        nothing happens (plus scheduling slack), and at once for 0."""
        with contextlib.suppress(TransportError):
            link.local.drain_notifications()
        for timeout in (0.0, 0.001, 0.02, 0.1, 0.02):
            start = time.monotonic()
            link.local.wait(timeout)
            took = time.monotonic() - start
            assert took <= timeout + WAIT_SLACK_S, f"wait({timeout}) took {took:.3f} s"

    # -- peers ------------------------------------------------------------------------

    @capability("read")
    def test_re_adding_a_peer_refreshes_it(self, link: Link) -> None:
        """Contract: ``add_peer`` with the metadata of a peer already known (a refresh after
        it registered more memory, or a repeat) returns the same name, makes every region
        in the new metadata usable, and frees what the old entry held; ``remove_peer``
        makes the name unknown (posts raise) until it is added again."""
        self.require(link, "read", "dram")
        lr = link.local_regions["numpy"]
        peer = PeerAgent(
            link.spec.transport, link.spec.options, env=link.spec.env, timeout=self.timeout
        )
        try:
            first = peer.alloc(1 << 20)
            peer.fill(first["addr"], first["nbytes"], 11)
            link.peer.metadata()  # anything lazily set up for metadata is set up by now
            before, own = snapshot(), counts(link.local)
            name = link.local.add_peer(peer.metadata())
            assert link.local.add_peer(peer.metadata()) == name, "a repeat add_peer renamed it"
            self._check_read(link, name, lr.addr, first["addr"], 11, "after a repeat add_peer")
            second = peer.alloc(1 << 20, link.spec.allocators[-1])
            peer.fill(second["addr"], second["nbytes"], 12)
            fresh = peer.metadata()
            assert link.local.add_peer(fresh) == name
            self._check_read(link, name, lr.addr, second["addr"], 12, "a region added later")
            self._check_read(link, name, lr.addr, first["addr"], 11, "an earlier region")
            for round_ in range(10):
                assert link.local.add_peer(fresh) == name
                self._check_read(link, name, lr.addr, second["addr"], 12, f"re-add {round_}")
            link.local.remove_peer(name)
            local = memory.descs(lr.addr, np.array([0]), np.array([64]))
            remote = memory.descs(first["addr"], np.array([0]), np.array([64]))
            with pytest.raises(TransportError):
                link.local.read(name, local, remote)
                pytest.fail("a READ naming a removed peer was accepted")
            assert link.local.add_peer(fresh) == name
            self._check_read(link, name, lr.addr, first["addr"], 11, "added after removal")
            link.local.remove_peer(name)
            leaks = leaks_after(before, timeout=5.0)
            assert not leaks, "a peer added 14 times, then removed: " + "; ".join(leaks)
            assert counts(link.local) == own, f"resource_counts(): {own} -> {counts(link.local)}"
        finally:
            with contextlib.suppress(TransportError):
                link.local.remove_peer(peer.agent_name)
            peer.close(10.0)

    def _check_read(
        self, link: Link, peer: str, laddr: int, raddr: int, seed: int, what: str
    ) -> None:
        n = 8192
        handle = link.local.read(
            peer,
            memory.descs(laddr, np.array([0]), np.array([n])),
            memory.descs(raddr, np.array([100]), np.array([n])),
        )
        state = link.wait(handle)
        assert state is XferState.DONE, f"{what}: READ ended {state.name}"
        link.local.release(handle)
        got = memory.view(laddr, n)
        assert np.array_equal(got, memory.pattern(seed, 1 << 20)[100 : 100 + n]), (
            f"{what}: wrong bytes"
        )

    def test_foreign_metadata_is_refused(self, link: Link) -> None:
        """Contract: ``add_peer`` of a blob that is not this transport's metadata (empty,
        garbage, another encoder's, truncated) raises TransportError (PeerMetadataError),
        never a decoder's exception, and leaves the agent working."""
        real = link.peer.metadata()
        blobs = {
            "empty": b"",
            "one zero byte": b"\x00",
            "0xff bytes": b"\xff" * 64,
            "random bytes": memory.pattern(7, 512).tobytes(),
            "msgpack map": msgspec.msgpack.encode({"name": "x", "addr": 1}),
            "msgpack ints": msgspec.msgpack.encode(list(range(8))),
            "json": b'{"agent": "x", "regions": []}',
            "truncated": real[: len(real) // 2],
            "first byte": real[:1],
        }
        wrong = []
        for what, blob in blobs.items():
            try:
                link.local.add_peer(blob)
            except TransportError:
                continue
            except Exception as exc:
                wrong.append(f"{what}: {type(exc).__name__}")
            else:
                wrong.append(f"{what}: accepted")
        assert not wrong, "foreign metadata not refused with a TransportError: " + ", ".join(wrong)
        self.roundtrip(link, tag="after-foreign-metadata")

    # -- registrations ----------------------------------------------------------------

    @capability("read")
    def test_deregistering_each_registration(self, link: Link) -> None:
        """Contract: ``deregister`` removes exactly the registration it names (first,
        middle or last), whose memory is then refused while the others keep working;
        handles are never reused; deregistering twice, or a handle the agent never issued,
        raises TransportError."""
        self.require(link, "read", "dram")
        pr = link.peer_regions["numpy"]
        link.peer.fill(pr.addr, 1 << 16, 21)
        arrays = [np.zeros(1 << 16, dtype=np.uint8) for _ in range(4)]
        handles = [link.local.register([region_of_array(a)]) for a in arrays[:3]]

        def works(i: int) -> bool:
            local = memory.descs(int(arrays[i].ctypes.data), np.array([3]), np.array([500]))
            remote = memory.descs(pr.addr, np.array([9]), np.array([500]))
            try:
                handle = link.local.read(link.peer_name, local, remote)
            except TransportError:
                return False
            state = link.wait(handle)
            link.local.release(handle)
            return state is XferState.DONE

        try:
            assert all(works(i) for i in range(3)), "a fresh registration was refused"
            dead: set[int] = set()
            for victim in (1, 0, 2):  # middle, first, last
                link.local.deregister(handles[victim])
                dead.add(victim)
                assert not works(victim), f"memory of deregistered handle {victim} still used"
                live = [i for i in range(len(handles)) if i not in dead]
                assert all(works(i) for i in live), f"deregistering {victim} broke another"
                with pytest.raises(TransportError):
                    link.local.deregister(handles[victim])
                    pytest.fail("deregistering the same handle twice was accepted")
                if victim == 1:
                    handles.append(link.local.register([region_of_array(arrays[3])]))
                    with pytest.raises(TransportError):
                        link.local.deregister(handles[1])
                        pytest.fail("an old handle removed a newer registration")
                    assert works(3), "a newer registration was lost to an old handle"
            for bogus in (object(), None, 0, -1, 2**62, "handle", 1.5):
                with pytest.raises(TransportError):
                    link.local.deregister(bogus)
                    pytest.fail(f"deregister({bogus!r}) was accepted")
            assert works(3)
        finally:
            for handle in handles[3:]:
                with contextlib.suppress(TransportError):
                    link.local.deregister(handle)
        self.roundtrip(link, tag="after-deregistering")

    # -- capabilities -----------------------------------------------------------------

    @capability("vram")
    def test_a_vram_claim_moves_vram(self, link: Link) -> None:
        """Contract: a claimed memory kind is moved like any other; on a host without a GPU
        a VRAM claim is reported as not checked, never as passed."""
        if MemKind.VRAM not in link.caps.mem_kinds:
            pytest.skip("transport does not claim VRAM")
        torch = _torch_with_cuda()
        if torch is None:
            pytest.skip("could not check the VRAM claim: no CUDA device on this host")
        pr = link.peer_regions["numpy"]
        n = 1 << 20
        link.peer.fill(pr.addr, n, 31)
        tensor = torch.zeros(n, dtype=torch.uint8, device="cuda")
        handle = link.local.register([region_of_tensor(tensor)])
        try:
            vram = memory.descs(int(tensor.data_ptr()), np.array([0]), np.array([n]))
            vram[:, 2] = tensor.device.index or 0
            remote = memory.descs(pr.addr, np.array([0]), np.array([n]))
            xfer = link.local.read(link.peer_name, vram, remote)
            assert link.wait(xfer) is XferState.DONE, "a READ into VRAM failed"
            link.local.release(xfer)
            got = tensor.cpu().numpy()
            assert np.array_equal(got, memory.pattern(31, n)), "VRAM holds the wrong bytes"
            tensor.fill_(7)
            torch.cuda.synchronize()
            xfer = link.local.write(link.peer_name, vram, remote)
            assert link.wait(xfer) is XferState.DONE, "a WRITE from VRAM failed"
            link.local.release(xfer)
            back = np.frombuffer(link.peer.read(remote), dtype=np.uint8)
            assert (back == 7).all(), "a WRITE from VRAM left the wrong bytes"
        finally:
            link.local.deregister(handle)


def _torch_with_cuda() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None
