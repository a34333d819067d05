"""Store-backed discovery with real Producer/Consumer ranks over shm and a real etcd.

Every wait is on a condition with a deadline; nothing asserts on elapsed time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import pytest
from kvwire_shm import allocate

from kvwire.config import KVWireConfig
from kvwire.demo.content import count_wrong_bytes, fill
from kvwire.demo.models import CacheSpec, preset
from kvwire.runtime import Consumer, Finished, Producer
from kvwire.testing.etcd import EtcdServer

SECRET = b"s" * 32
TTL_S = 2.0


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout:g}s: {what}")
        time.sleep(0.01)


def sees(rank: Producer | Consumer, engine_id: str) -> bool:
    """The rank's store view is current (listed and watched) and holds the engine."""
    directory = rank.directory
    assert directory is not None
    return directory.healthy.is_set() and engine_id in directory.engines()


@dataclass
class Fleet:
    """Ranks made by one test (closed in teardown) and their KV memory (kept until then)."""

    closers: list[object] = field(default_factory=list)
    memory: list[npt.NDArray[np.uint8]] = field(default_factory=list)
    spec: CacheSpec = field(default_factory=lambda: CacheSpec(preset("llama-3-8b"), 2, 32, 0, 1))

    def config(
        self, engine_id: str, store: str | None, mode: str = "pull", **kw: object
    ) -> KVWireConfig:
        return KVWireConfig(
            engine_id=engine_id,
            mode=mode,
            compat=self.spec.compat(mode),
            metadata_store=store,
            metadata_store_ttl_s=TTL_S,
            handshake_timeout_s=2.0,
            handshake_retries=1,
            handshake_backoff_s=0.05,
            **kw,  # type: ignore[arg-type]
        )

    def _kv(self) -> npt.NDArray[np.uint8]:
        buffer = allocate(self.spec.total_bytes)
        self.memory.append(buffer)
        return buffer

    def producer(
        self, engine_id: str, store: str | None, **kw: object
    ) -> tuple[Producer, npt.NDArray[np.uint8]]:
        buffer = self._kv()
        producer = Producer(self.config(engine_id, store, **kw), "shm")
        self.closers.append(producer)
        producer.register_kv_caches(self.spec.geometry(int(buffer.ctypes.data)))
        return producer, buffer

    def consumer(
        self, engine_id: str, store: str | None, **kw: object
    ) -> tuple[Consumer, npt.NDArray[np.uint8]]:
        buffer = self._kv()
        consumer = Consumer(self.config(engine_id, store, **kw), "shm")
        self.closers.append(consumer)
        consumer.register_kv_caches(self.spec.geometry(int(buffer.ctypes.data)))
        return consumer, buffer

    def close(self) -> None:
        for thing in reversed(self.closers):
            thing.close()  # type: ignore[attr-defined]


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    made = Fleet()
    try:
        yield made
    finally:
        made.close()


def transfer(
    fleet: Fleet,
    producer: Producer,
    p_kv: npt.NDArray[np.uint8],
    consumer: Consumer,
    d_kv: npt.NDArray[np.uint8],
    rid: str,
    seed: int,
) -> Finished:
    """One request P -> D; what D reports for it."""
    fill(fleet.spec, p_kv, seed, [0, 1, 2, 3])
    params = producer.prefill_finished(rid, [[0, 1, 2, 3]], num_tokens=64)
    consumer.add_request(rid, params, [[8, 9, 10, 11]])
    seen = Finished()

    def ended() -> bool:
        got = consumer.get_finished()
        seen.done.extend(got.done)
        seen.failed.update(got.failed)
        return rid in seen.done or rid in seen.failed

    wait_until(ended, 30.0, f"request {rid} ended")
    if rid in seen.done:
        assert count_wrong_bytes(fleet.spec, d_kv, seed, [8, 9, 10, 11])[0] == 0
    return seen


def test_a_published_producer_is_handshaken_from_the_store(etcd: EtcdServer, fleet: Fleet) -> None:
    producer, p_kv = fleet.producer("prefill-a", etcd.url)
    consumer, d_kv = fleet.consumer("decode-a", etcd.url)
    assert producer.publisher is not None and consumer.directory is not None
    wait_until(producer.publisher.published.is_set, what="P published")
    wait_until(lambda: sees(consumer, "prefill-a"), what="D sees P")
    seen = transfer(fleet, producer, p_kv, consumer, d_kv, "r1", 1)
    assert seen.done == ["r1"]
    totals = consumer.metrics.snapshot()["totals"]
    assert totals["store_handshakes"] == 1 and totals["store_fallbacks"] == 0
    # No ZMQ round trip was made: the producer's own listener answered nobody.
    assert producer._listener is not None and producer._listener.stats().served == 0


