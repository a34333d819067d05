"""The worker half of ``KVWireConnector``: one TP rank's Producer or Consumer over the
rank's KV tensors, fed from the scheduler's metadata each step and, on a streaming P, from
the forward's layers as they are computed."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from kvwire.config import KVWireConfig
from kvwire.errors import ConfigError
from kvwire.integrations.vllm import staging
from kvwire.integrations.vllm.config import sides
from kvwire.integrations.vllm.geometry import layer_geometry, layer_order
from kvwire.integrations.vllm.groups import exchanged, past_placeholders
from kvwire.integrations.vllm.messages import KVWireHandshake, KVWireMetadata, KVWireStats
from kvwire.layout.geometry import KVGeometry
from kvwire.runtime import Consumer, Producer
from kvwire.runtime.driver import agent_name
from kvwire.runtime.metrics import combined_totals
from kvwire.runtime.prometheus import MetricsServer, serve
from kvwire.runtime.shared_agent import SharedAgent
from kvwire.transport import Transport, create

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Under vLLM's logger, so a vLLM deployment's logging configuration shows it.
log = logging.getLogger("vllm.kvwire")


class WorkerSide:
    """One rank: a Producer (a ``kv_producer`` engine) or a Consumer (``kv_consumer``) over
    the rank's KV tensors."""

    def __init__(
        self, vllm_config: VllmConfig, config: KVWireConfig, kv_cache_config: KVCacheConfig
    ) -> None:
        self.vllm_config = vllm_config
        self.config = config
        self.kv_cache_config = kv_cache_config
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self.agent: SharedAgent | None = None
        """Both sides' one agent, when the engine runs both (:func:`sides`)."""
        self.metrics_server: MetricsServer | None = None
        """Both sides' counters on the rank's one ``metrics_port``."""
        producing, consuming = sides(vllm_config, kv_cache_config)
        if producing and consuming:
            self._start_both(config)
        elif producing:
            self.producer = Producer(config)
        else:
            self.consumer = Consumer(config)
        self.recving: set[str] = set()
        self.sending: set[str] = set()
        self.invalid: set[int] = set()
        self.failed: set[str] = set()
        """D: requests whose KV did not all arrive, reported as requests (``by_request``)."""
        self.by_request = len(kv_cache_config.kv_cache_groups) > 1
        """A block id names a page in one KV-cache group only, so with several groups vLLM
        takes failed loads by request (``failed_recving``), never by block: it stops the
        engine on a block-level report."""
        self.has_state = bool(getattr(kv_cache_config, "has_mamba_layers", False)) or any(
            rule.ring for rule in exchanged(kv_cache_config, vllm_config)
        )
        """A Mamba state or a ring, each for one token count: D checks that P computed the
        count it loads (:meth:`_counts_agree`)."""
        self.batch: tuple[str, ...] = ()
        """P, streaming: the requests this step computes prompt tokens of."""
        self.layers: frozenset[str] = frozenset()
        """P, streaming: the registered layers' names (others are not reported)."""
        self.staging: staging.HostStaging | None = None
        """A host buffer over a device KV cache (``kv_buffer_device: "cpu"``)."""
        self.staged: list[list[list[int]]] = []
        """P with a host buffer: the blocks this step's forward writes, per request."""
        self.loading: dict[str, list[list[int]]] = {}
        """D with a host buffer: each request's blocks being received, copied to the device
        once they all arrived."""
        self.device: torch.device | None = None
        """P, streaming: the device the KV cache is on (None: host memory)."""
        self.in_order: _InOrder | None = None
        """P, streaming: where the producer's calls run, in the engine's order (on a device
        each after the kernels enqueued before it), so vLLM's engine thread never waits
        for the runtime posting a round."""
        self._after: Any = None
        """P, streaming on a device: this step's start event, for its first call."""

    def _start_both(self, config: KVWireConfig) -> None:
        """A producer and a consumer over one agent, whose rank is one peer: it serves one
        ``/metrics`` (both sides' counters, by role) and, in push mode where both sides are
        dialled, publishes one metadata-store record (the producer's: the same agent and
        memory)."""
        self.agent = SharedAgent(_agent(config), str(config.mode))
        quiet = replace(config, metrics_port=None)
        try:
            self.producer = Producer(quiet, self.agent.view("producer"))
            if config.mode == "push":
                quiet = replace(quiet, metadata_store=None)
            self.consumer = Consumer(quiet, self.agent.view("consumer"))
            if config.metrics_port is not None:
                self.metrics_server = serve(
                    [self.producer.metrics, self.consumer.metrics],
                    config.side_channel_host,
                    config.metrics_port + config.tp_rank,
                )
        except BaseException:
            for side in (self.consumer, self.producer):
                if side is not None:
                    side.close()
            self.agent.close()
            raise

    @property
    def endpoint(self) -> Producer | Consumer:
        """The side whose handshake the engine serves: the producer where there is one (a
        shared agent's two sides describe the same agent and memory; the producer's answer
        also states its lease, which a pulling peer checks)."""
        endpoint = self.producer or self.consumer
        assert endpoint is not None
        return endpoint

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        registered = kv_caches
        if staging.wants_host_buffer(self.vllm_config):
            self.staging = staging.HostStaging(kv_caches)
            registered = self.staging.views
        geometry = layer_geometry(registered, self.kv_cache_config, self.config, self.vllm_config)
        if self.staging is not None:
            self.staging.bind(geometry)
        for side in (self.producer, self.consumer):
            if side is not None:
                side.register_kv_caches(geometry)
        if self.producer is not None and self.producer.streaming:
            # The producer's calls go to a thread of their own, so the engine thread never
            # waits while the runtime posts a round (on CPU too).
            self.layers = self._streamed_layers(kv_caches, geometry)
            devices = {t.device for t in kv_caches.values()} - {torch.device("cpu")}
            self.device, self.in_order = (devices.pop() if devices else None), _InOrder()

    @staticmethod
    def _streamed_layers(
        kv_caches: dict[str, torch.Tensor], geometry: KVGeometry
    ) -> frozenset[str]:
        """The layers whose computing a streaming P reports: every registered one, when the
        regions (in stock's name order) are in the order vLLM allocated the layers. A
        reported layer completes the regions before it, which holds only if that order is
        the order they compute in; where the two orders differ (a sparse MLA model's
        indexer caches, a drafter whose names sort first) no layer is reported: a prompt
        streams by chunks (a later chunk proves the earlier one computed in every layer),
        its last chunk with the completion."""
        ends = geometry.layer_ends()
        allocated = [name for name in kv_caches if name in ends]
        if allocated == sorted(allocated, key=layer_order):
            return frozenset(ends)
        log.info("stream_layers: regions are not in vLLM's allocation order; pushing whole")
        return frozenset()

    def handshake(self) -> KVWireHandshake:
        return KVWireHandshake(self.endpoint.handshake_payload())

    def bind(self, meta: KVWireMetadata) -> None:
        """P: the step's facts, before its forward (vLLM binds the metadata first; it calls
        ``start_load_kv`` after the forward unless a load must finish before it), so the
        layers the forward reports belong to this step's chunks."""
        producer = self.producer
        if producer is None:
            return
        # On a device vLLM may start a step before the last one's kernels ran (async
        # scheduling; a full CUDA graph's replay reports no layers), and a chunk tells the
        # runtime that the one before is computed: this step's calls wait for them.
        self._after = None if self.device is None else _recorded_event(self.device)
        call = self._call
        for rid in meta.started:
            # A streamed prompt is known from its chunk, which names its length.
            if rid not in meta.to_send and rid not in meta.chunks:
                call(producer.request_started, rid)
        for rid in meta.preempted:
            call(producer.preempted, rid)
        for rid, (groups, end, length) in meta.chunks.items():
            call(producer.chunk_scheduled, rid, groups, num_tokens=end, prompt_tokens=length)
        self.batch = tuple(meta.chunks)
        self.staged = list(meta.staged.values())
        for rid, (groups, num_tokens) in meta.to_send.items():
            self.sending.add(rid)
            held = meta.held_s.get(rid)
            if held is not None and self.staging is not None:
                # D keeps a conversation its host buffer has only the loaded part of: the
                # tokens D computed (and its own prefix hits) go to the host before a read.
                self.staging.to_host(groups)
            call(
                producer.prefill_finished, rid, groups, num_tokens=num_tokens, lease_s=held,
                unsent=rid,
            )  # fmt: skip
        for rid in meta.to_abort:
            call(producer.abort, rid)

    def saved(self) -> None:
        """P with a host buffer: the step's forward ran, so the blocks it wrote go to the
        host before vLLM finishes any of its requests (a pulling D may read them as soon as
        it has the params)."""
        if self.staging is not None and self.staged:
            # One gather per region for the whole step, not one per request.
            merged = [
                [b for groups in self.staged for b in groups[g]] for g in range(len(self.staged[0]))
            ]
            self.staging.to_host(merged)
        self.staged = []

    def start(self, meta: KVWireMetadata) -> None:
        """D: the step's loads (vLLM starts them after the forward: they run between
        steps)."""
        if self.consumer is not None:
            for rid, (params, local, prompt) in meta.to_recv.items():
                readback = rid in meta.read_back
                if local and not self._counts_agree(rid, params, prompt, readback):
                    # Nothing read; P frees its blocks as for a request D never allocated.
                    self.consumer.add_request(rid, params, [])
                    self.recving.add(rid)
                    self.failed.add(rid)
                    continue
                if local and not readback:
                    params = _placeholders_dropped(params, prompt)
                self.consumer.add_request(
                    rid, params, local, num_tokens=prompt if local or readback else None,
                    readback=readback,
                )  # fmt: skip
                if local:
                    self.recving.add(rid)
                    if self.staging is not None:
                        self.loading[rid] = [list(g) for g in local]
            for rid in meta.to_abort:
                self.consumer.abort(rid)
                self.loading.pop(rid, None)

    def _counts_agree(
        self, rid: str, params: dict[str, Any], loaded: int | None, readback: bool = False
    ) -> bool:
        """D: whether what P computed (``remote_num_tokens``) can fill the tokens D loads.
        Fewer cannot. Another count cannot for a model with state (Mamba, a ring): the
        state is for P's count, and D's model would apply tokens twice or skip some; the engines
        cut the prompt apart (each by its own rule), so a drafter's lookahead on one side
        only does it. Nor can it in push, where P places D's blocks by its own count
        (PUSH_REG carries none), so a P that generated past the prompt would write them
        shifted. A pulling D without state places both counts (and refuses by name a
        window P clipped away), as does a read-back, the first tokens of a longer
        conversation. A refusal fails the request, naming both counts, rather than
        completing it with P's bytes in the wrong tokens."""
        sent = params.get("remote_num_tokens")
        if sent is None or loaded is None or sent == loaded:
            return True
        if self.has_state:
            why = "a Mamba state or a ring is for one count (do both engines cut the prompt alike?)"
        elif type(sent) is int and sent < loaded:
            why = "P lacks the rest"
        elif self.config.mode == "push" and not readback:
            why = "a pushing P places them by its own count"
        else:
            return True
        log.warning(
            "KV of %s not loaded: P computed %s of its tokens and this engine loads %s; %s",
            rid, sent, loaded, why,
        )  # fmt: skip
        return False

    def layer_saved(self, layer: str) -> None:
        """P, streaming: vLLM ran ``layer``'s attention for this step's batch, whose
        prompts' KV of that layer is then in the blocks (on a device: once the kernels
        enqueued so far ran). O(batch): the runtime works out what that completes."""
        producer = self.producer
        if not self.batch or producer is None or layer not in self.layers:
            return
        assert self.in_order is not None  # made with the layers, at registration
        event = None if self.device is None else _recorded_event(self.device)
        self.in_order.put(event, None, producer.layer_computed, layer, self.batch)

    def _call(
        self, fn: Callable[..., object], *args: Any, unsent: str | None = None, **kwargs: Any
    ) -> None:
        """A producer call now, or (streaming) on the producer's thread, after the kernels
        enqueued before it. There a failure cannot reach vLLM: for a request's final
        write (``unsent``), its blocks go back to vLLM as if sent, and D's watchdog ends
        its side, rather than held forever."""
        if self.in_order is None:
            fn(*args, **kwargs)
        else:
            event, self._after = self._after, None
            self.in_order.put(event, unsent, fn, *args, **kwargs)

    def finished(self) -> tuple[set[str] | None, set[str] | None]:
        sent: set[str] = set()
        received: set[str] = set()
        if self.producer is not None:
            sent = {f.request_id for f in self.producer.get_finished()}
            if self.in_order is not None:
                sent |= self.in_order.take_unsent()
            sent &= self.sending
            self.sending -= sent
        if self.consumer is not None:
            got = self.consumer.get_finished()
            received = set(got.done)
            if self.staging is not None:
                for rid in received & self.recving:
                    # None: refused before any read, or aborted as its last byte landed.
                    blocks = self.loading.pop(rid, None)
                    if blocks is not None and rid not in self.failed:
                        self.staging.to_device(blocks)
            for rid, failure in got.failed.items():
                self.loading.pop(rid, None)
                log.warning("KV of %s not received (%s): %s", rid, failure.reason, failure.detail)
                received.add(rid)
                if self.by_request:
                    self.failed.add(rid)
                    continue
                for group in failure.invalid_block_ids:
                    self.invalid.update(group)
            received |= self.failed  # refused before any read (see _counts_agree)
            received &= self.recving
            self.recving -= received
            self.failed &= received
        return sent or None, received or None

    def take_invalid(self) -> set[int]:
        out, self.invalid = self.invalid, set()
        return out

    def take_failed(self) -> set[str]:
        out, self.failed = self.failed, set()
        return out

    def stats(self) -> KVWireStats:
        """The runtime's counters; where the rank runs both sides, the two combined
        (:func:`kvwire.runtime.metrics.combined_totals`)."""
        sides = [side.metrics for side in (self.producer, self.consumer) if side is not None]
        return KVWireStats(data=combined_totals(sides))

    def close(self) -> None:
        if self.in_order is not None:
            self.in_order.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        for side in (self.producer, self.consumer):
            if side is not None:
                side.close()
        if self.agent is not None:
            self.agent.close()


