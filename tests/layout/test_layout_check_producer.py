"""A pushed-to consumer checks its producer (``check_producer``) and must refuse exactly
what the producer's own push plan refuses: a stricter check would turn away producers
that move correctly, a looser one would let a vLLM producer (which checks nothing of
kvwire's) write bytes that are not the request's. Generated from the layout oracle's
cases (TP and block sizes, kernel splits, layouts, MLA, packed rows, members, rings)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvwire.errors import ConfigError, IncompatiblePeerError
from kvwire.layout import check_producer, validate_peer
from kvwire.layout.geometry import KVGeometry, RemoteGeometry
from kvwire.pairs.oracle import Case, Side, make_rank

from .test_layout_oracle import LAYOUTS, cases
from .test_layout_region_names import geometry, hf_name, peer


def _accepts(check: object, *args: object, **kw: object) -> str | None:
    try:
        check(*args, **kw)  # type: ignore[operator]
    except IncompatiblePeerError as exc:
        return str(exc)
    return None


def _both_ways(producer: KVGeometry, consumer: KVGeometry) -> None:
    by_plan = _accepts(validate_peer, producer, RemoteGeometry.from_local(consumer), mode="push")
    by_consumer = _accepts(check_producer, consumer, RemoteGeometry.from_local(producer))
    assert (by_plan is None) == (by_consumer is None), (by_plan, by_consumer)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(cases())
def test_a_consumer_refuses_what_the_producers_plan_refuses(case: Case) -> None:
    for p_rank in range(case.p.tp):
        for d_rank in range(case.d.tp):
            _both_ways(make_rank(case, 0, p_rank).geometry, make_rank(case, 1, d_rank).geometry)


@st.composite
def strangers(draw: st.DrawFn) -> tuple[Case, Case]:
    """Two engines of one model (the compatibility hash sees to that) whose sizes need
    not pair: the consumer's TP size, block size and kernel split drawn anew, some of
    them dividing nothing the producer's do."""
    case = draw(cases())
    block = draw(st.sampled_from([4, 6, 8, 12, 16, 32]))
    d = Side(
        draw(st.sampled_from([1, 2, 3, 4, 6, 8])),
        draw(st.sampled_from(LAYOUTS)),
        block,
        draw(st.sampled_from([p for p in (1, 2, 3, 4) if block % p == 0 and block // p >= 2])),
        draw(st.sampled_from([0, 8])),
    )
    return case, replace(case, d=d)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(strangers())
def test_and_accepts_what_it_accepts_between_sizes_that_may_not_pair(
    pair: tuple[Case, Case],
) -> None:
    producer, consumer = pair
    try:
        ranks = [make_rank(consumer, 1, r).geometry for r in range(consumer.d.tp)]
    except ConfigError:  # no such engine: its geometry refuses its own sizes
        assume(False)
    for d_rank in ranks:
        _both_ways(make_rank(producer, 0, 0).geometry, d_rank)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(cases(rings=True))
def test_with_rings_too(case: Case) -> None:
    _both_ways(make_rank(case, 0, 0).geometry, make_rank(case, 1, 0).geometry)


def test_a_pipeline_stage_pushing_into_a_whole_model_is_left_to_its_plan() -> None:
    """The stage finds its window among the consumer's regions by their names; from the
    consumer's side its fewer regions do not pair by index, so the check stands aside."""
    whole = geometry([hf_name(i) for i in range(4)])
    stage = geometry([hf_name(2), hf_name(3)], first_layer=2, pp_rank=1, pp_size=2)
    validate_peer(stage, peer(whole), mode="push")  # the stage's plan pairs it
    check_producer(whole, peer(stage))
    with pytest.raises(IncompatiblePeerError, match="region count"):
        check_producer(geometry([hf_name(i) for i in range(3)]), peer(whole))
