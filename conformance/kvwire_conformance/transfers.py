"""READ and WRITE: exact bytes over every shape of descriptor set, many at once, and random
sequences of every operation (:mod:`kvwire_conformance.stateful_model`).

Memory is checked with oracle reads and writes on the peer that never go through the
transport, comparing whole regions so stray writes show.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from kvwire.errors import TransportError
from kvwire.transport import XferState
from kvwire_conformance import memory
from kvwire_conformance.base import SuiteBase
from kvwire_conformance.capabilities import capability
from kvwire_conformance.extras import failure_reason
from kvwire_conformance.link import Link, assert_bytes, seed

# name -> (descriptor count, min length, max length)
CASES: dict[str, tuple[int, int, int]] = {
    "one-byte": (1, 1, 1),
    "large-8MiB": (3, 8 << 20, 8 << 20),
    "mixed-1B-256KiB": (100, 1, 256 << 10),
    "many-small-1B-16KiB": (2_000, 1, 16 << 10),
    "100k-tiny-1B-64B": (100_000, 1, 64),
}


class TransferTests(SuiteBase):
    """READ and WRITE move exactly the bytes their descriptors name, alone and at once."""

    @capability("read", "dram")
    @pytest.mark.parametrize("case", list(CASES))
    def test_read_moves_exact_bytes(self, link: Link, case: str) -> None:
        for alloc in link.spec.allocators:
            self._read_case(link, alloc, case)

    def _read_case(self, link: Link, alloc: str, case: str) -> None:
        count, lo, hi = CASES[case]
        lr, pr = link.local_regions[alloc], link.peer_regions[alloc]
        n = lr.nbytes
        rng = np.random.default_rng(seed("read", alloc, case))
        loff, lengths = memory.random_spans(rng, n, count, lo, hi)
        roff = memory.place(rng, pr.nbytes, lengths)
        src_seed, bg_seed = seed("src", case), seed("bg", case)
        link.peer.fill(pr.addr, pr.nbytes, src_seed)
        background = memory.cached_pattern(bg_seed, n)
        lr.view[:] = background
        handle = link.local.read(
            link.peer_name,
            memory.descs(lr.addr, loff, lengths),
            memory.descs(pr.addr, roff, lengths),
        )
        state = link.wait(handle)
        assert state is XferState.DONE, (
            f"READ {case} ended {state.name}{failure_reason(link.local, handle)}"
        )
        got = lr.view.copy()
        link.local.release(handle)
        expected = background.copy()
        moved = memory.gather(memory.cached_pattern(src_seed, pr.nbytes), roff, lengths)
        memory.scatter(expected, loff, lengths, moved)
        assert_bytes(got, expected, loff, lengths, f"READ {case} [{alloc}] local memory")

    @capability("write", "dram")
    @pytest.mark.parametrize("case", list(CASES))
    def test_write_moves_exact_bytes(self, link: Link, case: str) -> None:
        for alloc in link.spec.allocators:
            self._write_case(link, alloc, case)

    def _write_case(self, link: Link, alloc: str, case: str) -> None:
        count, lo, hi = CASES[case]
        lr, pr = link.local_regions[alloc], link.peer_regions[alloc]
        rng = np.random.default_rng(seed("write", alloc, case))
        loff, lengths = memory.random_spans(rng, lr.nbytes, count, lo, hi)
        roff = memory.place(rng, pr.nbytes, lengths)
        src_seed, bg_seed = seed("wsrc", case), seed("wbg", case)
        lr.view[:] = memory.cached_pattern(src_seed, lr.nbytes)
        link.peer.fill(pr.addr, pr.nbytes, bg_seed)
        handle = link.local.write(
            link.peer_name,
            memory.descs(lr.addr, loff, lengths),
            memory.descs(pr.addr, roff, lengths),
        )
        state = link.wait(handle)
        assert state is XferState.DONE, (
            f"WRITE {case} ended {state.name}{failure_reason(link.local, handle)}"
        )
        link.local.release(handle)
        whole = memory.descs(pr.addr, np.array([0]), np.array([pr.nbytes]))
        expected = memory.cached_pattern(bg_seed, pr.nbytes).copy()
        memory.scatter(expected, roff, lengths, memory.gather(lr.view, loff, lengths))
        if link.peer.digest(whole) != zlib.crc32(expected.tobytes()):
            got = np.frombuffer(link.peer.read(whole), dtype=np.uint8)
            assert_bytes(got, expected, roff, lengths, f"WRITE {case} [{alloc}] peer memory")

    @capability("read", "dram")
    def test_empty_descriptor_list_is_not_a_crash(self, link: Link) -> None:
        empty = np.zeros((0, 3), dtype=np.int64)
        try:
            handle = link.local.read(link.peer_name, empty, empty)
        except TransportError:
            return
        state = link.wait(handle)
        assert state is not XferState.PENDING, "an empty READ never finished"
        link.local.release(handle)

    @capability("read", "write", "dram")
    def test_many_concurrent_transfers(self, link: Link) -> None:
        lr, pr = link.local_regions["numpy"], link.peer_regions["numpy"]
        slots, per = 64, 8
        slot = lr.nbytes // slots
        rng = np.random.default_rng(seed("concurrent"))
        local_seed, peer_seed = seed("conc-local"), seed("conc-peer")
        lr.view[:] = memory.pattern(local_seed, lr.nbytes)
        link.peer.fill(pr.addr, pr.nbytes, peer_seed)
        local_expected = memory.pattern(local_seed, lr.nbytes).copy()
        peer_expected = memory.pattern(peer_seed, pr.nbytes).copy()
        posted = []
        for i in range(slots):
            loff, lengths = memory.random_spans(rng, slot, per, 1, slot // per)
            roff = memory.place(rng, slot, lengths)
            loff, roff = loff + i * slot, roff + i * slot
            if i % 2:
                moved = memory.gather(peer_expected, roff, lengths)
                memory.scatter(local_expected, loff, lengths, moved)
                post = link.local.read
            else:
                moved = memory.gather(local_expected, loff, lengths)
                memory.scatter(peer_expected, roff, lengths, moved)
                post = link.local.write
            local, remote = (
                memory.descs(lr.addr, loff, lengths),
                memory.descs(pr.addr, roff, lengths),
            )
            posted.append(post(link.peer_name, local, remote))
        states = [link.wait(h) for h in posted]
        assert all(s is XferState.DONE for s in states), [s.name for s in states]
        for handle in posted:
            link.local.release(handle)
        everything = np.array([0]), np.array([lr.nbytes])
        assert_bytes(lr.view.copy(), local_expected, *everything, "local memory")
        whole = memory.descs(pr.addr, np.array([0]), np.array([pr.nbytes]))
        got = np.frombuffer(link.peer.read(whole), dtype=np.uint8)
        assert_bytes(got, peer_expected, *everything, "peer memory")

    @capability("read", "write", "notifications", "dram")
    def test_random_operation_sequences(self, link: Link) -> None:
        from kvwire_conformance.stateful_model import run_machine

        run_machine(link, self.timeout)
