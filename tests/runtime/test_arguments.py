"""The public API refuses, at the call and by name, what it cannot honour.

The property: whatever an engine passes as block ids, the runtime either takes exactly the
ids it was given (one list of ints per KV-cache group, all inside the pool) or raises
``LocalProtocolError`` naming the argument; nothing is converted into other ids.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire import BlockRegion, KVGeometry, KVWireConfig
from kvwire.errors import ConfigError, LocalProtocolError, WireDecodeError
from kvwire.pairs.oracle import Case, Side
from kvwire.pairs.worker import compat_factors
from kvwire.runtime import Consumer, Producer
from kvwire.runtime.arguments import (
    block_ids_arg,
    geometry_groups,
    num_tokens_arg,
    request_id_arg,
)

POOL = 16


def geometry(groups: int = 1, ppl: int = 1) -> KVGeometry:
    regions = [
        BlockRegion(base_addr=4096 * (i + 1) << 20, block_len=64, num_blocks=POOL * ppl,
                    group_id=i % groups, mem_kind="DRAM", name=f"layers.{i}")
        for i in range(2 * groups)
    ]  # fmt: skip
    return KVGeometry(regions, block_size=16 * ppl, physical_blocks_per_logical=ppl)


ids_like = st.one_of(
    st.integers(-3, POOL + 3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=3),
    st.integers(-(2**70), 2**70),
)
shapes = st.one_of(
    st.lists(st.lists(ids_like, max_size=4), max_size=3),
    st.lists(ids_like, max_size=4),
    ids_like,
    st.tuples(st.lists(st.integers(0, POOL - 1), max_size=4)),
)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(value=shapes, groups=st.integers(1, 2))
def test_block_ids_are_taken_exactly_or_refused_by_name(value: Any, groups: int) -> None:
    try:
        got = block_ids_arg(value, geometry(groups))
    except LocalProtocolError as exc:
        assert str(exc).startswith("block_ids")
        return
    assert got == () or len(got) == groups
    assert [list(g) for g in got] == [list(g) for g in value]
    for group in got:
        for block in group:
            assert type(block) is int and 0 <= block < POOL


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ([0, 1, 2, 3], "expected a list of block ids, got int"),
        ([[0, 1.9]], "must be ints, got float64"),
        ([["30"]], "must be ints"),
        ([[True]], "must be ints, got bool"),
        ([[0, POOL]], f"block id {POOL} is outside the registered pool of {POOL} blocks"),
        ([[0], [1]], "2 lists, but the registered KV cache has 1 KV-cache group"),
        ("0,1", "expected one list of block ids per KV-cache group, got str"),
    ],
)
def test_each_mistake_is_named(value: Any, words: str) -> None:
    with pytest.raises(LocalProtocolError, match=words.replace("[", r"\[")):
        block_ids_arg(value, geometry())


def test_the_pool_counts_logical_blocks() -> None:
    # 16 logical blocks of 2 kernel blocks each: logical id 16 is past the pool.
    with pytest.raises(LocalProtocolError, match="outside the registered pool of 16"):
        block_ids_arg([[16]], geometry(ppl=2))
    assert block_ids_arg(np.array([[15, 0]]), geometry(ppl=2)) == ((15, 0),)


def test_num_tokens_must_fit_the_blocks() -> None:
    assert num_tokens_arg(None, 32) is None
    assert num_tokens_arg(np.int64(32), 32) == 32
    assert num_tokens_arg(5) == 5  # no blocks passed: any length
    for bad in (33, 0, -1):
        with pytest.raises(LocalProtocolError, match="num_tokens"):
            num_tokens_arg(bad, 32)
    for wrong in (1.5, "32", True):
        with pytest.raises(LocalProtocolError, match="num_tokens must be an int"):
            num_tokens_arg(wrong, 32)


def test_the_lists_reach_as_far_as_each_groups_own_blocks() -> None:
    """DeepSeek-V4's groups (``group_block_sizes``): a request's lists reach as far as the
    furthest group's blocks of its own size, not as far as as many blocks of the
    engine's size."""
    region = BlockRegion(base_addr=0, block_len=48, num_blocks=16, group_id=-1)
    rows = KVGeometry([region], block_size=16, group_block_sizes=(16, 4), is_mla=True)
    assert rows.tokens_held(((1, 2), (3, 4, 5, 6, 7))) == 32  # 2 blocks of 16, 5 of 4
    assert rows.tokens_held(((1,), (3, 4, 5, 6, 7))) == 20
    plain = KVGeometry([region], block_size=16, is_mla=True)
    assert plain.tokens_held(((1, 2), (3, 4, 5, 6, 7))) == 80
    assert geometry_groups(rows) == 2


def test_request_ids_must_fit_the_notifications() -> None:
    assert request_id_arg("cmpl-1:2") == "cmpl-1:2"  # ':' is fine: split on the last one
    for bad, words in (("a,b", "contains ','"), ("", "non-empty"), (7, "non-empty str"),
                       ("\ud800", "not valid Unicode")):  # fmt: skip
        with pytest.raises(LocalProtocolError, match=words):
            request_id_arg(bad)


