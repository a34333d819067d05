"""Builders shared by the machine tests: configs, requests driven to a given state."""

from __future__ import annotations

from typing import Any

from kvwire.config import KVWireConfig
from kvwire.machine import (
    Abort,
    Action,
    AllocationDone,
    ChunkScheduled,
    ConsumerMachine,
    HandshakeDone,
    LayersComputed,
    NotificationReceived,
    PostRead,
    PostWrite,
    PrefillFinished,
    ProducerMachine,
    RemotePrefill,
    RequestAdded,
    StartHandshake,
    Timer,
    TransferMode,
    TransferPosted,
)
from kvwire.wire.notifications import encode_push_registration
from kvwire.wire.schemas import PushRegistration

PULL = TransferMode.PULL
PUSH = TransferMode.PUSH
STREAM = "stream"
"""Push with ``stream_layers``: what ``ProducerAt`` drives through the streaming path."""


MACHINE_DEFAULTS: dict[str, Any] = {
    "environ": {},
    "expiry_margin_s": 5.0,
    "completion_margin_s": 1.0,
    "transfer_timeout_s": 30.0,
    "handshake_timeout_s": 4.0,
    "handshake_retries": 0,
}
"""Fixed durations for machine tests (a 5 s handshake budget: 4 s x one attempt + 1 s), so
a test's numbers do not move with the lease-derived defaults or the environment."""


def machine_config(**kw: Any) -> KVWireConfig:
    return KVWireConfig(**{**MACHINE_DEFAULTS, **kw})


def consumer(*, mla: bool = False, host: str = "", port: int = 0, **kw: Any) -> ConsumerMachine:
    kw.setdefault("engine_id", "D")
    return ConsumerMachine(machine_config(**kw), one_source=mla, host=host, port=port)


def producer(**kw: Any) -> ProducerMachine:
    kw.setdefault("engine_id", "P")
    return ProducerMachine(machine_config(**kw))


def remote(
    rid: str = "p1",
    engine: str = "P",
    blocks: tuple[tuple[int, ...], ...] = ((10, 11, 12),),
    tp: int = 1,
    pp: int = 1,
    expiry: float | None = None,
) -> RemotePrefill:
    return RemotePrefill(
        engine_id=engine,
        request_id=rid,
        host="p-host",
        port=5600,
        block_ids=blocks,
        tp_size=tp,
        pp_size=pp,
        blocks_expiry_time=expiry,
    )


def of(actions: list[Action], cls: type[Any]) -> list[Any]:
    return [a for a in actions if isinstance(a, cls)]


def one(actions: list[Action], cls: type[Any]) -> Any:
    found = of(actions, cls)
    assert len(found) == 1, (cls.__name__, actions)
    return found[0]


def registration(
    rid: str = "r1",
    blocks: tuple[tuple[int, ...], ...] = ((1, 2),),
    engine: str = "P",
    decode_tp: int = 1,
    decode_engine: str = "D",
) -> bytes:
    return encode_push_registration(
        PushRegistration(
            request_id=rid,
            decode_engine_id=decode_engine,
            decode_host="d-host",
            decode_port=7000,
            decode_tp_size=decode_tp,
            local_block_ids=[list(g) for g in blocks],
            remote_engine_id=engine,
            remote_host="p-host",
            remote_port=5600,
            remote_tp_size=1,
            remote_pp_size=1,
        )
    )


class ConsumerAt:
    """A consumer with request ``d1`` driven to a named state.

    Pull states use a producer with TP 2 (this rank reads two remote ranks), so a
    TRANSFERRING request has one posted READ and one still requested.
    """

    def __init__(self, state: str, mode: TransferMode = PULL) -> None:
        self.now = 1.0
        push = mode is PUSH
        self.m = consumer(mode=mode)
        self.rid = "d1"
        self.xfers: list[int] = []
        self.attempt = 0
        if state == "absent":
            return
        blocks = () if push else ((10, 11, 12),)
        acts = self.step(RequestAdded("d1", remote(tp=1 if push else 2, blocks=blocks)))
        self.attempt = one(acts, StartHandshake).attempt
        if state == "wait_alloc":
            return
        acts = self.step(AllocationDone("d1", ((7, 8),)))
        if state == "wait_peer":
            return
        acts = self.step(HandshakeDone("P", self.attempt, 1 if push else 2))
        if push:
            assert state == "await_writes"
            return
        self.xfers.append(one(acts, PostRead).xfer_id)
        acts = self.step(TransferPosted(self.xfers[0]))
        self.xfers.append(one(acts, PostRead).xfer_id)
        if state == "transferring":
            return
        assert state == "draining"
        self.step(Abort("d1"))

    def step(self, event: Any, dt: float = 0.001) -> list[Action]:
        self.now += dt
        return self.m.handle(event, self.now)


class ProducerAt:
    """A producer with request ``r1`` driven to a named state (push: writes to 2 D ranks)."""

    def __init__(self, state: str, mode: TransferMode | str = PULL) -> None:
        self.now = 1.0
        stream = self.stream = mode == STREAM
        mode = PUSH if stream else mode
        self.m = producer(mode=mode, stream_layers=stream)
        self.rid = "r1"
        self.xfers: list[int] = []
        self.attempt = 0
        if state == "absent":
            return
        self.step(RequestAdded("r1"))
        if stream:
            self._stream_to(state)
            return
        if state == "prefilling":
            return
        self.step(PrefillFinished("r1", ((1, 2, 3),)))
        if state == "leased":
            return
        if state == "quarantined":
            self.step(Timer(), self.m.config.lease_s + 0.001)
            return
        acts = self.step(NotificationReceived("d-agent", registration("r1", decode_tp=2)))
        self.attempt = one(acts, StartHandshake).attempt
        if state == "wait_peer":
            return
        acts = self.step(HandshakeDone("D", self.attempt, 2))
        self.xfers.append(one(acts, PostWrite).xfer_id)
        acts = self.step(TransferPosted(self.xfers[0]))
        self.xfers.append(one(acts, PostWrite).xfer_id)
        if state == "writing":
            return
        assert state == "draining"
        self.step(Abort("r1"))

    def _stream_to(self, state: str) -> None:
        """Streaming push: matched while the prompt computes; a round in flight to both D
        ranks in ``writing`` (and ``draining``, after an abort)."""
        self.step(ChunkScheduled("r1", 32, ((1, 2),), 1))
        if state == "prefilling":
            return
        acts = self.step(NotificationReceived("d-agent", registration("r1", decode_tp=2)))
        self.attempt = one(acts, StartHandshake).attempt
        if state == "wait_peer":
            return
        self.step(HandshakeDone("D", self.attempt, 2))
        self.xfers.append(one(self.step(LayersComputed(("r1",), 1)), PostWrite).xfer_id)
        self.xfers.append(one(self.step(TransferPosted(self.xfers[0])), PostWrite).xfer_id)
        if state == "writing":
            return
        assert state == "draining"
        self.step(Abort("r1"))

    def step(self, event: Any, dt: float = 0.001) -> list[Action]:
        self.now += dt
        return self.m.handle(event, self.now)
