"""Rank selection and notification counts, exhaustively over small deployments."""

from __future__ import annotations

import itertools

import pytest

from kvwire.errors import ConfigError
from kvwire.layout import topology
from kvwire.layout.geometry import rank_heads

SIZES = [1, 2, 4, 8]
PAIRS = list(itertools.product(SIZES, SIZES))


def test_protocol_examples() -> None:
    assert topology.tp_ratio(4, 2) == 2
    assert topology.tp_ratio(2, 8) == -4
    assert topology.tp_ratio(2, 2) == 1
    assert topology.remote_tp_ranks(3, 4, 2) == [1]
    assert topology.remote_tp_ranks(1, 2, 8) == [4, 5, 6, 7]
    assert topology.remote_ranks(0, 2, 4, remote_pp=2) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_sizes_that_do_not_divide_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="divide"):
        topology.tp_ratio(4, 3)
    with pytest.raises(ConfigError, match="outside"):
        topology.remote_tp_ranks(4, 4, 2)
    with pytest.raises(ConfigError, match="positive"):
        topology.consumer_expected_notifications(2, 2, producer_pp=0)


@pytest.mark.parametrize(("p_tp", "d_tp"), PAIRS)
def test_peering_is_symmetric(p_tp: int, d_tp: int) -> None:
    for d in range(d_tp):
        for p in range(p_tp):
            seen_from_d = p in topology.remote_tp_ranks(d, d_tp, p_tp)
            seen_from_p = d in topology.consumer_ranks_of_producer(p, p_tp, d_tp)
            assert seen_from_d == seen_from_p


@pytest.mark.parametrize(("p_tp", "d_tp"), PAIRS)
def test_producer_waits_for_exactly_the_consumers_that_notify_it(p_tp: int, d_tp: int) -> None:
    expected = topology.pull_completion_count(p_tp, d_tp)
    for p in range(p_tp):
        notifiers = [d for d in range(d_tp) if p in topology.notified_producer_ranks(d, d_tp, p_tp)]
        assert len(notifiers) == expected


@pytest.mark.parametrize(("p_tp", "d_tp"), PAIRS)
@pytest.mark.parametrize("p_pp", [1, 2])
def test_consumer_waits_for_every_writer_in_push(p_tp: int, d_tp: int, p_pp: int) -> None:
    expected = topology.consumer_expected_notifications(p_tp, d_tp, p_pp)
    for d in range(d_tp):
        writers = [
            (pp, p)
            for pp in range(p_pp)
            for p in range(p_tp)
            if d in topology.consumer_ranks_of_producer(p, p_tp, d_tp)
        ]
        assert len(writers) == expected


@pytest.mark.parametrize(("p_tp", "d_tp"), PAIRS)
@pytest.mark.parametrize("heads", [1, 2, 4, 8])
def test_every_consumer_head_has_one_source_that_holds_it(p_tp: int, d_tp: int, heads: int) -> None:
    for d in range(d_tp):
        sources = topology.head_sources(d, d_tp, p_tp, heads)
        peers = topology.remote_tp_ranks(d, d_tp, p_tp)
        consumer_heads = rank_heads(d, d_tp, heads).tolist()
        assert len(sources) == len(consumer_heads)
        for head, source in zip(consumer_heads, sources, strict=True):
            assert source in peers
            assert head in rank_heads(source, p_tp, heads).tolist()
        readers = topology.read_source_ranks(d, d_tp, p_tp, heads)
        assert readers == sorted(set(sources))
        assert topology.read_source_ranks(d, d_tp, p_tp, heads, is_mla=True) == [
            topology.replicated_source(d, d_tp, p_tp)
        ]


def test_mla_with_more_producer_ranks_reads_one_and_notifies_all() -> None:
    assert topology.read_source_ranks(1, 2, 8, 1, is_mla=True) == [4]
    assert topology.notified_producer_ranks(1, 2, 8) == [4, 5, 6, 7]
    assert topology.pull_completion_count(8, 2) == 1


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "p_dcp", "d_dcp", "count"),
    [
        (1, 1, 1, 1, 1),
        (2, 4, 1, 1, 2),  # two D ranks read each P rank
        (4, 2, 1, 1, 1),  # each P rank is read by one D rank
        (2, 2, 1, 1, 1),  # not D's world size (the old, wrong count was 2)
        (4, 4, 2, 1, 4),  # a replicated D reads every shard of a sharded P
        (4, 4, 2, 4, 2),
        (4, 4, 4, 2, 1),
    ],
)
def test_pull_completion_count_is_vllms(
    p_tp: int, d_tp: int, p_dcp: int, d_dcp: int, count: int
) -> None:
    # The rule of vLLM 0.31.0's TransferTopology.dcp_consumer_count, seen from D; the interop
    # suite (make interop) proves it against vLLM's running code.
    assert topology.pull_completion_count(p_tp, d_tp, p_dcp, d_dcp) == count


def test_pull_completion_count_refuses_bad_dcp() -> None:
    with pytest.raises(ConfigError, match="dcp_size"):
        topology.pull_completion_count(2, 2, 0, 1)
