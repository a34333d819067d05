"""Descriptors proven on real bytes.

The oracle (:mod:`kvwire.pairs.oracle`, no kvwire descriptor code) lays the logical KV out
into each rank's buffer; kvwire's descriptors then move bytes between the producer's buffers
and the consumer's, and each consumer buffer must equal the oracle laid out for the
consumer: every listed block holds the right tokens, nothing outside the listed blocks is
touched, and whatever the transfer does not write is covered by the zero ranges. The same
oracle checks the whole runtime between processes (``tests/runtime/test_pairs.py``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from kvwire.errors import LocalProtocolError, RemoteProtocolError
from kvwire.layout import Descs, PeerLayout, TransferPlan, coalesce, topology
from kvwire.layout.alignment import Mode
from kvwire.layout.geometry import RemoteGeometry
from kvwire.pairs.oracle import (
    SPACE,
    Case,
    RankBuffer,
    Request,
    Side,
    check_consumer,
    check_producer,
    lay_out,
    make_rank,
    make_request,
    producer_lacks,
)

# ----------------------------------------------------------------------------------------
# Moving bytes along descriptor rows
# ----------------------------------------------------------------------------------------


def locate(buffers: dict[int, RankBuffer], rows: Descs) -> list[tuple[RankBuffer, int, int]]:
    out = []
    for addr, length, device in rows.tolist():
        rb = buffers[addr - addr % SPACE]
        assert device == rb.device, f"descriptor device {device} != buffer device {rb.device}"
        offset = addr - rb.base
        assert length > 0 and offset >= 0 and offset + length <= rb.buf.size
        out.append((rb, offset, length))
    return out


def copy_rows(buffers: dict[int, RankBuffer], src: Descs, dst: Descs) -> None:
    assert src.shape == dst.shape and src.dtype == np.int64 and dst.dtype == np.int64
    for (s, so, n), (d, do, m) in zip(locate(buffers, src), locate(buffers, dst), strict=True):
        assert n == m
        d.buf[do : do + n] = s.buf[so : so + n]


def zero_rows(buffers: dict[int, RankBuffer], rows: Descs) -> None:
    for rb, offset, length in locate(buffers, rows):
        rb.buf[offset : offset + length] = 0


def assert_rows_in_tables(
    layout: PeerLayout,
    local_ids: Any,
    remote_ids: Any,
    num_tokens: int | None,
    producer_tokens: int | None = None,
) -> None:
    """The request's rows named by index in the layout's prepared tables (what a transport
    prepares once per peer, then makes requests from) are its rows: uncoalesced, equal
    row for row; coalesced, the same runs."""
    tables = layout.tables(max(len(local_ids), len(remote_ids)))
    assert tables is not None
    for merge in (False, True):
        plan = layout.plan(
            local_ids,
            remote_ids,
            num_tokens=num_tokens,
            producer_tokens=producer_tokens,
            coalesce=merge,
            rows=True,
        )
        assert plan.local_rows is not None and plan.remote_rows is not None
        local, remote = tables[0][plan.local_rows], tables[1][plan.remote_rows]
        if merge:
            local, remote = coalesce(local, remote)
        np.testing.assert_array_equal(local, plan.local_descs)
        np.testing.assert_array_equal(remote, plan.remote_descs)


# ----------------------------------------------------------------------------------------
# The check
# ----------------------------------------------------------------------------------------


def ranks(case: Case) -> tuple[Request, list[RankBuffer], list[RankBuffer], dict[int, RankBuffer]]:
    """The case's request, its producer ranks (holding it) and consumer ranks, and every
    rank's buffer by base address."""
    request = make_request(case)
    producers = [make_rank(case, 0, r) for r in range(case.p.tp)]
    consumers = [make_rank(case, 1, r) for r in range(case.d.tp)]
    for rb in producers:
        lay_out(case, rb, request.p_ids, request.p_starts, request)
    return request, producers, consumers, {rb.base: rb for rb in producers + consumers}


