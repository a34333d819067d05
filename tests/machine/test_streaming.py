"""Streaming push in the producer machine, sans IO: what is written, when, and how it ends.

The property test draws chunk boundaries, layer reports, the order transfers end in and
preemptions; a model of the prompt tracks which (region, token) cells are computed, and
every round is checked against it the moment it is posted: each cell is written once per
computation of the prompt, never before it is computed, and the completion goes out only
with the last round, after every earlier round ended.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from machine_helpers import PUSH, of, one, producer, registration

from kvwire.machine import (
    Abort,
    Action,
    ChunkScheduled,
    FreeBlocks,
    FreeReason,
    HandshakeDone,
    LayersComputed,
    NotificationReceived,
    PostWrite,
    Preempted,
    PrefillFinished,
    ProducerMachine,
    ProducerState,
    RequestAdded,
    StartHandshake,
    Timer,
    TransferDone,
    TransferFailed,
    TransferPosted,
)

REGIONS = 5
"""Stream units are regions; the last layer (one region here) is held back."""
UNITS = REGIONS - 1
BLOCK = 4
BLOCKS = (3, 9, 1, 7, 5, 2, 8, 6)


class Run:
    """One streaming request on a machine, with the cells each round wrote."""

    def __init__(self, decode_tp: int = 1, **kw: Any) -> None:
        self.m: ProducerMachine = producer(mode=PUSH, stream_layers=True, **kw)
        self.now = 1.0
        self.xfers: list[int] = []
        self.writes: list[PostWrite] = []
        self.step(RequestAdded("r1"))
        acts = self.step(
            NotificationReceived("d", registration("r1", ((1, 2, 3),), decode_tp=decode_tp))
        )
        self.attempt = one(acts, StartHandshake).attempt
        self.step(HandshakeDone("D", self.attempt, decode_tp))

    def step(self, event: Any, dt: float = 0.001) -> list[Action]:
        self.now += dt
        acts = self.m.handle(event, self.now)
        for w in of(acts, PostWrite):
            self.writes.append(w)
            self.xfers.append(w.xfer_id)
        return acts

    def state(self) -> ProducerState:
        return self.m.request_state("r1")


def cells(piece: tuple[int, int, int, int], prompt: int) -> np.ndarray[Any, Any]:
    """The (region, token) cells a piece names, as a boolean grid."""
    u0, u1, t0, t1 = piece
    grid = np.zeros((REGIONS, prompt), dtype=bool)
    grid[u0 : REGIONS if u1 < 0 else u1, t0 : prompt if t1 < 0 else t1] = True
    return grid


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_every_cell_is_written_once_after_it_is_computed(data: st.DataObject) -> None:
    prompt = data.draw(st.integers(1, len(BLOCKS) * BLOCK), "prompt")
    run = Run()
    computed = np.zeros((REGIONS, prompt), dtype=bool)
    written = np.zeros((REGIONS, prompt), dtype=np.int64)
    in_flight: list[int] = []
    freed: list[FreeBlocks] = []
    finished = False

    def go(event: Any) -> None:
        """Feed one event; check every round it posts against the model."""
        acts = run.step(event)
        freed.extend(of(acts, FreeBlocks))
        for w in of(acts, PostWrite):
            if w.notification:
                assert finished, "the completion went out before the prompt ended"
                assert not in_flight, "the completion went out with a round still in flight"
            grid = np.zeros((REGIONS, prompt), dtype=bool)
            for piece in w.pieces or ((0, -1, 0, -1),):
                grid |= cells(piece, prompt)
            assert not (grid & ~computed).any(), "a cell was written before it was computed"
            written[grid] += 1
            in_flight.append(w.xfer_id)

    def settle(everything: bool = False) -> None:
        """End a drawn share of the transfers in flight, in a drawn order."""
        while in_flight and (everything or data.draw(st.booleans(), "end one")):
            pick = 0 if everything else data.draw(st.integers(0, len(in_flight) - 1), "which")
            x = in_flight.pop(pick)
            go(TransferPosted(x))
            go(TransferDone(x))

    start = 0
    while start < prompt:
        stop = data.draw(st.integers(start + 1, prompt), "chunk end")
        go(ChunkScheduled("r1", stop - stop % BLOCK, (BLOCKS[: -(-stop // BLOCK)],), UNITS))
        for layer in range(REGIONS):
            computed[layer, start:stop] = True
            go(LayersComputed(("r1",), layer + 1))
            settle()
        if stop < prompt and data.draw(st.integers(0, 9), "preempt") == 0:
            go(Preempted("r1"))
            # A new computation: every cell is computed and written again, from new blocks.
            computed[:] = False
            written[:] = 0
            start = 0
            continue
        start = stop
    finished = True
    go(PrefillFinished("r1", (BLOCKS[: -(-prompt // BLOCK)],)))
    settle(everything=True)
    assert [f.reason for f in freed] == [FreeReason.SENT]
    assert (written == 1).all(), "a cell was written twice or never"
    assert run.m.held_blocks() == 0 and run.m.transfers_in_flight() == 0


def test_a_round_that_fails_mid_stream_frees_the_prompt_when_it_ends() -> None:
    run = Run()
    run.step(ChunkScheduled("r1", 8, ((3, 9),), UNITS))
    run.step(LayersComputed(("r1",), 2))
    x = run.xfers[-1]
    run.step(TransferPosted(x))
    assert not of(run.step(TransferFailed(x, "peer gone")), FreeBlocks)
    # Nothing is held while the prompt computes: the engine's blocks are its own.
    assert run.state() is ProducerState.PREFILLING and run.m.held_blocks() == 0
    posted = len(run.writes)
    run.step(ChunkScheduled("r1", 12, ((3, 9, 1),), UNITS))
    run.step(LayersComputed(("r1",), UNITS))
    assert len(run.writes) == posted, "a failed stream wrote again"
    freed = one(run.step(PrefillFinished("r1", ((3, 9, 1),))), FreeBlocks)
    assert freed.reason is FreeReason.FAILED and freed.block_ids == ((3, 9, 1),)
    assert run.state() is ProducerState.ABSENT and run.m.held_blocks() == 0


def test_an_abort_mid_stream_drains_then_frees_once() -> None:
    run = Run()
    run.step(ChunkScheduled("r1", 8, ((3, 9),), UNITS))
    run.step(LayersComputed(("r1",), 1))
    x = run.xfers[-1]
    run.step(TransferPosted(x))
    assert not of(run.step(Abort("r1")), FreeBlocks)
    assert run.state() is ProducerState.DRAINING
    freed = of(run.step(TransferFailed(x, "cancelled")), FreeBlocks)
    assert [f.reason for f in freed] == [FreeReason.ABORTED]
    assert run.state() is ProducerState.ABSENT and run.m.transfers_in_flight() == 0


def test_a_preempted_stream_waits_for_its_round_then_starts_over() -> None:
    run = Run()
    run.step(ChunkScheduled("r1", 8, ((3, 9),), UNITS))
    run.step(LayersComputed(("r1",), 2))
    old = run.xfers[-1]
    run.step(Preempted("r1"))
    posted = len(run.writes)
    run.step(ChunkScheduled("r1", 8, ((6, 2),), UNITS))
    run.step(LayersComputed(("r1",), 3))
    assert len(run.writes) == posted, "a new round went out beside one from the old blocks"
    run.step(TransferPosted(old))
    run.step(TransferDone(old))
    new = run.writes[-1]
    assert new.local_block_ids == ((6, 2),) and new.pieces == ((0, 3, 0, 8),)
    assert run.m.stats.stream_restarts == 1


def test_writes_end_before_the_consumers_watchdog() -> None:
    """Push writes are bounded by the consumer's registration watchdog, so none lands in
    blocks the consumer already gave up on; a stream that would overrun it fails."""
    run = Run(registration_timeout_s=10.0)
    run.step(ChunkScheduled("r1", 8, ((3, 9),), UNITS))
    run.step(LayersComputed(("r1",), 1))
    x = run.xfers[-1]
    run.step(TransferPosted(x))
    # The write is still running at registration_timeout_s - completion_margin_s: cancelled.
    acts = run.step(Timer(), 9.0)
    assert run.state() is ProducerState.DRAINING, acts
    run.step(TransferFailed(x, "cancelled"))
    assert run.state() is ProducerState.PREFILLING
    freed = one(run.step(PrefillFinished("r1", ((3, 9),))), FreeBlocks)
    assert freed.reason is FreeReason.FAILED


def test_a_registration_that_needs_nothing_frees_the_prompt_as_it_ends() -> None:
    m = producer(mode=PUSH, stream_layers=True)
    m.handle(RequestAdded("r1"), 1.0)
    m.handle(NotificationReceived("d", registration("r1", ((),))), 1.1)
    assert m.request_state("r1") is ProducerState.PREFILLING
    m.handle(ChunkScheduled("r1", 8, ((3, 9),), UNITS), 1.2)
    assert not of(m.handle(LayersComputed(("r1",), UNITS), 1.3), PostWrite)
    freed = one(m.handle(PrefillFinished("r1", ((3, 9),)), 1.4), FreeBlocks)
    assert freed.reason is FreeReason.SENT


def test_rounds_go_to_every_consumer_rank_it_serves() -> None:
    run = Run(decode_tp=2)
    run.step(ChunkScheduled("r1", 8, ((3, 9),), UNITS))
    run.step(LayersComputed(("r1",), 1))
    first = run.writes[-1]
    second = one(run.step(TransferPosted(first.xfer_id)), PostWrite)
    assert {first.remote_rank, second.remote_rank} == {(0, 0), (0, 1)}
    assert first.pieces == second.pieces == ((0, 1, 0, 8),)
    assert first.notification == second.notification == b""


def test_a_prompt_that_ends_before_its_registration_is_held_and_written_whole() -> None:
    m = producer(mode=PUSH, stream_layers=True)
    m.handle(RequestAdded("r1"), 1.0)
    m.handle(ChunkScheduled("r1", 8, ((3, 9),), UNITS), 1.1)
    assert not m.handle(LayersComputed(("r1",), UNITS), 1.2)
    assert not of(m.handle(PrefillFinished("r1", ((3, 9),)), 1.3), FreeBlocks)
    assert m.request_state("r1") is ProducerState.LEASED and m.held_blocks() == 2
    acts = m.handle(NotificationReceived("d", registration("r1", ((1, 2),))), 1.4)
    attempt = one(acts, StartHandshake).attempt
    write = one(m.handle(HandshakeDone("D", attempt, 1), 1.5), PostWrite)
    assert write.pieces == () and write.notification  # the whole request, with completion
