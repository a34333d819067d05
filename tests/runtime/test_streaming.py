"""Streaming push over real shm transports: a prompt's KV leaves P while P computes it.

The producer's blocks hold a scribble until a layer's chunk is "computed" (written with the
values the consumer checks), and the engine reports progress only after it computed; so a
byte written before it was computed stays wrong at the consumer, and the check finds it.
Prompt lengths, chunk boundaries, block ids and preemptions are drawn, not listed. The
fault tests end a stream midway (the consumer's process killed, an abort on either side,
the consumer's watchdog): the request is never done, and the producer frees it once.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.demo.content import blocks_view, expected, scribble
from kvwire.errors import LocalProtocolError
from kvwire.runtime import Consumer, Producer

from .conftest import Side, config, make_side, wait_until

LAYERS = 4
NUM_BLOCKS = 24


Pair = tuple[Producer, Consumer, Side, Side]


@contextmanager
def streaming_pair(**kw: object) -> Iterator[Pair]:
    p_side, d_side = make_side(LAYERS, NUM_BLOCKS), make_side(LAYERS, NUM_BLOCKS)
    producer = Producer(config(p_side, "prefill-s", "push", stream_layers=True, **kw), "shm")
    consumer = Consumer(config(d_side, "decode-s", "push", **kw), "shm")
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


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    with streaming_pair() as made:
        yield made


def compute(side: Side, index: int, blocks: list[int], layer: int, start: int, stop: int) -> None:
    """Write layer ``layer``'s values of tokens [start, stop) into the request's blocks."""
    spec = side.spec
    tokens = spec.block_tokens
    view = blocks_view(spec, side.buffer)
    want = expected(spec, index, len(blocks))
    for t in range(start, stop):
        view[layer, blocks[t // tokens], :, t % tokens] = want[layer, t // tokens, :, t % tokens]


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def prefill(
    producer: Producer,
    p: Side,
    index: int,
    rid: str,
    blocks: list[int],
    bounds: list[int],
    after_layer: Callable[[int, int], None] | None = None,
    *,
    prompt: int | None = None,
) -> None:
    """Compute the chunks ``bounds`` of the prompt (``prompt`` tokens, default the last
    bound) layer by layer, reporting each layer after it is computed; ``after_layer(chunk,
    layer)`` runs after each report."""
    tokens = p.spec.block_tokens
    prompt = bounds[-1] if prompt is None else prompt
    for chunk, (start, stop) in enumerate(itertools.pairwise(bounds)):
        held = blocks[: -(-stop // tokens)]
        producer.chunk_scheduled(rid, [held], num_tokens=stop, prompt_tokens=prompt)
        for layer in range(LAYERS):
            compute(p, index, blocks, layer, start, stop)
            producer.layer_computed(layer_name(layer), [rid])
            if after_layer is not None:
                after_layer(chunk, layer)


def freed_reasons(producer: Producer, rid: str) -> list[str]:
    """Wait for ``rid`` to be freed; every time it was, with why."""
    seen: list[tuple[str, str]] = []
    wait_until(
        lambda: bool(seen.extend((f.request_id, f.reason) for f in producer.get_finished()) or seen)
    )
    return [reason for r, reason in seen if r == rid]


_counter = iter(range(1, 1 << 30))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_streamed_prompts_arrive_whole(pair: Pair, data: st.DataObject) -> None:
    producer, consumer, p, d = pair
    index = next(_counter)
    rid = f"stream-{index}"
    tokens = p.spec.block_tokens
    prompt = data.draw(st.integers(1, 8 * tokens), "prompt")
    count = -(-prompt // tokens)
    p_blocks = data.draw(st.permutations(range(NUM_BLOCKS)), "p")[:count]
    d_blocks = data.draw(st.permutations(range(NUM_BLOCKS)), "d")[:count]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, prompt - 1)), max_size=4), "cuts"))
    bounds = [0, *[c for c in cuts if c < prompt], prompt]
    preempt_at = data.draw(st.integers(0, len(bounds) * 2), "preempt after chunk")
    free = [b for b in range(NUM_BLOCKS) if b not in p_blocks]
    new_blocks = data.draw(st.permutations(free), "new p")[:count]
    # Everything is drawn before the runtimes are touched: an example Hypothesis abandons
    # midway must not leave a registration behind for the next one.
    scribble(p.spec, p.buffer, p_blocks)
    scribble(d.spec, d.buffer, d_blocks)

    params = producer.kv_transfer_params(rid, [p_blocks], num_tokens=prompt)
    consumer.add_request(rid, params, [d_blocks], num_tokens=prompt)
    wait_until(lambda: producer.pending_registrations() == 1)
    # Matched now; the stream can only write once P's handshake with D is done, so wait
    # for it rather than let its timing decide whether anything went early.
    producer.request_started(rid)
    wait_until(lambda: producer.metrics.snapshot()["totals"]["handshakes_ok"] >= 1)
    rounds = producer.machine_stats()["stream_rounds"]
    if preempt_at < len(bounds) - 1:
        # Preempted midway: the engine hands the old blocks to another prompt (scribbled
        # here) and computes this one again, from the start, into new blocks.
        prefill(producer, p, index, rid, p_blocks, bounds[: preempt_at + 2], prompt=prompt)
        producer.preempted(rid)
        scribble(p.spec, p.buffer, p_blocks)
        p_blocks = new_blocks
        scribble(p.spec, p.buffer, p_blocks)
    prefill(producer, p, index, rid, p_blocks, bounds)
    producer.prefill_finished(rid, [p_blocks], num_tokens=prompt)

    done: list[str] = []
    wait_until(lambda: bool(done.extend(consumer.get_finished().done) or done))
    assert done == [rid]
    # Only the prompt's tokens are the request's: the last block's tail is not.
    view = blocks_view(d.spec, d.buffer)
    want = expected(d.spec, index, count)
    got = view[:, d_blocks]
    flat_got = got.transpose(0, 2, 1, 3, 4).reshape(LAYERS, got.shape[2], count * tokens, -1)
    flat_want = want.transpose(0, 2, 1, 3, 4).reshape(LAYERS, got.shape[2], count * tokens, -1)
    wrong = int(np.count_nonzero(flat_got[:, :, :prompt] != flat_want[:, :, :prompt]))
    assert wrong == 0, f"{wrong} wrong values at the consumer"
    assert freed_reasons(producer, rid) == ["sent"] and producer.held_blocks() == 0
    if prompt >= tokens:  # a full block was computed in a streamed layer before the end
        assert producer.machine_stats()["stream_rounds"] > rounds
    assert producer.errors == [] and consumer.errors == []


def test_a_consumer_that_vanishes_mid_stream_never_gets_the_request_done() -> None:
    """D's process is killed after P's first round landed: P's next writes fail, P stops
    streaming and frees the prompt's blocks once, when the engine hands them over."""
    p = make_side(LAYERS, NUM_BLOCKS)
    producer = Producer(config(p, "prefill-v", "push", stream_layers=True), "shm")
    producer.register_kv_caches(p.spec.geometry(int(p.buffer.ctypes.data)))
    p.listener.set_payloads({(0, 0): producer.handshake_payload()})
    script = Path(__file__).with_name("push_consumer_proc.py")
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        tokens = p.spec.block_tokens
        blocks, prompt = list(range(6)), 6 * tokens
        params = producer.kv_transfer_params("r", [blocks], num_tokens=prompt)
        order = {"params": params, "blocks": blocks, "tokens": prompt}
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps({**order, "layers": LAYERS, "num_blocks": NUM_BLOCKS}) + "\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline()) == {"registered": True}
        wait_until(lambda: producer.pending_registrations() == 1)

        def kill_after_first_round(chunk: int, layer: int) -> None:
            if (chunk, layer) == (0, 0):
                wait_until(lambda: producer.machine_stats()["stream_rounds"] >= 1)
                proc.kill()
                proc.wait(timeout=30)

        prefill(producer, p, 1, "r", blocks, [0, 2 * tokens, prompt], kill_after_first_round)
        producer.prefill_finished("r", [blocks], num_tokens=prompt)
        assert freed_reasons(producer, "r") == ["failed"]
        assert producer.held_blocks() == 0
        assert producer.machine_stats()["transfers_failed"] >= 1
    finally:
        proc.kill()
        proc.wait(timeout=30)
        producer.close()
        p.listener.close()