def run_case(case: Case) -> dict[str, int]:
    request, producers, consumers, buffers = ranks(case)

    num_tokens = case.tokens if case.pass_tokens else None
    computed = case.tokens + case.past if case.past else None
    stats = {"descs": 0, "empty_plans": 0}
    zeros: list[Descs] = []

    def plan_between(local: RankBuffer, remote: RankBuffer, mode: Mode) -> TransferPlan:
        layout = PeerLayout(
            local.geometry,
            RemoteGeometry.from_local(remote.geometry),
            mode=mode,
            coalesce=case.coalesce,
        )
        local_ids, remote_ids = (
            (request.d_ids, request.p_ids) if mode == "pull" else (request.p_ids, request.d_ids)
        )
        assert_rows_in_tables(layout, local_ids, remote_ids, num_tokens, computed)
        return layout.plan(local_ids, remote_ids, num_tokens=num_tokens, producer_tokens=computed)

    if case.mode == "pull":
        for d, consumer in enumerate(consumers):
            for p in topology.remote_tp_ranks(d, case.d.tp, case.p.tp):
                plan = plan_between(consumer, producers[p], "pull")
                assert plan.remote_zero.shape == (0, 3)
                copy_rows(buffers, plan.remote_descs, plan.local_descs)
                zeros.append(plan.local_zero)
                stats["descs"] += plan.num_descs
                stats["empty_plans"] += plan.is_empty
    else:
        for p, producer in enumerate(producers):
            for d in topology.consumer_ranks_of_producer(p, case.p.tp, case.d.tp):
                plan = plan_between(producer, consumers[d], "push")
                assert plan.local_zero.shape == (0, 3)
                # The consumer reading the same pair would move exactly the same bytes.
                mirror = plan_between(consumers[d], producer, "pull")
                np.testing.assert_array_equal(plan.local_descs, mirror.remote_descs)
                np.testing.assert_array_equal(plan.remote_descs, mirror.local_descs)
                np.testing.assert_array_equal(plan.remote_zero, mirror.local_zero)
                copy_rows(buffers, plan.local_descs, plan.remote_descs)
                zeros.append(plan.remote_zero)
                stats["descs"] += plan.num_descs
                stats["empty_plans"] += plan.is_empty
    for rows in zeros:
        zero_rows(buffers, rows)

    problems = [p for consumer in consumers for p in check_consumer(case, consumer, request)]
    problems += [p for producer in producers for p in check_producer(case, producer, request)]
    assert not problems, f"{case}: " + "; ".join(problems)
    return stats


# ----------------------------------------------------------------------------------------
# The cases
# ----------------------------------------------------------------------------------------

TP_PAIRS = [(1, 1), (2, 4), (4, 2), (1, 8), (8, 1)]
LAYOUTS = ["HND", "NHD"]


