"""A transport that refuses a post (its peer died or restarted) makes the runtime forget the
peer, so the next request handshakes again instead of failing against a dead agent."""

from __future__ import annotations

from kvwire.demo.content import count_wrong_bytes, fill
from kvwire.runtime import Consumer, Finished, Producer
from kvwire.testing.faulty_transport import FaultyTransport
from kvwire.transport import create

from .conftest import config, make_side, wait_until


def _finish(consumer: Consumer, request_id: str) -> Finished:
    total = Finished()

    def ended() -> bool:
        got = consumer.get_finished()
        total.done.extend(got.done)
        total.failed.update(got.failed)
        return request_id in total.done or request_id in total.failed

    wait_until(ended, 30.0)
    return total


def test_refused_post_forgets_the_peer_and_the_next_request_handshakes_again() -> None:
    p_side, d_side = make_side(), make_side()
    faulty = FaultyTransport(create("shm", "decode-faulty"), fail_posts=1.0)
    producer = Producer(config(p_side, "prefill-e", "pull"), "shm")
    consumer = Consumer(config(d_side, "decode-e", "pull"), faulty)
    try:
        producer.register_kv_caches(p_side.spec.geometry(int(p_side.buffer.ctypes.data)))
        consumer.register_kv_caches(d_side.spec.geometry(int(d_side.buffer.ctypes.data)))
        p_side.listener.set_payloads({(0, 0): producer.handshake_payload()})

        fill(p_side.spec, p_side.buffer, 0, [0, 1])
        consumer.add_request("first", producer.prefill_finished("first", [[0, 1]]), [[4, 5]])
        first = _finish(consumer, "first")
        assert first.failed["first"].invalid_block_ids == ((4, 5),)
        assert faulty.injected["fail_posts"] == 1

        faulty.p["fail_posts"] = 0.0  # the peer is back
        fill(p_side.spec, p_side.buffer, 1, [2, 3])
        consumer.add_request("second", producer.prefill_finished("second", [[2, 3]]), [[6, 7]])
        assert _finish(consumer, "second").done == ["second"]
        assert count_wrong_bytes(d_side.spec, d_side.buffer, 1, [6, 7])[0] == 0
        totals = consumer.metrics.snapshot()["totals"]
        assert totals["handshakes_ok"] == 2 and totals["peers_lost"] == 1
    finally:
        consumer.close()
        producer.close()
        p_side.listener.close()
        d_side.listener.close()