def _agent(config: KVWireConfig) -> Transport:
    """The one transport agent of a rank that runs both sides, named as a driver names its
    own (engine, ranks, process), with "both" for the role."""
    transport = config.transport
    if not isinstance(transport, str):  # vLLM's config is JSON: a name, always
        raise ConfigError(f"transport must be named, got {type(transport).__name__}")
    return create(transport, agent_name(config, "both"), **config.transport_kwargs())


def _placeholders_dropped(params: dict[str, Any], loaded: int | None) -> dict[str, Any]:
    """D: P's params for a P that computed past the tokens D loads, its lists without their
    leading null blocks. Such lists are placed by P's own count, where a null block
    standing for a block P's window dropped would pass for one P holds, and D would take
    vLLM's null block for P's KV; without it the plan is refused by name. (Equal counts
    place the lists alike, and D lists none of those blocks.) Malformed params are left
    for the consumer to refuse."""
    sent, lists = params.get("remote_num_tokens"), params.get("remote_block_ids")
    if type(sent) is not int or loaded is None or sent <= loaded:
        return params
    if not isinstance(lists, list | tuple) or not all(
        isinstance(g, list | tuple) and all(type(b) is int for b in g) for g in lists
    ):
        return params
    return {**params, "remote_block_ids": [past_placeholders(list(g)) for g in lists]}


