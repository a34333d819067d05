"""Streaming push over real shm transports: a prompt's KV leaves P while P computes it.

The producer's blocks hold a scribble until a layer's chunk is "computed" (written with the
values the consumer checks), and the engine reports progress only after it computed; so a
byte written before it was computed stays wrong at the consumer, and the check finds it.
Prompt lengths, chunk boundaries and block ids are drawn, not listed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.demo.content import blocks_view, count_wrong_bytes, expected, scribble
from kvwire.runtime import Consumer, Producer

from .conftest import Side, config, make_side, wait_until

LAYERS = 4
NUM_BLOCKS = 24


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Producer, Consumer, Side, Side]]:
    p_side, d_side = make_side(LAYERS, NUM_BLOCKS), make_side(LAYERS, NUM_BLOCKS)
    producer = Producer(config(p_side, "prefill-s", "push", stream_layers=True), "shm")
    consumer = Consumer(config(d_side, "decode-s", "push"), "shm")
    producer.register_kv_caches(p_side.spec.geometry(int(p_side.buffer.ctypes.data)))
    consumer.register_kv_caches(d_side.spec.geometry(int(d_side.buffer.ctypes.data)))
    p_side.listener.set_payloads({(0, 0): producer.handshake_payload()})
    d_side.listener.set_payloads({(0, 0): consumer.handshake_payload()})
    try:
        yield producer, consumer, p_side, d_side
    finally:
        consumer.close()
        producer.close()
        p_side.listener.close()
        d_side.listener.close()


def compute(side: Side, index: int, blocks: list[int], layer: int, start: int, stop: int) -> None:
    """Write layer ``layer``'s values of tokens [start, stop) into the request's blocks."""
    spec = side.spec
    tokens = spec.block_tokens
    view = blocks_view(spec, side.buffer)
    want = expected(spec, index, len(blocks))
    for t in range(start, stop):
        view[layer, blocks[t // tokens], :, t % tokens] = want[layer, t // tokens, :, t % tokens]


_counter = iter(range(1, 1 << 30))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_streamed_prompts_arrive_whole(
    pair: tuple[Producer, Consumer, Side, Side], data: st.DataObject
) -> None:
    producer, consumer, p, d = pair
    index = next(_counter)
    rid = f"stream-{index}"
    tokens = p.spec.block_tokens
    prompt = data.draw(st.integers(1, 8 * tokens), "prompt")
    count = -(-prompt // tokens)
    p_blocks = data.draw(st.permutations(range(NUM_BLOCKS)), label="p")[:count]
    d_blocks = data.draw(st.permutations(range(NUM_BLOCKS)), label="d")[:count]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, prompt - 1)), max_size=4), "cuts"))
    cuts = [c for c in cuts if c < prompt]
    bounds = [0, *cuts, prompt]
    scribble(p.spec, p.buffer, p_blocks)
    scribble(d.spec, d.buffer, d_blocks)

    params = producer.kv_transfer_params(rid, [p_blocks], num_tokens=prompt)
    consumer.add_request(rid, params, [d_blocks], num_tokens=prompt)
    wait_until(lambda: producer.pending_registrations() == 1)
    rounds = producer.machine_stats()["stream_rounds"]
    for start, stop in itertools.pairwise(bounds):
        held = p_blocks[: -(-stop // tokens)]
        producer.chunk_scheduled(rid, [held], num_tokens=stop, prompt_tokens=prompt)
        for layer in range(LAYERS):
            compute(p, index, p_blocks, layer, start, stop)
            producer.layer_computed(f"model.layers.{layer}.self_attn.attn", [rid])
    producer.prefill_finished(rid, [p_blocks], num_tokens=prompt)

    done: list[str] = []
    wait_until(lambda: bool(done.extend(consumer.get_finished().done) or done))
    assert done == [rid]
    wrong, checked = count_wrong_bytes(d.spec, d.buffer, index, d_blocks)
    # Only the prompt's tokens are the request's: the last block's tail is not.
    view = blocks_view(d.spec, d.buffer)
    want = expected(d.spec, index, count)
    got = view[:, d_blocks]
    flat_got = got.transpose(0, 2, 1, 3, 4).reshape(LAYERS, got.shape[2], count * tokens, -1)
    flat_want = want.transpose(0, 2, 1, 3, 4).reshape(LAYERS, got.shape[2], count * tokens, -1)
    assert np.array_equal(flat_got[:, :, :prompt], flat_want[:, :, :prompt]), (wrong, checked)
    freed: list[str] = []
    wait_until(lambda: bool(freed.extend(f.request_id for f in producer.get_finished()) or freed))
    assert freed == [rid] and producer.held_blocks() == 0
    if prompt >= tokens:  # a full block was computed in a streamed layer before the end
        assert producer.machine_stats()["stream_rounds"] > rounds
    assert producer.errors == [] and consumer.errors == []
