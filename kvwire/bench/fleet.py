"""``kvwire bench fleet``: a fleet's metadata traffic, ZMQ handshakes against etcd.

One process brings up P prefill and D decode engines of TP ranks each (real Producers and
Consumers over shm, one ZMQ listener per prefill engine) twice: once with ZMQ handshakes
only, once with every rank on one etcd (started here on loopback unless ``--store``).
Each run:

1. **cold start**: the prefill engines come up (and publish), then the decode engines
   (and list the store), then every decode engine pulls one request from every prefill
   engine. Measured: the metadata messages (a ZMQ handshake is a request and an answer per
   queried rank; an etcd call is a request and an answer, a watch message one more; lease
   keepalives and quiet-watch probes, which recur per rank whatever the fleet does, are
   counted apart as upkeep) and the time from the first decode rank starting to the last
   first transfer.
2. **restart**: prefill engine 0 crashes (its ranks close without withdrawing their
   records) and comes back with new agent metadata. Measured: the time from the new
   engine starting until every decode rank has dropped the stale agents (store only: over
   ZMQ nothing is seen until a request fails), then the load failures of one request from
   every decode engine to the restarted one.

A third run names a store that never answers (etcd down): it must equal the ZMQ-only run.

The order is the usual one, decode engines joining a running prefill fleet: a decode rank
watching before the prefill ranks publish would get each publication as a watch message,
which this run would count.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvwire.bench.report import Report, Result
from kvwire.config import KVWireConfig
from kvwire.demo.models import CacheSpec, preset
from kvwire.demo.worker import allocate
from kvwire.errors import ConfigError
from kvwire.runtime import Consumer, Finished, Producer
from kvwire.sidechannel import HandshakeListener
from kvwire.testing.ports import free_port
from kvwire.transport import create

MODEL = "llama-3-8b"
LAYERS = 2
TTL_S = 5.0
DEFAULT_SHAPE = (8, 8, 2)
QUICK_SHAPE = (4, 4, 2)


def parse_shape(text: str) -> tuple[int, int, int]:
    """``PxDxTP``: prefill engines, decode engines, TP ranks per engine."""
    try:
        p, d, tp = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--fleet {text!r}: expected PxDxTP, e.g. 8x8x2") from None
    if not (1 <= p <= 256 and 1 <= d <= 256 and tp in (1, 2, 4, 8) and (p + d) * tp <= 512):
        raise ConfigError(f"--fleet {text!r}: 1-256 engines a side, TP 1/2/4/8, <= 512 ranks")
    return p, d, tp


@dataclass
class _Engine:
    engine_id: str
    ranks: list[Any]
    listener: HandshakeListener | None = None


@dataclass
class _Fleet:
    """The ranks of one run, and what they need kept alive (KV memory, transports)."""

    p: int
    d: int
    tp: int
    store: str | None
    spec_of: Callable[[int], CacheSpec]
    memory: list[npt.NDArray[np.uint8]] = field(default_factory=list)
    prefill: list[_Engine] = field(default_factory=list)
    decode: list[_Engine] = field(default_factory=list)
    closed: list[_Engine] = field(default_factory=list)

    def config(self, engine_id: str, tp_rank: int, port: int) -> KVWireConfig:
        return KVWireConfig(
            engine_id=engine_id,
            tp_rank=tp_rank,
            tp_size=self.tp,
            side_channel_port=port,
            compat=self.spec_of(tp_rank).compat("pull"),
            metadata_store=self.store,
            metadata_store_ttl_s=TTL_S,
            handshake_timeout_s=5.0,
            poll_interval_s=0.05,
            log_level="ERROR",
        )

    def _kv(self, tp_rank: int) -> tuple[CacheSpec, int]:
        spec = self.spec_of(tp_rank)
        buffer = allocate("shm", spec.total_bytes)
        self.memory.append(buffer)
        return spec, int(buffer.ctypes.data)

    def start_prefill(self, index: int) -> _Engine:
        listener = HandshakeListener({}).start()
        engine = _Engine(f"prefill-{index}", [], listener)
        for rank in range(self.tp):
            producer = Producer(self.config(engine.engine_id, rank, listener.port), "shm")
            engine.ranks.append(producer)
            spec, addr = self._kv(rank)
            producer.register_kv_caches(spec.geometry(addr))
        listener.set_payloads({(0, r): p.handshake_payload() for r, p in enumerate(engine.ranks)})
        return engine

    def start_decode(self, index: int) -> _Engine:
        engine = _Engine(f"decode-{index}", [])
        for rank in range(self.tp):
            consumer = Consumer(self.config(engine.engine_id, rank, 0), "shm")
            engine.ranks.append(consumer)
            spec, addr = self._kv(rank)
            consumer.register_kv_caches(spec.geometry(addr))
        return engine

    def crash(self, engine: _Engine) -> None:
        """Close without withdrawing the published records, as a killed process would."""
        for rank in engine.ranks:
            rank.close(withdraw=False)
        if engine.listener is not None:
            engine.listener.close()
        self.closed.append(engine)

    def close(self) -> None:
        for engine in [*self.decode, *self.prefill]:
            for rank in engine.ranks:
                rank.close()
            if engine.listener is not None:
                engine.listener.close()

    # -- counting -----------------------------------------------------------------------

    def zmq_messages(self) -> int:
        """Handshake requests and answers the prefill listeners served."""
        listeners = [e.listener for e in [*self.prefill, *self.closed] if e.listener is not None]
        return 2 * sum(listener.stats().served for listener in listeners)

    def store_messages(self) -> tuple[int, int]:
        """etcd messages of every rank: ``(discovery, upkeep)``. Discovery: lease grants,
        puts, listings, watch creations (a request and an answer each) and every watch
        message received. Upkeep: keepalives, quiet-watch probes and revocations, which
        recur every TTL/3 per rank whatever the fleet does."""
        discovery = upkeep = 0
        for engine in [*self.prefill, *self.decode, *self.closed]:
            for rank in engine.ranks:
                for part in (rank.publisher, rank.directory):
                    if part is None:
                        continue
                    calls = part.client.calls
                    periodic = sum(calls[k] for k in _UPKEEP)
                    upkeep += 2 * periodic
                    discovery += 2 * (sum(calls.values()) - periodic)
                    discovery += getattr(part, "messages", 0)
        return discovery, upkeep


_UPKEEP = ("lease/keepalive", "probe", "lease/revoke")


def _request(
    p: _Engine, d: _Engine, rid: str, p_blocks: list[int], d_blocks: list[int]
) -> list[dict[str, Any]]:
    """P's ranks finish the prompt; D's ranks are handed the params (rank 0's, as a proxy
    forwards them) and their blocks."""
    params = [prod.prefill_finished(rid, [p_blocks], num_tokens=2 * 16) for prod in p.ranks]
    for consumer in d.ranks:
        consumer.add_request(rid, params[0], [d_blocks])
    return params


def _wait(
    fleet: _Fleet, pending: dict[tuple[int, int], set[str]], timeout: float
) -> dict[str, str]:
    """Until every (decode engine, rank)'s requests ended; the failed ones with reasons."""
    failed: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while any(pending.values()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"fleet bench: {sum(map(len, pending.values()))} requests hang")
        for (di, rank), rids in pending.items():
            if not rids:
                continue
            got: Finished = fleet.decode[di].ranks[rank].get_finished()
            rids.difference_update(got.done)
            for rid, why in got.failed.items():
                failed[rid] = why.reason
                rids.discard(rid)
        time.sleep(0.002)
    return failed


