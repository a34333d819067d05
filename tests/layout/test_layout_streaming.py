"""Streaming push's pieces, proven on real bytes.

A streaming producer writes a prompt in rounds of (regions x tokens) rectangles, each
planned with the blocks it holds so far, and a last round for the rest. Here the rounds
come from the machine's own piece arithmetic, over drawn geometries (TP pairs, block and
kernel sizes, layouts, K/V split, MLA, packed layers, consumer prefix hits) and drawn chunk
and layer progress; the bytes they move must leave every consumer rank exactly as the
oracle lays the request out, as the whole-request plan does, and no consumer byte may be
written twice (a piece reaching past its rectangle would rewrite what another moved).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.layout import PeerLayout, TransferPlan, topology
from kvwire.layout.geometry import RemoteGeometry
from kvwire.machine.producer import _pieces, _remainder
from kvwire.pairs.oracle import Case, RankBuffer, check_consumer

from .test_layout_oracle import cases, copy_rows, locate, ranks, zero_rows

Frontier = tuple[int, int, int]


def rounds(
    data: st.DataObject, case: Case, units: int, regions: int
) -> list[tuple[Frontier, tuple]]:
    """The machine's rounds over drawn progress: (frontier the round reached, its pieces)."""
    block, prompt = case.p.block, case.tokens
    sent: Frontier = (0, 0, 0)
    computed: Frontier = (0, 0, 0)
    out: list[tuple[Frontier, tuple]] = []
    start = 0
    while start < prompt:
        stop = data.draw(st.integers(start + 1, prompt), "chunk end")
        whole = stop - stop % block
        if whole > computed[1]:
            computed = (computed[1], whole, 0)
        for layer in range(1, regions + 1):
            computed = (computed[0], computed[1], max(computed[2], min(layer, units)))
            if data.draw(st.booleans(), "post a round"):
                pieces = _pieces(sent, computed, units)
                if pieces:
                    out.append((computed, pieces))
                    sent = computed
        start = stop
    out.append(((-1, -1, -1), _remainder(sent, units) if sent != (0, 0, 0) else ()))
    return out


@settings(max_examples=150, deadline=None, derandomize=True)
@given(cases(), st.data())
def test_streamed_rounds_move_the_right_bytes(case: Case, data: st.DataObject) -> None:
    case = replace(case, mode="push", groups=1, window=0)
    request, producers, consumers, buffers = ranks(case)
    geometry = producers[0].geometry
    total, units = len(geometry.regions), geometry.streamed_regions()
    plan = rounds(data, case, units, total)
    d_ids = [g.tolist() for g in request.d_ids]
    writes = {rb.base: np.zeros(rb.buf.size, dtype=np.int64) for rb in consumers}
    for p, producer in enumerate(producers):
        for d in topology.consumer_ranks_of_producer(p, case.p.tp, case.d.tp):
            layout = PeerLayout(
                producer.geometry, RemoteGeometry.from_local(consumers[d].geometry), mode="push"
            )
            for (_, chunk_end, _), pieces in plan:
                for rows in move(layout, buffers, request.p_ids[0], d_ids, case, chunk_end, pieces):
                    for rb, offset, length in locate(buffers, rows):
                        writes[rb.base][offset : offset + length] += 1
            whole = layout.plan([request.p_ids[0].tolist()], d_ids, num_tokens=case.tokens)
            zero_rows(buffers, whole.remote_zero)  # the tails no write covers, as in the oracle
    problems = [q for consumer in consumers for q in check_consumer(case, consumer, request)]
    assert not problems, f"{case}: " + "; ".join(problems)
    assert max(int(w.max()) for w in writes.values()) <= 1, f"{case}: a byte written twice"


def move(
    layout: PeerLayout,
    buffers: dict[int, RankBuffer],
    p_ids: np.ndarray,
    d_ids: list[list[int]],
    case: Case,
    chunk_end: int,
    pieces: tuple,
) -> list[np.ndarray]:
    """One round: each piece planned with the blocks the producer holds so far; returns
    the consumer rows it wrote."""
    prompt = case.tokens
    held = p_ids if chunk_end < 0 else p_ids[: -(-chunk_end // case.p.block)]
    if not pieces:
        plans = [layout.plan([held.tolist()], d_ids, num_tokens=prompt)]
    else:
        total = len(layout.local.regions)
        plans = [
            layout.plan(
                [held.tolist()],
                d_ids,
                num_tokens=prompt,
                regions=(u0, total if u1 < 0 else u1),
                window=(t0, prompt if t1 < 0 else t1),
            )
            for u0, u1, t0, t1 in pieces
        ]
    for one in plans:
        assert isinstance(one, TransferPlan)
        copy_rows(buffers, one.local_descs, one.remote_descs)
    return [one.remote_descs for one in plans]