def _start(pair: Pair, prompt_blocks: int) -> tuple[list[int], int]:
    producer, consumer, p, _ = pair
    tokens = p.spec.block_tokens
    blocks, prompt = list(range(prompt_blocks)), prompt_blocks * tokens
    params = producer.kv_transfer_params("r", [blocks], num_tokens=prompt)
    consumer.add_request("r", params, [blocks], num_tokens=prompt)
    wait_until(lambda: producer.pending_registrations() == 1)
    return blocks, prompt


def test_a_consumer_abort_mid_stream_is_never_done_and_the_producer_frees_once() -> None:
    with streaming_pair() as pair:
        producer, consumer, p, _ = pair
        blocks, prompt = _start(pair, 6)
        tokens = p.spec.block_tokens

        def abort_midway(chunk: int, layer: int) -> None:
            if (chunk, layer) == (0, 1):
                consumer.abort("r")

        prefill(producer, p, 1, "r", blocks, [0, 2 * tokens, prompt], abort_midway)
        producer.prefill_finished("r", [blocks], num_tokens=prompt)
        assert freed_reasons(producer, "r") == ["sent"] and producer.held_blocks() == 0
        finished = consumer.get_finished()
        # The failure says until when P may write into the blocks: after every write did.
        assert finished.failed["r"].writes_until is not None
        assert finished.failed["r"].writes_until > time.perf_counter()
        # The completion came after the abort: counted, never a done request.
        wait_until(lambda: consumer.machine_stats()["completions_parked"] >= 1)
        finished.done.extend(consumer.get_finished().done)
        assert finished.done == []


