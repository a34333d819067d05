"""Streaming push inside vLLM: a ``KVWireConnector`` P with ``stream_layers`` writes a
prompt's KV to D while vLLM's scheduler runs its chunked prefill, layer by layer.

P's stand-in model computes as a model does (``layerwise``): each step's chunk is written
into P's blocks one layer at a time, just before that layer's ``save_kv_layer``, and each
layer waits until every write P posted so far has landed. P's blocks hold a scribble until
computed, so a byte sent before it was computed reaches D wrong, and D's check (every
prompt token on every D rank, with the byte count) finds it. D gets the request and
registers before P schedules it, as a proxy that knows P's address can arrange, so the
stream really runs: P's runtime counts the rounds it wrote before the prompt ended.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from harness import (
    Geometry,
    SchedulerEngine,
    Zygote,
    engines,
    params_ahead,
    streamed,
    wait_until,
)

from kvwire.integrations.vllm.messages import KVWireMetadata

GEO = Geometry(layers=3, num_blocks=32)
"""Three layers: the first two stream, the last goes with the completion."""
TOKENS = 150
"""4 full 32-token blocks and 22 tokens; P computes it in 64-token steps."""
CHUNKS = {"batch_tokens": 64}
ALL_BYTES = TOKENS * GEO.layers * 8 * 2 * 128 * 2
"""Every prompt token in every layer, all 8 heads (K and V of 128 bf16 values each),
whichever D ranks hold them."""


@contextmanager
def streaming_pair(
    zygote: Zygote, d_connector: str, tp: tuple[int, int]
) -> Iterator[tuple[SchedulerEngine, SchedulerEngine]]:
    """A streaming kvwire P (chunked prefill, layerwise compute) and a push D, over NIXL."""
    p_options = {
        "extra_config": {"transport": "nixl", "stream_layers": True},
        "tp": tp[0],
        "layerwise": True,
        "scheduler": CHUNKS,
    }
    d_options = {"extra_config": {"transport": "nixl"}, "tp": tp[1]}
    with engines(
        zygote, "KVWireConnector", d_connector, p_options, d_options, geo=GEO, mode="push"
    ) as pair:
        yield pair


def assert_streamed(p: SchedulerEngine, d: SchedulerEngine, rid: str, index: int) -> None:
    """``rid`` reaches D whole and right, and every P rank wrote rounds before the prompt
    ended."""
    state = streamed(p, d, rid, index, TOKENS)
    assert rid in state["checked"], (state["invalid"], d.peer.log[-3:], p.peer.log[-3:])
    assert tuple(state["checked"][rid]) == (0, ALL_BYTES)
    for rank, stats in enumerate(p.machine_stats()):
        assert stats["stream_rounds"] > 0, (rank, stats)
        assert stats["transfers_failed"] == 0, (rank, stats)


@pytest.mark.parametrize("tp", [(1, 1), (1, 2)], ids=["1-1", "1-2"])
def test_streaming_p_to_stock_push_d(zygote: Zygote, tp: tuple[int, int]) -> None:
    """vLLM 0.31.0's stock push D (``NixlPushConnector``) takes a streamed prompt as it
    takes a whole one: the completion comes after the last byte."""
    with streaming_pair(zygote, "NixlConnector", tp) as (p, d):
        assert_streamed(p, d, "req-s", 41)


@pytest.mark.parametrize("tp", [(1, 1), (2, 1)], ids=["1-1", "2-1"])
def test_streaming_p_to_kvwire_d(zygote: Zygote, tp: tuple[int, int]) -> None:
    with streaming_pair(zygote, "KVWireConnector", tp) as (p, d):
        assert_streamed(p, d, "req-s", 43)


def test_sparse_mla_streams_nothing_early(zygote: Zygote) -> None:
    """A sparse MLA model's regions, in stock's model-layer order (each latent, then its
    indexer keys), are not in the order vLLM allocated and this stand-in computes them
    (every latent, then every indexer cache): a reported latent does not complete the
    regions before it, so P reports no layer and writes only what a later chunk proves
    computed (the blocks of chunks before it), every byte right (streaming by layers in
    region order wrote layer 0's indexer keys before they were computed)."""
    geo = Geometry(model="mla", layers=2, num_blocks=32)
    p_options = {
        "extra_config": {"transport": "nixl", "stream_layers": True},
        "layerwise": True,
        "scheduler": CHUNKS,
        "indexer": True,
    }
    d_options = {"extra_config": {"transport": "nixl"}, "indexer": True}
    with engines(
        zygote, "KVWireConnector", "KVWireConnector", p_options, d_options, geo=geo, mode="push"
    ) as (p, d):
        state = streamed(p, d, "req-i", 43, TOKENS)
        assert tuple(state["checked"]["req-i"]) == (0, TOKENS * 2 * (576 * 2 + 132))


def test_streaming_through_a_preemption(zygote: Zygote) -> None:
    """vLLM preempts a streaming prompt (two prompts prefill in 32-token chunks on a P with
    five usable blocks; the second loses its blocks, then waits for those the first holds
    for D, and without prefix caching computes again from its first token): the connector
    tells the runtime, which writes the prompt again from its new blocks. Both reach D
    whole and right."""
    small = Geometry(layers=3, num_blocks=6)  # block 0 is vLLM's null block
    prompts = {"req-p1": 51, "req-p2": 53}
    p_options = {
        "extra_config": {"transport": "shm", "stream_layers": True}, "geo": small,
        "layerwise": True, "scheduler": {"batch_tokens": 64, "chunk_tokens": 32},
        "prefix_caching": False,
    }  # fmt: skip
    with engines(
        zygote, "KVWireConnector", "KVWireConnector", p_options,
        {"extra_config": {"transport": "shm"}, "geo": GEO}, mode="push",
    ) as (p, d):  # fmt: skip
        for rid, index in prompts.items():
            p.add(rid, index, 100)
            d.add(rid, index, 100, params_ahead(p, rid))
        wait_until(lambda: p.pending_registrations() == [2], d.step, 30, "D's registrations")

        def both() -> None:
            p.step()
            d.step()

        wait_until(
            lambda: set(prompts) <= set(d.state.get("checked", {})) & set(p.state.get("sent", [])),
            both, 60, "both prompts to reach D",
        )  # fmt: skip
        assert p.state["preemptions"]["req-p2"] >= 1
        for rid in prompts:
            assert tuple(d.state["checked"][rid]) == (0, 100 * 3 * 8 * 2 * 128 * 2), rid
        (stats,) = p.machine_stats()
        assert stats["stream_restarts"] >= 1 and stats["stream_rounds"] > 0, str(stats)


# -- a layer computed on a device ------------------------------------------------------


class _Event:
    """A device event the test completes by hand."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def synchronize(self) -> None:
        assert self.done.wait(30), "event never completed"


class _Producer:
    """Records the calls a worker makes."""

    streaming = True

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def chunk_scheduled(
        self, rid: str, groups: Any, *, num_tokens: int, prompt_tokens: int
    ) -> None:
        self.calls.append(("chunk", rid, num_tokens))

    def layer_computed(self, layer: str, rids: tuple[str, ...]) -> None:
        self.calls.append(("layer", layer, tuple(rids)))

    def prefill_finished(
        self, rid: str, groups: Any, *, num_tokens: int, lease_s: float | None = None
    ) -> None:
        self.calls.append(("finished", rid, num_tokens))
        if rid == "bad":
            raise ValueError("a final write that cannot start")

    def get_finished(self) -> list[Any]:
        return []


def test_device_layers_are_reported_after_their_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a device vLLM's attention returns before its kernels ran, and a step may start
    before the last one's did. The worker reports a layer once the event recorded after it
    completed, a step's chunk once the event recorded at the step's start did, and nothing
    overtakes what came before it (a later chunk tells the runtime the one before is
    computed in every layer)."""
    from kvwire.integrations.vllm import worker

    events: list[_Event] = []

    def recorded(device: Any) -> _Event:
        events.append(_Event())
        return events[-1]

    monkeypatch.setattr(worker, "_recorded_event", recorded)
    side = worker.WorkerSide.__new__(worker.WorkerSide)
    producer = _Producer()
    side.producer, side.consumer, side.in_order = producer, None, worker._InOrder()  # type: ignore[assignment]
    side.device, side.sending, side.batch = torch.device("meta"), set(), ()
    side.layers = frozenset({"l0", "l1"})
    step = [("chunk", "r", 64), ("layer", "l0", ("r",)), ("layer", "l1", ("r",))]

    def reported(count: int) -> list[tuple[Any, ...]]:
        deadline = time.monotonic() + 30
        while len(producer.calls) < count:
            assert time.monotonic() < deadline, producer.calls
            time.sleep(0.001)
        return producer.calls

    try:
        side.bind(KVWireMetadata(chunks={"r": ([[1, 2]], 64, 150)}))  # event 0
        side.layer_saved("l0")  # event 1
        side.layer_saved("l1")  # event 2
        side.layer_saved("not-registered")  # no KV of ours: not reported
        side.bind(KVWireMetadata(chunks={"r": ([[1, 2, 3, 4]], 128, 150)}))  # event 3
        assert len(events) == 4 and producer.calls == []
        for done in range(4):
            events[done].done.set()
            assert reported(done + 1) == [*step, ("chunk", "r", 128)][: done + 1]
            assert len(producer.calls) == done + 1  # the next one waits for its event
    finally:
        for event in events:
            event.done.set()
        side.in_order.close()


def test_a_final_write_that_cannot_start_gives_the_blocks_back() -> None:
    """The worker's producer calls run on its own thread (vLLM's engine thread never waits
    for the runtime), where a failure cannot reach vLLM: a prompt whose final write fails
    to start has its blocks reported sent, so vLLM frees them (D's watchdog ends D's
    side), and the thread goes on with the next call."""
    from kvwire.integrations.vllm import worker

    side = worker.WorkerSide.__new__(worker.WorkerSide)
    producer = _Producer()
    side.producer, side.consumer, side.in_order = producer, None, worker._InOrder()  # type: ignore[assignment]
    side.device, side.sending, side.batch, side._after = None, set(), (), None
    try:
        side.bind(KVWireMetadata(to_send={"bad": ([[1]], 16), "good": ([[2]], 16)}))
        assert side.in_order.drain()
        assert producer.calls == [("finished", "bad", 16), ("finished", "good", 16)]
        sent, received = side.finished()
        assert sent == {"bad"} and received is None
        assert side.sending == {"good"}  # still held: its write runs
        assert side.finished() == (None, None)  # reported once
    finally:
        side.in_order.close()


@pytest.mark.parametrize("sync", [False, True], ids=["async-loads", "sync-load"])
def test_vllm_binds_before_the_forward_and_starts_loads_after_it(
    monkeypatch: pytest.MonkeyPatch, sync: bool
) -> None:
    """The rule the connector (chunks taken in ``bind_connector_metadata``) and the harness
    (``start_load_kv`` after the layers unless ``has_sync_kv_loads``) rely on, from vLLM's
    own model runner code: the context its runner wraps the forward in."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.worker import kv_connector_model_runner_mixin as mixin

    calls: list[str] = []

    class Recorder(KVConnectorBase_V1):  # type: ignore[misc]
        def __init__(self) -> None:  # none of the base's set-up: only the step's calls
            pass

        def bind_connector_metadata(self, metadata: Any) -> None:
            calls.append("bind")

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            calls.append("start_load_kv")

        def wait_for_save(self) -> None:
            calls.append("wait_for_save")

        def get_finished(self, finished_req_ids: set[str]) -> tuple[None, None]:
            return None, None

        def get_block_ids_with_load_errors(self) -> set[int]:
            return set()

        def clear_connector_metadata(self) -> None:
            calls.append("clear")

    Recorder.__abstractmethods__ = frozenset()  # the scheduler half is not called here
    monkeypatch.setattr(mixin, "get_kv_transfer_group", Recorder)
    monkeypatch.setattr(mixin, "get_forward_context", lambda: None)
    out = SimpleNamespace(
        kv_connector_metadata=KVWireMetadata(), has_sync_kv_loads=sync, finished_req_ids=set()
    )
    with mixin.KVConnectorModelRunnerMixin._get_kv_connector_output(out):
        calls.append("forward")
    forward = ["forward", "start_load_kv"] if not sync else ["start_load_kv", "forward"]
    assert calls == ["bind", *forward, "wait_for_save", "clear"]
