"""The Hypothesis stateful model of one agent: a rule-based state machine that drives it
with random operation sequences (the suite's ``test_random_operation_sequences``).

Each example starts a fresh agent against the suite's peer process and mixes READs,
WRITEs, polls, early releases, plain notifications and bad posts. Slots keep concurrent
transfers from touching the same bytes, so every finished transfer can be checked exactly;
a slot whose transfer was released early is never trusted again in that example.

The sequences are drawn the same way on every run (``derandomize``): a conformance run
passes or fails on the adapter, not on which sequences one run happened to draw, and a
failure seen once is seen again.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    rule,
    run_state_machine_as_test,
)

from kvwire.errors import TransportError
from kvwire.transport import Transport, XferState, create, region_of_array, wait_for
from kvwire_conformance import memory

if TYPE_CHECKING:
    from kvwire_conformance.link import Link

SLOTS = 32
SLOT = 64 << 10
SOURCE_SEED = 0x5EED


@dataclass
class _Op:
    handle: object
    write: bool
    slot: int
    local: memory.I64
    remote: memory.I64
    notify: bytes | None


def _missing(expected: list[bytes], got: list[bytes]) -> bool:
    return bool(Counter(expected) - Counter(got))


def run_machine(link: Link, timeout: float, examples: int = 6, steps: int = 14) -> None:
    pr = link.peer_regions["numpy"]
    read_source = pr.addr  # lower half: constant pattern, only ever read
    write_area = pr.addr + pr.nbytes // 2  # upper half: SLOTS write slots
    if pr.nbytes // 2 < SLOTS * SLOT:
        raise ValueError("peer region too small for the state machine")
    link.peer.fill(read_source, pr.nbytes // 2, SOURCE_SEED)
    source = memory.pattern(SOURCE_SEED, pr.nbytes // 2)

    class Machine(RuleBasedStateMachine):
        xfers = Bundle("xfers")

        def __init__(self) -> None:
            super().__init__()
            name = f"kvwire-machine-{uuid.uuid4().hex[:8]}"
            self.agent: Transport = create(link.spec.transport, name, **link.spec.options)
            self.prefix = f"{name}:".encode()
            self.dst = np.zeros(SLOTS * SLOT, dtype=np.uint8)
            self.src = memory.pattern(SOURCE_SEED + 1, SLOTS * SLOT).copy()
            self.handles = [
                self.agent.register([region_of_array(self.dst)]),
                self.agent.register([region_of_array(self.src)]),
            ]
            self.peer = self.agent.add_peer(link.peer.metadata())
            self.busy_read: set[int] = set()
            self.busy_write: set[int] = set()
            self.tainted: set[int] = set()
            self.expected: list[bytes] = []
            self.maybe: list[bytes] = []
            self.outstanding: list[_Op] = []

        def _spans(self, data: Any) -> tuple[memory.I64, memory.I64]:
            count = data.draw(st.integers(1, 6), label="descriptors")
            seed = data.draw(st.integers(0, 2**31), label="seed")
            rng = np.random.default_rng(seed)
            return memory.random_spans(rng, SLOT, count, 1, SLOT // count)

        def _free(self, busy: set[int]) -> list[int]:
            return [s for s in range(SLOTS) if s not in busy and s not in self.tainted]

        @rule(target=xfers, data=st.data(), notify=st.booleans())
        def post_read(self, data: Any, notify: bool) -> Any:
            free = self._free(self.busy_read)
            if not free:
                return None
            slot = data.draw(st.sampled_from(free), label="slot")
            offsets, lengths = self._spans(data)
            roff = memory.place(np.random.default_rng(slot), pr.nbytes // 2, lengths)
            local = memory.descs(int(self.dst.ctypes.data) + slot * SLOT, offsets, lengths)
            remote = memory.descs(read_source, roff, lengths)
            message = self.prefix + f"read:{uuid.uuid4().hex}".encode() if notify else None
            handle = self.agent.read(self.peer, local, remote, message)
            self.busy_read.add(slot)
            op = _Op(handle, False, slot, local, remote, message)
            self.outstanding.append(op)
            return op

        @rule(target=xfers, data=st.data(), notify=st.booleans())
        def post_write(self, data: Any, notify: bool) -> Any:
            free = self._free(self.busy_write)
            if not free:
                return None
            slot = data.draw(st.sampled_from(free), label="slot")
            offsets, lengths = self._spans(data)
            local = memory.descs(int(self.src.ctypes.data) + slot * SLOT, offsets, lengths)
            remote = memory.descs(write_area + slot * SLOT, offsets, lengths)
            message = self.prefix + f"write:{uuid.uuid4().hex}".encode() if notify else None
            handle = self.agent.write(self.peer, local, remote, message)
            self.busy_write.add(slot)
            op = _Op(handle, True, slot, local, remote, message)
            self.outstanding.append(op)
            return op

        def _finish(self, op: _Op) -> None:
            state = wait_for(self.agent, op.handle, timeout)
            assert state is XferState.DONE, f"a transfer ended {state.name}"
            self.agent.release(op.handle)
            self.outstanding.remove(op)
            if op.notify is not None:
                self.expected.append(op.notify)
            if op.write:
                self.busy_write.discard(op.slot)
                got = np.frombuffer(link.peer.read(op.remote), dtype=np.uint8)
                want = np.frombuffer(memory.read_descs(op.local), dtype=np.uint8)
            else:
                self.busy_read.discard(op.slot)
                got = np.frombuffer(memory.read_descs(op.local), dtype=np.uint8)
                want = memory.gather(source, op.remote[:, 0] - read_source, op.remote[:, 1])
            assert np.array_equal(got, want), "a finished transfer moved the wrong bytes"

        @rule(op=consumes(xfers))
        def finish(self, op: _Op | None) -> None:
            if op is not None:
                self._finish(op)

        @rule(op=xfers)
        def poll(self, op: _Op | None) -> None:
            if op is None or op not in self.outstanding:
                return
            assert self.agent.poll(op.handle) in (XferState.PENDING, XferState.DONE)

        @rule(op=consumes(xfers))
        def release_early(self, op: _Op | None) -> None:
            if op is None:
                return
            try:
                self.agent.release(op.handle)
            except TransportError:
                assert wait_for(self.agent, op.handle, timeout) is not XferState.PENDING
                self.agent.release(op.handle)
            self.outstanding.remove(op)
            self.tainted.add(op.slot)
            if op.notify is not None:
                self.maybe.append(op.notify)

        @rule(text=st.binary(min_size=1, max_size=64))
        def notify(self, text: bytes) -> None:
            message = self.prefix + b"plain:" + uuid.uuid4().hex.encode() + text
            self.agent.notify(self.peer, message)
            self.expected.append(message)

        @rule(past=st.integers(0, 1 << 20))
        def bad_post(self, past: int) -> None:
            local = memory.descs(int(self.dst.ctypes.data), np.array([0]), np.array([16]))
            remote = memory.descs(pr.addr + pr.nbytes + past, np.array([0]), np.array([16]))
            try:
                handle = self.agent.read(self.peer, local, remote)
            except TransportError:
                return
            assert wait_for(self.agent, handle, timeout) is XferState.FAILED
            self.agent.release(handle)

        def teardown(self) -> None:
            try:
                for op in list(self.outstanding):
                    self._finish(op)
                mine: list[bytes] = []
                deadline = time.monotonic() + timeout
                while _missing(self.expected, mine) and time.monotonic() < deadline:
                    got = link.peer.drain(at_least=1, timeout=deadline - time.monotonic())
                    mine += [m for _, m in got if m.startswith(self.prefix)]
                for m in self.maybe:
                    if m in mine:
                        mine.remove(m)
                assert sorted(mine) == sorted(self.expected), (
                    f"{len(self.expected)} notifications expected exactly once, got {len(mine)}"
                )
            finally:
                self.agent.close()

    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            derandomize=True,  # the same sequences every run: a failure reproduces
            suppress_health_check=list(HealthCheck),
        ),
    )