def test_a_producer_abort_mid_stream_frees_once_and_the_consumer_fails() -> None:
    with streaming_pair(registration_timeout_s=2.0, completion_margin_s=0.5) as pair:
        producer, consumer, p, _ = pair
        blocks, prompt = _start(pair, 6)
        tokens = p.spec.block_tokens
        prefill(producer, p, 1, "r", blocks, [0, 2 * tokens], prompt=prompt)
        producer.abort("r")  # the engine gave up on the prompt midway
        assert freed_reasons(producer, "r") == ["aborted"] and producer.held_blocks() == 0
        failed: dict[str, object] = {}
        wait_until(lambda: bool(failed.update(consumer.get_finished().failed) or failed))
        assert list(failed) == ["r"]


def test_a_stream_past_the_consumers_watchdog_fails_on_both_sides() -> None:
    """The consumer gives up after registration_timeout_s; the producer bounds its writes
    by the same watchdog, so a prompt still computing then is never written to it again."""
    with streaming_pair(registration_timeout_s=1.0, completion_margin_s=0.2) as pair:
        producer, consumer, p, _ = pair
        blocks, prompt = _start(pair, 6)
        tokens = p.spec.block_tokens
        failed: dict[str, object] = {}
        posted: list[int] = []

        def stall_past_the_watchdog(chunk: int, layer: int) -> None:
            if (chunk, layer) == (0, LAYERS - 1):
                wait_until(lambda: bool(failed.update(consumer.get_finished().failed) or failed))
                posted.append(producer.machine_stats()["transfers_posted"])

        prefill(producer, p, 1, "r", blocks, [0, 2 * tokens, prompt], stall_past_the_watchdog)
        producer.prefill_finished("r", [blocks], num_tokens=prompt)
        assert freed_reasons(producer, "r") == ["failed"] and producer.held_blocks() == 0
        # Nothing was written after the consumer gave up: not the next chunk, not the end.
        assert producer.machine_stats()["transfers_posted"] == posted[0]
        assert list(failed) == ["r"] and consumer.get_finished().done == []


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda p: p.chunk_scheduled("b", [0, 1], num_tokens=8, prompt_tokens=8), "block"),
        (lambda p: p.chunk_scheduled("b", [[0]], num_tokens=8.0, prompt_tokens=8), "int"),
        (lambda p: p.chunk_scheduled("b", [[0]], num_tokens=9, prompt_tokens=8), "within"),
        (lambda p: p.chunk_scheduled("b,c", [[0]], num_tokens=8, prompt_tokens=8), "','"),
        (lambda p: p.layer_computed("lm_head", ["b"]), "not a layer"),
        (lambda p: p.preempted(""), "non-empty"),
    ],
)
def test_bad_streaming_calls_are_refused_by_name(
    pair: Pair, call: Callable[[Producer], object], named: str
) -> None:
    producer = pair[0]
    with pytest.raises(LocalProtocolError, match=named):
        call(producer)
    assert producer.errors == []
