"""Registration of memory and of peers: deregistered memory refused, each registration
undone exactly, peers refreshed and removed, foreign metadata refused, and each claimed
memory kind moved."""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
import numpy as np
import pytest

from kvwire.errors import TransportError
from kvwire.peer.agent import PeerAgent
from kvwire.transport import XferState, region_of_array, region_of_tensor
from kvwire_conformance import memory
from kvwire_conformance.base import SuiteBase
from kvwire_conformance.capabilities import capability
from kvwire_conformance.extras import counts
from kvwire_conformance.link import Link, seed
from kvwire_conformance.resources import leaks_after, snapshot


class RegistrationTests(SuiteBase):
    """``register``/``deregister`` and ``add_peer``/``remove_peer`` do exactly what they name."""

    @capability("read", "dram")
    def test_deregistered_memory_is_refused(self, link: Link) -> None:
        pr = link.peer_regions["numpy"]
        extra = np.zeros(1 << 20, dtype=np.uint8)
        handle = link.local.register([region_of_array(extra)])
        local = memory.descs(int(extra.ctypes.data), np.array([5]), np.array([1000]))
        remote = memory.descs(pr.addr, np.array([7]), np.array([1000]))
        link.peer.fill(pr.addr, 4096, seed("dereg"))
        xfer = link.local.read(link.peer_name, local, remote)
        assert link.wait(xfer) is XferState.DONE
        link.local.release(xfer)
        assert np.array_equal(extra[5:1005], memory.pattern(seed("dereg"), 4096)[7:1007])
        link.local.deregister(handle)
        self.expect_rejected(
            link, lambda: link.local.read(link.peer_name, local, remote), "READ into deregistered"
        )
        self.roundtrip(link, tag="after-deregister")

    @capability("read", "dram")
    def test_deregistering_each_registration(self, link: Link) -> None:
        """Contract: ``deregister`` removes exactly the registration it names (first,
        middle or last), whose memory is then refused while the others keep working;
        handles are never reused; deregistering twice, or a handle the agent never issued,
        raises TransportError."""
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

    @capability("read", "dram")
    def test_re_adding_a_peer_refreshes_it(self, link: Link) -> None:
        """Contract: ``add_peer`` with the metadata of a peer already known (a refresh after
        it registered more memory, or a repeat) returns the same name, makes every region
        in the new metadata usable, and frees what the old entry held; ``remove_peer``
        makes the name unknown (posts raise) until it is added again."""
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

    @capability("vram")
    def test_a_vram_claim_moves_vram(self, link: Link) -> None:
        """Contract: a claimed memory kind is moved like any other; on a host without a GPU
        a VRAM claim is reported as not checked, never as passed."""
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
