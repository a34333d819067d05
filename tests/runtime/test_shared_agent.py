"""A Producer and a Consumer sharing one agent (``kvwire.runtime.shared_agent``), as an
engine that is P for some requests and D for others runs them, over real transports; and
the consumer's read-back of the first tokens a producer holds."""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.demo.content import blocks_view, expected, fill, scribble
from kvwire.errors import ConfigError, LocalProtocolError
from kvwire.runtime import Consumer, Producer
from kvwire.runtime.shared_agent import SharedAgent
from kvwire.transport import DelegatingTransport, Region, Transport, create
from kvwire.wire.notifications import (
    encode_completion,
    encode_heartbeat,
    encode_push_registration,
)
from kvwire.wire.schemas import PushRegistration

from .conftest import Side, config, make_side, wait_until

_names = itertools.count()


@dataclass
class Engine:
    """One rank of an engine running both sides over one agent."""

    side: Side
    agent: SharedAgent
    producer: Producer
    consumer: Consumer


def _engine(stack: ExitStack, name: str, mode: str, transport: str) -> Engine:
    side = make_side()
    stack.callback(side.listener.close)
    agent = SharedAgent(create(transport, f"{name}-{next(_names)}"), mode)
    stack.callback(agent.close)
    cfg = config(side, name, mode)
    producer = Producer(cfg, agent.view("producer"))
    stack.callback(producer.close)
    consumer = Consumer(cfg, agent.view("consumer"))
    stack.callback(consumer.close)
    geometry = side.spec.geometry(int(side.buffer.ctypes.data))
    producer.register_kv_caches(geometry)
    consumer.register_kv_caches(geometry)
    side.listener.set_payloads({(0, 0): producer.handshake_payload()})
    return Engine(side, agent, producer, consumer)


@pytest.mark.parametrize("transport", ["shm", "nixl"])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_two_engines_each_both_ways(mode: str, transport: str) -> None:
    """Requests cross in both directions at once between two engines that each run both
    sides over one agent: every one lands byte for byte, every held block is freed, and
    each side's machine saw only notifications meant for it."""
    rng = random.Random(7)
    with ExitStack() as stack:
        a = _engine(stack, "engine-a", mode, transport)
        b = _engine(stack, "engine-b", mode, transport)
        placed: dict[str, tuple[Engine, int, list[int]]] = {}
        free = {id(a): list(range(32)), id(b): list(range(32))}
        for i in range(8):
            src, dst = (a, b) if i % 2 == 0 else (b, a)
            p_blocks = rng.sample(free[id(src)], 3)
            d_blocks = rng.sample(free[id(dst)], 3)
            for engine, blocks in ((src, p_blocks), (dst, d_blocks)):
                free[id(engine)] = [x for x in free[id(engine)] if x not in blocks]
            fill(src.side.spec, src.side.buffer, i, p_blocks)
            scribble(dst.side.spec, dst.side.buffer, d_blocks)
            params = src.producer.prefill_finished(f"r{i}", [p_blocks], num_tokens=48)
            dst.consumer.add_request(f"r{i}", params, [d_blocks])
            placed[f"r{i}"] = (dst, i, d_blocks)
        done: set[str] = set()

        def all_done() -> bool:
            for engine in (a, b):
                finished = engine.consumer.get_finished()
                assert not finished.failed, finished.failed
                done.update(finished.done)
            return done == set(placed)

        wait_until(all_done)
        for dst, index, d_blocks in placed.values():
            view = blocks_view(dst.side.spec, dst.side.buffer)
            want = expected(dst.side.spec, index, 3)
            assert np.array_equal(view[:, d_blocks], want)
        wait_until(lambda: a.producer.held_blocks() == b.producer.held_blocks() == 0)
        for engine in (a, b):
            for runtime in (engine.producer, engine.consumer):
                assert runtime.errors == []
                stats = runtime.machine_stats()
                assert stats.get("notifications_unexpected", 0) == 0, stats
                assert stats.get("notifications_malformed", 0) == 0, stats


