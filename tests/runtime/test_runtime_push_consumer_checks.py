"""A push consumer checks its producer's geometry itself, at the handshake, before it
registers a block: a vLLM producer writes by its own rules whatever it pairs with, so the
consumer cannot leave the check to the producer's plan (vLLM 0.32.0 pushing Glm5Next's
rows between TP 1 and 2 ended requests done with most bytes wrong)."""

from __future__ import annotations

import dataclasses

import pytest

from kvwire.runtime import Consumer, Producer

from .conftest import config, make_side, wait_until


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_consumer_refuses_a_producer_of_another_geometry_before_it_registers(
    mode: str,
) -> None:
    """The producer holds three layers, the consumer two (the hash, which names no layer
    count here, agrees): the consumer fails the request at its handshake, naming the
    regions, in push as in pull, long before a push registration could time out, and the
    producer never hears of a registration."""
    p_side, d_side = make_side(layers=3), make_side(layers=2)
    compat = d_side.spec.compat(mode)
    producer = Producer(
        dataclasses.replace(config(p_side, "prefill-3", mode), compat=compat), "shm"
    )
    consumer = Consumer(config(d_side, "decode-2", mode, registration_timeout_s=600.0), "shm")
    try:
        producer.register_kv_caches(p_side.spec.geometry(int(p_side.buffer.ctypes.data)))
        consumer.register_kv_caches(d_side.spec.geometry(int(d_side.buffer.ctypes.data)))
        p_side.listener.set_payloads({(0, 0): producer.handshake_payload()})
        d_side.listener.set_payloads({(0, 0): consumer.handshake_payload()})
        params = producer.prefill_finished("r", [[0, 1]], num_tokens=32)
        consumer.add_request("r", params, [[5, 6]])
        failed = {}
        wait_until(lambda: bool(failed.update(consumer.get_finished().failed) or failed), 60)
        assert failed["r"].reason == "handshake"
        assert "incompatible KV geometry" in failed["r"].detail
        assert failed["r"].invalid_block_ids == ((5, 6),)
        assert consumer.metrics.snapshot()["totals"].get("notifications_sent", 0) == 0
        assert producer.metrics.snapshot()["totals"].get("transfers_done", 0) == 0
    finally:
        consumer.close()
        producer.close()
        p_side.listener.close()
        d_side.listener.close()