def test_push_mode_producers_handshake_with_consumers_from_the_store(
    etcd: EtcdServer, fleet: Fleet
) -> None:
    """Push: the consumer publishes (producers dial it) and the producer reads the store."""
    producer, p_kv = fleet.producer("prefill-w", etcd.url, mode="push")
    consumer, d_kv = fleet.consumer("decode-w", etcd.url, mode="push")
    assert consumer.publisher is not None and producer.directory is not None
    wait_until(lambda: sees(producer, "decode-w"), what="P sees D")
    assert transfer(fleet, producer, p_kv, consumer, d_kv, "w1", 1).done == ["w1"]
    totals = producer.metrics.snapshot()["totals"]
    assert totals["store_handshakes"] == 1 and totals["store_fallbacks"] == 0


def test_a_restarted_producer_is_dropped_before_the_next_request(
    etcd: EtcdServer, fleet: Fleet
) -> None:
    producer, p_kv = fleet.producer("prefill-r", etcd.url)
    consumer, d_kv = fleet.consumer("decode-r", etcd.url)
    assert consumer.directory is not None
    wait_until(lambda: sees(consumer, "prefill-r"), what="D sees P")
    assert transfer(fleet, producer, p_kv, consumer, d_kv, "before", 1).done == ["before"]
    old_agents = consumer.peer_agents("prefill-r")
    assert old_agents

    # P crashes (its record stays until its lease runs out) and comes back as a new
    # process would: same engine id, new agent metadata, published again.
    producer.close(withdraw=False)
    producer, p_kv = fleet.producer("prefill-r", etcd.url)
    wait_until(
        lambda: consumer.metrics.snapshot()["totals"]["store_peers_dropped"] == 1,
        what="D dropped the stale agent",
    )
    assert consumer.peer_agents("prefill-r") == {}
    seen = transfer(fleet, producer, p_kv, consumer, d_kv, "after", 2)
    assert seen.done == ["after"] and not seen.failed  # no load failure
    assert set(consumer.peer_agents("prefill-r").values()).isdisjoint(old_agents.values())
    totals = consumer.metrics.snapshot()["totals"]
    assert totals["store_handshakes"] == 2 and totals["requests_failed"] == 0
    assert consumer.errors == [] and producer.errors == []
    text = consumer.metrics.prometheus_text()
    assert 'kvwire_store_handshakes_total{role="consumer",source="store"} 2.0' in text
    assert 'kvwire_store_peers_dropped_total{role="consumer"} 1.0' in text


def test_a_producer_whose_keepalive_stops_is_forgotten_and_reached_over_zmq(
    etcd: EtcdServer, fleet: Fleet
) -> None:
    producer, p_kv = fleet.producer("prefill-k", etcd.url)
    consumer, d_kv = fleet.consumer("decode-k", etcd.url)
    assert producer.publisher is not None and consumer.directory is not None
    wait_until(lambda: sees(consumer, "prefill-k"), what="D sees P")
    assert transfer(fleet, producer, p_kv, consumer, d_kv, "one", 1).done == ["one"]

    producer.publisher.close(withdraw=False)  # the keepalive stops; P itself lives on
    wait_until(lambda: "prefill-k" not in consumer.directory.engines(), what="P's lease expired")
    wait_until(lambda: consumer.peer_agents("prefill-k") == {}, what="D forgot P")
    seen = transfer(fleet, producer, p_kv, consumer, d_kv, "two", 2)
    assert seen.done == ["two"]  # over ZMQ: the listener still serves
    totals = consumer.metrics.snapshot()["totals"]
    assert totals["store_peers_dropped"] == 1 and totals["store_fallbacks"] == 1


def test_etcd_down_at_start_falls_back_to_zmq_and_the_store_is_used_once_it_is_up(
    tmp_path_factory: pytest.TempPathFactory, fleet: Fleet
) -> None:
    etcd = EtcdServer(tmp_path_factory.mktemp("etcd-late"))
    try:
        etcd.pick_ports()
        producer, p_kv = fleet.producer("prefill-d", etcd.url)
        consumer, d_kv = fleet.consumer("decode-d", etcd.url)
        seen = transfer(fleet, producer, p_kv, consumer, d_kv, "zmq", 1)
        assert seen.done == ["zmq"]
        assert consumer.metrics.snapshot()["totals"]["store_fallbacks"] == 1

        etcd.start()  # the publisher and the watch retry on their own
        assert producer.publisher is not None and consumer.directory is not None
        wait_until(producer.publisher.published.is_set, what="P published late")
        wait_until(lambda: sees(consumer, "prefill-d"), what="D sees P")
        # The record carries the agent D already holds: no drop, the next request reuses it.
        seen = transfer(fleet, producer, p_kv, consumer, d_kv, "same", 2)
        assert seen.done == ["same"]
        assert consumer.metrics.snapshot()["totals"]["store_peers_dropped"] == 0
    finally:
        fleet.close()
        fleet.closers.clear()
        etcd.close()


