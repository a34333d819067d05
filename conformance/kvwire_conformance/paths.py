"""Tests that drive the code paths an adapter takes for particular shapes of work.

A transport usually has several ways of moving bytes (a fast path for memory it can map,
a syscall per batch for the rest, threads from some size on) and bugs hide in the ones a
plain test never takes. Here each test picks the shape on purpose: rows of zero length,
transfers spanning several regions of a peer, sizes just below, at and above every
threshold the adapter documents (``conformance_thresholds``, beside the defaults below),
peers that registered one kind of memory only, and several peers at once. The helpers
that start a single-kind peer (:func:`new_solo`) serve the failure tests too.

Expected memory is mirrored in this process (:class:`Mirror`), so each check compares
whole local regions and every touched remote span with a guard byte on each side.
"""

from __future__ import annotations

import contextlib
import uuid
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvwire.errors import TransportError
from kvwire.peer import protocol as p
from kvwire.peer.agent import PeerAgent
from kvwire.transport import XferState, load, region_of_array
from kvwire_conformance import memory
from kvwire_conformance.base import SuiteBase
from kvwire_conformance.capabilities import capability
from kvwire_conformance.extras import declared_thresholds
from kvwire_conformance.link import Link, assert_bytes, peer_notifications
from kvwire_conformance.memory import I64, U8

DEFAULT_THRESHOLDS: dict[str, tuple[int, ...]] = {
    "transfer_bytes": (1 << 20,),
    "span_bytes": (4096,),
    "descriptors": (1024,),
}
"""Sizes every adapter is tried on both sides of (common batch and page boundaries)."""
THRESHOLD_KINDS = ("transfer_bytes", "span_bytes", "descriptors")
MAX_ROWS = 1 << 17
"""Rows in the largest threshold transfer (small spans stop short of huge totals)."""
SPAN_ROWS_BYTES = 1 << 20
"""Bytes moved by a transfer probing a span-length threshold on its own."""
REGION_SIZES = (1 << 20, 3 << 20, 2 << 20)
"""The separately registered regions of each single-kind peer."""


def thresholds(transport: str, agent: object) -> dict[str, list[int]]:
    """The defaults merged with every ``conformance_thresholds`` the adapter declares."""
    out = {kind: list(values) for kind, values in DEFAULT_THRESHOLDS.items()}
    for table in declared_thresholds(load(transport), agent):
        for kind, values in dict(table).items():
            if kind not in THRESHOLD_KINDS:
                raise ValueError(f"conformance_thresholds: unknown kind {kind!r}")
            out[kind] += [int(v) for v in values if int(v) not in out[kind]]
    return out