def _all_pairs(fleet: _Fleet, tag: str, p_indices: list[int]) -> dict[str, str]:
    pending: dict[tuple[int, int], set[str]] = {
        (di, r): set() for di in range(len(fleet.decode)) for r in range(fleet.tp)
    }
    for di, d in enumerate(fleet.decode):
        for pi in p_indices:
            rid = f"{tag}-d{di}-p{pi}"
            _request(fleet.prefill[pi], d, rid, [2 * di, 2 * di + 1], [2 * pi, 2 * pi + 1])
            for r in range(fleet.tp):
                pending[(di, r)].add(rid)
    return _wait(fleet, pending, 120.0)


def _expiry(fleet: _Fleet) -> float:
    """Prefill engine 1 crashes for good: seconds until every decode rank forgot it (its
    lease ran out, nothing was withdrawn)."""
    fleet.crash(fleet.prefill[1])
    t0 = time.perf_counter()
    deadline = time.monotonic() + TTL_S + 30.0
    ranks = [c for e in fleet.decode for c in e.ranks]
    while any(c.peer_agents("prefill-1") for c in ranks):
        if time.monotonic() > deadline:
            raise TimeoutError("fleet bench: a decode rank kept an expired agent")
        time.sleep(0.005)
    seen = time.perf_counter() - t0
    fleet.prefill.pop(1)
    return seen