def test_a_restart_while_etcd_was_down_is_seen_when_it_comes_back(
    tmp_path_factory: pytest.TempPathFactory, fleet: Fleet
) -> None:
    """D handshook over ZMQ; P restarted while etcd was down (D holds a stale agent); when
    etcd is back, D's listing or watch shows P's new record and D drops the stale agent."""
    etcd = EtcdServer(tmp_path_factory.mktemp("etcd-back"))
    try:
        etcd.pick_ports()
        producer, p_kv = fleet.producer("prefill-b", etcd.url)
        consumer, d_kv = fleet.consumer("decode-b", etcd.url)
        assert transfer(fleet, producer, p_kv, consumer, d_kv, "zmq", 1).done == ["zmq"]
        producer.close(withdraw=False)
        producer, p_kv = fleet.producer("prefill-b", etcd.url)

        etcd.start()
        wait_until(
            lambda: consumer.metrics.snapshot()["totals"]["store_peers_dropped"] == 1,
            what="D dropped the agent it took over ZMQ",
        )
        wait_until(lambda: sees(consumer, "prefill-b"), what="D sees P")
        seen = transfer(fleet, producer, p_kv, consumer, d_kv, "back", 2)
        assert seen.done == ["back"] and not seen.failed
        assert consumer.metrics.snapshot()["totals"]["store_handshakes"] == 1
    finally:
        fleet.close()
        fleet.closers.clear()
        etcd.close()


@pytest.mark.parametrize("fault", ["killed", "partitioned"])
def test_etcd_lost_mid_run_falls_back_to_zmq(etcd: EtcdServer, fleet: Fleet, fault: str) -> None:
    producer, p_kv = fleet.producer("prefill-m", etcd.url)
    consumer, d_kv = fleet.consumer("decode-m", etcd.url)
    assert consumer.directory is not None
    wait_until(lambda: sees(consumer, "prefill-m"), what="D sees P")
    assert transfer(fleet, producer, p_kv, consumer, d_kv, "m1", 1).done == ["m1"]

    if fault == "killed":
        etcd.stop()
    else:
        etcd.pause()  # no FIN, nothing answers: the watch is confirmed by a probe
    wait_until(lambda: not consumer.directory.healthy.is_set(), 60.0, "D saw the store go")
    # The cached peer keeps working, and a peer never seen is reached over ZMQ.
    assert transfer(fleet, producer, p_kv, consumer, d_kv, "m2", 2).done == ["m2"]
    other, o_kv = fleet.producer("prefill-n", etcd.url)
    assert transfer(fleet, other, o_kv, consumer, d_kv, "n1", 3).done == ["n1"]
    totals = consumer.metrics.snapshot()["totals"]
    assert totals["store_fallbacks"] == 1 and totals["requests_failed"] == 0
    etcd.resume()


def test_published_payloads_are_authenticated_with_a_secret(etcd: EtcdServer, fleet: Fleet) -> None:
    from kvwire.sidechannel.etcd import EtcdClient
    from kvwire.sidechannel.store_records import StoreRecord, decode_record

    producer, p_kv = fleet.producer("prefill-s", etcd.url, secret=SECRET)
    consumer, d_kv = fleet.consumer("decode-s", etcd.url, secret=SECRET)
    assert producer.publisher is not None and consumer.directory is not None
    wait_until(lambda: sees(consumer, "prefill-s"), what="D sees P")
    key = producer.publisher.key
    _, kvs = EtcdClient(etcd.url).get_prefix(key)
    sealed = kvs[0].value
    plain = producer.handshake_payload()
    assert plain not in sealed  # the metadata (memory keys) is not readable in the store
    assert decode_record(key, sealed, SECRET).payload == plain

    assert transfer(fleet, producer, p_kv, consumer, d_kv, "s1", 1).done == ["s1"]
    assert consumer.metrics.snapshot()["totals"]["store_handshakes"] == 1

    # Someone with write access to etcd flips one byte of the sealed payload: D refuses the
    # record, drops the agent it held (the store no longer vouches for it) and handshakes
    # over the authenticated ZMQ channel instead.
    import msgspec

    record = msgspec.msgpack.decode(sealed, type=StoreRecord)
    forged = msgspec.structs.replace(
        record, payload=bytes([record.payload[0] ^ 1]) + record.payload[1:]
    )
    EtcdClient(etcd.url).put(key, msgspec.msgpack.encode(forged))
    wait_until(lambda: consumer.directory.rejected >= 1, what="D refused the forged record")
    wait_until(lambda: consumer.peer_agents("prefill-s") == {}, what="D dropped P")
    assert transfer(fleet, producer, p_kv, consumer, d_kv, "s2", 2).done == ["s2"]
    totals = consumer.metrics.snapshot()["totals"]
    assert totals["store_fallbacks"] == 1 and totals["requests_failed"] == 0


@pytest.mark.parametrize("with_store", ["decode", "prefill"])
def test_a_mixed_fleet_handshakes_over_zmq(etcd: EtcdServer, fleet: Fleet, with_store: str) -> None:
    producer, p_kv = fleet.producer("prefill-x", etcd.url if with_store == "prefill" else None)
    consumer, d_kv = fleet.consumer("decode-x", etcd.url if with_store == "decode" else None)
    if producer.publisher is not None:
        wait_until(producer.publisher.published.is_set, what="P published")
    assert transfer(fleet, producer, p_kv, consumer, d_kv, "x1", 1).done == ["x1"]
    totals = consumer.metrics.snapshot()["totals"]
    assert totals["handshakes_ok"] == 1 and totals["store_handshakes"] == 0
