"""Completion and notification after the data, checked by construction, not by luck.

A transfer lands in memory the suite holds back (:mod:`kvwire.peer.gate`): a READ's
destination here, a WRITE's in the peer process. The first write into each page of the
destination waits in the kernel until the test lets it go, and the test lets go only of
writes it saw *before* a poll that answered PENDING. So while the test holds a write, the
bytes behind it have not landed, and a transfer that polls DONE then (or whose
notification has reached the peer then) is caught on every run, however fast the adapter
copies. The bytes are checked the moment DONE, or the notification, is first seen.

Where the adapter's ``poll`` waits on the writer the gate holds (a lock held while it
copies), the gate lets every writer through after :data:`~kvwire.peer.gate.STALL_S` and
the transfer is checked against its bytes at DONE only.

What this cannot see: a completion early by less than the page its last writer is inside,
and a notification that is still on its way when the test releases a page (the peer is
asked at every held page; an adapter that sends the notification together with an early
DONE is caught by the DONE). Where the host cannot hold writes (no ``userfaultfd``), the
tests report the check as not made, which fails the run unless unchecked claims are
accepted (:mod:`kvwire_conformance.report`).
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from kvwire.errors import TransportError
from kvwire.peer import protocol as p
from kvwire.peer.gate import Gate, GateUnavailable, open_gate
from kvwire.transport import XferState, region_of_array
from kvwire_conformance import memory
from kvwire_conformance.base import SuiteBase
from kvwire_conformance.capabilities import capability
from kvwire_conformance.extras import failure_reason
from kvwire_conformance.link import Link, assert_bytes, seed
from kvwire_conformance.memory import I64, U8
from kvwire_conformance.report import UNCHECKED

GATED_BYTES = 8 << 20
"""The held destination: large enough that an adapter splits a READ into several chunks."""
SPANS = 12
SPAN_BYTES = 512 << 10
"""One gated READ: 6 MiB in spans the adapter may copy in any order or at once."""
ROUNDS = 3
"""Gated READs per test, each over other spans: each is a deterministic check; several
vary which chunk, thread and descriptor comes last."""


@dataclass
class Seen:
    """What the test saw at the one moment it checks: the state, the pages still held,
    and the destination's bytes, copied then."""

    what: str
    held: int
    data: U8


class LocalGated(SuiteBase):
    """The READ half: this process's gated memory."""

    @pytest.fixture(scope="class")
    @classmethod
    def gate(cls, link: Link) -> Iterator[Gate | str]:
        """The held destination, registered with this agent; a string saying why not."""
        try:
            gate = open_gate(GATED_BYTES)
        except GateUnavailable as exc:
            yield f"{UNCHECKED} ordering by construction: {exc}"
            return
        handle: object = None
        try:
            handle = link.local.register([region_of_array(gate.array)])
            yield gate
        finally:
            gate.open()
            if handle is not None:
                with contextlib.suppress(TransportError):
                    link.local.deregister(handle)
            gate.close()

    @capability("read", "dram")
    def test_a_read_is_done_only_after_its_last_byte(self, link: Link, gate: Gate | str) -> None:
        for round_ in range(ROUNDS):
            self._gated_read(link, _usable(gate), None, f"done{round_}")

    @capability("notifications", "read", "dram")
    def test_a_read_notification_follows_its_last_byte(self, link: Link, gate: Gate | str) -> None:
        for round_ in range(ROUNDS):
            note = f"conformance:gated:{uuid.uuid4().hex}".encode()
            self._gated_read(link, _usable(gate), note, f"note{round_}")

    def _gated_read(self, link: Link, gate: Gate, note: bytes | None, tag: str) -> None:
        pr = link.peer_regions["numpy"]
        rng = np.random.default_rng(seed("gated", tag))
        lengths = np.full(SPANS, SPAN_BYTES, dtype=np.int64)
        loff = memory.place(rng, gate.nbytes, lengths)
        roff = memory.place(rng, pr.nbytes, lengths)
        src = seed("gated-src", tag)
        link.peer.fill(pr.addr, pr.nbytes, src)
        link.peer.drain()
        expected = memory.gather(memory.cached_pattern(src, pr.nbytes), roff, lengths)
        gate.open()
        gate.array[:] = 0
        gate.protect(loff, lengths)
        handle = link.local.read(
            link.peer_name,
            memory.descs(gate.addr, loff, lengths),
            memory.descs(pr.addr, roff, lengths),
            note,
        )
        try:
            done, noticed = self._watch(link, gate, handle, note, loff, lengths)
        finally:
            gate.open()
        where = np.cumsum(lengths) - lengths
        for seen in (noticed, done):
            if seen is None:
                continue
            assert not seen.held, (
                f"{seen.what} while {seen.held} page(s) of the READ's destination were still "
                "held back by the suite: the data had not landed"
            )
            assert_bytes(seen.data, expected, where, lengths, f"READ data when {seen.what}")
        if note is not None and noticed is None:
            got = link.peer.drain(at_least=1, timeout=self.timeout)
            assert note in [m for _, m in got], "the READ's notification never reached the peer"
        link.local.release(handle)

    def _watch(
        self, link: Link, gate: Gate, handle: object, note: bytes | None, loff: I64, lengths: I64
    ) -> tuple[Seen, Seen | None]:
        """Poll until the READ ends, releasing held writes only after a PENDING poll; the
        first time the notification is at the peer, and when DONE shows, look at once."""
        noticed: Seen | None = None
        while True:
            mark = gate.recorded()
            state = link.local.poll(handle)
            if state is not XferState.PENDING:
                held = gate.held()
                data = memory.gather(gate.array, loff, lengths)
                assert state is XferState.DONE, (
                    f"a gated READ ended {state.name}{failure_reason(link.local, handle)}"
                )
                return Seen("the READ polled DONE", held, data), noticed
            asked = note is not None and noticed is None and gate.held()
            if asked and note in [m for _, m in link.peer.drain()]:
                held = gate.held()
                data = memory.gather(gate.array, loff, lengths)
                noticed = Seen("its notification reached the peer", held, data)
            gate.release(mark)
            gate.wait_fault(0.002)


