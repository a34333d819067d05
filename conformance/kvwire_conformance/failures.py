"""Failures the transport must report, never hide: bad descriptors, and peers that die
before, during and after transfers, holding each kind of memory."""

from __future__ import annotations

import contextlib
import functools
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from kvwire.errors import TransportError
from kvwire.peer.agent import PeerAgent
from kvwire.transport import XferState
from kvwire_conformance import memory
from kvwire_conformance.base import SuiteBase
from kvwire_conformance.capabilities import capability
from kvwire_conformance.link import Link, seed
from kvwire_conformance.pairs import REGION_COUNTS, Pair, new_pair
from kvwire_conformance.paths import new_solo

DEFECTS = [
    "remote-past-region",
    "remote-straddles-end",
    "local-past-region",
    "local-straddles-end",
    "local-unregistered",
    "unknown-peer",
    "length-mismatch",
    "count-mismatch",
    "wrong-shape",
]
"""What is wrong with each bad post."""


class FailureTests(SuiteBase):
    """A bad post or a dead peer ends in a TransportError or FAILED: never DONE, a crash
    or a hang, and the agent keeps working for everyone else."""

    @pytest.fixture(scope="class")
    @classmethod
    def pairs(cls, link: Link) -> Iterator[dict[str, Pair]]:
        """A fresh pair per region count (one, several), both sides alike."""
        out: dict[str, Pair] = {}
        try:
            if link.local_regions:
                for label, count in REGION_COUNTS.items():
                    out[label] = new_pair(link, count, cls.timeout)
            yield out
        finally:
            for pair in out.values():
                pair.close()

    @capability("{op}", "dram")
    @pytest.mark.parametrize("defect", DEFECTS)
    @pytest.mark.parametrize("regions", list(REGION_COUNTS))
    @pytest.mark.parametrize("op", ["read", "write"])
    def test_bad_descriptors_are_a_transport_error(
        self, link: Link, pairs: dict[str, Pair], regions: str, defect: str, op: str
    ) -> None:
        """Contract: a descriptor outside the registered memory of its side (past a
        region's end, straddling it, or never registered), an unknown peer and malformed
        arrays raise TransportError or end FAILED, whether that side registered one
        region or several; memory past each region's end is mapped, so a missed bound
        check shows as DONE."""
        pair = pairs[regions]
        (laddr, lbytes), (raddr, rbytes) = pair.local[-1], pair.remote[-1]
        stray = np.zeros(1 << 16, dtype=np.uint8)
        peer = pair.peer_name
        local = memory.descs(laddr, np.array([64]), np.array([256]))
        remote = memory.descs(raddr, np.array([64]), np.array([256]))
        if defect == "remote-past-region":
            remote = memory.descs(raddr + rbytes + 4096, np.array([0]), np.array([256]))
        elif defect == "remote-straddles-end":
            remote = memory.descs(raddr, np.array([rbytes - 100]), np.array([256]))
        elif defect == "local-past-region":
            local = memory.descs(laddr + lbytes + 4096, np.array([0]), np.array([256]))
        elif defect == "local-straddles-end":
            local = memory.descs(laddr, np.array([lbytes - 100]), np.array([256]))
        elif defect == "local-unregistered":
            local = memory.descs(int(stray.ctypes.data), np.array([0]), np.array([256]))
        elif defect == "unknown-peer":
            peer = f"no-such-agent-{uuid.uuid4().hex[:6]}"
        elif defect == "length-mismatch":
            remote = memory.descs(raddr, np.array([64]), np.array([512]))
        elif defect == "count-mismatch":
            remote = memory.descs(raddr, np.array([64, 4096]), np.array([128, 128]))
        else:
            local = local[:, :2].copy()
        post = getattr(pair.agent, op)
        self.expect_rejected(
            link, lambda: post(peer, local, remote), f"{op} with {defect} ({regions})", pair.agent
        )
        pair.roundtrip(self.timeout, f"after-{defect}-{regions}")

    def _doomed_peer(self, link: Link) -> tuple[PeerAgent, str, dict[str, int]]:
        doomed = PeerAgent(
            link.spec.transport, link.spec.options, env=link.spec.env, timeout=self.timeout
        )
        region = doomed.alloc(self.region_bytes)
        doomed.fill(region["addr"], region["nbytes"], seed("doomed"))
        name = link.local.add_peer(doomed.metadata())
        return doomed, name, region

    @capability("cross_process", "read", "write", "dram")
    def test_transfers_to_a_dead_peer_fail(self, link: Link) -> None:
        lr = link.local_regions["numpy"]
        doomed, name, region = self._doomed_peer(link)
        local = memory.descs(lr.addr, np.array([0]), np.array([65536]))
        remote = memory.descs(region["addr"], np.array([0]), np.array([65536]))
        handle = link.local.read(name, local, remote)
        assert link.wait(handle) is XferState.DONE, "a READ from a live peer failed"
        link.local.release(handle)
        doomed.die()
        self.expect_rejected(link, lambda: link.local.read(name, local, remote), "READ, dead peer")
        self.expect_rejected(
            link, lambda: link.local.write(name, local, remote), "WRITE, dead peer"
        )
        with contextlib.suppress(TransportError):
            link.local.notify(name, b"anyone there?")
        with contextlib.suppress(TransportError):
            link.local.remove_peer(name)
        self.roundtrip(link, tag="other-peer-after-death")

    @capability("cross_process", "read", "dram")
    def test_peer_dying_mid_transfer_is_never_done_with_wrong_data(self, link: Link) -> None:
        lr = link.local_regions["numpy"]
        doomed, name, region = self._doomed_peer(link)
        lr.view[:] = 0
        per, chunk = 64, 64 << 10
        handles = []
        for i in range(lr.nbytes // (per * chunk)):
            offsets = np.arange(per, dtype=np.int64) * chunk + i * per * chunk
            lengths = np.full(per, chunk, dtype=np.int64)
            handles.append(
                link.local.read(
                    name,
                    memory.descs(lr.addr, offsets, lengths),
                    memory.descs(region["addr"], offsets, lengths),
                )
            )
        doomed.die()
        states = [link.wait(h) for h in handles]
        assert XferState.PENDING not in states, "a transfer hung after its peer died"
        source = memory.pattern(seed("doomed"), region["nbytes"])
        span = per * chunk
        for i, state in enumerate(states):
            if state is XferState.DONE:
                window = slice(i * span, (i + 1) * span)
                assert np.array_equal(lr.view[window], source[window]), (
                    f"transfer {i} reported DONE but its bytes are not all there"
                )
            link.local.release(handles[i])
        local = memory.descs(lr.addr, np.array([0]), np.array([4096]))
        remote = memory.descs(region["addr"], np.array([0]), np.array([4096]))
        self.expect_rejected(link, lambda: link.local.read(name, local, remote), "after death")

    @capability("cross_process", "read", "write", "dram")
    def test_a_peer_dying_holding_each_kind_of_memory(self, link: Link) -> None:
        """Contract: once a peer is dead, transfers to it end FAILED (or raise), whatever
        memory it held, even memory this agent could still reach (a mapping)."""
        lr = next(iter(link.local_regions.values()))
        for alloc in link.spec.allocators:
            doomed = new_solo(link, alloc, (1 << 20,), self.timeout)
            try:
                region = doomed.remote[0]
                local = memory.descs(lr.addr, np.array([0]), np.array([65536]))
                remote = memory.descs(region.addr, np.array([0]), np.array([65536]))
                handle = link.local.read(doomed.name, local, remote)
                assert link.wait(handle) is XferState.DONE, f"[{alloc}] a live READ failed"
                link.local.release(handle)
                doomed.agent.die()
                for op in ("read", "write"):
                    post = functools.partial(getattr(link.local, op), doomed.name, local, remote)
                    self.expect_rejected(link, post, f"[{alloc}] {op} from a dead peer")
            finally:
                doomed.agent.kill()
                with contextlib.suppress(TransportError):
                    link.local.remove_peer(doomed.name)
        self.roundtrip(link, tag="after-deaths")
