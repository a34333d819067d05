"""The kvwire transport interface over one NIXL agent.

Design choices, each measured on nixl-cu12 1.5.1 (see docs/transports.md, NIXL section):

* **Requests**: a transfer is created with NIXL's plain ``initialize_xfer`` after merging
  adjacent descriptors in numpy (NIXL's plain path does not merge). A caller that prepared
  a peer's tables (:meth:`NixlTransport.prepare`: every row a pairing can post, taken once
  per peer with ``prep_xfer_dlist``) makes a request from index arrays instead
  (:meth:`NixlTransport.read_rows`, ``make_prepped_xfer``): no descriptor list is built or
  checked per transfer. The runtime does so for scattered blocks; contiguous runs still
  go as a few merged rows.
  A finished request of a small descriptor set is kept on ``release`` and re-posted when
  the very same descriptors move again, which is what NIXL's own fast path is (one
  ``transfer`` call): kvwire's 4 KiB READ then costs what raw NIXL's does.
* **Progress**: NIXL's progress thread is off; a light kvwire thread progresses the agent
  with backoff (``_progress.ProgressThread``), and ``poll`` / ``wait`` /
  ``drain_notifications`` progress inline. UCX runs with ``ucx_error_handling_mode=none``
  so an initiator never waits for an idle target.
* **Errors**: NIXL's exceptions become kvwire ``TransportError`` subclasses with NIXL's
  status name in ``.status``; a failed transfer is a FAILED state, never dropped.

All calls into the agent hold one lock, so the progress thread and the caller never run
inside NIXL at the same time (the agent is created without NIXL's own locking).

Why one module of ~950 lines: it is one adapter class over one NIXL agent, whose request
cache, notification pump and error mapping all act on the same agent state under one
lock; descriptor preparation lives in ``_descs``.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvwire.errors import (
    ConfigError,
    DescriptorError,
    PeerMetadataError,
    RegistrationError,
    TransferFailedError,
    TransportClosedError,
    TransportError,
    TransportUnavailableError,
    UnknownPeerError,
    UnpreparedTablesError,
)
from kvwire.layout import coalesce
from kvwire.transport import (
    Capabilities,
    Descs,
    MemKind,
    Region,
    XferState,
    as_descs,
    as_message,
    descs_key,
    region_of_array,
    region_of_tensor,
)
from kvwire_nixl._descs import prepare
from kvwire_nixl._errors import is_status, status_of, translate
from kvwire_nixl._loader import load_nixl
from kvwire_nixl._options import NixlOptions, parse_options
from kvwire_nixl._progress import ProgressThread
from kvwire_nixl._tables import Prepared, release_lists, rows_of

_NOT_FOUND = "NIXL_ERR_NOT_FOUND"
_PENDING = XferState.PENDING
_DONE = XferState.DONE
_NETWORK_BACKENDS = frozenset({"UCX", "LIBFABRIC", "UCCL", "GPUNETIO", "MOONCAKE"})


class _Request:
    """One NIXL request and what kvwire needs to post it again: made once, then kept
    (in the cache) between the transfers that re-post it. A transfer owns it while live."""

    __slots__ = ("empty_notif", "key", "nixl", "peer", "prepared", "status")

    def __init__(
        self, nixl: Any, key: tuple[Any, ...] | None, peer: str, prepared: Prepared | None = None
    ) -> None:
        self.nixl = nixl  # None for an empty transfer
        self.key = key  # the cache key; None: never re-posted
        self.peer = peer
        self.prepared = prepared  # the tables it was made from (kept alive while it lives)
        self.status: str | None = None  # NIXL's status name once it failed
        self.empty_notif = False  # an empty notification is owed after DONE


class NixlXfer:
    """A posted transfer; opaque to callers, who pass it back to poll / release.

    One post of a :class:`_Request`. Built without ``__init__`` on the hot path (two slot
    writes), and dead once released (``owner`` is None) even while its request lives on.
    """

    __slots__ = ("__weakref__", "owner", "request", "state")  # weakref: the suite's leak check

    owner: NixlTransport | None
    request: _Request
    state: XferState

    def __repr__(self) -> str:
        state = getattr(self, "state", XferState.PENDING)
        return f"<NixlXfer to {self.request.peer!r} {state.name}>"


_new_xfer = object.__new__


class NixlRegistration:
    """Memory registered with :meth:`NixlTransport.register`."""

    __slots__ = ("lists", "owner", "regions")

    def __init__(self, owner: NixlTransport, regions: list[Region], lists: list[Any]):
        self.owner = owner
        self.regions = regions
        self.lists = lists  # NIXL registration lists, one per memory kind


class NixlTransport:
    """One NIXL agent as a kvwire transport: ``NixlTransport(name, **options)``.

    Options (all optional): ``backend`` (a NIXL plugin name, default ``"UCX"``),
    ``backend_options`` (the plugin's init parameters; UCX defaults to
    ``{"ucx_error_handling_mode": "none"}``), ``progress`` (``"thread"`` | ``"inline"`` |
    ``"nixl"``), ``progress_min_us`` / ``progress_max_us`` (the progress thread's backoff
    range), ``spin_us`` (how long ``wait`` polls before it sleeps), ``telemetry`` (NIXL's
    per-transfer telemetry, read with :meth:`telemetry`), ``cache_size`` (finished
    requests kept for re-posting; 0 disables).
    """

    def __init__(self, name: str, **options: Any) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a NIXL agent needs a non-empty name, got {name!r}")
        self._opts: NixlOptions = parse_options(options)
        self._cache_size = self._opts.cache_size
        self._cache_on = self._cache_size > 0
        api, bindings = load_nixl()
        self._bindings = bindings
        self._name = name
        self._lock = threading.Lock()
        self._agent: Any = self._create_agent(api, name, self._opts)
        self._bind_post()
        self._peers: set[str] = set()
        self._registrations: list[NixlRegistration] = []
        self._vram_spans: list[tuple[int, int]] = []
        self._remote_kind: dict[tuple[str, str], str] = {}
        self._cache: dict[tuple[Any, ...], _Request] = {}  # finished, kept for re-posting
        self._prepared: dict[str, Prepared] = {}  # per peer: the tables prepare() took
        self._retired: set[Prepared] = set()  # dropped tables some request still uses
        self._inflight: set[NixlXfer] = set()
        self._requests: set[_Request] = set()  # every request not yet freed: close() frees them
        self._zombies: list[Any] = []  # requests NIXL refused to release yet
        self._inbox: collections.deque[tuple[str, bytes]] = collections.deque()
        self._activity = threading.Event()
        self._last_progress = 0.0
        self._closed = False
        self._capabilities: Capabilities | None = None
        self._created = self._posts = self._post_errors = self._failed = 0
        self._made_prepared = 0
        self._sent = self._received = 0
        self._spin_s = self._opts.spin_us * 1e-6
        self._min_s = self._opts.progress_min_us * 1e-6
        self._max_s = self._opts.progress_max_us * 1e-6
        self._thread: ProgressThread | None = None
        if self._opts.progress == "thread":
            self._thread = ProgressThread(
                name,
                self._background_progress,
                lambda: self._last_progress,
                min_s=self._min_s,
                max_s=self._max_s,
                posts=lambda: self._posts,
            )
            self._thread.start()

    @staticmethod
    def _create_agent(api: Any, name: str, opts: NixlOptions) -> Any:
        config = api.nixl_agent_config(
            enable_prog_thread=opts.progress == "nixl",
            backends=[],
            capture_telemetry=opts.telemetry,
        )
        try:
            agent = api.nixl_agent(name, config)
        except Exception as exc:
            raise translate(exc, TransportUnavailableError, "creating a NIXL agent") from exc
        plugins = list(agent.get_plugin_list())
        if opts.backend not in plugins:
            raise TransportUnavailableError(
                f"NIXL has no plugin {opts.backend!r} here (available: {', '.join(plugins)})"
            )
        try:
            agent.create_backend(opts.backend, opts.effective_backend_options)
        except Exception as exc:
            raise translate(
                exc, TransportUnavailableError, f"starting NIXL backend {opts.backend}"
            ) from exc
        return agent

    # -- identity ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def backend(self) -> str:
        return self._opts.backend

    @property
    def capabilities(self) -> Capabilities:
        if self._capabilities is None:
            kinds = set()
            if self._backend_takes("DRAM"):
                kinds.add(MemKind.DRAM)
            if self._backend_takes("VRAM") and cuda_device_present():
                kinds.add(MemKind.VRAM)
            self._capabilities = Capabilities(
                mem_kinds=frozenset(kinds),
                cross_host=self._opts.backend in _NETWORK_BACKENDS,
                ordered_notifications=self._ordered_notifications(),
            )
        return self._capabilities

    def _ordered_notifications(self) -> bool:
        """UCX with one worker sends every notification to a peer on one endpoint, in
        order (a transfer's after its data); more workers may overtake each other."""
        workers = self._opts.effective_backend_options.get("num_workers", "1")
        return self._opts.backend == "UCX" and workers.strip() == "1"

    def _backend_takes(self, kind: str) -> bool:
        if self._agent is None:
            return kind == "DRAM"
        with self._lock:
            types = self._agent.get_backend_mem_types(self._opts.backend)
        return f"{kind}_SEG" in types

    # -- memory -----------------------------------------------------------------------

    def register(self, regions: Sequence[Region | Any]) -> NixlRegistration:
        """Register regions (``Region``s; numpy arrays and torch tensors are converted)."""
        agent = self._open_agent()
        items = [_as_region(r) for r in regions]
        by_kind: dict[MemKind, list[tuple[int, int, int, str]]] = {}
        for region in items:
            if region.kind not in self.capabilities.mem_kinds:
                raise RegistrationError(
                    f"cannot register {region.kind.value} memory: this agent moves only "
                    f"{sorted(k.value for k in self.capabilities.mem_kinds)}"
                )
            by_kind.setdefault(region.kind, []).append(
                (region.addr, region.length, region.device_id, "")
            )
        lists: list[Any] = []
        with self._lock:
            try:
                for kind, rows in by_kind.items():
                    lists.append(agent.register_memory(rows, kind.value))
            except Exception as exc:
                for done in lists:  # best effort: the registration already failed
                    with contextlib.suppress(Exception):
                        agent.deregister_memory(done)
                raise translate(exc, RegistrationError, "registering memory with NIXL") from exc
        handle = NixlRegistration(self, items, lists)
        self._registrations.append(handle)
        self._rebuild_spans()
        with self._lock:
            self._retire_all()  # prepared tables were checked against the old registrations
        return handle

    def deregister(self, handle: object) -> None:
        agent = self._open_agent()
        if not isinstance(handle, NixlRegistration) or handle.owner is not self:
            raise RegistrationError("not a registration of this agent")
        if handle not in self._registrations:
            raise RegistrationError("this registration was already deregistered")
        self._registrations.remove(handle)
        self._rebuild_spans()
        with self._lock:
            self._clear_cache()  # kept requests may point into the memory
            self._retire_all()  # and prepared tables may list it
            try:
                for reg_list in handle.lists:
                    agent.deregister_memory(reg_list)
            except Exception as exc:
                raise translate(exc, RegistrationError, "deregistering memory") from exc

    def _rebuild_spans(self) -> None:
        self._vram_spans = [
            (r.addr, r.addr + r.length)
            for reg in self._registrations
            for r in reg.regions
            if r.kind is MemKind.VRAM
        ]

    def _local_kind(self, local: Descs) -> str:
        if self._vram_spans:
            addr = int(local[0, 0])
            for start, end in self._vram_spans:
                if start <= addr < end:
                    return "VRAM"
        return "DRAM"

    # -- peers ------------------------------------------------------------------------

    def local_metadata(self) -> bytes:
        """NIXL's own agent metadata blob (what vLLM sends), covering every registration."""
        agent = self._open_agent()
        with self._lock:
            try:
                return bytes(agent.get_agent_metadata())
            except Exception as exc:
                raise translate(exc, TransportError, "reading the agent metadata") from exc

    def add_peer(self, blob: bytes) -> str:
        """Load (or refresh) a peer from its metadata blob; returns the peer's agent name."""
        agent = self._open_agent()
        if not isinstance(blob, (bytes, bytearray, memoryview)) or not len(blob):
            raise PeerMetadataError(f"peer metadata must be non-empty bytes, got {type(blob)}")
        with self._lock:
            try:
                raw = agent.add_remote_agent(bytes(blob))
            except Exception as exc:
                raise translate(exc, PeerMetadataError, self._load_context()) from exc
            peer = raw.decode() if isinstance(raw, bytes) else str(raw)
            self._drop_cached(peer)  # its regions may have changed
        self._peers.add(peer)
        return peer

    def _load_context(self) -> str:
        """What a failed peer load says; names the likeliest cause when it applies."""
        mode = self._opts.effective_backend_options.get("ucx_error_handling_mode")
        if mode != "none":
            return "loading peer metadata"
        # Measured against vLLM 0.31.0 (make interop): UCX cannot connect a 'none' agent
        # and a 'peer' one both ways, which push mode needs; the failure is a bare
        # "failed to create ep" from UCX.
        return (
            "loading peer metadata (this agent runs UCX with ucx_error_handling_mode=none; "
            "a vLLM engine's agents use peer error handling, and the two cannot connect "
            "both ways as push mode needs: create the transport with "
            "backend_options={'ucx_error_handling_mode': 'peer'})"
        )

    def remove_peer(self, peer: str) -> None:
        agent = self._open_agent()
        if peer not in self._peers:
            raise UnknownPeerError(f"no peer named {peer!r}")
        self._peers.discard(peer)
        with self._lock:
            self._drop_cached(peer)
            try:
                agent.remove_remote_agent(peer)
            except Exception as exc:
                raise translate(exc, UnknownPeerError, f"removing peer {peer!r}") from exc

    @property
    def peers(self) -> frozenset[str]:
        return frozenset(self._peers)

    # -- prepared tables --------------------------------------------------------------

    def prepare(self, peer: str, local: Descs, remote: Descs) -> None:
        """Prepare the tables of every row transfers with ``peer`` may post (this agent's
        rows and the peer's: ``kvwire.layout.PeerLayout.tables``) with NIXL, once; then
        :meth:`read_rows` / :meth:`write_rows` make a request from index arrays.

        Replaces the peer's earlier tables. They are dropped when the peer is added again
        or removed and when a local registration changes, so no request is ever made from
        lists checked against memory that has since changed (:class:`UnpreparedTablesError`
        instead).
        """
        agent = self._open_agent()
        if peer not in self._peers:
            raise UnknownPeerError(f"no peer named {peer!r}; add it with add_peer first")
        loc, rem = as_descs(local), as_descs(remote)
        local_kind = self._local_kind(loc) if loc.shape[0] else "DRAM"
        preferred = self._remote_kind.get((peer, local_kind), local_kind)
        with self._lock:
            self._retire(peer)
            if not loc.shape[0] or not rem.shape[0]:
                return
            lists: list[Any] = []
            try:
                lists.append(agent.prep_xfer_dlist("NIXL_INIT_AGENT", loc, local_kind))
                for remote_kind in (preferred, "VRAM" if preferred == "DRAM" else "DRAM"):
                    try:
                        lists.append(agent.prep_xfer_dlist(peer, rem, remote_kind))
                        break
                    except Exception as exc:
                        if not is_status(exc, _NOT_FOUND) or remote_kind != preferred:
                            raise
            except Exception as exc:
                for made in lists:
                    with contextlib.suppress(Exception):
                        made.release()
                raise translate(
                    exc, DescriptorError, f"preparing {rem.shape[0]} rows of {peer!r}"
                ) from exc
            self._prepared[peer] = Prepared(lists[0], loc.shape[0], lists[1], rem.shape[0])

    def read_rows(
        self, peer: str, local_rows: Any, remote_rows: Any, notify: bytes | None = None
    ) -> NixlXfer:
        """A READ of the prepared tables' rows ``remote_rows`` into ``local_rows``."""
        return self._post_rows("READ", peer, local_rows, remote_rows, notify)

    def write_rows(
        self, peer: str, local_rows: Any, remote_rows: Any, notify: bytes | None = None
    ) -> NixlXfer:
        """A WRITE of the prepared tables' rows ``local_rows`` into ``remote_rows``."""
        return self._post_rows("WRITE", peer, local_rows, remote_rows, notify)

    def _post_rows(
        self, op: str, peer: str, local_rows: Any, remote_rows: Any, notify: bytes | None
    ) -> NixlXfer:
        self._open_agent()
        prepared = self._prepared.get(peer)
        if prepared is None:
            raise UnpreparedTablesError(f"no prepared tables for {peer!r} (dropped or never made)")
        loc = rows_of(local_rows, prepared.local_rows, "local")
        rem = rows_of(remote_rows, prepared.remote_rows, "remote")
        if loc.shape != rem.shape:
            raise DescriptorError(f"{loc.size} local rows but {rem.size} remote rows")
        message = b"" if notify is None else as_message(notify)
        if not loc.size:
            return self._empty_transfer(peer, None if notify is None else message)
        with self._lock:
            if prepared.stale:  # dropped since the lookup above
                raise UnpreparedTablesError(f"the tables for {peer!r} were just dropped")
            try:
                nixl = self._agent.make_prepped_xfer(
                    op, prepared.local_list, loc, prepared.remote_list, rem, message
                )
            except Exception as exc:
                raise translate(
                    exc, _post_error(exc), f"making a {op} of {loc.size} rows with {peer!r}"
                ) from exc
            prepared.users += 1
        self._created += 1
        self._made_prepared += 1
        request = _Request(nixl, None, peer, prepared)
        self._requests.add(request)
        return self._launch(op, peer, request, message, notify is not None and not message)

    def _retire(self, peer: str) -> None:
        """Drop a peer's prepared tables (lock held); NIXL's lists go once unused."""
        prepared = self._prepared.pop(peer, None)
        if prepared is not None:
            prepared.stale = True
            if prepared.users:
                self._retired.add(prepared)  # released when its last request goes
            else:
                release_lists(prepared)

    def _retire_all(self) -> None:
        for peer in list(self._prepared):
            self._retire(peer)

    # -- transfers --------------------------------------------------------------------

    def read(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> NixlXfer:
        return self._post("READ", peer, local, remote, notify)

    def write(
        self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None
    ) -> NixlXfer:
        return self._post("WRITE", peer, local, remote, notify)

    def _post(self, op: str, peer: str, local: object, remote: object, notify: object) -> NixlXfer:
        """Post a transfer, re-posting a kept request when the same descriptors move again.

        The kept-request path is the small-transfer latency path (a 4 KiB READ is about
        1 us of NIXL), so it does only what it must: one key lookup, a two-slot handle, the
        post under the lock. It skips the peer check (a kept request's peer is known: the
        cache drops a peer's requests when it goes) and descriptor validation (the key is
        the exact bytes of arrays that were validated when the request was made).
        """
        if notify is None:
            message = b""
            owes_empty = False
        else:
            message = as_message(notify)
            owes_empty = not message  # NIXL cannot attach b"": it is sent after DONE
        request = None
        key = None
        if self._cache_on:
            small = descs_key(local, remote)
            if small is not None:
                key = (op, peer, not message, small)
                request = self._cache.pop(key, None)
        if request is None:
            request = self._new_request(op, peer, local, remote, message, key)
            if request is None:
                return self._empty_transfer(peer, None if notify is None else message)
        return self._launch(op, peer, request, message, owes_empty)

    def _launch(
        self, op: str, peer: str, request: _Request, message: bytes, owes_empty: bool
    ) -> NixlXfer:
        """Post a made request under a fresh handle."""
        if owes_empty:
            request.empty_notif = True
        xfer = _new_xfer(NixlXfer)
        xfer.owner = self
        xfer.request = request
        lock = self._lock
        lock.acquire()
        try:
            if self._closed:
                self._free(request)
                raise TransportClosedError(f"NIXL agent {self._name!r} is closed")
            self._posts += 1
            core = self._core_post
            try:
                if core is not None:
                    posted = core(request.nixl._handle, message)
                else:
                    posted = self._agent.transfer(request.nixl, message)
            except Exception as exc:
                self._post_errors += 1
                self._free(request)
                raise translate(exc, TransferFailedError, f"posting a {op} to {peer!r}") from exc
            if posted == self._success:
                xfer.state = _DONE
                if request.empty_notif:
                    self._finish(xfer)
            elif posted == self._in_progress:
                xfer.state = _PENDING
                self._inflight.add(xfer)
            else:
                self._fail(xfer, "NIXL_ERR_BACKEND")
        finally:
            lock.release()
        return xfer

    def _new_request(
        self,
        op: str,
        peer: str,
        local: object,
        remote: object,
        message: bytes,
        key: tuple[Any, ...] | None,
    ) -> _Request | None:
        """A fresh NIXL request for validated, merged descriptors (None: nothing to move)."""
        self._open_agent()
        if peer not in self._peers:
            raise UnknownPeerError(f"no peer named {peer!r}; add it with add_peer first")
        loc, rem = prepare(local, remote)
        if loc.shape[0] == 0:
            return None
        nixl = self._create_request(op, peer, *coalesce(loc, rem), message)
        self._created += 1
        request = _Request(nixl, key, peer)
        self._requests.add(request)
        return request

    def _bind_post(self) -> None:
        """Post through the binding's ``postXferReq`` when it is there: the same call
        ``nixl_agent.transfer`` makes, minus its string mapping (0.2 us of a 1.2 us post)."""
        core = getattr(self._agent, "agent", None)
        post = getattr(core, "postXferReq", None)
        success = getattr(self._bindings, "NIXL_SUCCESS", None)
        in_progress = getattr(self._bindings, "NIXL_IN_PROG", None)
        self._core_post: Any = None
        self._success: Any = "DONE"
        self._in_progress: Any = "PROC"
        if post is not None and success is not None and in_progress is not None:
            self._core_post, self._success, self._in_progress = post, success, in_progress

    def _create_request(self, op: str, peer: str, loc: Descs, rem: Descs, message: bytes) -> Any:
        agent = self._agent
        local_kind = self._local_kind(loc)
        preferred = self._remote_kind.get((peer, local_kind), local_kind)
        other = "VRAM" if preferred == "DRAM" else "DRAM"
        failure: BaseException | None = None
        with self._lock:
            local_list = agent.get_xfer_descs(loc, local_kind)
            for remote_kind in (preferred, other):
                try:
                    request = agent.initialize_xfer(
                        op, local_list, agent.get_xfer_descs(rem, remote_kind), peer, message
                    )
                except Exception as exc:
                    if failure is None:
                        failure = exc
                    if is_status(exc, _NOT_FOUND):
                        continue  # maybe the peer's memory is of the other kind
                    break
                self._remote_kind[(peer, local_kind)] = remote_kind
                return request
        assert failure is not None
        cls = _post_error(failure)
        raise translate(
            failure, cls, f"creating a {op} of {loc.shape[0]} descriptor(s) with {peer!r}"
        ) from failure

    def _empty_transfer(self, peer: str, notify: bytes | None) -> NixlXfer:
        xfer = _new_xfer(NixlXfer)
        xfer.owner = self
        xfer.request = _Request(None, None, peer)
        xfer.state = XferState.DONE
        if notify is not None:
            self.notify(peer, notify)  # nothing to land first
        return xfer

    def poll(self, handle: object) -> XferState:
        if type(handle) is NixlXfer and handle.owner is self and not self._closed:
            state = handle.state  # the common case, checked inline: the latency path
            if state is not _PENDING:
                return state
        xfer = self._own(handle)
        if xfer.state is _PENDING:
            with self._lock:
                self._refresh(xfer)
        return xfer.state

    def _refresh(self, xfer: NixlXfer) -> None:
        """Ask NIXL for a pending transfer's state (lock held); checking progresses it."""
        try:
            state = self._agent.check_xfer_state(xfer.request.nixl)
        except Exception as exc:
            self._fail(xfer, status_of(exc) or f"{type(exc).__name__}: {exc}")
            return
        self._last_progress = time.monotonic()
        if state == "DONE":
            self._finish(xfer)
        elif state != "PROC":
            self._fail(xfer, "NIXL_ERR_BACKEND")

    def _finish(self, xfer: NixlXfer) -> None:
        xfer.state = XferState.DONE
        self._inflight.discard(xfer)
        request = xfer.request
        if request.empty_notif:
            request.empty_notif = False
            try:
                self._agent.send_notif(request.peer, b"")
            except Exception as exc:
                self._fail(xfer, status_of(exc) or str(exc))

    def _fail(self, xfer: NixlXfer, status: str) -> None:
        xfer.state = XferState.FAILED
        request = xfer.request
        request.status = status
        request.key = None  # never re-post a request that failed
        request.empty_notif = False
        self._inflight.discard(xfer)
        self._failed += 1

    def release(self, handle: object) -> None:
        """Forget a transfer: abort it if running; keep a finished small request for reuse."""
        if type(handle) is NixlXfer and handle.owner is self and not self._closed:
            xfer = handle  # checked inline: the latency path
        else:
            xfer = self._own(handle)
        xfer.owner = None
        request = xfer.request
        if xfer.state is _DONE:
            key = request.key
            if key is not None:
                cache = self._cache
                cache[key] = request
                if len(cache) > self._cache_size:
                    self._evict_oldest()
                return
        with self._lock:
            self._inflight.discard(xfer)
            self._free(request)

    def _evict_oldest(self) -> None:
        oldest = next(iter(self._cache))
        with self._lock:
            self._free(self._cache.pop(oldest))

    def _free(self, request: _Request) -> None:
        """Give a request back to NIXL (lock held); one NIXL refuses is retried later."""
        self._requests.discard(request)
        released = request.nixl is None or self._release_request(request.nixl)
        prepared = request.prepared
        if prepared is not None and released:  # a zombie keeps its lists to the end (close)
            request.prepared = None
            prepared.users -= 1
            if prepared.stale and not prepared.users:
                self._retired.discard(prepared)
                release_lists(prepared)

    def _release_request(self, request: Any) -> bool:
        try:
            request.release()
        except Exception:
            self._zombies.append(request)  # still running and not abortable: retry later
            return False
        return True

    def _own(self, handle: object) -> NixlXfer:
        if self._closed:
            raise TransportClosedError(f"NIXL agent {self._name!r} is closed")
        if not isinstance(handle, NixlXfer) or handle.owner is not self:
            raise TransportError("not a live transfer of this agent (released already?)")
        return handle

    def failure_reason(self, handle: object) -> str:
        """NIXL's status name for a FAILED transfer ('' while it has not failed)."""
        xfer = self._own(handle)
        return xfer.request.status or ""

    def telemetry(self, handle: object) -> dict[str, int] | None:
        """NIXL's record of one transfer (times in microseconds), or None without
        ``telemetry=True`` or before NIXL has one."""
        xfer = self._own(handle)
        if xfer.request.nixl is None or not self._opts.telemetry:
            return None
        with self._lock:
            try:
                record = self._agent.get_xfer_telemetry(xfer.request.nixl)
            except Exception:
                return None
        return {
            "start_us": int(record.startTime),
            "post_us": int(record.postDuration),
            "xfer_us": int(record.xferDuration),
            "bytes": int(record.totalBytes),
            "descriptors": int(record.descCount),
        }

    def stats(self) -> dict[str, int]:
        """Counters since creation: requests created / reused, posts, failures,
        notifications, the progress thread's rounds; and the NIXL requests that exist now
        (``requests_live``: kept for reuse plus those unreleased handles hold)."""
        out = {
            "requests_created": self._created,
            "requests_reused": self._posts - self._created,
            "posted": self._posts - self._post_errors,
            "failed": self._failed,
            "notifications_sent": self._sent,
            "notifications_received": self._received,
        }
        out["requests_prepared"] = self._made_prepared  # of requests_created: made by index
        out["peers_prepared"] = len(self._prepared)
        out["requests_kept"] = len(self._cache)
        out["requests_live"] = len(self._requests)  # kept, or held by unreleased handles
        out["in_flight"] = len(self._inflight)
        if self._thread is not None:
            out["progress_rounds"] = self._thread.rounds
            out["progress_skipped"] = self._thread.skipped
        return out

    # -- notifications and progress ---------------------------------------------------

    def notify(self, peer: str, message: bytes) -> None:
        agent = self._open_agent()
        if peer not in self._peers:
            raise UnknownPeerError(f"no peer named {peer!r}; add it with add_peer first")
        body = as_message(message)
        with self._lock:
            try:
                agent.send_notif(peer, body)
            except Exception as exc:
                cls = UnknownPeerError if is_status(exc, _NOT_FOUND) else TransferFailedError
                raise translate(exc, cls, f"notifying {peer!r}") from exc
        self._sent += 1

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        self._open_agent()
        with self._lock:
            self._progress_locked()
            out = list(self._inbox)
            self._inbox.clear()
        self._received += len(out)
        return out

    def wait(self, timeout: float) -> None:
        """Progress until a transfer ends or a notification arrives, or ``timeout`` passes:
        polling for ``spin_us`` (transfers here finish inside progress calls), then
        sleeping with doubling pauses, woken early by the progress thread."""
        self._open_agent()
        now = time.monotonic()
        deadline = now + max(timeout, 0.0)
        self._activity.clear()
        if self._step() or timeout <= 0:
            return
        spin_end = min(deadline, now + self._spin_s)
        while time.monotonic() < spin_end:
            if self._step():
                return
        pause = self._min_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            if self._activity.wait(min(pause, remaining)) or self._step():
                return
            pause = min(pause * 2, self._max_s)

    def _step(self) -> bool:
        """One round of inline progress; True when something happened for the caller."""
        with self._lock:
            if self._agent is None:
                return True
            changed = self._progress_locked()
            for xfer in list(self._inflight):
                self._refresh(xfer)
                changed = changed or xfer.state is not XferState.PENDING
        return changed or bool(self._inbox)

    def _progress_locked(self) -> bool:
        """Move the agent once (lock held): fetch notifications into the inbox."""
        try:
            fresh = self._agent.get_new_notifs()
        except Exception as exc:
            raise translate(exc, TransportError, "progressing the NIXL agent") from exc
        self._last_progress = time.monotonic()
        got = False
        for peer, messages in fresh.items():
            sender = peer.decode() if isinstance(peer, bytes) else str(peer)
            for message in messages:
                self._inbox.append((sender, bytes(message)))
                got = True
        if self._zombies:
            self._retry_zombies()
        return got

    def _retry_zombies(self) -> None:
        pending, self._zombies = self._zombies, []
        for request in pending:
            self._release_request(request)

    def _background_progress(self) -> bool:
        with self._lock:
            if self._agent is None or self._closed:
                return False
            got = self._progress_locked()
        if got:
            self._activity.set()
        return got

    # -- teardown ---------------------------------------------------------------------

    def close(self) -> None:
        """Abort what runs, give back every registration and peer, stop the thread, and
        drop the agent (NIXL frees its workers, threads and sockets with it)."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._thread.stop()
        with self._lock:
            agent, self._agent = self._agent, None
            for request in list(self._requests):  # kept, and owned by unreleased handles
                self._free(request)
            self._retire_all()
            for prepared in self._retired:  # a zombie's: NIXL goes with the agent anyway
                release_lists(prepared)
            self._retired.clear()
            self._cache.clear()
            self._inflight.clear()
            self._retry_zombies()
            self._zombies.clear()
            for reg in self._registrations:  # closing: nothing useful to report on failure
                for reg_list in reg.lists:
                    with contextlib.suppress(Exception):
                        agent.deregister_memory(reg_list)
            self._registrations.clear()
            for peer in self._peers:  # a dead peer may refuse a clean goodbye
                with contextlib.suppress(Exception):
                    agent.remove_remote_agent(peer)
            self._peers.clear()
            # the bound post method holds the binding's agent alive: drop it too
            self._core_post = None
            del agent

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ----------------------------------------------------------------------

    def _open_agent(self) -> Any:
        agent = self._agent
        if agent is None or self._closed:
            raise TransportClosedError(f"NIXL agent {self._name!r} is closed")
        return agent

    def _clear_cache(self) -> None:
        kept, self._cache = self._cache, {}
        for request in kept.values():
            self._free(request)

    def _drop_cached(self, peer: str) -> None:
        stale = [key for key in self._cache if key[1] == peer]
        for key in stale:
            self._free(self._cache.pop(key))
        self._retire(peer)
        self._remote_kind = {k: v for k, v in self._remote_kind.items() if k[0] != peer}


def _post_error(exc: BaseException) -> type[TransportError]:
    """What a refused request means: memory NIXL cannot find or parameters it rejects are
    the caller's descriptors; anything else, the transfer (or the peer) failing."""
    if status_of(exc) in (_NOT_FOUND, "NIXL_ERR_INVALID_PARAM"):
        return DescriptorError
    return TransferFailedError


def _as_region(item: object) -> Region:
    if isinstance(item, Region):
        return item
    if hasattr(item, "data_ptr") and hasattr(item, "is_contiguous"):
        return region_of_tensor(item)
    if hasattr(item, "ctypes") and hasattr(item, "flags"):
        return region_of_array(item)  # type: ignore[arg-type]
    raise RegistrationError(
        f"cannot register {type(item).__name__}: pass kvwire Regions, numpy arrays or tensors"
    )


_cuda_answer: bool | None = None


def cuda_device_present() -> bool:
    """Whether the CUDA driver sees a device, asked through libcuda itself (no torch)."""
    global _cuda_answer
    if _cuda_answer is None:
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
            count = ctypes.c_int(0)
            _cuda_answer = (
                cuda.cuInit(0) == 0
                and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0
                and count.value > 0
            )
        except OSError:
            _cuda_answer = False
    return _cuda_answer