def _factors(mode: str = "pull") -> Any:
    return compat_factors(Case(Side(), Side(), mode=mode))


def test_the_runtime_calls_refuse_at_the_call() -> None:
    with Producer(KVWireConfig(engine_id="p", compat=_factors())) as producer:
        producer.register_kv_caches(geometry())
        with pytest.raises(LocalProtocolError, match="contains ','"):
            producer.prefill_finished("a,b", [[0]])
        with pytest.raises(LocalProtocolError, match="expected a list of block ids"):
            producer.prefill_finished("r", [0, 1])
        with pytest.raises(LocalProtocolError, match="num_tokens 40 does not fit"):
            producer.prefill_finished("r", [[0, 1]], num_tokens=40)
        assert producer.held_blocks() == 0  # nothing was held for a refused call
        params = producer.prefill_finished("r", [[0, 1]], num_tokens=20)
    with Consumer(KVWireConfig(engine_id="d", compat=_factors())) as consumer:
        consumer.register_kv_caches(geometry())
        with pytest.raises(LocalProtocolError, match="must be a dict, JSON text or msgpack"):
            consumer.add_request("r", 42, [[1]])  # type: ignore[arg-type]
        with pytest.raises(WireDecodeError, match="text must be a JSON object"):
            consumer.add_request("r", "not json", [[1]])
        with pytest.raises(LocalProtocolError, match="outside the registered pool"):
            consumer.add_request("r", params, [[99]])
        with pytest.raises(LocalProtocolError, match="must be ints"):
            consumer.blocks_allocated("r", [[1.0]])
        with pytest.raises(ConfigError, match=r"needs a kvwire\.KVGeometry"):
            consumer.register_kv_caches({"regions": []})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mode", "num_tokens", "words"),
    [
        ("pull", 21, "num_tokens 21, and the producer computed 20 tokens: it cannot send"),
        ("push", 21, "num_tokens 21, and the producer computed 20 tokens: it cannot send"),
        ("push", 19, "a pushing producer places this consumer's blocks by its own count"),
    ],
)
def test_a_count_the_producer_cannot_fill_is_refused_at_the_call(
    mode: str, num_tokens: int, words: str
) -> None:
    """The params say the producer computed 20 tokens. A consumer loading more waits for
    tokens that do not exist; a push consumer loading fewer gets its blocks placed by the
    producer's count. (A pull consumer loading fewer is placed by both counts.)"""
    with Producer(KVWireConfig(engine_id="p", mode=mode, compat=_factors(mode))) as producer:
        producer.register_kv_caches(geometry())
        params = producer.prefill_finished("r", [[0, 1]], num_tokens=20)
    config = KVWireConfig(engine_id="d", mode=mode, compat=_factors(mode))
    with Consumer(config) as consumer:
        consumer.register_kv_caches(geometry())
        with pytest.raises(LocalProtocolError, match=words):
            consumer.add_request("r", params, [[2, 3]], num_tokens=num_tokens)
        consumer.add_request("r", params, [[2, 3]], num_tokens=20)  # the same count: taken


def test_push_producers_need_the_prompt_length() -> None:
    config = KVWireConfig(engine_id="p", mode="push", compat=_factors("push"))
    with Producer(config) as producer:
        producer.register_kv_caches(geometry())
        with pytest.raises(LocalProtocolError, match="push mode: prefill_finished needs"):
            producer.prefill_finished("r", [[0, 1]])


@pytest.mark.parametrize(
    ("knobs", "words"),
    [
        ({"lease_s": 4, "expiry_margin_s": 5}, "expiry_margin_s 5 is not below lease_s 4"),
        ({"lease_s": 4, "completion_margin_s": 4}, "completion_margin_s 4 is not below"),
        ({"lease_s": 6, "heartbeat_interval_s": 5}, "heartbeat_interval_s 5 is not below"),
    ],
)
def test_durations_that_fail_every_request_are_refused(knobs: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        KVWireConfig(engine_id="x", **knobs)


def test_a_producer_whose_lease_no_read_fits_is_refused_at_the_handshake() -> None:
    """P's lease (2 s) is not above D's expiry margin (3 s): every READ would be declined,
    so the handshake fails naming both knobs, and the request with it."""
    p_config = KVWireConfig(engine_id="p", compat=_factors(), lease_s=2.0)
    d_config = KVWireConfig(engine_id="d", compat=_factors(), expiry_margin_s=3.0)
    with Producer(p_config) as producer, Consumer(d_config) as consumer:
        producer.register_kv_caches(geometry())
        consumer.register_kv_caches(geometry())
        params = producer.prefill_finished("r", [[0, 1]], num_tokens=20)
        consumer.add_request("r", params, [[2, 3]])
        assert consumer.wait_finished(30.0)
        failure = consumer.get_finished().failed["r"]
        assert failure.reason == "handshake"
        assert "lease_s 2, not above our expiry_margin_s 3" in failure.detail