class PeerGated(SuiteBase):
    """The WRITE half: the peer's gated memory, the same checks made in the peer."""

    @pytest.fixture(scope="class")
    @classmethod
    def peer_gate(cls, link: Link) -> dict[str, Any]:
        """The peer's held memory (``addr``, ``nbytes``), known to this agent; or
        ``unavailable`` saying why not."""
        got: dict[str, Any] = link.peer.call(p.GateOpen(GATED_BYTES))
        if "unavailable" in got:
            got["unavailable"] = f"{UNCHECKED} ordering by construction: {got['unavailable']}"
        else:
            link.local.add_peer(link.peer.metadata())
        return got

    @capability("write", "dram")
    def test_a_write_is_done_only_after_its_last_byte(
        self, link: Link, peer_gate: dict[str, Any]
    ) -> None:
        for round_ in range(ROUNDS):
            self._gated_write(link, _usable(peer_gate), None, f"wdone{round_}")

    @capability("notifications", "write", "dram")
    def test_a_write_notification_follows_its_last_byte(
        self, link: Link, peer_gate: dict[str, Any]
    ) -> None:
        for round_ in range(ROUNDS):
            note = f"conformance:wgated:{uuid.uuid4().hex}".encode()
            self._gated_write(link, _usable(peer_gate), note, f"wnote{round_}")

    def _gated_write(self, link: Link, gate: dict[str, Any], note: bytes | None, tag: str) -> None:
        lr = link.local_regions["numpy"]
        rng = np.random.default_rng(seed("wgated", tag))
        lengths = np.full(SPANS, SPAN_BYTES, dtype=np.int64)
        loff = memory.place(rng, lr.nbytes, lengths)
        roff = memory.place(rng, int(gate["nbytes"]), lengths)
        lr.view[:] = memory.cached_pattern(seed("wgated-src", tag), lr.nbytes)
        expected = memory.gather(lr.view, loff, lengths)
        link.peer.drain()
        through = threading.get_native_id()
        link.peer.call(p.GateArm(roff.tobytes(), lengths.tobytes(), note, through))
        handle = link.local.write(
            link.peer_name,
            memory.descs(lr.addr, loff, lengths),
            memory.descs(int(gate["addr"]), roff, lengths),
            note,
        )
        try:
            mark = -1
            while True:
                step = link.peer.call(p.GateStep(mark, 0.002))
                state = link.local.poll(handle)
                if state is not XferState.PENDING:
                    look = link.peer.call(p.GateLook())
                    break
                mark = int(step["mark"])
        finally:
            link.peer.call(p.GateShut())
        assert state is XferState.DONE, (
            f"a gated WRITE ended {state.name}{failure_reason(link.local, handle)}"
        )
        where = np.cumsum(lengths) - lengths
        checks = [("the WRITE polled DONE", look)]
        if look["noticed"] is not None:
            checks.insert(0, ("its notification reached the peer", look["noticed"]))
        for what, seen in checks:
            assert not seen["held"], (
                f"{what} while {seen['held']} page(s) of the WRITE's destination were still "
                "held back by the suite: the data had not landed"
            )
            got = np.frombuffer(seen["data"], dtype=np.uint8)
            assert_bytes(got, expected, where, lengths, f"WRITE data at the peer when {what}")
        if note is not None and look["noticed"] is None:
            got_notes = link.peer.drain(at_least=1, timeout=self.timeout)
            assert note in [m for _, m in got_notes], (
                "the WRITE's notification never reached the peer"
            )
        link.local.release(handle)


def _usable(gate: Any) -> Any:
    """The gate, or a skip saying why the check could not be made."""
    if isinstance(gate, str):
        pytest.skip(gate)
    if isinstance(gate, dict) and "unavailable" in gate:
        pytest.skip(str(gate["unavailable"]))
    return gate


class OrderingTests(LocalGated, PeerGated):
    """DONE, and a transfer's notification, come only after its last byte landed."""
