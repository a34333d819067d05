"""Fresh connected pairs whose both sides registered a chosen number of regions.

Descriptor checks hide per region count: an adapter may take a fast path when a side
registered exactly one region (no search, one bound) and another for several, and a bug
in either passes a suite that only ever tries one of them. Each :class:`Pair` is a new
agent in this process and a new peer process, each side with ``count`` regions. Every
region is registered short of its allocation (:data:`SLACK` bytes stay mapped after its
end), so a descriptor past a region's end reaches memory: an adapter that skips the bound
check then moves bytes (DONE) instead of faulting, and the test sees it.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvwire.errors import TransportError
from kvwire.peer import protocol as p
from kvwire.peer.agent import PeerAgent
from kvwire.transport import Transport, XferState, create, region_of_array, wait_for
from kvwire_conformance import memory
from kvwire_conformance.link import CLOSE_TIMEOUT_S, Link, close_within, seed

REGION_COUNTS = {"one": 1, "several": 3}
"""The region counts every descriptor check runs against, on both sides."""
REGION_BYTES = 256 << 10
SLACK = 64 << 10
"""Mapped bytes after each registered region's end."""


@dataclass
class Pair:
    """An agent here and a peer process, connected, each with ``count`` regions."""

    agent: Transport
    peer: PeerAgent
    peer_name: str
    local: list[tuple[int, int]] = field(default_factory=list)
    """(address, registered bytes) of each local region."""
    remote: list[tuple[int, int]] = field(default_factory=list)
    arrays: list[Any] = field(default_factory=list)

    def roundtrip(self, timeout: float, tag: str) -> None:
        """A small READ into the last local region that must succeed."""
        (laddr, _), (raddr, _) = self.local[-1], self.remote[-1]
        self.peer.fill(raddr, 4096, seed(tag))
        handle = self.agent.read(
            self.peer_name,
            memory.descs(laddr, np.array([5]), np.array([3000])),
            memory.descs(raddr, np.array([9]), np.array([3000])),
        )
        state = wait_for(self.agent, handle, timeout)
        assert state is XferState.DONE, f"{tag}: a plain READ ended {state.name}"
        self.agent.release(handle)
        got = memory.view(laddr + 5, 3000)
        assert np.array_equal(got, memory.pattern(seed(tag), 4096)[9:3009]), f"{tag}: wrong bytes"

    def close(self) -> None:
        self.peer.close(CLOSE_TIMEOUT_S)
        close_within(self.agent, CLOSE_TIMEOUT_S, "a pair's agent")


def new_pair(link: Link, count: int, timeout: float) -> Pair:
    """A fresh agent here and a fresh peer, ``count`` regions each, connected both ways."""
    spec = link.spec
    agent = create(
        spec.transport, f"kvwire-conformance-pair-{uuid.uuid4().hex[:8]}", **spec.options
    )
    peer: PeerAgent | None = None
    try:
        peer = PeerAgent(spec.transport, spec.options, env=spec.env, timeout=timeout)
        pair = Pair(agent, peer, "")
        for _ in range(count):
            array = memory.allocate("numpy", REGION_BYTES + SLACK)
            agent.register([region_of_array(array[:REGION_BYTES])])
            pair.arrays.append(array)
            pair.local.append((int(array.ctypes.data), REGION_BYTES))
            got = peer.alloc(REGION_BYTES + SLACK, "numpy", REGION_BYTES)
            pair.remote.append((got["addr"], got["nbytes"]))
        pair.peer_name = agent.add_peer(peer.metadata())
        peer.call(p.AddPeer(agent.local_metadata()))
    except BaseException:
        if peer is not None:
            peer.kill()
        with contextlib.suppress(TransportError):
            agent.close()
        raise
    return pair