def _cases() -> list[Case]:
    cases: list[Case] = []
    # Heterogeneous TP x layouts, 8 heads, both modes.
    for p_tp, d_tp in TP_PAIRS:
        for layout in LAYOUTS:
            for mode in ("pull", "push"):
                cases.append(
                    Case(Side(p_tp, layout), Side(d_tp, layout), heads=8, mode=mode, tokens=37)
                )
    # GQA: fewer KV heads than TP ranks on one or both sides.
    for p_tp, d_tp in [(1, 4), (4, 1), (8, 2), (2, 8), (4, 8), (8, 4), (8, 8)]:
        for mode in ("pull", "push"):
            cases.append(Case(Side(p_tp), Side(d_tp), heads=2, mode=mode, tokens=33))
    # MLA: replicated, read once.
    for p_tp, d_tp in TP_PAIRS:
        cases.append(Case(Side(p_tp, "NHD"), Side(d_tp, "NHD"), mla=True, tokens=50))
    cases.append(Case(Side(4), Side(2), mla=True, mode="push", tokens=50))
    cases.append(Case(Side(2), Side(4), mla=True, mode="push", tokens=50))
    # Block-size ratios both ways, with kernel/logical ratios on either side.
    for p_side, d_side in [
        (Side(2, "HND", 4), Side(2, "HND", 16)),
        (Side(2, "NHD", 4), Side(2, "NHD", 16)),
        (Side(1, "HND", 16), Side(2, "HND", 4)),
        (Side(2, "NHD", 16), Side(1, "NHD", 8)),
        (Side(1, "HND", 32, 2), Side(1, "HND", 16)),
        (Side(1, "NHD", 16), Side(1, "NHD", 32, 4)),
        (Side(2, "HND", 32, 4), Side(4, "HND", 16, 2)),
        (Side(4, "NHD", 8, 2), Side(2, "HND", 32, 2)),
    ]:
        for mode in ("pull", "push"):
            cases.append(Case(p_side, d_side, tokens=45, mode=mode))
    # Mixed layouts on the two sides.
    cases.append(Case(Side(2, "HND"), Side(4, "NHD"), tokens=29))
    cases.append(Case(Side(4, "NHD"), Side(1, "HND", 8), tokens=29, mode="push"))
    # Prefix hits, with and without the token count.
    for p_side, d_side, hits, pass_tokens in [
        (Side(1), Side(1), 1, True),
        (Side(1), Side(1), 2, False),
        (Side(2, "HND", 16, 2), Side(4, "HND", 16), 1, False),
        (Side(1, "HND", 4), Side(2, "HND", 16), 1, True),
        (Side(2, "NHD", 32), Side(1, "NHD", 8), 3, True),
        (Side(1, "NHD", 8), Side(1, "NHD", 16, 2), 2, True),
    ]:
        for mode in ("pull", "push"):
            cases.append(
                Case(p_side, d_side, hits=hits, pass_tokens=pass_tokens, tokens=61, mode=mode)
            )
    # Multiple regions (K and V apart) and KV-cache groups.
    cases.append(Case(Side(2), Side(4), kv_split=True, layers=3))
    cases.append(
        Case(Side(4, "NHD"), Side(2, "NHD"), kv_split=True, groups=2, layers=3, mode="push")
    )
    cases.append(Case(Side(1), Side(1), groups=3, layers=5, hits=1))
    cases.append(Case(Side(2, "HND", 8), Side(2, "HND", 16), groups=2, layers=4, kv_split=True))
    # A sliding-window group: both sides hold only the window's tail blocks.
    for p_side, d_side in [
        (Side(1), Side(1)),
        (Side(2, "HND", 8), Side(1, "HND", 16)),
        (Side(1, "NHD", 32, 2), Side(2, "NHD", 8)),
    ]:
        for mode in ("pull", "push"):
            cases.append(
                Case(p_side, d_side, groups=2, layers=4, window=20, tokens=70, hits=1, mode=mode)
            )
    # Padding between blocks, layer-name pairing.
    cases.append(Case(Side(2, "HND", 16, 1, 24), Side(4, "HND", 16, 1, 8), tokens=40))
    cases.append(Case(Side(2), Side(2), members=True, layers=3, mode="push"))
    cases.append(Case(Side(1, "NHD"), Side(2, "NHD"), members=True, kv_split=True))
    # v13 packed rows on either side, paired by layer name.
    for packed in ("p", "d"):
        for mode in ("pull", "push"):
            cases.append(
                Case(Side(2), Side(2), members=True, mla=True, packed=packed, layers=3, mode=mode)
            )
        cases.append(
            Case(Side(1, "HND", 16, 1, 32), Side(2), members=True, packed=packed, layers=2)
        )
        cases.append(
            Case(Side(2, "NHD", 8), Side(1, "NHD", 16), members=True, packed=packed, kv_split=True)
        )
    # Contiguous allocation (what coalescing feeds on), coalescing on and off.
    more: list[Case] = []
    for case in cases:
        if case.mode == "pull" and not case.hits and case.groups == 1:
            more.append(replace(case, contiguous=True))
            more.append(replace(case, coalesce=False))
    return cases + more


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_descriptors_move_the_right_bytes(case: Case) -> None:
    run_case(case)


def test_coalescing_reduces_contiguous_requests_to_one_descriptor_per_region() -> None:
    base = Case(Side(1), Side(1), heads=8, layers=4, contiguous=True, tokens=64)
    merged = run_case(base)
    per_block = run_case(replace(base, coalesce=False))
    # 4 blocks of 16 tokens, 4 regions: 16 descriptors, or one per region.
    assert per_block["descs"] == 16
    assert merged["descs"] == 4


def test_hetero_tp_with_nhd_costs_one_descriptor_per_token_run() -> None:
    hnd = run_case(Case(Side(1, "HND"), Side(2, "HND"), heads=8, tokens=32, coalesce=False))
    nhd = run_case(Case(Side(1, "NHD"), Side(2, "NHD"), heads=8, tokens=32, coalesce=False))
    # HND: one slice per block; NHD: one run of heads per token.
    assert hnd["descs"] == 2 * 2 * 2  # consumer ranks x regions x blocks
    assert nhd["descs"] == 2 * 2 * 32


def test_gqa_duplicate_holders_send_notification_only() -> None:
    stats = run_case(Case(Side(8), Side(2), heads=2, tokens=20))
    # Each consumer rank holds one head and talks to 4 producer ranks that all hold it:
    # the first sends the data, the other 3 only get the completion notification.
    assert stats["empty_plans"] == 2 * 3


def test_mla_reads_one_rank_only() -> None:
    stats = run_case(Case(Side(8, "NHD"), Side(1, "NHD"), mla=True, tokens=20))
    assert stats["empty_plans"] == 7