def _run_mode(
    shape: tuple[int, int, int], store: str | None, *, expiry: bool = False, up: bool = True
) -> dict[str, Any]:
    """One run; ``up=False``: every rank names a store that never answers."""
    p, d, tp = shape
    live = store is not None and up
    blocks = 2 * max(p, d) + 2
    specs = {r: CacheSpec(preset(MODEL), LAYERS, blocks, r, tp) for r in range(tp)}
    fleet = _Fleet(p, d, tp, store, specs.__getitem__)
    out: dict[str, Any] = {}
    try:
        fleet.prefill = [fleet.start_prefill(i) for i in range(p)]
        if live:  # the fleet is published before decode engines join
            for engine in fleet.prefill:
                for rank in engine.ranks:
                    if not rank.publisher.published.wait(60.0):
                        raise TimeoutError("fleet bench: a prefill rank did not publish")
        base_zmq, (base_store, _) = fleet.zmq_messages(), fleet.store_messages()
        t0 = time.perf_counter()
        fleet.decode = [fleet.start_decode(i) for i in range(d)]
        if live:
            for engine in fleet.decode:
                for rank in engine.ranks:
                    if not rank.directory.healthy.wait(60.0):
                        raise TimeoutError("fleet bench: a decode rank did not list the store")
        failed = _all_pairs(fleet, "cold", list(range(p)))
        out["cold_start_s"] = time.perf_counter() - t0
        out["cold_failures"] = len(failed)
        discovery, upkeep = fleet.store_messages()
        out["messages"] = discovery if live else fleet.zmq_messages() - base_zmq
        out["upkeep_messages"] = upkeep
        out["zmq_handshake_messages"] = fleet.zmq_messages() - base_zmq
        out["publish_messages"] = base_store
        old = {(di, r): c.peer_agents("prefill-0") for di, e in enumerate(fleet.decode)
               for r, c in enumerate(e.ranks)}  # fmt: skip

        fleet.crash(fleet.prefill[0])
        t_restart = time.perf_counter()
        fleet.prefill[0] = fleet.start_prefill(0)
        seen_s = None
        if live:
            deadline = time.monotonic() + TTL_S + 30.0
            while any(
                c.peer_agents("prefill-0") == old[(di, r)]
                for di, e in enumerate(fleet.decode) for r, c in enumerate(e.ranks)
            ):  # fmt: skip
                if time.monotonic() > deadline:
                    raise TimeoutError("fleet bench: a decode rank kept the stale agent")
                time.sleep(0.001)
            seen_s = time.perf_counter() - t_restart
            for rank in fleet.prefill[0].ranks:
                rank.publisher.published.wait(60.0)
        out["restart_seen_s"] = seen_s
        failed = _all_pairs(fleet, "restart", [0])
        out["restart_load_failures"] = len(failed)
        out["restart_failure_reasons"] = sorted(set(failed.values()))
        if live and expiry and p > 1:
            out["expiry_seen_s"] = _expiry(fleet)
    finally:
        fleet.close()
    return out


