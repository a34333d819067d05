"""The demo's two engines: a scheduler process side that owns rank processes.

Like a real serving engine, block ids are allocated once per engine (every rank uses the
same ids) and one handshake listener serves every rank's metadata. The prefill engine fills
and holds blocks until every rank has freed them; the decode engine allocates blocks, hands
each rank the request, and collects the ranks' verified results.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvwire.demo.models import BLOCK_TOKENS
from kvwire.demo.ranks import RankError, RankProcess
from kvwire.errors import ConfigError
from kvwire.sidechannel import HandshakeListener


@dataclass(frozen=True)
class EngineOptions:
    model: str
    layers: int
    tp: int
    num_blocks: int
    mode: str
    transport: str
    engine_id: str
    host: str = "127.0.0.1"
    """Where this engine's handshake listener binds."""
    advertise_host: str | None = None
    """The host peers are told to dial (defaults to ``host``)."""
    lease_s: float = 30.0
    secret: bytes | None = field(default=None, repr=False)
    """Shared secret of the authenticated handshake; None: vLLM's plain handshake."""
    block_tokens: int = BLOCK_TOKENS
    rank_extra: Mapping[str, Any] = field(default_factory=dict)
    """More ``init`` keys for every rank (kvwire.demo.worker): a peer engine's layout
    name, layer names, backend or compat factors."""

    def rank_init(self, role: str, rank: int, side_channel_port: int) -> dict[str, Any]:
        return {
            "role": role,
            "model": self.model,
            "layers": self.layers,
            "num_blocks": self.num_blocks,
            "tp_rank": rank,
            "tp_size": self.tp,
            "mode": self.mode,
            "transport": self.transport,
            "engine_id": self.engine_id,
            "side_channel_host": self.advertise_host or self.host,
            "side_channel_port": side_channel_port,
            "lease_s": self.lease_s,
            "secret": self.secret.hex() if self.secret is not None else None,
            "block_tokens": self.block_tokens,
            **self.rank_extra,
        }

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_tokens)


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_TOKENS)