# ----------------------------------------------------------------------------------------
# Random geometries: whatever the combination, the bytes must land where the oracle says
# ----------------------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def sides(draw: st.DrawFn) -> Side:
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    block = draw(st.sampled_from([4, 8, 16, 32]))
    ppl = draw(st.sampled_from([p for p in (1, 2, 4) if block // p >= 2]))
    return Side(tp, draw(st.sampled_from(LAYOUTS)), block, ppl, draw(st.sampled_from([0, 8])))


@st.composite
def cases(draw: st.DrawFn, rings: bool = False) -> Case:
    """Any pair; with ``rings``, one whose last KV-cache group is a ring with layers."""
    p, d = draw(sides()), draw(sides())
    tokens = draw(st.integers(1, 90))
    mla = draw(st.booleans())
    packed = "" if rings else draw(st.sampled_from(["", "", "p", "d"]))
    groups = draw(st.sampled_from([2, 3])) if rings else 1 if packed else 2
    if rings:  # a ring's capacity is the model's: one block size, never split
        p, d = replace(p, ppl=1), replace(d, block=p.block, ppl=1)
    d_total = -(-tokens // d.block)
    return Case(
        p,
        d,
        heads=draw(st.sampled_from([1, 2, 4, 8])),
        layers=draw(st.integers(groups if rings else 1, 4 if rings else 3)),
        kv_split=not mla and draw(st.booleans()),
        mla=mla,
        groups=groups,
        tokens=tokens,
        hits=draw(st.integers(0, d_total - 1)),
        window=draw(st.sampled_from([0, 0, 5, 24])),
        coalesce=draw(st.booleans()),
        contiguous=draw(st.booleans()),
        pass_tokens=True,
        mode=draw(st.sampled_from(["pull", "push"])),
        members=bool(packed) or draw(st.booleans()),
        packed=packed,
        ring=rings,
    )


@settings(max_examples=150, deadline=None, derandomize=True)
@given(cases())
def test_random_geometries_move_the_right_bytes(case: Case) -> None:
    run_case(case)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(cases(rings=True))
def test_a_ring_moves_whole_and_sliced_as_its_region(case: Case) -> None:
    """A ring group beside attention (and a window): its one block pairs with the
    consumer's, every slot right on every consumer rank, heads sliced between unequal TP
    sizes and read once where replicated (MLA)."""
    run_case(case)


@st.composite
def past_cases(draw: st.DrawFn) -> Case:
    """A producer that generated past the consumer's prompt (up to 36 tokens: its lists
    stay within the oracle's 32 blocks per region), a quarter of them with a ring."""
    case = draw(cases(rings=draw(st.integers(0, 3)) == 0))
    return replace(case, past=draw(st.integers(1, 36)), window=draw(st.sampled_from([0, 5, 24])))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(past_cases())
def test_a_producer_that_computed_past_the_prompt_moves_it_or_is_refused(case: Case) -> None:
    """Its lists end at its own count and the consumer's at the prompt's. The request moves
    with every token the consumer attends to right, or is refused by name: it must be
    where the producer's window no longer holds a token the consumer attends to or its
    ring is its own count's, and may be only where it lacks one the consumer's list holds
    (the planner sees lists, not windows)."""
    must, may = producer_lacks(case, make_request(case))
    try:
        run_case(case)
    except (LocalProtocolError, RemoteProtocolError) as exc:
        assert may, f"{case}: refused with every listed token held: {exc}"
        assert "asks for" in str(exc) or "a state is for one token count" in str(exc), exc
    else:
        assert not must, f"{case}: moved though the producer dropped attended tokens"


def test_the_producers_count_alone_places_both_sides() -> None:
    """Without the consumer's count its lists end where the producer's do."""
    case = Case(Side(1, "HND", 16), Side(1, "NHD", 8), tokens=40, groups=2, window=24)
    request, producers, consumers, _ = ranks(case)
    layout = PeerLayout(
        consumers[0].geometry, RemoteGeometry.from_local(producers[0].geometry), mode="pull"
    )
    alone = layout.plan(request.d_ids, request.p_ids, producer_tokens=40)
    both = layout.plan(request.d_ids, request.p_ids, num_tokens=40, producer_tokens=40)
    np.testing.assert_array_equal(alone.local_descs, both.local_descs)
    np.testing.assert_array_equal(alone.remote_descs, both.remote_descs)


@pytest.mark.parametrize(
    "counts",
    [{"num_tokens": "40"}, {"producer_tokens": -5}, {"producer_tokens": True}, {"num_tokens": 4.0}],
)
def test_token_counts_that_are_not_whole_numbers_are_refused_by_name(
    counts: dict[str, Any],
) -> None:
    case = Case(Side(1, "HND", 16), Side(1, "NHD", 8), tokens=40)
    request, producers, consumers, _ = ranks(case)
    layout = PeerLayout(
        consumers[0].geometry, RemoteGeometry.from_local(producers[0].geometry), mode="pull"
    )
    (name,) = counts
    with pytest.raises(LocalProtocolError, match=f"{name} must be an int >= 0 or None"):
        layout.plan(request.d_ids, request.p_ids, **counts)