def _recorded_event(device: torch.device) -> Any:
    """An event on the device's current stream (the forward's), which completes once every
    kernel enqueued before it ran: vLLM's attention returns before its kernels do."""
    event = torch.Event(device=device)
    event.record(torch.accelerator.current_stream(device))
    return event


class _InOrder:
    """The producer's calls on one thread, in the engine's order, each after the device
    event put with it has completed. A layer is reported computed only after its kernels
    ran, and no call overtakes one before it (a later chunk tells the runtime that every
    layer of the earlier one is computed), while the forward goes on launching layers."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Call | threading.Event | None] = queue.SimpleQueue()
        self._unsent: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvwire-layers", daemon=True)
        self._thread.start()

    def put(
        self,
        event: Any,
        unsent: str | None,
        fn: Callable[..., object],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """``fn`` after ``event``; should it fail, ``unsent`` (a request id) is handed back
        by :meth:`take_unsent`."""
        self._queue.put(_Call(event, unsent, fn, args, kwargs))

    def take_unsent(self) -> set[str]:
        """The requests whose final write failed to start since the last call."""
        out = set()
        while not self._unsent.empty():
            out.add(self._unsent.get_nowait())
        return out

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every call put so far has run (False: not within ``timeout``)."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                if item.event is not None:
                    item.event.synchronize()
                item.fn(*item.args, **item.kwargs)
            except Exception:  # the engine's step has moved on: say what failed
                log.exception("kvwire: %s failed", getattr(item.fn, "__name__", item.fn))
                if item.unsent is not None:
                    self._unsent.put(item.unsent)

    def close(self, timeout: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)


@dataclass(frozen=True)
class _Call:
    event: Any
    unsent: str | None
    fn: Callable[..., object]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