class _Blocks:
    """The engine's block pool; ids are shared by all ranks."""

    def __init__(self, num_blocks: int) -> None:
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        self.capacity = num_blocks

    def take(self, count: int) -> list[int] | None:
        if count > self.capacity:
            raise ConfigError(f"a request of {count} blocks exceeds the pool of {self.capacity}")
        if len(self._free) < count:
            return None
        return [self._free.popleft() for _ in range(count)]

    def give(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    @property
    def free(self) -> int:
        return len(self._free)


class PrefillEngine:
    """P: rank processes with KV caches, one listener, the proxy-facing ``prefill`` call."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self._listener = HandshakeListener({}, host=options.host, port=0, secret=options.secret)
        self._ranks: list[RankProcess] = []
        self._pool = _Blocks(options.num_blocks)
        self._held: dict[str, tuple[list[int], set[int]]] = {}
        self._lock = threading.Lock()
        self.freed_reasons: collections.Counter[str] = collections.Counter()

    @property
    def side_channel_port(self) -> int:
        return self._listener.port

    def start(self) -> PrefillEngine:
        self._listener.start()
        try:
            for rank in range(self.options.tp):
                self._ranks.append(self._spawn(rank))
        except BaseException:
            self.close()
            raise
        self._publish()
        return self

    def _spawn(self, rank: int) -> RankProcess:
        init = self.options.rank_init("prefill", rank, self._listener.port)
        return RankProcess(rank, init)

    def _publish(self) -> None:
        self._listener.set_payloads({(0, r.index): r.payload for r in self._ranks})

    def prefill(
        self, rid: str, index: int, num_tokens: int, *, timeout: float = 60.0
    ) -> dict[str, Any]:
        """Compute (fill) the prompt on every rank; returns the kv_transfer_params."""
        with self._lock:
            count = self.options.blocks_for(num_tokens)
            deadline = time.monotonic() + timeout
            blocks = self._pool.take(count)
            while blocks is None:
                if time.monotonic() > deadline:
                    raise RankError(f"no free prefill blocks for {rid} within {timeout:g} s")
                if not self._reclaim():
                    time.sleep(0.002)
                blocks = self._pool.take(count)
            msg = {"op": "prefill", "rid": rid, "index": index, "blocks": blocks,
                   "num_tokens": num_tokens}  # fmt: skip
            for rank in self._ranks:
                rank.send(msg)
            answers = [rank.answer() for rank in self._ranks]
            self._held[rid] = (blocks, {r.index for r in self._ranks})
            params: dict[str, Any] = answers[0]["params"]
            return params

    def _reclaim(self) -> bool:
        """Ask every rank which requests it freed; blocks return once all ranks have."""
        returned = False
        for rank in self._ranks:
            if not rank.alive:
                continue
            for rid, reason in rank.call({"op": "freed"})["freed"]:
                held = self._held.get(rid)
                if held is None:
                    continue
                held[1].discard(rank.index)
                if not held[1]:
                    del self._held[rid]
                    self._pool.give(held[0])
                    self.freed_reasons[reason] += 1
                    returned = True
        return returned

    def reclaim(self) -> None:
        with self._lock:
            self._reclaim()

    def held_requests(self) -> int:
        with self._lock:
            return len(self._held)

    def kill_rank(self, rank: int) -> None:
        """Crash a rank (SIGKILL); its held blocks are lost with it."""
        with self._lock:
            self._ranks[rank].kill()

    def restart_rank(self, rank: int) -> None:
        """Start a fresh process for a killed rank and serve its new metadata."""
        with self._lock:
            old = self._ranks[rank]
            if old.alive:
                old.kill()
            self._ranks[rank] = self._spawn(rank)
            for _blocks, ranks in list(self._held.values()):
                ranks.discard(rank)
            for rid in [rid for rid, (_, ranks) in self._held.items() if not ranks]:
                self._pool.give(self._held.pop(rid)[0])
            self._publish()

    def stats(self) -> list[dict[str, Any]]:
        with self._lock:
            return [r.call({"op": "stats"}) for r in self._ranks if r.alive]

    def close(self) -> None:
        for rank in self._ranks:
            rank.close()
        self._ranks.clear()
        self._listener.close()


@dataclass
class RequestResult:
    """One request as the decode engine saw it end."""

    rid: str
    index: int
    ok: bool
    time_to_kv: float
    wrong_bytes: int = 0
    checked_bytes: int = 0
    reasons: list[str] = field(default_factory=list)
    invalid_blocks: list[list[int]] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    """Each failed rank's one-line reason (e.g. which versions a refused peer speaks)."""


@dataclass
class _Inflight:
    index: int
    blocks: list[int]
    started: float
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)


