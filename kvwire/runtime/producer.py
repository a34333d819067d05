"""The prefill side: hold finished prompts' KV blocks until consumers have them.

An engine calls :meth:`Producer.prefill_finished` when a prompt's KV is computed and puts
the returned ``kv_transfer_params`` in its answer; it reuses a request's blocks only after
:meth:`Producer.get_finished` lists the request (consumers are done, the lease ran out, or
the request was aborted). Everything in between — completions, heartbeats, leases, push
registrations and writes — runs on the runtime's threads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvwire.errors import ConfigError, LocalProtocolError
from kvwire.layout import KVGeometry
from kvwire.machine import (
    Abort,
    ChunkScheduled,
    Event,
    FreeBlocks,
    LayersComputed,
    Preempted,
    PrefillFinished,
    ProducerMachine,
    ProducerState,
    RequestAdded,
    RequestDone,
    RequestFailed,
)
from kvwire.runtime._endpoint import _Endpoint
from kvwire.runtime.arguments import block_ids_arg, num_tokens_arg, request_id_arg
from kvwire.runtime.driver import Outcome

BlockIdsLike = Sequence[Sequence[int]]


@dataclass(frozen=True)
class FreedRequest:
    """A request whose blocks the engine may reuse now, and why."""

    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    reason: str
    """``sent``, ``nothing_to_send``, ``expired``, ``aborted``, ``failed`` or ``protocol``."""


class Producer(_Endpoint[list[FreedRequest]]):
    """One prefill rank's transfer runtime.

    ``transport`` is a transport name (``"shm"``, ``"nixl"``, ``"ucx"`` or
    ``"module:factory"``, created and owned here) or an already created agent (left open at
    :meth:`close`, with this runtime's registrations and peers removed).
    """

    _role = "producer"
    _stream_cache: tuple[KVGeometry, dict[str, int], int] | None = None

    # -- setup ---------------------------------------------------------------------

    def handshake_payload(self) -> bytes:
        """This rank's handshake answer; the engine's listener serves it at (pp, tp)."""
        return self._driver.handshake_payload()

    # -- engine calls --------------------------------------------------------------

    def request_started(self, request_id: str) -> None:
        """Optional: the prompt started prefilling (lets an abort come before the finish)."""
        self._driver.feed(RequestAdded(request_id_arg(request_id)))

    def prefill_finished(
        self,
        request_id: str,
        block_ids: BlockIdsLike,
        *,
        num_tokens: int | None = None,
        lease_s: float | None = None,
    ) -> dict[str, Any]:
        """Hold ``block_ids`` for consumers; returns the ``kv_transfer_params`` for the proxy.

        ``block_ids`` holds one list of logical block ids per KV-cache group (``[[0, 1]]``
        for a single group); ``num_tokens`` is the prompt's length, which a consumer with
        smaller blocks needs (and push mode always: this side plans the writes). An empty
        block list frees at once (nothing to send); the engine sees the request in
        :meth:`get_finished` with reason ``nothing_to_send``. ``lease_s``: hold them this
        long instead of the config's ``lease_s`` (a decode engine keeping a conversation
        for the next turn's prefill holds it by its own rule). Arguments that
        cannot be honoured raise :class:`~kvwire.errors.LocalProtocolError` naming them.
        """
        machine = self._driver.machine
        if machine is None:
            raise ConfigError("register_kv_caches before prefill_finished")
        blocks, num_tokens = self._arguments(request_id, block_ids, num_tokens)
        if num_tokens is None and self.config.mode == "push" and any(blocks):
            # The writer places the prompt in the consumer's blocks, and the consumer has no
            # way to say it failed: a missing length must fail here, not at its registration.
            raise LocalProtocolError(
                "push mode: prefill_finished needs num_tokens (the prompt's length), which "
                "places the prompt in the consumer's blocks"
            )
        events: list[Event] = []
        assert isinstance(machine, ProducerMachine)
        if machine.request_state(request_id) is ProducerState.ABSENT:
            events.append(RequestAdded(request_id))
        if lease_s is None:
            events.append(PrefillFinished(request_id, blocks))
        else:
            if not 0 < lease_s < math.inf:
                raise LocalProtocolError(f"lease_s must be positive and finite, got {lease_s!r}")
            deadline = self._driver.clock() + lease_s  # the machine's clock
            events.append(PrefillFinished(request_id, blocks, lease_deadline=deadline))
        self._driver.request_started(request_id, num_tokens)
        self._driver.feed(*events)
        return self._params(request_id, blocks, num_tokens)

    # -- streaming push (``stream_layers``) -------------------------------------------

    @property
    def streaming(self) -> bool:
        """Whether this rank writes layers while prompts are computed (push with
        ``stream_layers``); the streaming calls below are no-ops otherwise."""
        return self.config.stream_layers and self.config.mode == "push"

    def chunk_scheduled(
        self,
        request_id: str,
        block_ids: BlockIdsLike,
        *,
        num_tokens: int,
        prompt_tokens: int,
    ) -> None:
        """This step computes the prompt through ``num_tokens`` of ``prompt_tokens``, into
        ``block_ids`` (the request's blocks so far). Call it before the step's first
        :meth:`layer_computed`; a later chunk tells that the earlier one is done in every
        layer. Only full blocks are written before the prompt ends."""
        if not self.streaming:
            return
        rid = request_id_arg(request_id)
        geometry = self._driver.geometry
        machine = self._driver.machine
        if geometry is None or not isinstance(machine, ProducerMachine):
            raise ConfigError("register_kv_caches before chunk_scheduled")
        blocks = block_ids_arg(block_ids, geometry)
        prompt = num_tokens_arg(prompt_tokens)
        done = num_tokens_arg(num_tokens, geometry.tokens_held(blocks))
        if prompt is None or done is None or done > prompt:
            raise LocalProtocolError(
                f"num_tokens {num_tokens} must be an int within prompt_tokens {prompt_tokens}"
            )
        # Streaming writes one attention group's full blocks; anything else (SSM states,
        # several groups) goes out whole with the completion.
        units = self._stream_units if len(blocks) == 1 and not geometry.has_ssm else 0
        events: list[Event] = []
        if machine.request_state(rid) is ProducerState.ABSENT:
            events.append(RequestAdded(rid))
        # Always: an engine that called request_started first gave no length then.
        self._driver.request_started(rid, prompt)
        whole = done - done % geometry.block_size
        events.append(ChunkScheduled(rid, whole, blocks, units))
        self._driver.feed(*events)

    def layer_computed(self, layer: str, request_ids: Sequence[str]) -> None:
        """``layer`` (a region's layer name, see :meth:`KVGeometry.layer_ends`) is computed
        for these requests' current chunks: what it completes is written in the
        background."""
        if not self.streaming or not request_ids:
            return
        ends = self._layer_ends
        if layer not in ends:
            raise LocalProtocolError(f"layer {layer!r} is not a layer of the registered KV cache")
        self._driver.feed(LayersComputed(tuple(request_ids), ends[layer]))

    def preempted(self, request_id: str) -> None:
        """The engine took the request's blocks back; it will compute it again."""
        if self.streaming:
            self._driver.feed(Preempted(request_id_arg(request_id)))

    @property
    def _layer_ends(self) -> dict[str, int]:
        return self._stream_layout()[0]

    @property
    def _stream_units(self) -> int:
        """Regions written before the prompt ends: all but the last layer's (it carries
        the completion)."""
        return self._stream_layout()[1]

    def _stream_layout(self) -> tuple[dict[str, int], int]:
        """Each layer's region count and the streamed units, worked out once per
        registration (the engine asks on every chunk and layer)."""
        geometry = self._driver.geometry
        if geometry is None:
            raise ConfigError("register_kv_caches before streaming calls")
        cached = self._stream_cache
        if cached is None or cached[0] is not geometry:
            ends, units = geometry.layer_ends(), geometry.streamed_regions()
            cached = self._stream_cache = (geometry, ends, units)
        return cached[1], cached[2]

    def kv_transfer_params(
        self,
        request_id: str,
        block_ids: BlockIdsLike,
        *,
        num_tokens: int | None = None,
    ) -> dict[str, Any]:
        """The params a consumer needs to fetch this request (what vLLM's P returns)."""
        blocks, num_tokens = self._arguments(request_id, block_ids, num_tokens)
        return self._params(request_id, blocks, num_tokens)

    def _arguments(
        self, request_id: object, block_ids: object, num_tokens: object
    ) -> tuple[tuple[tuple[int, ...], ...], int | None]:
        request_id_arg(request_id)
        geometry = self._driver.geometry
        blocks = block_ids_arg(block_ids, geometry)
        assert geometry is not None  # block_ids_arg refuses an unregistered runtime
        return blocks, num_tokens_arg(num_tokens, geometry.tokens_held(blocks))

    def _params(
        self, request_id: str, blocks: tuple[tuple[int, ...], ...], num_tokens: int | None
    ) -> dict[str, Any]:
        cfg = self.config
        geometry = self._driver.geometry
        host, port = self._driver.advertise
        if not port:
            raise LocalProtocolError("register_kv_caches before asking for kv_transfer_params")
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(g) for g in blocks],
            "remote_engine_id": cfg.engine_id,
            "remote_request_id": request_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": cfg.tp_size,
            "dcp_size": geometry.dcp_size if geometry is not None else 1,
            "pp_size": cfg.pp_size,
            "remote_blocks_expiry_time": self._expiry(request_id),
            "transfer_mode": cfg.mode,
        }
        if num_tokens is not None:
            params["remote_num_tokens"] = num_tokens
        return params

    def _expiry(self, request_id: str) -> float | None:
        """Pull: the lease deadline in this rank's clock (the one the listener's clock
        replies sample, so a consumer can convert it); the consumer bounds its READ by it.
        None when the blocks are not held under a lease (push, or nothing to send)."""
        machine = self._driver.machine
        if self.config.mode != "pull" or not isinstance(machine, ProducerMachine):
            return None
        return machine.lease_deadline(request_id)

    def lease_deadlines(self, request_ids: Sequence[str]) -> list[float | None]:
        """Per id, the deadline this rank's lease runs to (``time.perf_counter``), or None
        when it holds no lease for it. An engine that runs the listener itself passes this
        to :meth:`~kvwire.sidechannel.HandshakeListener.set_lease_source` for the rank, so
        kvwire consumers can confirm the leases their heartbeats extended."""
        return self._driver.lease_deadlines(request_ids)

    def abort(self, request_id: str) -> None:
        """The engine gave up on the request; its blocks show up in get_finished."""
        self._driver.feed(Abort(request_id_arg(request_id)))

    def get_finished(self) -> list[FreedRequest]:
        """Requests freed since the last call (their blocks are the engine's again)."""
        return self._take_finished()

    # -- introspection -------------------------------------------------------------

    def held_blocks(self) -> int:
        machine = self._driver.machine
        return machine.held_blocks() if isinstance(machine, ProducerMachine) else 0

    def pending_registrations(self) -> int:
        """Push: consumers' registrations received and not yet matched with a prompt."""
        machine = self._driver.machine
        return machine.pending_registrations() if isinstance(machine, ProducerMachine) else 0

    # -- internals -----------------------------------------------------------------

    def _empty_finished(self) -> list[FreedRequest]:
        return []

    def _on_outcome(self, action: Outcome) -> None:
        if isinstance(action, (RequestDone, RequestFailed)):  # pragma: no cover - consumer only
            return
        assert isinstance(action, FreeBlocks)
        with self._cv:
            self._finished.append(
                FreedRequest(action.request_id, action.block_ids, action.reason.value)
            )
            self._cv.notify_all()
