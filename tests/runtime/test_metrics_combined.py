"""A rank that runs a producer and a consumer (vLLM's ``kv_both``) reports one set of
counters: each counter the sum of both sides', and the rate of the side that moved bytes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.runtime.metrics import Metrics, combined_totals

REASONS = st.sampled_from(["expired", "sent", "aborted", "transfer failed", "handshake"])
EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("transfer"), st.integers(0, 1 << 30), st.booleans()),
        st.tuples(st.just("request"), st.sampled_from(["done", "failed", "freed"]), REASONS),
        st.tuples(st.just("handshake"), st.booleans(), st.sampled_from(["", "timeout", "hash"])),
        st.tuples(st.just("count"), st.sampled_from(["notifications_sent", "peers_lost"])),
    ),
    max_size=30,
)


def _play(role: str, events: list[tuple[Any, ...]]) -> Metrics:
    metrics = Metrics(role)
    for n, event in enumerate(events):
        now = float(n)
        if event[0] == "transfer":
            metrics.transfer_posted(f"r{n}", now, event[1], 1, 0.001)
            metrics.transfer_ended(event[1], 1, 0.5, event[2])
        elif event[0] == "request":
            metrics.request_started(f"r{n}", now)
            metrics.request_ended(f"r{n}", now + 1.0, event[1], event[2])
        elif event[0] == "handshake":
            metrics.handshake(event[1], 0.01, event[2])
        else:
            metrics.count(event[1])
    return metrics


@settings(max_examples=60, deadline=None)
@given(EVENTS, EVENTS)
def test_both_sides_combine_into_one_rank(producing: Any, consuming: Any) -> None:
    sides = [_play("producer", producing), _play("consumer", consuming)]
    alone = [side.snapshot()["totals"] for side in sides]
    combined = combined_totals(sides)
    assert combined.keys() == alone[0].keys()
    for key, value in combined.items():
        if key in ("gbps", "busy_s"):
            mover = max(alone, key=lambda t: t["bytes"])
            assert value == mover[key], key
        elif isinstance(value, dict):
            for reason in set(alone[0][key]) | set(alone[1][key]):
                assert value[reason] == sum(t[key].get(reason, 0) for t in alone), (key, reason)
            assert set(value) == set(alone[0][key]) | set(alone[1][key])
        else:
            assert value == pytest.approx(alone[0][key] + alone[1][key]), key


def test_one_side_is_itself() -> None:
    side = _play("consumer", [("transfer", 4096, True), ("request", "done", "sent")])
    assert combined_totals([side]) == side.snapshot()["totals"]
    with pytest.raises(ValueError, match="at least one"):
        combined_totals([])