class DecodeEngine:
    """D: rank processes that receive and verify; blocks allocated here, once per request."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self._listener = HandshakeListener({}, host=options.host, port=0, secret=options.secret)
        self._events: queue.Queue[tuple[int, dict[str, Any] | None]] = queue.Queue()
        self._ranks: list[RankProcess] = []
        self._pool = _Blocks(options.num_blocks)
        self._inflight: dict[str, _Inflight] = {}
        self._stats: dict[int, dict[str, Any]] = {}

    def start(self) -> DecodeEngine:
        self._listener.start()
        try:
            for rank in range(self.options.tp):
                self._ranks.append(self._spawn(rank))
        except BaseException:
            self.close()
            raise
        self._publish()
        return self

    def _spawn(self, rank: int) -> RankProcess:
        init = self.options.rank_init("decode", rank, self._listener.port)
        return RankProcess(rank, init, events=self._events)

    def _publish(self) -> None:
        self._listener.set_payloads({(0, r.index): r.payload for r in self._ranks})

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def can_take(self, num_tokens: int) -> bool:
        return self._pool.free >= self.options.blocks_for(num_tokens)

    def submit(
        self,
        rid: str,
        index: int,
        params: dict[str, Any],
        num_tokens: int,
        *,
        hit: int = 0,
        wait: bool = False,
    ) -> None:
        """The request arrives at D with P's params; allocate and hand it to every rank
        (``hit`` leading blocks are a local prefix-cache hit, not received; ``wait``: the
        ranks learn of the blocks only at :meth:`allocate`, the request queues meanwhile)."""
        blocks = self._pool.take(self.options.blocks_for(num_tokens))
        if blocks is None:
            raise ConfigError("decode engine has no free blocks (call poll first)")
        self._inflight[rid] = _Inflight(index, blocks, time.perf_counter())
        msg = {"op": "recv", "rid": rid, "index": index, "params": params, "blocks": blocks,
               "hit": hit, "wait": wait}  # fmt: skip
        for rank in self._ranks:
            rank.send(msg)

    def allocate(self, rid: str, *, hit: int = 0) -> None:
        """Hand a waiting request its blocks (see :meth:`submit`)."""
        for rank in self._ranks:
            rank.send({"op": "alloc", "rid": rid, "hit": hit})

    def poll(self, timeout: float) -> list[RequestResult]:
        """Results of requests every rank has reported on (waits up to ``timeout`` for one)."""
        results: list[RequestResult] = []
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                rank, msg = self._events.get(timeout=max(0.0, remaining) if not results else 0)
            except queue.Empty:
                return results
            done = self._on_event(rank, msg)
            if done is not None:
                results.append(done)

    def _on_event(self, rank: int, msg: dict[str, Any] | None) -> RequestResult | None:
        """One frame from a rank's reader; the request's result once every rank reported."""
        if msg is None:
            raise RankError(f"decode rank {rank} exited unexpectedly")
        event = msg.get("event")
        if event == "stats":
            self._stats[rank] = msg
            return None
        if event != "finished":
            raise RankError(f"decode rank {rank}: {msg.get('error', msg)}")
        return self._record(rank, msg)

    def _record(self, rank: int, msg: dict[str, Any]) -> RequestResult | None:
        rid = msg["rid"]
        req = self._inflight.get(rid)
        if req is None:
            return None
        req.reports[rank] = msg
        if len(req.reports) < len(self._ranks):
            return None
        del self._inflight[rid]
        self._pool.give(req.blocks)
        reports = list(req.reports.values())
        ok = all(r["ok"] for r in reports)
        return RequestResult(
            rid=rid,
            index=req.index,
            ok=ok,
            time_to_kv=max(float(r.get("kv_s", 0.0)) for r in reports),
            wrong_bytes=sum(int(r.get("wrong", 0)) for r in reports),
            checked_bytes=sum(int(r.get("checked", 0)) for r in reports),
            reasons=sorted({str(r.get("reason")) for r in reports if not r["ok"]}),
            invalid_blocks=[g for r in reports if not r["ok"] for g in r.get("invalid", [])],
            blocks=req.blocks,
            details=[str(r.get("detail", "")) for r in reports if not r["ok"]],
        )

    def stats(self, timeout: float = 10.0) -> dict[int, dict[str, Any]]:
        """Every rank's metrics (other events that arrive meanwhile are kept for poll)."""
        self._stats.clear()
        for rank in self._ranks:
            rank.send({"op": "stats"})
        deferred: list[tuple[int, dict[str, Any] | None]] = []
        deadline = time.monotonic() + timeout
        while len(self._stats) < len(self._ranks) and time.monotonic() < deadline:
            try:
                rank_index, msg = self._events.get(timeout=0.1)
            except queue.Empty:
                continue
            if msg is not None and msg.get("event") == "stats":
                self._stats[rank_index] = msg
            else:
                deferred.append((rank_index, msg))
        for item in deferred:
            self._events.put(item)
        return dict(self._stats)

    def close(self) -> None:
        for rank in self._ranks:
            rank.close()
        self._ranks.clear()
        self._listener.close()
