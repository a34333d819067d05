"""The driver: one sans-IO machine, one transport, the side channel, and two threads.

Engine calls (``prefill_finished``, ``add_request``...) feed the machine on the caller's
thread and execute the resulting actions there, so a READ is posted before the call
returns. A background thread polls posted transfers, drains notifications and fires the
machine's timers; handshakes run on a small pool because they block on the network. Every
touch of the machine or the transport happens under one lock, and time is read inside it,
so the machine sees a clock that never runs backwards.

Actions are executed in order; their outcomes become events queued behind the current
one (never re-entering ``handle``), exactly as :mod:`kvwire.machine.actions` prescribes.

Why one module of ~980 lines: it is the one place the sans-IO machine meets threads,
sockets and a transport (the executor of every action and the source of every event), so
its locking can be read in one file.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvwire.config import KVWireConfig
from kvwire.errors import (
    ConfigError,
    DescriptorError,
    HandshakeError,
    HandshakeTimeoutError,
    IncompatiblePeerError,
    KVWireError,
    LocalProtocolError,
    PeerUnreachableError,
    TransportClosedError,
    TransportError,
    UnpreparedTablesError,
    WireDecodeError,
)
from kvwire.layout import (
    PeerLayout,
    TransferPlan,
    check_producer,
    empty_descs,
    topology,
)
from kvwire.layout.geometry import KVGeometry, RemoteGeometry
from kvwire.logs import get_logger
from kvwire.machine import (
    Action,
    ArmTimer,
    CancelTransfer,
    ConsumerMachine,
    Event,
    EvictEngine,
    FreeBlocks,
    HandshakeDone,
    HandshakeFailed,
    LeaseConfirmed,
    NotificationReceived,
    PeerLost,
    PeerMisbehaved,
    PostRead,
    PostWrite,
    ProducerMachine,
    QueryLeases,
    ReleaseFailed,
    ReleaseTransfer,
    RemoteRank,
    RequestDone,
    RequestFailed,
    SendNotification,
    StartHandshake,
    Timer,
    TransferDone,
    TransferFailed,
    TransferPosted,
)
from kvwire.runtime.arguments import geometry_groups
from kvwire.runtime.metrics import Metrics
from kvwire.sidechannel import HandshakeClient, PeerHandshake, fetch_agent_metadata
from kvwire.transport import (
    Descs,
    MemKind,
    PreparesTables,
    Region,
    Transport,
    XferState,
    create,
    failure_detail,
)
from kvwire.wire.handshake import decode_handshake, encode_handshake_payload
from kvwire.wire.schemas import AgentMetadataV13, AgentMetadataV14

if TYPE_CHECKING:
    from kvwire.sidechannel.store import Directory

Outcome = FreeBlocks | RequestDone | RequestFailed
Machine = ProducerMachine | ConsumerMachine


@dataclass
class _PeerRank:
    agent: str
    layout: PeerLayout | None
    blob: bytes = b""
    """The transport metadata the agent was added from: a store record carrying other
    bytes means the peer restarted."""
    prepared: bool = False
    """The transport holds this rank's descriptor tables: requests go by row index."""


@dataclass
class _PeerEngine:
    ranks: dict[RemoteRank, _PeerRank] = field(default_factory=dict)
    stale_agents: set[str] = field(default_factory=set)


@dataclass
class _Xfer:
    xfer_id: int
    request_id: str
    engine_id: str
    handle: object | None
    agent: str
    nbytes: int
    ndescs: int
    posted_at: float
    state: XferState = XferState.PENDING
    awaiting_retry: bool = False


def agent_name(config: KVWireConfig, role: str) -> str:
    """The name a rank's transport agent gets unless the config names it: engine, role,
    ranks and process, and a random tail (a restarted rank is a new peer)."""
    return config.agent_name or (
        f"{config.engine_id}-{role}-pp{config.pp_rank}-tp{config.tp_rank}-{os.getpid()}"
        f"-{uuid.uuid4().hex[:6]}"
    )


def regions_of(geometry: KVGeometry) -> list[Region]:
    """The memory spans a geometry's regions cover, overlapping spans merged.

    K and V views of one tensor are separate regions of the geometry but one registration.
    A region's last block reaches as far as it moves (its extent), not as it advertises.
    """
    spans: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for index, region in enumerate(geometry.regions):
        if region.num_blocks == 0:
            continue
        end = region.base_addr + (region.num_blocks - 1) * region.block_stride + region.extent
        key = (geometry.region_device(index), region.mem_kind)
        spans.setdefault(key, []).append((region.base_addr, end))
    out: list[Region] = []
    for (device, kind), items in spans.items():
        items.sort()
        start, stop = items[0]
        for s, e in items[1:]:
            if s <= stop:
                stop = max(stop, e)
                continue
            out.append(Region(start, stop - start, device, MemKind(kind)))
            start, stop = s, e
        out.append(Region(start, stop - start, device, MemKind(kind)))
    return out