def threshold_cases(limits: Mapping[str, Sequence[int]]) -> list[tuple[str, I64]]:
    """``(label, row lengths)`` of transfers one below, at and one above each threshold."""
    cases: list[tuple[str, I64]] = []
    for t in limits["transfer_bytes"]:
        for n in (t - 1, t, t + 1):
            if n <= 0:
                continue
            if n == t:
                cases.append((f"transfer {n} B in one row", np.array([n], dtype=np.int64)))
            rows = -(-n // (64 << 10))
            lengths = np.full(rows, n // rows, dtype=np.int64)
            lengths[: n - int(lengths.sum())] += 1
            cases.append((f"transfer {n} B in {rows} rows", lengths))
    for s in limits["span_bytes"]:
        for n in (s - 1, s, s + 1):
            if n <= 0:
                continue
            rows = max(2, min(MAX_ROWS, -(-SPAN_ROWS_BYTES // n)))
            cases.append((f"{rows} rows of {n} B", np.full(rows, n, dtype=np.int64)))
    for d in limits["descriptors"]:
        for rows in sorted({d - 1, d, d + 1, 2 * d, 2 * d + 1}):
            if rows > 0:
                cases.append((f"{rows} rows of 64 B", np.full(rows, 64, dtype=np.int64)))
    return cases


def case_bytes(cases: Sequence[tuple[str, I64]]) -> int:
    """Region size that holds every case's rows with at least a byte between them."""
    return max(int(lengths.sum()) + 2 * int(lengths.shape[0]) for _, lengths in cases) + 4096


@dataclass
class Mirror:
    """A registered region and the bytes it must hold, tracked in this process."""

    addr: int
    nbytes: int
    expected: U8
    array: Any = None
    """The local array that keeps the memory alive (None for a peer's region)."""


@dataclass
class Solo:
    """A peer process that registered memory of one allocator only, in several regions,
    and this agent's regions of the same allocator that only its tests use."""

    agent: PeerAgent
    name: str
    remote: list[Mirror]
    local: list[Mirror] = field(default_factory=list)
    big: Mirror | None = None
    local_big: Mirror | None = None
    """Regions for the threshold transfers, made by the first test that needs them."""
    handles: list[object] = field(default_factory=list)
    """This agent's registrations to undo at the end (shared by all solos)."""

    def bigs(self, link: Link, alloc: str, nbytes: int) -> tuple[Mirror, Mirror]:
        if self.big is None or self.local_big is None or self.big.nbytes < nbytes:
            got = self.agent.alloc(nbytes, alloc)
            seed = memory_seed("big", alloc)
            self.agent.fill(got["addr"], got["nbytes"], seed)
            self.big = Mirror(got["addr"], got["nbytes"], memory.pattern(seed, nbytes).copy())
            link.local.add_peer(self.agent.metadata())
            self.local_big, handle = local_mirror(link, alloc, nbytes, memory_seed("lb", alloc))
            self.handles.append(handle)
        return self.local_big, self.big


@dataclass
class Rows:
    """One transfer's rows: which local/remote mirror each uses, offsets and lengths."""

    li: I64
    loff: I64
    ri: I64
    roff: I64
    length: I64
    local: list[Mirror] = field(default_factory=list)
    remote: list[Mirror] = field(default_factory=list)

    def descs(self, mirrors: list[Mirror], which: I64, offsets: I64) -> I64:
        bases = np.array([m.addr for m in mirrors], dtype=np.int64)
        return memory.descs(0, bases[which] + offsets, self.length)


def resync(peer: PeerAgent, local: Sequence[Mirror], remote: Sequence[Mirror]) -> None:
    """Mirrors take the memory's present contents: a test starts from what is there, even
    after an earlier test failed midway."""
    for m in local:
        m.expected[:] = memory.view(m.addr, m.nbytes)
    for m in remote:
        whole = memory.descs(m.addr, np.zeros(1, np.int64), np.full(1, m.nbytes, np.int64))
        m.expected[:] = np.frombuffer(peer.read(whole), dtype=np.uint8)


def move(link: Link, agent_peer: str, rows: Rows, write: bool, note: bytes | None = None) -> object:
    local = rows.descs(rows.local, rows.li, rows.loff)
    remote = rows.descs(rows.remote, rows.ri, rows.roff)
    post = link.local.write if write else link.local.read
    return post(agent_peer, local, remote, note)


def settle(rows: Rows, write: bool) -> None:
    """Apply a finished transfer to the mirrors."""
    src, dst = (rows.local, rows.remote) if write else (rows.remote, rows.local)
    soff, doff = (rows.loff, rows.roff) if write else (rows.roff, rows.loff)
    si, di = (rows.li, rows.ri) if write else (rows.ri, rows.li)
    for a in range(len(src)):
        for b in range(len(dst)):
            mask = (si == a) & (di == b)
            if mask.any():
                moved = memory.gather(src[a].expected, soff[mask], rows.length[mask])
                memory.scatter(dst[b].expected, doff[mask], rows.length[mask], moved)


def check_local(mirrors: Sequence[Mirror], what: str, rows: Rows | None = None) -> None:
    """Local regions hold what they must: whole, or (``rows``) every span of ``rows`` with
    a guard byte either side."""
    for i, m in enumerate(mirrors):
        got = memory.view(m.addr, m.nbytes)
        if rows is not None:
            mask = rows.li == i
            start = np.maximum(rows.loff[mask] - 1, 0)
            end = np.minimum(rows.loff[mask] + rows.length[mask] + 1, m.nbytes)
            offsets, lengths = np.cumsum(end - start) - (end - start), end - start
            assert_bytes(
                memory.gather(got, start, lengths),
                memory.gather(m.expected, start, lengths),
                offsets,
                lengths,
                f"{what}: local region {i}",
            )
        elif not np.array_equal(got, m.expected):
            everything = np.zeros(1, np.int64), np.full(1, m.nbytes, np.int64)
            assert_bytes(got.copy(), m.expected, *everything, f"{what}: local region {i}")


def check_remote(peer: PeerAgent, rows: Rows, what: str) -> None:
    """Every remote span of ``rows`` and one guard byte either side hold what they must."""
    for r, m in enumerate(rows.remote):
        mask = rows.ri == r
        if not mask.any():
            continue
        start = np.maximum(rows.roff[mask] - 1, 0)
        end = np.minimum(rows.roff[mask] + rows.length[mask] + 1, m.nbytes)
        descs = memory.descs(m.addr, start, end - start)
        expected = memory.gather(m.expected, start, end - start)
        if peer.digest(descs) == zlib.crc32(expected.tobytes()):
            continue
        got = np.frombuffer(peer.read(descs), dtype=np.uint8)
        assert_bytes(
            got,
            expected,
            np.cumsum(end - start) - (end - start),
            end - start,
            f"{what}: remote region {r}",
        )


def spread(rng: np.random.Generator, lengths: I64, sizes: Sequence[int]) -> tuple[I64, I64]:
    """Place rows across regions of ``sizes``: (region index, offset) per row, no overlap,
    each region's first byte, and its last where a second row lands there, touched."""
    n = lengths.shape[0]
    which: I64 = np.asarray(rng.integers(0, len(sizes), size=n), dtype=np.int64)
    offsets: I64 = np.zeros(n, dtype=np.int64)
    for r, size in enumerate(sizes):
        mask = np.flatnonzero(which == r)
        if not mask.shape[0]:
            continue
        offsets[mask] = memory.place(rng, size, lengths[mask])
        order = mask[np.argsort(offsets[mask])]
        offsets[order[0]] = 0
        if order.shape[0] > 1:
            offsets[order[-1]] = size - max(1, int(lengths[order[-1]]))
    return which, offsets


def disjoint_rows(
    rng: np.random.Generator,
    batches: int,
    per: int,
    max_length: int,
    local: list[Mirror],
    remote: list[Mirror],
) -> list[Rows]:
    """``batches`` transfers of ``per`` rows each, no two sharing a byte on either side.

    Transfers in flight together have no order between them, so memory after several are
    posted at once is predictable only if none overlaps another; drawing each transfer on
    its own lets them overlap, and the check then fails on whichever order the adapter
    happened to finish them in. Every row is placed in one draw instead, then split.
    """
    lengths: I64 = rng.integers(1, max_length, size=batches * per).astype(np.int64)
    li, loff = spread(rng, lengths, [m.nbytes for m in local])
    ri, roff = spread(rng, lengths, [m.nbytes for m in remote])
    return [
        Rows(li[s], loff[s], ri[s], roff[s], lengths[s], local, remote)
        for s in (slice(b * per, (b + 1) * per) for b in range(batches))
    ]


def new_solo(link: Link, alloc: str, sizes: Sequence[int], timeout: float) -> Solo:
    agent = PeerAgent(link.spec.transport, link.spec.options, env=link.spec.env, timeout=timeout)
    try:
        regions = []
        for i, size in enumerate(sizes):
            got = agent.alloc(size, alloc)
            seed = memory_seed(alloc, i)
            agent.fill(got["addr"], got["nbytes"], seed)
            pattern = memory.pattern(seed, got["nbytes"]).copy()
            regions.append(Mirror(got["addr"], got["nbytes"], pattern))
        name = link.local.add_peer(agent.metadata())
        agent.call(p.AddPeer(link.local.local_metadata()))
    except BaseException:
        agent.kill()
        raise
    return Solo(agent, name, regions)


def memory_seed(*parts: object) -> int:
    return zlib.crc32(repr(("paths", *parts)).encode())


def local_mirror(link: Link, alloc: str, nbytes: int, seed: int) -> tuple[Mirror, object]:
    array = memory.allocate(alloc, nbytes)
    array[:] = memory.pattern(seed, nbytes)
    handle = link.local.register([region_of_array(array)])
    return Mirror(int(array.ctypes.data), nbytes, np.array(array, copy=True), array), handle


class PathTests(SuiteBase):
    """Each test picks a shape of work that sends the adapter down a particular path."""

    @pytest.fixture(scope="class")
    @classmethod
    def solos(cls, link: Link) -> Iterator[dict[str, Solo]]:
        """One single-kind peer per allocator, with several regions each, and this agent's
        extra regions of the same allocator (the threshold test adds big ones on demand)."""
        out: dict[str, Solo] = {}
        handles: list[object] = []
        try:
            if not link.local_regions:
                yield out
                return
            for alloc in link.spec.allocators:
                solo = new_solo(link, alloc, REGION_SIZES, cls.timeout)
                out[alloc] = solo
                solo.handles = handles
                for extra in range(2):
                    mirror, handle = local_mirror(link, alloc, 2 << 20, memory_seed(alloc, extra))
                    handles.append(handle)
                    solo.local.append(mirror)
            yield out
        finally:
            for solo in out.values():
                with contextlib.suppress(TransportError):
                    link.local.remove_peer(solo.name)
                solo.agent.close(10.0)
            for handle in handles:
                with contextlib.suppress(TransportError):
                    link.local.deregister(handle)

    # -- zero-length rows ----------------------------------------------------------------

    @capability("{op}", "dram")
    @pytest.mark.parametrize("op", ["read", "write"])
    def test_zero_length_rows_move_nothing(
        self, link: Link, solos: dict[str, Solo], op: str
    ) -> None:
        """Contract: a row of length 0 is legal anywhere in registered memory and moves
        nothing; the rows around it move as usual; a transfer of only such rows is DONE."""
        write = op == "write"
        for alloc, solo in solos.items():
            local, remote = solo.local, solo.remote
            resync(solo.agent, local, remote)
            rng = np.random.default_rng(memory_seed("zero", alloc, op))
            lengths = rng.integers(1, 4096, size=24).astype(np.int64)
            lengths[[0, 5, 6, 11, 23]] = 0  # first, a pair, middle, last
            li, loff = spread(rng, lengths, [m.nbytes for m in local])
            ri, roff = spread(rng, lengths, [m.nbytes for m in remote])
            rows = Rows(li, loff, ri, roff, lengths, local, remote)
            for part, what in ((rows, "mixed rows"), (_only_zero(rows), "only empty rows")):
                handle = move(link, solo.name, part, write)
                state = link.wait(handle)
                assert state is XferState.DONE, f"[{alloc}] {op} of {what} ended {state.name}"
                link.local.release(handle)
                settle(part, write)
                check_local(local, f"[{alloc}] {op} of {what}")
                check_remote(solo.agent, part, f"[{alloc}] {op} of {what}")

    # -- several regions ------------------------------------------------------------------

    @capability("{op}", "dram")
    @pytest.mark.parametrize("op", ["read", "write"])
    def test_one_transfer_spans_several_regions(
        self, link: Link, solos: dict[str, Solo], op: str
    ) -> None:
        """Contract: the rows of one transfer may fall in any of the peer's (and this
        agent's) registered regions, in any order, up to each region's first and last byte.
        The peer registered one kind of memory only: the path a production peer takes."""
        write = op == "write"
        for alloc, solo in solos.items():
            local, remote = solo.local, solo.remote
            resync(solo.agent, local, remote)
            rng = np.random.default_rng(memory_seed("regions", alloc, op))
            lengths = rng.integers(1, 8 << 10, size=300).astype(np.int64)
            li, loff = spread(rng, lengths, [m.nbytes for m in local])
            ri, roff = spread(rng, lengths, [m.nbytes for m in remote])
            rows = Rows(li, loff, ri, roff, lengths, local, remote)
            self._move_and_check(link, solo.name, solo.agent, rows, write, f"[{alloc}] {op}")
        if len(link.peer_regions) > 1:
            # One transfer over every kind of memory the suite's peer holds.
            window = 2 << 20
            remote = []
            for alloc, pr in link.peer_regions.items():
                seed = memory_seed("mixed", alloc, op)
                link.peer.fill(pr.addr, window, seed)
                remote.append(Mirror(pr.addr, window, memory.pattern(seed, window).copy()))
            local = [
                Mirror(lr.addr, window, lr.view[:window].copy())
                for lr in link.local_regions.values()
            ]
            rng = np.random.default_rng(memory_seed("mixed", op))
            lengths = rng.integers(1, 8 << 10, size=120).astype(np.int64)
            li, loff = spread(rng, lengths, [m.nbytes for m in local])
            ri, roff = spread(rng, lengths, [m.nbytes for m in remote])
            rows = Rows(li, loff, ri, roff, lengths, local, remote)
            self._move_and_check(link, link.peer_name, link.peer, rows, write, f"mixed {op}")

    @staticmethod
    def _move_and_check(
        link: Link, name: str, agent: PeerAgent, rows: Rows, write: bool, what: str
    ) -> None:
        handle = move(link, name, rows, write)
        state = link.wait(handle)
        assert state is XferState.DONE, f"{what} over several regions: {state.name}"
        link.local.release(handle)
        settle(rows, write)
        check_local(rows.local, f"{what} over several regions")
        check_remote(agent, rows, f"{what} over several regions")

    # -- thresholds -----------------------------------------------------------------------

    @capability("{op}", "dram")
    @pytest.mark.parametrize("op", ["read", "write"])
    def test_sizes_on_both_sides_of_each_threshold(
        self, link: Link, solos: dict[str, Solo], op: str
    ) -> None:
        """Contract: every size moves exactly, whichever copy strategy the adapter picks
        for it (its ``conformance_thresholds`` say where strategies change)."""
        write = op == "write"
        cases = threshold_cases(thresholds(link.spec.transport, link.local))
        for alloc, solo in solos.items():
            local_big, big = solo.bigs(link, alloc, case_bytes(cases))
            local, remote = [local_big], [big]
            resync(solo.agent, local, remote)
            rng = np.random.default_rng(memory_seed("thresholds", alloc, op))
            for label, lengths in cases:
                n = lengths.shape[0]
                zeros = np.zeros(n, dtype=np.int64)
                loff = memory.place(rng, local[0].nbytes, lengths)
                roff = memory.place(rng, remote[0].nbytes, lengths)
                rows = Rows(zeros, loff, zeros.copy(), roff, lengths, local, remote)
                handle = move(link, solo.name, rows, write)
                state = link.wait(handle)
                assert state is XferState.DONE, f"[{alloc}] {op}, {label}: {state.name}"
                link.local.release(handle)
                settle(rows, write)
                if write:
                    check_remote(solo.agent, rows, f"[{alloc}] {op}, {label}")
                else:
                    check_local(local, f"[{alloc}] {op}, {label}", rows)

    # -- several peers --------------------------------------------------------------------

    @capability("notifications", "read", "write", "dram")
    def test_several_peers_at_once(self, link: Link, solos: dict[str, Solo]) -> None:
        """Contract: transfers to several peers may run at once; each peer gets its own
        bytes and notifications, and every notification names the agent that sent it,
        whichever agents are connected."""
        if len(solos) < 1:
            pytest.skip("needs host memory")
        tag = uuid.uuid4().hex[:8]
        plan: list[tuple[Solo, Rows | None, bool, bytes]] = []
        for alloc, solo in solos.items():
            solo.agent.drain()
            local, remote = solo.local, solo.remote
            resync(solo.agent, local, remote)
            rng = np.random.default_rng(memory_seed("several", alloc))
            for i, rows in enumerate(disjoint_rows(rng, 4, 16, 16 << 10, local, remote)):
                plan.append((solo, rows, i % 2 == 0, f"several:{tag}:{solo.name}:{i}".encode()))
        # No byte is shared by two transfers in flight: a peer's four share no span, and
        # each peer's reads land in this agent's extra regions, which it owns alone.
        # Interleave the peers' posts.
        plan.sort(key=lambda entry: entry[3].rsplit(b":", 1)[1])
        handles = [
            move(link, solo.name, rows, write, note) for solo, rows, write, note in plan if rows
        ]
        for (solo, posted, write, _), handle in zip(plan, handles, strict=True):
            assert posted is not None
            assert link.wait(handle) is XferState.DONE, f"a transfer to {solo.name} failed"
            link.local.release(handle)
            settle(posted, write)
        plain = {}

        # Only this test's messages count (any agent's, so one sent to the wrong peer
        # shows): a notification from an earlier test may still arrive.
        def ours(message: bytes) -> bool:
            return f":{tag}:".encode() in message

        for solo in solos.values():
            plain[solo.name] = f"plain:{tag}:{solo.name}".encode()
            link.local.notify(solo.name, plain[solo.name])
        for solo in solos.values():
            check_local(solo.local, f"several peers, {solo.name}")
            mine = [entry for entry in plan if entry[0] is solo]
            mine.append((solo, None, False, plain[solo.name]))
            for _, posted, _, _ in mine:
                if posted is not None:
                    check_remote(solo.agent, posted, f"several peers, {solo.name}")
            got = peer_notifications(solo.agent, ours, len(mine), self.timeout)
            assert sorted(m for _, m in got) == sorted(note for *_, note in mine), (
                f"peer {solo.name} got notifications meant for others or lost its own"
            )
            assert {s for s, _ in got} == {link.local_name}, "wrong sender named at a peer"
        # Back the other way: every connected agent notifies this one.
        link.local.drain_notifications()
        senders = {link.peer_name: link.peer, **{s.name: s.agent for s in solos.values()}}
        expected = []
        for round_ in range(3):
            for name, agent in senders.items():
                message = f"from:{tag}:{name}:{round_}".encode()
                agent.call(p.Notify(link.local_name, message))
                expected.append((name, message))
        got = link.local_notifications(len(expected), ours)
        assert sorted(got) == sorted(expected), (
            "notifications from several agents were lost or named the wrong sender: "
            f"{sorted(set(got) ^ set(expected))[:3]}"
        )


def _only_zero(rows: Rows) -> Rows:
    keep = rows.length == 0
    return Rows(
        rows.li[keep],
        rows.loff[keep],
        rows.ri[keep],
        rows.roff[keep],
        rows.length[keep],
        rows.local,
        rows.remote,
    )
