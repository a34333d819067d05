"""The ``ucx`` transport: kvwire's block-move interface on UCP's one-sided RMA API.

One agent owns one UCP context and one worker. Registered regions are ``ucp_mem_map``-ed and
their packed rkeys travel in the metadata blob with the worker address; ``add_peer`` creates
an endpoint (see ``error_handling``) and unpacks the peer's rkeys. A READ is one
``ucp_get_nbx`` per coalesced descriptor row, a WRITE one ``ucp_put_nbx``, then one
``ucp_ep_flush_nbx``: the transfer is DONE when that flush completes, and only then is its
notification sent, as an active message on the same endpoint, so it cannot overtake its data.
With the C helper ``_native`` built, one call posts every row and, for a READ, progresses
the worker until the gets completed or a short deadline passed (then the flush takes over),
so no Python runs per row and a small READ is DONE when ``read`` returns.

Progress: a background thread sleeps in ``poll(2)`` on the worker's event fd, armed with
``ucp_worker_arm``; it wakes only when UCX has something to do (a completion, an incoming
notification, a peer's wire-up or get request on TCP), progresses the worker, and sleeps
again. Nothing spins, and a target never has to call into kvwire for an initiator's transfer
to finish. ``poll`` also progresses once when it finds a transfer still pending, so a caller
that polls sees completions without a thread hand-off.

Why one module of ~700 lines: one adapter class over one UCP worker and its endpoints,
whose progress, request table and peer error handling act on the same worker state; the
binding is ``_ucp`` and the descriptor tables ``tables``.
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvwire.errors import (
    ConfigError,
    DescriptorError,
    RegistrationError,
    TransportClosedError,
    TransportError,
    UnknownPeerError,
)
from kvwire.transport import (
    Capabilities,
    Descs,
    MemKind,
    Region,
    XferState,
    as_descs,
    as_message,
    check_pair,
    descs_key,
)
from kvwire_ucx import _ucp
from kvwire_ucx import metadata as meta_codec
from kvwire_ucx._native_load import NATIVE
from kvwire_ucx.tables import RegionTable, coalesce
from kvwire_ucx.watch import ProcessWatch

NOTIFY_AM_ID = 0x4B56
"""Active-message id of kvwire notifications (arbitrary, fixed: both sides must agree)."""

_ERROR_MODES = ("auto", "peer", "none")
_SMALL = 4
"""Transfers of at most this many rows skip numpy: a numpy call costs more than the work."""
_READ_WAIT_NS = 10_000_000
"""How long ``read`` progresses the worker for its gets (C helper only) before leaving the
rest to a flush. Over CMA, UCX copies a get's bytes inside progress, not inside
``ucp_get_nbx``, so somebody's thread does the copy either way: doing it in the call saves
the hand-over to the progress thread and the flush (measured at 256 x 64 KiB: 0.78x of the
raw loop when ``read`` stopped after 50 us). 10 ms covers READs up to some 30 MiB here; a
larger one returns after 10 ms and completes through the flush as before."""
_PEER_LOST = frozenset(
    {"UCS_ERR_CONNECTION_RESET", "UCS_ERR_UNREACHABLE", "UCS_ERR_ENDPOINT_TIMEOUT"}
)
"""Flush failures that mean the peer is gone (how ``error_handling="none"`` learns it)."""


_U64 = (1 << 64) - 1

_Rows = tuple[Any, Any, Any, Any, Any]
"""Local addresses, lengths, remote addresses, rkeys, request params: lists or arrays."""


def _descs(descs: Any) -> Descs:
    """:func:`kvwire.transport.as_descs` with a cheap path for arrays already in shape."""
    if (
        isinstance(descs, np.ndarray)
        and descs.dtype == np.int64
        and descs.ndim == 2
        and descs.shape[1] == 3
        and descs.flags.c_contiguous
    ):
        if descs.shape[0] <= _SMALL:
            if any(v < 0 for row in descs.tolist() for v in row[:2]):
                return as_descs(descs)  # raises the standard DescriptorError
            return descs
        if descs[:, 0].min() >= 0 and descs[:, 1].min() >= 0:  # 5x faster than a 2-D slice
            return descs
    return as_descs(descs)


@dataclass(eq=False)
class UcxTransfer:
    """A posted READ or WRITE; the handle ``read``/``write`` return."""

    owner: int
    peer: str
    notify: bytes | None
    state: XferState = XferState.PENDING
    status: str | None = None
    released: bool = False


@dataclass(eq=False)
class _Registration:
    """What ``register`` returns: the regions and their UCX memory handles."""

    owner: int
    regions: tuple[Region, ...]
    handles: list[_ucp.MemHandle]
    rkeys: list[bytes]
    active: bool = True


@dataclass(eq=False)
class _Peer:
    name: str
    token: int
    worker_address: bytes
    endpoint: _ucp.Endpoint
    peer_errors: bool
    rkeys: list[int] = field(default_factory=list)
    table: RegionTable = field(default_factory=RegionTable.empty)
    plans: dict[tuple[bytes, bytes], _Rows] = field(default_factory=dict)
    """Planned rows of recent transfers to this peer, by :func:`descs_key`. They name this
    peer's unpacked rkeys and our memory handles, so they are dropped whenever either
    changes (``add_peer``, ``register``, ``deregister``) and go with the peer."""
    failed: str | None = None
    watch: ProcessWatch | None = None
    """Same-host peers without UCX peer error handling: their process, watched by pidfd."""

    def check_alive(self) -> bool:
        """False (and the peer marked failed) once a watched peer process has exited."""
        if self.failed is not None:
            return False
        if self.watch is not None and not self.watch.alive():
            self.failed = "UCS_ERR_CONNECTION_RESET"
            return False
        return True


class UcxTransport:
    """One kvwire agent on raw UCP. ``UcxTransport(name, **options)``.

    Options:

    * ``error_handling``: ``"auto"`` (default), ``"peer"`` or ``"none"``. ``"peer"`` creates
      endpoints with ``UCP_ERR_HANDLING_MODE_PEER`` and an error callback: a dead or
      unreachable peer fails its transfers. UCX 1.22 then refuses shared memory and CMA
      (their error handling is only ``ep_check``) and moves even same-host data over TCP,
      about 7x slower here. ``"auto"`` uses ``"peer"`` for peers on other machines and
      ``"none"`` for peers on this kernel (same boot id), where a killed peer still
      surfaces as ``UCS_ERR_CONNECTION_RESET`` from CMA within a millisecond (measured),
      which fails the transfer and marks the peer failed.
    * ``progress``: ``"thread"`` (default; the event-fd thread described in the module
      docstring) or ``"caller"`` (no thread; ``poll``/``wait`` progress, and ``wait``
      sleeps on the event fd itself; the caller must then also drive an idle target).
    * ``config``: ``{"TLS": "tcp,self", ...}``, UCX settings without the ``UCX_`` prefix,
      applied over the ``UCX_*`` environment (``UCX_TLS``, ``UCX_NET_DEVICES``, ...).
    * ``plan_cache``: how many planned transfers (of up to 1024 descriptors) to keep per
      peer, so the same descriptors moving again skip validation and planning (default
      256; 0: off). The small-READ latency path, like the NIXL adapter's kept requests.
    """

    def __init__(
        self,
        name: str,
        *,
        error_handling: str = "auto",
        progress: str = "thread",
        config: dict[str, str] | None = None,
        plan_cache: int = 256,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise ConfigError(f"unknown ucx transport options: {', '.join(sorted(unknown))}")
        if not name:
            raise ConfigError("a ucx agent needs a non-empty name")
        if error_handling not in _ERROR_MODES:
            raise ConfigError(
                f"error_handling must be one of {_ERROR_MODES}, got {error_handling!r}"
            )
        if progress not in ("thread", "caller"):
            raise ConfigError(f"progress must be 'thread' or 'caller', got {progress!r}")
        if isinstance(plan_cache, bool) or not isinstance(plan_cache, int) or plan_cache < 0:
            raise ConfigError(f"plan_cache must be a count >= 0, got {plan_cache!r}")
        self._plans_kept = plan_cache
        self._name = name
        self._header = name.encode()
        self._error_handling = error_handling
        self._host_id = meta_codec.local_host_id()
        lib = _ucp.load_library()
        self._context = _ucp.Context(lib, name=name, config=config)
        try:
            self._worker = _ucp.Worker(self._context, name=name, am_id=NOTIFY_AM_ID)
        except BaseException:
            self._context.close()
            raise
        if len(self._header) > self._worker.max_am_header:
            self._worker.destroy()
            self._context.close()
            raise ConfigError(f"agent name longer than UCX's {self._worker.max_am_header} bytes")
        self._lock = threading.Lock()
        self._activity = threading.Condition(self._lock)
        self._events = 0
        self._events_seen = 0
        self._closed = False
        self._registrations: list[_Registration] = []
        self._local = RegionTable.empty()
        self._peers: dict[str, _Peer] = {}
        self._peer_by_token: dict[int, _Peer] = {}
        self._inflight: dict[int, UcxTransfer] = {}
        self._notifications: list[tuple[str, bytes]] = []
        self._efd = self._worker.event_fd()
        self._stop = False
        self._thread: threading.Thread | None = None
        if progress == "thread":
            self._thread = threading.Thread(
                target=self._progress_loop, name=f"kvwire-ucx-{name}", daemon=True
            )
            self._thread.start()

    # -- Transport protocol: identity -----------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def capabilities(self) -> Capabilities:
        kinds = {MemKind.DRAM}
        if self._context.supports_cuda:
            kinds.add(MemKind.VRAM)
        return Capabilities(mem_kinds=frozenset(kinds), cross_host=True)

    @property
    def ucx_version(self) -> str:
        return self._context.lib.version

    # -- registration ----------------------------------------------------------------------

    def register(self, regions: Sequence[Region]) -> object:
        regions = tuple(regions)
        with self._lock:
            self._check_open()
            handles: list[_ucp.MemHandle] = []
            rkeys: list[bytes] = []
            try:
                for region in regions:
                    if not isinstance(region, Region):
                        raise RegistrationError(f"expected a Region, got {type(region).__name__}")
                    cuda = region.kind is MemKind.VRAM
                    if cuda and not self._context.supports_cuda:
                        raise RegistrationError(
                            "VRAM region but this UCX has no CUDA memory support here"
                        )
                    handle = self._context.mem_map(region.addr, region.length, cuda=cuda)
                    handles.append(handle)
                    rkeys.append(handle.pack_rkey())
            except BaseException:
                for handle in handles:
                    handle.unmap()
                raise
            registration = _Registration(id(self), regions, handles, rkeys)
            self._registrations.append(registration)
            self._rebuild_local()
            return registration

    def deregister(self, handle: object) -> None:
        with self._lock:
            self._check_open()
            if not isinstance(handle, _Registration) or handle.owner != id(self):
                raise RegistrationError("not a registration handle of this ucx agent")
            if not handle.active:
                raise RegistrationError("registration handle already deregistered")
            handle.active = False
            self._registrations.remove(handle)
            self._rebuild_local()
            for memh in handle.handles:
                memh.unmap()

    def _rebuild_local(self) -> None:
        for peer in self._peers.values():
            peer.plans.clear()  # they name memory handles that may be gone
        handles = [h for r in self._registrations for h in r.handles]
        self._local = RegionTable(
            np.array([h.address for h in handles], dtype=np.int64),
            np.array([h.length for h in handles], dtype=np.int64),
            np.array([h.param_address for h in handles], dtype=np.int64),
        )

    def local_metadata(self) -> bytes:
        with self._lock:
            self._check_open()
            regions = [
                meta_codec.RegionInfo(r.addr, r.length, r.device_id, r.kind.value, rkey)
                for reg in self._registrations
                for r, rkey in zip(reg.regions, reg.rkeys, strict=True)
            ]
            return meta_codec.encode(
                meta_codec.UcxMetadata(
                    name=self._name,
                    worker_address=self._worker.address,
                    regions=regions,
                    ucx_version=self._context.lib.version,
                    host_id=self._host_id,
                    pid=os.getpid(),
                    start_time=meta_codec.process_start_time(os.getpid()),
                )
            )

    # -- peers ------------------------------------------------------------------------------

    def add_peer(self, blob: bytes) -> str:
        meta = meta_codec.decode(blob)
        with self._lock:
            self._check_open()
            peer = self._peers.get(meta.name)
            if peer is not None and (peer.worker_address != meta.worker_address or peer.failed):
                self._drop_peer(peer)
                peer = None
            if peer is None:
                token = self._worker.token()
                watch = None
                if self._error_handling != "peer" and meta.host_id == self._host_id:
                    watch = ProcessWatch.open(meta.pid, meta.start_time)
                peer_errors = self._error_handling == "peer" or (
                    self._error_handling == "auto" and watch is None
                )
                endpoint = self._worker.connect(
                    meta.worker_address,
                    token=token,
                    peer_errors=peer_errors,
                    name=meta.name,
                )
                peer = _Peer(meta.name, token, meta.worker_address, endpoint, peer_errors)
                peer.watch = watch
                self._peers[meta.name] = peer
                self._peer_by_token[token] = peer
            try:
                rkeys = [peer.endpoint.unpack_rkey(r.rkey) for r in meta.regions]
            except TransportError:
                self._drop_peer(peer)
                raise
            peer.plans.clear()  # they name the rkeys destroyed next
            for old in peer.rkeys:
                peer.endpoint.destroy_rkey(old)
            peer.rkeys = rkeys
            peer.table = RegionTable(
                np.array([r.addr for r in meta.regions], dtype=np.int64),
                np.array([r.length for r in meta.regions], dtype=np.int64),
                np.array(rkeys, dtype=np.uint64).view(np.int64),
            )
            return meta.name

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            self._check_open()
            self._drop_peer(self._peer(peer))

    def _peer(self, name: str) -> _Peer:
        try:
            return self._peers[name]
        except KeyError:
            raise UnknownPeerError(f"ucx: no peer named {name!r}") from None

    def _drop_peer(self, peer: _Peer) -> None:
        """Forget a peer: its rkeys, then its endpoint; its running transfers fail."""
        self._peers.pop(peer.name, None)
        self._peer_by_token.pop(peer.token, None)
        peer.plans.clear()
        for rkey in peer.rkeys:
            peer.endpoint.destroy_rkey(rkey)
        peer.rkeys = []
        if peer.watch is not None:
            peer.watch.close()
        force = peer.peer_errors or peer.failed is not None
        peer.endpoint.close(self._worker.progress, force=force)
        for token, xfer in list(self._inflight.items()):
            if xfer.peer == peer.name:
                del self._inflight[token]
                self._settle(xfer, XferState.FAILED, "peer removed")
        self._absorb()

    # -- transfers --------------------------------------------------------------------------

    def read(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        return self._post(False, peer, local, remote, notify)

    def write(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        return self._post(True, peer, local, remote, notify)

    def _post(
        self, write: bool, peer_name: str, local: Descs, remote: Descs, notify: bytes | None
    ) -> UcxTransfer:
        key = descs_key(local, remote) if self._plans_kept else None
        if notify is not None:
            notify = as_message(notify)
        with self._lock:
            self._check_open()
            peer = self._peer(peer_name)
            rows = None if key is None else peer.plans.get(key)
            if rows is None:
                rows = self._plan(peer, local, remote)
                if key is not None:
                    self._keep(peer, key, rows)
            xfer = UcxTransfer(id(self), peer.name, notify)
            if peer.failed is not None:  # (whether it lived through the copy: _complete)
                self._settle(xfer, XferState.FAILED, peer.failed)
                return xfer
            try:
                if NATIVE is None:
                    running = peer.endpoint.post_rma(write, *rows)
                else:  # posts and progresses in C; a READ usually ends inside the call
                    wait_ns = 0 if write else _READ_WAIT_NS
                    running = peer.endpoint.post_rma_native(write, *rows, wait_ns=wait_ns)
                if running == 0 and not write:
                    # Every get finished inside its call: the bytes are here already.
                    self._complete(xfer, _ucp.UCS_OK)
                    return xfer
                token, status = peer.endpoint.flush()
            except TransportError as exc:
                self._settle(xfer, XferState.FAILED, exc.status or str(exc))
                self._note_lost(peer, exc.status)
                return xfer
            if status is None:
                self._inflight[token] = xfer
            else:
                self._complete(xfer, status)
            return xfer

    def _plan(self, peer: _Peer, local: Descs, remote: Descs) -> _Rows:
        """Validate a transfer's descriptors and turn them into rows to post."""
        local = _descs(local)
        remote = _descs(remote)
        if local.shape[0] <= _SMALL and local.shape == remote.shape:
            return self._plan_few(peer, local.tolist(), remote.tolist())
        return self._plan_many(peer, local, remote)

    def _keep(self, peer: _Peer, key: tuple[bytes, bytes], rows: _Rows) -> None:
        """Keep a transfer's planned rows for re-posting, the oldest going first."""
        plans = peer.plans
        plans[key] = rows
        if len(plans) > self._plans_kept:
            del plans[next(iter(plans))]

    def _plan_few(
        self, peer: _Peer, local: list[list[int]], remote: list[list[int]]
    ) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """Rows to post for a transfer of a few descriptors, in plain Python."""
        la: list[int] = []
        ln: list[int] = []
        ra: list[int] = []
        rk: list[int] = []
        params: list[int] = []
        for row, ((laddr, llen, _), (raddr, rlen, _)) in enumerate(zip(local, remote, strict=True)):
            if llen != rlen:
                raise DescriptorError(
                    f"descriptor {row}: local length {llen} != remote length {rlen}"
                )
            if llen == 0:
                continue
            li = self._local.find(laddr, llen, side="local", row=row)
            ri = peer.table.find(raddr, llen, side="remote", row=row)
            la.append(laddr)
            ln.append(llen)
            ra.append(raddr)
            rk.append(peer.table.value_list[ri] & _U64)
            params.append(self._local.value_list[li])
        return la, ln, ra, rk, params

    def _plan_many(self, peer: _Peer, local: Descs, remote: Descs) -> _Rows:
        """Rows to post for a large transfer: vectorised lookup and coalescing; int64
        arrays for the C helper, lists for the ctypes loop."""
        check_pair(local, remote)
        if local.shape[0] and not (local[:, 1] > 0).all():
            keep = local[:, 1] > 0
            local, remote = local[keep], remote[keep]
        lengths = np.ascontiguousarray(local[:, 1])
        local_idx = self._local.locate(local[:, 0], lengths, side="local")
        remote_idx = peer.table.locate(remote[:, 0], lengths, side="remote")
        la, ra, ln, li, ri = coalesce(
            np.ascontiguousarray(local[:, 0]),
            np.ascontiguousarray(remote[:, 0]),
            lengths,
            local_idx,
            remote_idx,
        )
        columns = (la, ln, ra, peer.table.values[ri], self._local.values[li])
        if NATIVE is not None:  # the C helper reads int64 arrays directly
            la, ln, ra, rk, pa = (np.ascontiguousarray(c, dtype=np.int64) for c in columns)
            return la, ln, ra, rk, pa
        la, ln, ra, rk, pa = columns
        return la.tolist(), ln.tolist(), ra.tolist(), rk.view(np.uint64).tolist(), pa.tolist()

    def _note_lost(self, peer: _Peer, status: str | None) -> None:
        """A failure that means the peer is gone marks it failed (needed without PEER mode)."""
        if status in _PEER_LOST and peer.failed is None:
            peer.failed = status
            self._events += 1

    def poll(self, handle: object) -> XferState:
        xfer = self._transfer(handle)
        if xfer.state is XferState.PENDING:
            with self._lock:
                self._check_open()
                self._progress_locked()
        return xfer.state

    def release(self, handle: object) -> None:
        xfer = self._transfer(handle)
        with self._lock:
            if xfer.released:
                raise TransportError("ucx transfer handle already released")
            # A running transfer is detached: its flush still completes inside UCX, but
            # nobody is told and no notification goes out.
            xfer.released = True

    def _transfer(self, handle: object) -> UcxTransfer:
        if not isinstance(handle, UcxTransfer) or handle.owner != id(self):
            raise TransportError("not a transfer handle of this ucx agent")
        if self._closed:
            raise TransportClosedError("ucx transport is closed")
        if handle.released:
            raise TransportError("ucx transfer handle was released")
        return handle

    def _complete(self, xfer: UcxTransfer, status: int) -> None:
        """The flush of ``xfer`` finished with ``status``: notify the peer, then settle."""
        peer = self._peers.get(xfer.peer)
        if status == _ucp.UCS_OK and peer is not None and not peer.check_alive():
            # Without UCX peer error handling a copy from a dead process can "complete"
            # with no data; the pidfd says whether the peer lived through the whole flush.
            status = _ucp.UCS_ERR_CONNECTION_RESET
        if status != _ucp.UCS_OK:
            name = _ucp.status_name(status)
            self._settle(xfer, XferState.FAILED, name)
            if peer is not None:
                self._note_lost(peer, name)
            return
        if xfer.notify is not None and not xfer.released:
            if peer is None or peer.failed is not None:
                self._settle(xfer, XferState.FAILED, "peer gone before the notification")
                return
            _, sent = peer.endpoint.send_am(self._header, xfer.notify)
            if sent is not None and sent != _ucp.UCS_OK:
                self._settle(xfer, XferState.FAILED, _ucp.status_name(sent))
                return
        self._settle(xfer, XferState.DONE, None)

    def _settle(self, xfer: UcxTransfer, state: XferState, status: str | None) -> None:
        xfer.status = status
        xfer.state = state
        self._events += 1

    # -- notifications ----------------------------------------------------------------------

    def notify(self, peer: str, message: bytes) -> None:
        body = as_message(message)
        with self._lock:
            self._check_open()
            target = self._peer(peer)
            if not target.check_alive():
                raise TransportError(
                    f"ucx peer {peer!r} failed ({target.failed})", status=target.failed
                )
            _, status = target.endpoint.send_am(self._header, body)
            if status is not None:
                _ucp.check(self._context.lib, status, f"notification to {peer!r}")

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        with self._lock:
            self._check_open()
            self._progress_locked()
            out, self._notifications = self._notifications, []
            return out

    # -- progress ---------------------------------------------------------------------------

    def wait(self, timeout: float) -> None:
        with self._lock:
            self._check_open()
            self._progress_locked()
            if self._events == self._events_seen and timeout > 0:
                if self._thread is not None:
                    self._activity.wait(timeout)
                else:
                    self._sleep_on_efd(timeout)
            self._events_seen = self._events

    def _sleep_on_efd(self, timeout: float) -> None:
        """Without a progress thread: arm the worker and sleep on its fd (lock held)."""
        if self._worker.arm():
            poller = select.poll()
            poller.register(self._efd, select.POLLIN)
            self._lock.release()
            try:
                poller.poll(timeout * 1000.0)
            finally:
                self._lock.acquire()
        self._progress_locked()

    def _progress_loop(self) -> None:
        """The progress thread: progress, arm, sleep on the event fd; never spins."""
        poller = select.poll()
        poller.register(self._efd, select.POLLIN)
        while True:
            with self._lock:
                if self._stop:
                    return
                self._progress_locked()
                armed = self._worker.arm()
            if armed:
                # The timeout is a safety net only; UCX signals the fd on every event.
                poller.poll(1000.0)

    def _progress_locked(self) -> None:
        self._worker.progress_all()
        self._absorb()

    def _absorb(self) -> None:
        """Turn what the worker's callbacks recorded into transfer states and messages."""
        worker = self._worker
        before = self._events
        if worker.failed_endpoints:
            failed, worker.failed_endpoints = worker.failed_endpoints, []
            for token, status in failed:
                peer = self._peer_by_token.get(token)
                if peer is not None and peer.failed is None:
                    peer.failed = _ucp.status_name(status)
                    self._events += 1
        if worker.completions:
            done, worker.completions = worker.completions, []
            for completion in done:
                xfer = self._inflight.pop(completion.token, None)
                if xfer is not None:
                    self._complete(xfer, completion.status)
        if worker.messages:
            messages, worker.messages = worker.messages, []
            for header, body in messages:
                self._notifications.append((header.decode("utf-8", "replace"), body))
            self._events += 1
        if self._events != before:
            self._activity.notify_all()

    # -- lifetime ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosedError("ucx transport is closed")

    def close(self) -> None:
        """Stop the progress thread, close endpoints, unmap memory, destroy the worker."""
        if getattr(self, "_closed", True):
            return
        thread = self._thread
        with self._lock:
            self._stop = True
            self._worker.signal()
        if thread is not None:
            thread.join()
        with self._lock:
            if self._closed:
                return
            try:
                for peer in list(self._peers.values()):
                    self._drop_peer(peer)
                for registration in self._registrations:
                    registration.active = False
                    for memh in registration.handles:
                        memh.unmap()
                self._registrations.clear()
                self._local = RegionTable.empty()
                for xfer in self._inflight.values():
                    self._settle(xfer, XferState.FAILED, "transport closed")
                self._inflight.clear()
            finally:
                self._closed = True
                self._worker.destroy()
                self._context.close()
                self._activity.notify_all()

    def __enter__(self) -> UcxTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._peers)} peers"
        return f"UcxTransport({self._name!r}, {state})"