class Driver:
    """Runs one machine against one transport; Producer and Consumer wrap it."""

    def __init__(
        self,
        role: str,
        config: KVWireConfig,
        transport: Transport | str,
        *,
        transport_options: dict[str, object] | None = None,
        on_outcome: Callable[[Outcome], None],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not config.engine_id:
            raise ConfigError("engine_id is not set (pass engine_id=... or set KVWIRE_ENGINE_ID)")
        self.role = role
        self.config = config
        self.metrics = Metrics(role)
        self.log = get_logger(
            "kvwire.runtime",
            engine=config.engine_id,
            role=role,
            rank=f"pp{config.pp_rank}/tp{config.tp_rank}",
            transport=transport if isinstance(transport, str) else type(transport).__name__,
        )
        self._clock = clock
        self._on_outcome = on_outcome
        self._agent_name = agent_name(config, role)
        if isinstance(transport, str):
            self.transport: Transport = create(
                transport, self._agent_name, **(transport_options or {})
            )
            self._owns_transport = True
        else:
            self.transport = transport
            self._owns_transport = False
        self._tables: PreparesTables | None = (
            self.transport if isinstance(self.transport, PreparesTables) else None
        )
        """The transport, when it takes prepared descriptor tables (requests by row index)."""
        self._lock = threading.RLock()
        self._events: collections.deque[Event] = collections.deque()
        self._feeding = False
        self.machine: Machine | None = None
        self.geometry: KVGeometry | None = None
        self.advertise: tuple[str, int] = ("", 0)
        """Where peers reach this rank's side channel (set by :meth:`attach`)."""
        self._registration: object | None = None
        self._engines: dict[str, _PeerEngine] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._num_tokens: dict[str, int] = {}
        self._producer_tokens: dict[str, int] = {}
        """Consumer: the producer's count where it computed past ``_num_tokens``."""
        self._client = HandshakeClient(config.handshake, secret=config.secret)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._asking: set[str] = set()
        """Engines with a lease query in flight (one at a time: a slow peer is not piled on)."""
        self._directory: Directory | None = None
        """The metadata store's view of our peers (``metadata_store``; handshaking side)."""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self.errors: list[str] = []
        """Unexpected errors of the background threads (kept for tests and logs)."""

    # ------------------------------------------------------------------ lifecycle

    def attach(
        self,
        geometry: KVGeometry,
        regions: Sequence[Region] | None = None,
        *,
        advertise: tuple[str, int] = ("", 0),
    ) -> None:
        """Register the KV cache with the transport, build the machine, start the threads.

        ``advertise`` is where this rank's side channel is reached (the listener's real
        address), for the push registrations the machine sends."""
        with self._lock:
            if self._closed:
                raise LocalProtocolError(f"{self.role} is closed")
            if self.machine is not None:
                raise LocalProtocolError("KV caches are already registered")
            cfg = self.config
            if geometry.tp_rank != cfg.tp_rank or geometry.tp_size != cfg.tp_size:
                raise ConfigError(
                    f"geometry is TP rank {geometry.tp_rank}/{geometry.tp_size}, the runtime "
                    f"is {cfg.tp_rank}/{cfg.tp_size}"
                )
            spans = list(regions) if regions is not None else regions_of(geometry)
            self._registration = self.transport.register(spans)
            self.geometry = geometry
            self.advertise = advertise
            self.machine = (
                ProducerMachine(cfg)
                if self.role == "producer"
                else ConsumerMachine(
                    cfg, one_source=geometry.replicated_whole, host=advertise[0], port=advertise[1]
                )
            )
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix=f"kvwire-{self.role}-handshake"
            )
            group = self.store_group()
            if cfg.metadata_store is not None and self.handshakes_here and group is not None:
                from kvwire.sidechannel.store import Directory  # only with a store

                self._directory = Directory(
                    cfg.metadata_store,
                    group,
                    secret=cfg.secret,
                    on_change=self._store_changed,
                    probe_s=max(1.0, cfg.metadata_store_ttl_s / 3),
                ).start()
            self._thread = threading.Thread(
                target=self._run, name=f"kvwire-{self.role}-driver", daemon=True
            )
            self._thread.start()

    @property
    def handshakes_here(self) -> bool:
        """Whether this side starts handshakes (pull: the consumer; push: the producer)."""
        return (self.role == "consumer") == (self.config.mode == "pull")

    @property
    def clock(self) -> Callable[[], float]:
        """The clock deadlines and handshake clock samples are read from."""
        return self._clock

    def store_group(self) -> str | None:
        """The compatibility hash that scopes this rank's keys in the metadata store; None
        when the config has neither factors nor a hash (then the store is not used)."""
        try:
            return self.config.local_hash or self.config.advertised_hash
        except ConfigError:
            return None

    @property
    def directory(self) -> Directory | None:
        return self._directory

    def handshake_payload(self) -> bytes:
        """This rank's encoded handshake answer, as the engine's listener serves it."""
        with self._lock:
            if self.geometry is None:
                raise LocalProtocolError("register the KV caches before serving handshakes")
            cfg = self.config
            md_type = AgentMetadataV14 if cfg.version >= 14 else AgentMetadataV13
            fields = self.geometry.agent_metadata_fields()
            if md_type is AgentMetadataV13:
                fields.pop("ple_block_len", None)  # a v14 field; a v13 peer moves no such page
            md = md_type(
                engine_id=cfg.engine_id, agent_metadata=self.transport.local_metadata(), **fields
            )
            lease = cfg.lease_s if self.role == "producer" and cfg.mode == "pull" else None
            return encode_handshake_payload(
                md, compatibility_hash=cfg.advertised_hash, factors=cfg.compat, lease_s=lease
            )

    def close(self, timeout: float = 10.0) -> None:
        """Stop the threads, cancel what runs, deregister, close what we own."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._directory is not None:
            self._directory.close()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for xfer in list(self._xfers.values()):
                if xfer.handle is not None:
                    try:
                        self.transport.release(xfer.handle)
                    except TransportError as exc:
                        self.log.warning(
                            "release of transfer %d at close failed: %s", xfer.xfer_id, exc,
                            extra={"peer": xfer.engine_id, "request_id": xfer.request_id},
                        )  # fmt: skip
            self._xfers.clear()
            if not self._owns_transport:
                for engine in self._engines.values():
                    for agent in {r.agent for r in engine.ranks.values()} | engine.stale_agents:
                        self._remove_agent(agent)
                if self._registration is not None:
                    try:
                        self.transport.deregister(self._registration)
                    except TransportError as exc:
                        self.log.warning("deregister at close failed: %s", exc)
            self._engines.clear()
            self._registration = None
        self._client.close()
        if self._owns_transport:
            self.transport.close()

    # ------------------------------------------------------------------ feeding

    def feed(self, *events: Event) -> None:
        """Hand events to the machine and execute every action they cause."""
        with self._lock:
            if self._closed:
                raise LocalProtocolError(f"{self.role} is closed")
            self._events.extend(events)
            if self._feeding:
                return
            self._feeding = True
            try:
                self._pump()
            finally:
                self._feeding = False

    def _pump(self) -> None:
        machine = self.machine
        if machine is None:
            self._events.clear()
            raise LocalProtocolError("register the KV caches first")
        while self._events:
            event = self._events.popleft()
            try:
                actions = machine.handle(event, self._clock())
            except LocalProtocolError:
                self._events.clear()
                raise
            for action in actions:
                self._execute(action)

    def request_started(
        self, request_id: str, num_tokens: int | None, producer_tokens: int | None = None
    ) -> None:
        """Start the request's metrics record on the driver's clock (the one its end is
        stamped with) and keep its token counts for planning: where this side's lists end,
        and a consumer's producer's where it computed more (its lists end there)."""
        if num_tokens is not None:
            self._num_tokens[request_id] = num_tokens
        if producer_tokens is not None and producer_tokens != num_tokens:
            self._producer_tokens[request_id] = producer_tokens
        self.metrics.request_started(request_id, self._clock())

    # ------------------------------------------------------------------ actions

    def _execute(self, action: Action) -> None:
        if isinstance(action, (PostRead, PostWrite)):
            self._post(action)
        elif isinstance(action, SendNotification):
            self._send(action)
        elif isinstance(action, (CancelTransfer, ReleaseTransfer)):
            self._release(action.xfer_id, cancelled=isinstance(action, CancelTransfer))
        elif isinstance(action, StartHandshake):
            assert self._pool is not None
            self._pool.submit(self._handshake, action)
        elif isinstance(action, QueryLeases):
            self._ask_leases(action)
        elif isinstance(action, (FreeBlocks, RequestDone, RequestFailed)):
            self._outcome(action)
        elif isinstance(action, EvictEngine):
            self._forget_engine(action.engine_id, evicted=True)
        elif isinstance(action, PeerMisbehaved):
            self.metrics.count("peer_misbehaved")
            self.log.warning(
                "peer %s misbehaved: %s", action.engine_id or "?", action.detail,
                extra={"peer": action.engine_id, "request_id": action.request_id},
            )  # fmt: skip
        elif isinstance(action, ArmTimer):
            pass  # the background thread reads next_deadline() on every turn
        else:  # pragma: no cover - a new action type the driver does not know
            raise LocalProtocolError(f"driver cannot execute {type(action).__name__}")

    def _post(self, action: PostRead | PostWrite) -> None:
        xid = action.xfer_id
        peer = self._engines.get(action.engine_id)
        rank = peer.ranks.get(action.remote_rank) if peer is not None else None
        if rank is None or rank.layout is None:
            self._events.append(TransferFailed(xid, f"no handshake with rank {action.remote_rank}"))
            return
        t0 = self._clock()
        try:
            if isinstance(action, PostWrite) and action.pieces:
                plan = self._plan_pieces(action, rank.layout)
            else:
                plan = rank.layout.plan(
                    action.local_block_ids,
                    action.remote_block_ids,
                    num_tokens=self._num_tokens.get(action.request_id),
                    producer_tokens=self._producer_tokens.get(action.request_id),
                    rows=rank.prepared,
                )
            if plan.local_zero.shape[0]:
                _zero_host_ranges(plan.local_zero)
            if plan.is_empty:
                if action.notification:
                    self.transport.notify(rank.agent, action.notification)
                    self.metrics.count("notifications_sent")
                self._events.extend((TransferPosted(xid), TransferDone(xid)))
                return
            handle, ndescs = self._post_plan(action, rank, plan)
        except KVWireError as exc:
            self._events.append(TransferFailed(xid, f"post failed: {exc}"))
            if isinstance(exc, TransportError) and not isinstance(exc, DescriptorError):
                # The transport refused the peer itself (it died or restarted: NIXL reports
                # REMOTE_DISCONNECT at post). Forget it so the next request handshakes again
                # instead of every request failing against a dead agent.
                self.metrics.count("peers_lost")
                self._events.append(PeerLost(action.engine_id))
                self._forget_engine(action.engine_id, evicted=False)
            return
        now = self._clock()
        nbytes = plan.num_bytes  # sums every row: once
        self._xfers[xid] = _Xfer(
            xid, action.request_id, action.engine_id, handle, rank.agent, nbytes, ndescs, now
        )  # fmt: skip
        self.metrics.transfer_posted(action.request_id, now, nbytes, ndescs, now - t0)
        if self.log.isEnabledFor(logging.INFO):
            self.log.info(
                "%s posted to %s rank %s: %d descriptors, %d bytes",
                "READ" if isinstance(action, PostRead) else "WRITE", action.engine_id,
                action.remote_rank, ndescs, nbytes, extra={"request_id": action.request_id},
            )  # fmt: skip
        self._events.append(TransferPosted(xid))

    def _plan_pieces(self, action: PostWrite, layout: PeerLayout) -> TransferPlan:
        """One streaming round: each rectangle of regions x tokens planned on its own, the
        rows joined into one WRITE."""
        num_tokens = self._num_tokens.get(action.request_id)
        if num_tokens is None:
            raise LocalProtocolError(
                f"request {action.request_id!r} streams without its prompt's length"
            )
        num_regions = len(layout.local.regions)
        plans = [
            layout.plan(
                action.local_block_ids,
                action.remote_block_ids,
                num_tokens=num_tokens,
                regions=(u0, num_regions if u1 < 0 else u1),
                window=(t0, num_tokens if t1 < 0 else t1),
            )
            for u0, u1, t0, t1 in action.pieces
        ]
        if len(plans) == 1:
            return plans[0]
        return TransferPlan(
            np.concatenate([p.local_descs for p in plans]),
            np.concatenate([p.remote_descs for p in plans]),
            empty_descs(),
            empty_descs(),
        )

    def _post_plan(
        self, action: PostRead | PostWrite, rank: _PeerRank, plan: TransferPlan
    ) -> tuple[object, int]:
        """Post by row index into the rank's prepared tables, or the plan's (coalesced)
        rows themselves where merging shrank them to at most half: a few merged spans cost
        less to post than the many table rows they cover. Returns the handle and the
        descriptors handed to the transport."""
        read = isinstance(action, PostRead)
        # A streaming round carries no notification: None, never an empty one (which a
        # transport would deliver, and vLLM's D cannot parse).
        notify = action.notification or None
        rows, remote_rows, tables = plan.local_rows, plan.remote_rows, self._tables
        if (
            rank.prepared
            and tables is not None
            and rows is not None
            and remote_rows is not None
            and plan.num_descs * 2 > rows.size
        ):
            post_rows = tables.read_rows if read else tables.write_rows
            try:
                handle = post_rows(rank.agent, rows, remote_rows, notify)
                return handle, int(rows.size)
            except UnpreparedTablesError:
                rank.prepared = False  # dropped by the transport: post rows until re-prepared
        post = self.transport.read if read else self.transport.write
        handle = post(rank.agent, plan.local_descs, plan.remote_descs, notify)
        return handle, plan.num_descs

    def _send(self, action: SendNotification) -> None:
        peer = self._engines.get(action.engine_id)
        if peer is None:
            self.metrics.count("notifications_dropped")
            return
        ranks = action.ranks or tuple(peer.ranks)
        for key in ranks:
            rank = peer.ranks.get(key)
            if rank is None:
                self.metrics.count("notifications_dropped")
                continue
            try:
                self.transport.notify(rank.agent, action.data)
                self.metrics.count("notifications_sent")
            except TransportError as exc:
                self.metrics.count("notifications_dropped")
                self.log.info(
                    "notification to %s failed: %s", rank.agent, exc,
                    extra={"peer": action.engine_id, "request_id": action.request_id},
                )  # fmt: skip
                if not isinstance(exc, TransportClosedError):
                    # The peer is gone (heartbeats are what notice it first in push mode,
                    # where nothing else is sent to the producer while it writes).
                    self.metrics.count("peers_lost")
                    self._events.append(PeerLost(action.engine_id))
                    self._forget_engine(action.engine_id, evicted=False)
                    return

    def _release(self, xid: int, *, cancelled: bool) -> None:
        xfer = self._xfers.get(xid)
        if xfer is None:
            # Never reached the transport (it failed to post): nothing to release.
            self._events.append(TransferFailed(xid, "cancelled"))
            return
        state = xfer.state
        if xfer.handle is not None:
            try:
                state = self.transport.poll(xfer.handle)
                self.transport.release(xfer.handle)
            except TransportError as exc:
                xfer.awaiting_retry = True
                self._events.append(ReleaseFailed(xid, str(exc)))
                return
        del self._xfers[xid]
        if state is XferState.DONE and not cancelled:
            self._transfer_ended(xfer, ok=True)
            self._events.append(TransferDone(xid))
        else:
            self._transfer_ended(xfer, ok=False)
            self._events.append(TransferFailed(xid, "cancelled" if cancelled else "failed"))

    def _outcome(self, action: Outcome) -> None:
        now = self._clock()
        rid = action.request_id
        self._num_tokens.pop(rid, None)
        self._producer_tokens.pop(rid, None)
        extra = {"request_id": rid}
        if isinstance(action, FreeBlocks):
            self.metrics.request_ended(rid, now, "freed", action.reason.value)
            self.log.info("request freed its blocks (%s)", action.reason.value, extra=extra)
        elif isinstance(action, RequestDone):
            self.metrics.request_ended(rid, now, "done")
            self.log.info("request done", extra=extra)
        else:
            # The engine recomputes a failed request, so nothing else would show it: an
            # operator must see each one, and why, at the default level.
            self.metrics.request_ended(rid, now, "failed", action.reason.value)
            self.log.warning(
                "request failed (%s): %s", action.reason.value, action.detail, extra=extra
            )
        self._on_outcome(action)

    def _transfer_ended(self, xfer: _Xfer, *, ok: bool) -> None:
        self.metrics.transfer_ended(xfer.nbytes, xfer.ndescs, self._clock() - xfer.posted_at, ok)

    # ------------------------------------------------------------------ handshakes

    def _handshake(self, action: StartHandshake) -> None:
        """On the pool: fetch and validate off the lock, then add agents and tell the machine.

        A handshake served from the metadata store is used only if the store still holds
        those very records once the lock is taken: a restart published meanwhile would
        otherwise reach this engine's agent cache after the watch had nothing to drop."""
        cfg = self.config
        t0 = time.perf_counter()
        try:
            ranks = topology.remote_ranks(
                cfg.tp_rank, cfg.tp_size, action.expected_tp_size, action.expected_pp_size
            )
            for _ in range(3):
                result, used = self._fetch_peer(action, ranks)
                self._check_peer_lease(action.engine_id, result)
                layouts = self._peer_layouts(action, result)
                self._check_vllm_consumer(action.engine_id, result, layouts)
                self._check_vllm_pusher(action, result)
                self._check_producer(action, result)
                if not used or self._store_unchanged(action.engine_id, used):
                    break
        except KVWireError as exc:
            kind = (
                "unreachable" if isinstance(exc, PeerUnreachableError)
                else "timeout" if isinstance(exc, HandshakeTimeoutError)
                else "incompatible" if isinstance(exc, IncompatiblePeerError)
                else "error"
            )  # fmt: skip
            self.metrics.handshake(False, time.perf_counter() - t0, kind)
            self.log.warning(
                "handshake with %s failed: %s", action.engine_id, exc,
                extra={"peer": f"{action.host}:{action.port}"},
            )  # fmt: skip
            self._feed_quietly(HandshakeFailed(action.engine_id, action.attempt, str(exc)))
            return
        try:
            with self._lock:
                if self._closed:
                    return
                if used and not self._store_unchanged(action.engine_id, used):
                    raise HandshakeError(f"{action.engine_id} republished during the handshake")
                peer = self._engines.setdefault(action.engine_id, _PeerEngine())
                old_agents = {r.agent for r in peer.ranks.values()}
                for key, layout in layouts.items():
                    blob = result.metadata[key].agent_metadata
                    peer.ranks[key] = _PeerRank(self.transport.add_peer(blob), layout, blob)
                    self._prepare_tables(peer.ranks[key])
                peer.stale_agents |= old_agents - {r.agent for r in peer.ranks.values()}
                self._retire_stale(peer)
                self.metrics.handshake(True, time.perf_counter() - t0)
                self.feed(
                    HandshakeDone(
                        action.engine_id,
                        action.attempt,
                        remote_tp_size=action.expected_tp_size,
                        remote_pp_size=action.expected_pp_size,
                        clock_offset=result.clock_offset,
                        peer_features=result.features,
                        clock_uncertainty=result.best_rtt / 2,
                    )
                )
        except KVWireError as exc:
            self.metrics.handshake(False, time.perf_counter() - t0, "transport")
            self._feed_quietly(HandshakeFailed(action.engine_id, action.attempt, str(exc)))

    def _prepare_tables(self, rank: _PeerRank) -> None:
        """Hand a transport that prepares descriptor lists (``PreparesTables``) every row
        requests with this rank can post, once per handshake; it then makes each request
        by index. A hint: if it fails, requests post their rows as before."""
        if rank.layout is None or self._tables is None:
            return
        assert self.geometry is not None
        tables = rank.layout.tables(geometry_groups(self.geometry) or 1)
        if tables is None:
            return
        try:
            self._tables.prepare(rank.agent, *tables)
        except KVWireError as exc:
            self.metrics.count("tables_not_prepared")
            self.log.info("tables for %s not prepared: %s", rank.agent, exc)
            return
        rank.prepared = True
        self.metrics.count("tables_prepared")

    def _check_peer_lease(self, engine_id: str, result: PeerHandshake) -> None:
        """A producer whose lease no READ fits in (every one would start inside our expiry
        margin and be declined) is refused here, naming both knobs, not request by request."""
        margin = self.config.expiry_margin
        if result.lease_s is not None and result.lease_s <= margin:
            raise IncompatiblePeerError(
                f"engine {engine_id!r} holds blocks for lease_s {result.lease_s:g}, not above "
                f"our expiry_margin_s {margin:g}: every READ would start inside the margin and "
                "be declined (lower expiry_margin_s here, or raise lease_s there)"
            )

    def _check_vllm_consumer(
        self,
        engine_id: str,
        result: PeerHandshake,
        layouts: Mapping[RemoteRank, PeerLayout | None],
    ) -> None:
        """A vLLM consumer (its ranks announce no kvwire features) that a producer writes to
        rearranges what lands in blocks of another size by its own rule, written for a
        vLLM producer's placement, not kvwire's final one: vLLM 0.31.0's consumer then
        stops on an index error. So a push producer refuses such a consumer here, naming
        both block sizes, before any write; the consumer's own watchdog ends its side."""
        if result.features or self.role != "producer" or self.config.mode != "push":
            return
        assert self.geometry is not None
        ours = self.geometry.block_size
        for layout in layouts.values():
            if layout is not None and layout.remote.block_size != ours:
                raise IncompatiblePeerError(
                    f"engine {engine_id!r} is a vLLM NixlConnector consumer (it announces no "
                    f"kvwire features) with blocks of {layout.remote.block_size} tokens, and "
                    f"this producer's hold {ours}: vLLM's consumer rearranges pushed blocks of "
                    "another size by its own rule, which kvwire's writes do not follow; give "
                    "both engines one block size"
                )

    def _check_vllm_pusher(self, action: StartHandshake, result: PeerHandshake) -> None:
        """A vLLM producer (its ranks announce no kvwire features) pushing into blocks of
        another size places them by its own rule, not by kvwire's token placement: measured
        with vLLM 0.31.0's push connector (64-token blocks into 32-token ones), the request
        ended done with most of its bytes wrong. A push consumer, which handshakes the
        producer to register with it, refuses such a producer here, naming both block
        sizes, before any write, and fails the request (the engine computes it)."""
        if result.features or self.role != "consumer" or self.config.mode != "push":
            return
        assert self.geometry is not None
        ours = self.geometry.block_size
        for rank, md in result.metadata.items():
            remote = _remote_geometry(action, rank, md)
            if remote.block_size != ours:
                raise IncompatiblePeerError(
                    f"engine {action.engine_id!r} is a vLLM NixlConnector producer (it "
                    f"announces no kvwire features) with blocks of {remote.block_size} "
                    f"tokens, and this consumer's hold {ours}: vLLM's push producer writes "
                    "only into blocks of its own size; give both engines one block size"
                )

    def _check_producer(self, action: StartHandshake, result: PeerHandshake) -> None:
        """A push consumer posts nothing, so no plan of its own checks the producer's
        geometry: a kvwire producer's plan does, but a vLLM producer writes by its own
        rules whatever it pairs with, into pairings kvwire may not describe (rows of
        another TP size, which kvwire moves whole). So this consumer checks every producer
        rank (``check_producer``) and refuses, by name, before it registers any block."""
        if self.role != "consumer" or self.config.mode != "push":
            return
        assert self.geometry is not None
        for rank, md in result.metadata.items():
            check_producer(self.geometry, _remote_geometry(action, rank, md))

    def _fetch_peer(
        self, action: StartHandshake, ranks: Sequence[RemoteRank]
    ) -> tuple[PeerHandshake, dict[RemoteRank, bytes]]:
        """The peer's metadata from the store when it has it (with the payloads used), else
        over ZMQ (with none)."""
        found = self._store_handshake(action.engine_id, ranks)
        if found is not None:
            return found
        cfg = self.config
        result = fetch_agent_metadata(
            self._client,
            action.host,
            action.port,
            ranks,
            local_hash=cfg.local_hash,
            expected_engine_id=action.engine_id,
            version=cfg.version,
            local_factors=cfg.compat,
        )
        return result, {}

    def _peer_layouts(
        self, action: StartHandshake, result: PeerHandshake
    ) -> dict[RemoteRank, PeerLayout | None]:
        """Each remote rank's descriptor plan (None on the side that does not post)."""
        cfg = self.config
        layouts: dict[RemoteRank, PeerLayout | None] = {}
        assert self.geometry is not None
        for rank, md in result.metadata.items():
            layout = None
            if self.handshakes_here:
                remote = _remote_geometry(action, rank, md)
                layout = PeerLayout(self.geometry, remote, mode=cfg.mode, coalesce=cfg.coalesce)
            layouts[rank] = layout
        return layouts

    def _store_unchanged(self, engine_id: str, used: dict[RemoteRank, bytes]) -> bool:
        return self._directory is not None and self._directory.unchanged(engine_id, used)

    def _store_handshake(
        self, engine_id: str, ranks: Sequence[RemoteRank]
    ) -> tuple[PeerHandshake, dict[RemoteRank, bytes]] | None:
        """The handshake from the metadata store's cache and the payloads it used; None: go
        over ZMQ (no store, the store unreachable, or the peer not published: a vLLM peer,
        a peer without one)."""
        if self._directory is None:
            return None
        cfg = self.config
        found = self._directory.handshake(
            engine_id,
            ranks,
            local_hash=cfg.local_hash,
            version=cfg.version,
            local_factors=cfg.compat,
            clock=self._clock,
        )
        self.metrics.count("store_handshakes" if found is not None else "store_fallbacks")
        return found

    def _store_changed(self, engine_id: str, rank: RemoteRank, payload: bytes | None) -> None:
        """The store says a peer rank vanished or now serves other metadata: drop the
        engine's agents now, so no request reads from them; the next one handshakes anew.
        A record carrying the very agent we hold (republished after an etcd outage) is
        no change."""
        with self._lock:
            peer = self._engines.get(engine_id)
            held = peer.ranks.get(rank) if peer is not None else None
            if self._closed or held is None:
                return
            if payload is not None:
                try:
                    md = decode_handshake(payload, local_hash=None, version=self.config.version)
                    if md.agent_metadata == held.blob:
                        return
                except WireDecodeError:
                    pass
            self.metrics.count("store_peers_dropped")
            self.log.info(
                "metadata store: %s rank %s %s; dropping its agents", engine_id, rank,
                "restarted" if payload is not None else "is gone",
                extra={"peer": engine_id},
            )  # fmt: skip
            self._feed_quietly(PeerLost(engine_id))
            self._forget_engine(engine_id, evicted=False)

    def peer_agents(self, engine_id: str) -> dict[RemoteRank, str]:
        """The transport agents this rank holds for a peer engine (empty: none cached)."""
        with self._lock:
            peer = self._engines.get(engine_id)
            return {k: r.agent for k, r in peer.ranks.items()} if peer is not None else {}

    def _feed_quietly(self, *events: Event) -> None:
        try:
            self.feed(*events)
        except LocalProtocolError as exc:
            if not self._closed:
                name = type(events[0]).__name__
                self.errors.append(f"{name}: {exc}")
                self.log.error("machine refused %s: %s", name, exc)

    # ------------------------------------------------------------------ lease queries

    def lease_deadlines(self, request_ids: Sequence[str]) -> list[float | None]:
        """Producer: the deadline each request's lease runs to, in this driver's clock (the
        one the listener's clock replies sample), or None when its blocks are not held
        under a lease. What the listener answers a ``lease-query`` with."""
        with self._lock:
            machine = self.machine
            if not isinstance(machine, ProducerMachine):
                return [None] * len(request_ids)
            return [machine.lease_deadline(rid) for rid in request_ids]

    def _ask_leases(self, action: QueryLeases) -> None:
        """Consumer: put the query on the pool, unless one to that engine is still out or
        the side channel is authenticated (the query is not, so its answers would be
        evidence anyone on the path could forge)."""
        if self.config.secret is not None or action.engine_id in self._asking:
            self.metrics.count("lease_queries_skipped")
            return
        assert self._pool is not None
        self._asking.add(action.engine_id)
        self._pool.submit(self._query_leases, action)

    def _query_leases(self, action: QueryLeases) -> None:
        """On the pool: ask every rank the reads come from; a request's lease is the
        earliest any of them holds (None if one holds none). No answer, no event."""
        try:
            per_rank = [
                self._client.query_leases(action.host, action.port, rank, action.remote_request_ids)
                for rank in action.ranks
            ]
        except KVWireError as exc:
            self.metrics.count("lease_queries_failed")
            self.log.info(
                "lease query to %s failed: %s", action.engine_id, exc,
                extra={"peer": f"{action.host}:{action.port}"},
            )  # fmt: skip
            return
        finally:
            with self._lock:
                self._asking.discard(action.engine_id)
        self.metrics.count("lease_queries")
        events: list[Event] = []
        for i, rid in enumerate(action.request_ids):
            held = [answer[i] for answer in per_rank]
            deadline = None if None in held else min(d for d in held if d is not None)
            events.append(LeaseConfirmed(rid, deadline))
        with self._lock:
            if not self._closed:
                self._feed_quietly(*events)

    def _retire_stale(self, peer: _PeerEngine) -> None:
        busy = {x.agent for x in self._xfers.values()}
        for agent in list(peer.stale_agents):
            if agent not in busy:
                self._remove_agent(agent)
                peer.stale_agents.discard(agent)

    def _remove_agent(self, agent: str) -> None:
        try:
            self.transport.remove_peer(agent)
        except TransportError as exc:
            self.log.debug("remove_peer(%s): %s", agent, exc, extra={"peer": agent})

    def _forget_engine(self, engine_id: str, *, evicted: bool) -> None:
        peer = self._engines.get(engine_id)
        if peer is None:
            return
        peer.stale_agents |= {r.agent for r in peer.ranks.values()}
        peer.ranks.clear()
        self._retire_stale(peer)
        if evicted and not peer.stale_agents:
            del self._engines[engine_id]

    # ------------------------------------------------------------------ background thread

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._turn()
            except Exception as exc:  # keep serving; record what went wrong
                self.errors.append(f"{type(exc).__name__}: {exc}")
                self.log.exception("kvwire %s driver turn failed", self.role)
                self._stop.wait(self.config.poll_interval_s)
                continue
            with self._lock:
                machine = self.machine
                deadline = machine.next_deadline() if machine is not None else None
                busy = bool(self._xfers)
            wait = self.config.poll_interval_s
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - self._clock()))
            if busy:
                wait = min(wait, 0.002)
            try:
                self.transport.wait(wait)
            except TransportError:
                self._stop.wait(wait)

    def _turn(self) -> None:
        with self._lock:
            if self._closed or self.machine is None:
                return
            events: list[Event] = []
            lost: set[str] = set()
            for xfer in list(self._xfers.values()):
                if xfer.awaiting_retry or xfer.handle is None:
                    continue
                state = self.transport.poll(xfer.handle)
                if state is XferState.PENDING:
                    continue
                xfer.state = state
                reason = "failed"
                if state is XferState.FAILED:
                    detail = failure_detail(self.transport, xfer.handle)
                    reason = f"transfer failed: {detail}" if detail else "transfer failed"
                    lost.add(xfer.engine_id)
                try:
                    self.transport.release(xfer.handle)
                except TransportError as exc:
                    xfer.awaiting_retry = True
                    events.append(ReleaseFailed(xfer.xfer_id, str(exc)))
                    continue
                del self._xfers[xfer.xfer_id]
                ok = state is XferState.DONE
                self._transfer_ended(xfer, ok=ok)
                events.append(
                    TransferDone(xfer.xfer_id) if ok else TransferFailed(xfer.xfer_id, reason)
                )
            for engine_id in lost:
                # A failed transfer usually means the peer died or restarted: forget its
                # agents so the next request handshakes again instead of failing forever.
                self.metrics.count("peers_lost")
                events.append(PeerLost(engine_id))
            for sender, data in self.transport.drain_notifications():
                self.metrics.count("notifications_received")
                events.append(NotificationReceived(sender, data))
            deadline = self.machine.next_deadline()
            if deadline is not None and deadline <= self._clock():
                events.append(Timer())
            if events:
                self.feed(*events)
            for engine_id in lost:
                self._forget_engine(engine_id, evicted=False)


def _remote_geometry(
    action: StartHandshake, rank: RemoteRank, md: AgentMetadataV13 | AgentMetadataV14
) -> RemoteGeometry:
    """A remote rank's geometry, from the metadata its handshake answered."""
    pp, tp = rank
    return RemoteGeometry.from_agent_metadata(
        md,
        tp_rank=tp,
        tp_size=action.expected_tp_size,
        pp_rank=pp,
        pp_size=action.expected_pp_size,
    )


def _zero_host_ranges(ranges: Descs) -> None:
    """Zero the consumer bytes a transfer leaves unwritten (host memory; one call per
    range, and ranges exist only with heterogeneous block sizes)."""
    rows = np.asarray(ranges, dtype=np.int64)
    for addr, length in zip(rows[:, 0].tolist(), rows[:, 1].tolist(), strict=True):
        ctypes.memset(addr, 0, length)
