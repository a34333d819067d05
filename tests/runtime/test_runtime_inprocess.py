"""Producer and Consumer in one process over shm: the engine-facing API, fast."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from kvwire.demo.content import count_wrong_bytes, fill
from kvwire.errors import LocalProtocolError
from kvwire.runtime import Consumer, Finished, Producer

from .conftest import Side, wait_until

Pair = Callable[..., tuple[Producer, Consumer, Side, Side]]


def _collect(consumer: Consumer, want: int, timeout: float = 30.0) -> Finished:
    total = Finished()

    def enough() -> bool:
        got = consumer.get_finished()
        total.done.extend(got.done)
        total.failed.update(got.failed)
        return len(total.done) + len(total.failed) >= want

    wait_until(enough, timeout)
    return total


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_requests_move_verified_bytes_and_free_producer_blocks(
    pair_factory: Pair, mode: str
) -> None:
    producer, consumer, p, d = pair_factory(mode)
    for i in range(6):
        p_blocks = list(range(i * 4, i * 4 + 4))
        d_blocks = list(range(31 - i * 4, 27 - i * 4, -1))  # reversed, other ids
        fill(p.spec, p.buffer, i, p_blocks)
        params = producer.prefill_finished(f"req-{i}", [p_blocks], num_tokens=64)
        assert params["remote_block_ids"] == [p_blocks]
        assert params["transfer_mode"] == mode
        consumer.add_request(f"req-{i}", params, [d_blocks])
    fin = _collect(consumer, 6)
    assert sorted(fin.done) == [f"req-{i}" for i in range(6)] and not fin.failed
    for i in range(6):
        d_blocks = list(range(31 - i * 4, 27 - i * 4, -1))
        assert count_wrong_bytes(d.spec, d.buffer, i, d_blocks)[0] == 0
    freed: list[object] = []
    wait_until(lambda: bool(freed.extend(producer.get_finished()) or len(freed) == 6))
    assert {f.reason for f in freed} == {"sent"}  # type: ignore[attr-defined]
    assert producer.held_blocks() == 0
    posting = consumer if mode == "pull" else producer
    totals = posting.metrics.snapshot()["totals"]
    assert totals["bytes"] == 6 * 4 * d.spec.layers * d.spec.block_len
    assert totals["transfers_done"] == 6 and totals["handshakes_ok"] == 1
    assert consumer.errors == [] and producer.errors == []


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_nixl_requests_are_made_from_tables_prepared_at_the_handshake(
    pair_factory: Pair, mode: str
) -> None:
    """The runtime hands NIXL every row a pairing can post once, at the handshake; then a
    scattered request (no two blocks adjacent on both sides) is made by index."""
    producer, consumer, p, d = pair_factory(mode, transport="nixl")
    requests = {
        f"scattered-{i}": ([3 + i, 17 + i, 9 + i], [30 - i, 2 + i, 21 - i]) for i in range(3)
    }
    for i, (rid, (p_blocks, d_blocks)) in enumerate(requests.items()):
        fill(p.spec, p.buffer, i, p_blocks)
        params = producer.prefill_finished(rid, [p_blocks], num_tokens=48)
        consumer.add_request(rid, params, [d_blocks])
    fin = _collect(consumer, 3)
    assert sorted(fin.done) == sorted(requests) and not fin.failed
    for i, (_, d_blocks) in enumerate(requests.values()):
        assert count_wrong_bytes(d.spec, d.buffer, i, d_blocks)[0] == 0
    posting = consumer if mode == "pull" else producer
    assert posting.metrics.snapshot()["totals"]["tables_prepared"] == 1
    stats = posting.transport.stats()  # type: ignore[attr-defined]
    assert stats["peers_prepared"] == 1 and stats["requests_prepared"] == 3


def test_empty_prefill_frees_at_once(pair_factory: Pair) -> None:
    producer, _, _, _ = pair_factory()
    producer.prefill_finished("nothing", [[]])
    got = producer.get_finished()
    assert [(f.request_id, f.reason) for f in got] == [("nothing", "nothing_to_send")]


def test_full_prefix_hit_needs_no_transfer(pair_factory: Pair) -> None:
    producer, consumer, _, _ = pair_factory()
    params = producer.prefill_finished("hit", [[1, 2]])
    consumer.add_request("hit", params, [[]])
    assert _collect(consumer, 1).done == ["hit"]
    wait_until(lambda: [f.reason for f in producer.get_finished()] == ["sent"])


def test_unreachable_producer_fails_request_with_its_blocks_invalid(pair_factory: Pair) -> None:
    producer, consumer, p, _ = pair_factory()
    params = producer.prefill_finished("r", [[0, 1]])
    p.listener.close()  # P's side channel is gone
    consumer.add_request("r", params, [[5, 6]])
    fin = _collect(consumer, 1, timeout=60)
    failure = fin.failed["r"]
    assert failure.reason == "handshake"
    assert failure.invalid_block_ids == ((5, 6),)
    assert consumer.metrics.snapshot()["totals"]["handshakes_failed"] == 1


def test_lease_expires_when_no_consumer_comes(pair_factory: Pair) -> None:
    producer, _, _, _ = pair_factory(lease_s=0.2)
    producer.prefill_finished("orphan", [[3]])
    wait_until(lambda: any(f.reason == "expired" for f in producer.get_finished()), 10)
    assert producer.metrics.snapshot()["totals"]["leases_expired"] == 1
    assert producer.held_blocks() == 0


def test_abort_on_decode_side(pair_factory: Pair) -> None:
    producer, consumer, _, _ = pair_factory()
    params = producer.prefill_finished("a", [[0]])
    consumer.add_request("a", params)  # blocks not allocated yet
    consumer.abort("a")
    fin = _collect(consumer, 1)
    assert fin.failed["a"].reason == "aborted"


def test_engine_mistakes_are_local_protocol_errors(pair_factory: Pair) -> None:
    producer, consumer, _, _ = pair_factory()
    params = producer.prefill_finished("dup", [[0]])
    consumer.add_request("dup", params, [[1]])
    with pytest.raises(LocalProtocolError):
        consumer.add_request("dup", params, [[2]])
    with pytest.raises(LocalProtocolError):
        producer.prefill_finished("dup", [[4]])


def test_metrics_snapshot_and_prometheus_text(pair_factory: Pair) -> None:
    producer, consumer, _, _ = pair_factory()
    params = producer.prefill_finished("m", [[0, 1]])
    consumer.add_request("m", params, [[2, 3]])
    _collect(consumer, 1)
    snap = consumer.metrics.snapshot()
    rec = snap["requests"][0]
    assert rec["request_id"] == "m" and rec["outcome"] == "done"
    assert rec["bytes"] > 0 and rec["descriptors"] >= 1 and rec["transfer_s"] is not None
    text = consumer.metrics.prometheus_text()
    assert 'kvwire_requests_total{role="consumer",outcome="done"} 1.0' in text
    assert "# TYPE kvwire_transferred_bytes counter" in text


def test_close_leaves_no_threads_and_releases_a_passed_in_transport(pair_factory: Pair) -> None:
    from kvwire.transport import create

    from .conftest import config, make_side

    before = {t.ident for t in threading.enumerate()}
    side = make_side()
    transport = create("shm", "outside-agent")
    try:
        producer = Producer(config(side, "e"), transport)
        producer.register_kv_caches(side.spec.geometry(int(side.buffer.ctypes.data)))
        producer.prefill_finished("x", [[0]])
        producer.close()
        producer.close()
        # The registration is gone: the agent describes no memory any more.
        assert b"DRAM" not in transport.local_metadata()
    finally:
        transport.close()
        side.listener.close()
    wait_until(lambda: {t.ident for t in threading.enumerate()} <= before, 10)


def test_prometheus_export_is_optional(pair_factory: Pair) -> None:
    import importlib.util

    from kvwire.errors import ConfigError
    from kvwire.runtime.prometheus import register

    producer, _, _, _ = pair_factory()
    if importlib.util.find_spec("prometheus_client") is None:
        with pytest.raises(ConfigError, match="prometheus_client is not installed"):
            register(producer.metrics)
        return
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    register(producer.metrics, registry)
    assert b"kvwire_handshakes_total" in generate_latest(registry)
