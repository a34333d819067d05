"""Shared pieces of the runtime tests: a small model cache in shm memory, P/D pairs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest
from kvwire_shm import allocate

from kvwire.config import KVWireConfig
from kvwire.demo.engines import DecodeEngine, RequestResult
from kvwire.demo.models import CacheSpec, preset
from kvwire.runtime import Consumer, Producer
from kvwire.sidechannel import HandshakeListener


@dataclass
class Side:
    spec: CacheSpec
    buffer: npt.NDArray[np.uint8]
    listener: HandshakeListener


def make_side(layers: int = 2, num_blocks: int = 32, tp_rank: int = 0, tp_size: int = 1) -> Side:
    spec = CacheSpec(preset("llama-3-8b"), layers, num_blocks, tp_rank, tp_size)
    buffer = allocate(spec.total_bytes)
    return Side(spec, buffer, HandshakeListener({}).start())


def config(side: Side, engine_id: str, mode: str = "pull", **kw: object) -> KVWireConfig:
    return KVWireConfig(
        engine_id=engine_id,
        mode=mode,  # type: ignore[arg-type]
        tp_rank=side.spec.tp_rank,
        tp_size=side.spec.tp_size,
        side_channel_port=side.listener.port,
        compat=side.spec.compat(mode),
        handshake_timeout_s=2.0,
        handshake_retries=1,
        handshake_backoff_s=0.05,
        **kw,  # type: ignore[arg-type]
    )


def finish(decode: DecodeEngine, count: int, timeout: float = 60.0) -> list[RequestResult]:
    """The results of ``count`` requests a demo decode engine runs, failing after ``timeout``."""
    results: list[RequestResult] = []
    deadline = time.monotonic() + timeout
    while len(results) < count and time.monotonic() < deadline:
        results += decode.poll(0.5)
    assert len(results) == count, f"only {len(results)} of {count} requests ended"
    return results


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


@pytest.fixture
def pair_factory() -> Iterator[Callable[..., tuple[Producer, Consumer, Side, Side]]]:
    made: list[object] = []
    keep_alive: list[Side] = []  # the KV memory must outlive the agents that registered it

    def make(
        mode: str = "pull", transport: str = "shm", **kw: object
    ) -> tuple[Producer, Consumer, Side, Side]:
        p_side, d_side = make_side(), make_side()
        producer = Producer(config(p_side, "prefill-e", mode, **kw), transport)
        consumer = Consumer(config(d_side, "decode-e", mode, **kw), transport)
        producer.register_kv_caches(p_side.spec.geometry(int(p_side.buffer.ctypes.data)))
        consumer.register_kv_caches(d_side.spec.geometry(int(d_side.buffer.ctypes.data)))
        p_side.listener.set_payloads({(0, 0): producer.handshake_payload()})
        d_side.listener.set_payloads({(0, 0): consumer.handshake_payload()})
        made.extend([producer, consumer, p_side.listener, d_side.listener])
        keep_alive.extend([p_side, d_side])
        return producer, consumer, p_side, d_side

    yield make
    for thing in reversed(made):
        thing.close()  # type: ignore[attr-defined]
