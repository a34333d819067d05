"""Push with decode TP 2: a rank that gets its request after the producer wrote to it.

The producer writes to every decode rank it serves as soon as the first rank's registration
arrives, so rank 1 can hold the write notification before its engine hands it the request.
The consumer machine parks it; the request then completes at once instead of waiting for
its watchdog (``registration_timeout_s``, made long here so only that path could fail).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kvwire_shm import allocate

from kvwire.demo.content import count_wrong_bytes, fill
from kvwire.demo.models import CacheSpec, preset
from kvwire.runtime import Consumer, Producer
from kvwire.sidechannel import HandshakeListener

from .conftest import Side, config, make_side, wait_until

WATCHDOG_S = 120.0


@pytest.fixture
def push_tp2() -> Iterator[tuple[Producer, list[Consumer], Side, list[Side]]]:
    p_side = make_side()
    listener = HandshakeListener({}).start()
    d_sides = []
    for rank in range(2):
        spec = CacheSpec(preset("llama-3-8b"), 2, 32, rank, 2)
        d_sides.append(Side(spec, allocate(spec.total_bytes), listener))
    kw = {"registration_timeout_s": WATCHDOG_S}
    producer = Producer(config(p_side, "prefill-e", "push", **kw), "shm")
    consumers = [Consumer(config(s, "decode-e", "push", **kw), "shm") for s in d_sides]
    producer.register_kv_caches(p_side.spec.geometry(int(p_side.buffer.ctypes.data)))
    for c, s in zip(consumers, d_sides, strict=True):
        c.register_kv_caches(s.spec.geometry(int(s.buffer.ctypes.data)))
    p_side.listener.set_payloads({(0, 0): producer.handshake_payload()})
    listener.set_payloads({(0, r): c.handshake_payload() for r, c in enumerate(consumers)})
    try:
        yield producer, consumers, p_side, d_sides
    finally:
        for c in consumers:
            c.close()
        producer.close()
        listener.close()
        p_side.listener.close()


def test_a_rank_that_gets_the_request_after_the_write_completes_without_its_watchdog(
    push_tp2: tuple[Producer, list[Consumer], Side, list[Side]],
) -> None:
    producer, (d0, d1), p, (s0, s1) = push_tp2
    p_blocks, d_blocks = [0, 1, 2], [9, 8, 7]
    fill(p.spec, p.buffer, 3, p_blocks)
    params = producer.prefill_finished("req", [p_blocks], num_tokens=48)

    d0.add_request("req", params, [d_blocks])  # rank 0's registration triggers both writes
    wait_until(lambda: d0.get_finished().done == ["req"])
    wait_until(lambda: d1.machine_stats()["completions_parked"] == 1)
    assert producer.machine_stats()["transfers_posted"] == 2

    d1.add_request("req", params, [d_blocks])  # the engine hands rank 1 the request late
    finished = d1.get_finished()
    wait_until(lambda: bool(finished.done.extend(d1.get_finished().done) or finished.done))
    assert finished.done == ["req"] and not finished.failed
    assert d1.machine_stats()["completions_parked_applied"] == 1
    for side in (s0, s1):
        assert count_wrong_bytes(side.spec, side.buffer, 3, d_blocks)[0] == 0
    assert d0.errors == [] and d1.errors == [] and producer.errors == []