@contextlib.contextmanager
def _etcd(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    from kvwire.testing.etcd import EtcdServer

    with EtcdServer() as server:
        yield server.url


def run(args: argparse.Namespace) -> Report:
    shape = parse_shape(args.fleet) if getattr(args, "fleet", None) else (
        QUICK_SHAPE if getattr(args, "quick", False) else DEFAULT_SHAPE
    )  # fmt: skip
    p, d, tp = shape
    create("shm", "kvwire-bench-fleet-check").close()  # fail early without the transport
    smaller = sorted({(max(1, p // k), max(1, d // k), tp) for k in (4, 2)} - {shape})
    growth = []
    with _etcd(getattr(args, "store", None)) as url:
        for size in smaller:
            growth.append(
                {
                    "ranks": (size[0] + size[1]) * tp,
                    "shape": list(size),
                    "zmq": _run_mode(size, None)["messages"],
                    "store": _run_mode(size, url)["messages"],
                }
            )
        zmq = _run_mode(shape, None)
        store = _run_mode(shape, url, expiry=True)
    down = _run_mode(shape, f"etcd://127.0.0.1:{free_port()}", up=False)
    growth.append({"ranks": (p + d) * tp, "shape": list(shape), "zmq": zmq["messages"],
                   "store": store["messages"]})  # fmt: skip
    report = Report("fleet")
    ttl = f"TTL {TTL_S:g} s"

    def add(name: str, value: float, unit: str, baseline: str | None = None) -> None:
        """A figure; with a baseline of this run's ZMQ-only figures, their ratio too."""
        base = {
            "fleet.messages.zmq": zmq["messages"], "fleet.cold_start_s.zmq": zmq["cold_start_s"],
        }.get(baseline or "")  # fmt: skip
        ratio = value / base if base else None
        report.add(Result(name, value, unit, baseline=baseline, ratio=ratio))

    add("fleet.ranks", (p + d) * tp, "ranks")
    add("fleet.pairs", p * d, "engine pairs")
    add("fleet.messages.zmq", zmq["messages"], "messages")
    add("fleet.messages.store", store["messages"], "messages", "fleet.messages.zmq")
    add("fleet.messages.store_zmq_handshakes", store["zmq_handshake_messages"], "messages")
    add("fleet.messages.store_upkeep", store["upkeep_messages"], "messages",
        "keepalives and quiet-watch probes in the cold-start window")  # fmt: skip
    add("fleet.cold_start_s.zmq", zmq["cold_start_s"], "s")
    add("fleet.cold_start_s.store", store["cold_start_s"], "s", "fleet.cold_start_s.zmq")
    add("fleet.cold_load_failures", zmq["cold_failures"] + store["cold_failures"], "requests")
    add("fleet.restart_seen_s", store["restart_seen_s"], "s", f"{ttl} + 1 s")
    add("fleet.restart_load_failures", store["restart_load_failures"], "requests")
    add("fleet.restart_load_failures.zmq", zmq["restart_load_failures"], "requests")
    add("fleet.store_down.messages", down["messages"], "messages", "fleet.messages.zmq")
    add("fleet.store_down.cold_start_s", down["cold_start_s"], "s", "fleet.cold_start_s.zmq")
    add("fleet.store_down.restart_load_failures", down["restart_load_failures"], "requests",
        "fleet.restart_load_failures.zmq")  # fmt: skip
    if "expiry_seen_s" in store:
        add("fleet.expiry_seen_s", store["expiry_seen_s"], "s", ttl)
    report.sweeps["fleet"] = {
        "shape": {"prefill_engines": p, "decode_engines": d, "tp": tp},
        "lease_ttl_s": TTL_S,
        "zmq": zmq,
        "store": store,
        "store_down": down,
        "growth": growth,
    }
    return report