class _Counting(DelegatingTransport):
    """Counts the registrations and peers the inner agent is given."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self.registered = self.deregistered = self.added = self.removed = 0

    def register(self, regions: Sequence[Region]) -> object:
        self.registered += 1
        return super().register(regions)

    def deregister(self, handle: object) -> None:
        self.deregistered += 1
        super().deregister(handle)

    def add_peer(self, blob: bytes) -> str:
        self.added += 1
        return super().add_peer(blob)

    def remove_peer(self, peer: str) -> None:
        self.removed += 1
        super().remove_peer(peer)


@pytest.fixture
def agents() -> Iterator[tuple[SharedAgent, _Counting, Transport]]:
    inner = _Counting(create("shm", f"shared-{next(_names)}"))
    other = create("shm", f"remote-{next(_names)}")
    agent = SharedAgent(inner, "pull")
    yield agent, inner, other
    agent.close()
    other.close()


def test_memory_is_registered_once_and_peers_added_once(
    agents: tuple[SharedAgent, _Counting, Transport],
) -> None:
    """Both sides register the same KV cache: one registration, gone with the last side;
    a peer both sides add is added once (adding it again would drop the tables the posting
    side prepared) and removed when neither holds it."""
    agent, inner, other = agents
    producer, consumer = agent.view("producer"), agent.view("consumer")
    memory = np.zeros(4096, dtype=np.uint8)
    spans = [Region(int(memory.ctypes.data), memory.nbytes)]
    handle = producer.register(spans)
    assert consumer.register(spans) is handle and inner.registered == 1
    with pytest.raises(ConfigError, match="register different memory"):
        consumer.register([Region(int(memory.ctypes.data), 2048)])
    name = producer.add_peer(other.local_metadata())
    assert consumer.add_peer(other.local_metadata()) == name and inner.added == 1
    # A side's new handshake adds its peer again, as without sharing.
    assert consumer.add_peer(other.local_metadata()) == name and inner.added == 2
    producer.remove_peer(name)  # after a failure, say: the consumer still holds it
    assert inner.removed == 0
    assert producer.add_peer(other.local_metadata()) == name and inner.added == 3  # afresh
    producer.remove_peer(name)
    consumer.remove_peer(name)
    assert inner.removed == 1
    producer.deregister(handle)
    assert inner.deregistered == 0
    consumer.deregister(handle)
    assert inner.deregistered == 1
    with pytest.raises(ConfigError):
        consumer.deregister(handle)
    assert producer.name == consumer.name == inner.name


_KINDS = st.sampled_from(["completion", "registration", "heartbeat", "garbage"])


def _message(kind: str, n: int) -> bytes:
    """A notification of ``kind`` as a peer sends it (``garbage``: no kind at all)."""
    if kind == "completion":
        return encode_completion(f"req-{n}", 1)
    if kind == "registration":
        where = {"decode_host": "127.0.0.1", "remote_host": "127.0.0.1"}
        return encode_push_registration(
            PushRegistration(
                request_id=f"req-{n}",
                decode_engine_id="decode",
                decode_port=5600,
                decode_tp_size=1,
                local_block_ids=[[n]],
                remote_engine_id="prefill",
                remote_port=5601,
                remote_tp_size=1,
                remote_pp_size=1,
                **where,
            )
        )
    if kind == "heartbeat":
        return encode_heartbeat([f"req-{n}", "other"])
    return bytes([0xFF, n])


@settings(max_examples=25, deadline=None)
@given(kinds=st.lists(_KINDS, max_size=12), mode=st.sampled_from(["pull", "push"]))
def test_each_notification_reaches_the_side_that_understands_it(
    kinds: list[str], mode: str
) -> None:
    """Whatever a peer sends, each notification is handed to exactly one side, once, in
    the order sent: registrations and heartbeats to the producer; completions to the
    producer in pull mode (a consumer read our blocks), to the consumer in push mode (a
    producer wrote into ours); what neither understands to the producer, whose machine
    counts it."""
    inner = create("shm", f"shared-{next(_names)}")
    other = create("shm", f"remote-{next(_names)}")
    agent = SharedAgent(inner, mode)
    try:
        views = {"producer": agent.view("producer"), "consumer": agent.view("consumer")}
        peer = other.add_peer(inner.local_metadata())
        sent: dict[str, list[bytes]] = {"producer": [], "consumer": []}
        for n, kind in enumerate(kinds):
            message = _message(kind, n)
            side = "consumer" if kind == "completion" and mode == "push" else "producer"
            sent[side].append(message)
            other.notify(peer, message)
        got: dict[str, list[bytes]] = {"producer": [], "consumer": []}

        def arrived() -> bool:
            for side, view in views.items():
                got[side].extend(data for _, data in view.drain_notifications())
            return sum(map(len, got.values())) >= len(kinds)

        wait_until(arrived, 10)
        assert got == sent
    finally:
        agent.close()
        other.close()


# -- read-back -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def pull_pair() -> Iterator[tuple[Producer, Consumer, Side, Side]]:
    with ExitStack() as stack:
        p_side, d_side = make_side(), make_side()
        for side in (p_side, d_side):
            stack.callback(side.listener.close)
        producer = Producer(config(p_side, "decode-keeps"), "shm")
        stack.callback(producer.close)
        consumer = Consumer(config(d_side, "next-turn"), "shm")
        stack.callback(consumer.close)
        producer.register_kv_caches(p_side.spec.geometry(int(p_side.buffer.ctypes.data)))
        consumer.register_kv_caches(d_side.spec.geometry(int(d_side.buffer.ctypes.data)))
        p_side.listener.set_payloads({(0, 0): producer.handshake_payload()})
        yield producer, consumer, p_side, d_side


_rids = itertools.count()


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    held=st.integers(1, 8),
    read=st.integers(1, 8 * 16),
    hit=st.integers(0, 7),
    seed=st.integers(0, 2**16),
)
def test_a_read_back_moves_the_first_tokens_held(
    pull_pair: tuple[Producer, Consumer, Side, Side], held: int, read: int, hit: int, seed: int
) -> None:
    """A producer holds ``held`` blocks (of 16 tokens); the consumer reads back the first
    ``read`` tokens, its own prefix cache holding the first ``hit`` blocks of them: the
    tokens past its hit land where they belong (the rest of the last block is the
    prefill's to compute). Where the producer holds fewer tokens than asked, the request
    fails and reports its blocks, never done."""
    producer, consumer, p, d = pull_pair
    tokens = p.spec.block_tokens
    needed = -(-read // tokens)
    hit = min(hit, needed - 1)
    rng = random.Random(seed)
    p_blocks = rng.sample(range(p.spec.num_blocks), held)
    d_blocks = rng.sample(range(d.spec.num_blocks), needed - hit)
    index = next(_rids)
    fill(p.spec, p.buffer, index, p_blocks)
    scribble(d.spec, d.buffer, d_blocks)
    rid = f"readback-{index}"
    params = producer.prefill_finished(rid, [p_blocks], num_tokens=held * tokens)
    consumer.add_request(rid, params, [d_blocks], num_tokens=read, readback=True)
    finished = consumer.get_finished()

    def ended() -> bool:
        nonlocal finished
        if not finished:
            finished = consumer.get_finished()
        return bool(finished)

    wait_until(ended)
    if read > held * tokens:
        assert rid in finished.failed and rid not in finished.done
        assert "more than the producer's blocks hold" in finished.failed[rid].detail
        producer.abort(rid)
        return
    assert finished.done == [rid], finished.failed
    got = blocks_view(d.spec, d.buffer)[:, d_blocks]
    want = expected(p.spec, index, held)[:, hit:needed]
    last = read - (needed - 1) * tokens  # tokens of the last block that are read
    assert np.array_equal(got[:, :-1], want[:, :-1])
    assert np.array_equal(got[:, -1, :, :last], want[:, -1, :, :last])
    wait_until(lambda: producer.held_blocks() == 0)


def test_a_kept_conversation_is_held_its_own_time(
    pull_pair: tuple[Producer, Consumer, Side, Side],
) -> None:
    """``lease_s`` at ``prefill_finished`` holds those blocks that long (what a decode
    engine keeping a conversation for the next turn asks), others the config's lease; the
    params state each deadline."""
    producer, _, _, _ = pull_pair
    before = time.perf_counter()
    kept = producer.prefill_finished("kept", [[1, 2]], num_tokens=32, lease_s=480.0)
    leased = producer.prefill_finished("leased", [[3, 4]], num_tokens=32)
    after = time.perf_counter()
    deadlines = producer.lease_deadlines(["kept", "leased"])
    assert deadlines[0] is not None and before + 480 <= deadlines[0] <= after + 480
    lease = producer.config.lease_s
    assert deadlines[1] is not None and before + lease <= deadlines[1] <= after + lease
    assert kept["remote_blocks_expiry_time"] == deadlines[0]
    assert leased["remote_blocks_expiry_time"] == deadlines[1]
    for rid in ("kept", "leased"):
        producer.abort(rid)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(LocalProtocolError, match="lease_s must be positive and finite"):
            producer.prefill_finished("never", [[5]], num_tokens=16, lease_s=bad)
    assert producer.held_blocks() == 0
