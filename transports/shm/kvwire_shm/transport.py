"""The shm transport: real bytes between processes of one host, no RDMA hardware.

``read``/``write`` return at once; the bytes move on the agent's worker thread and on any
thread blocked in ``wait``, which lends itself to the transfers (see ``_executor``), except
that a small host transfer is copied inside ``read``/``write`` when nothing is queued ahead
of it (a thread hand-over costs far more than the copy). Copies go through the C helper
``_native`` when it was built (streaming stores, batched syscalls, GIL released), which
also plans a host transfer whole inside ``read``/``write`` so that its chunks are out
before the call returns:

* memory the peer allocated with :func:`kvwire_shm.allocate` is mapped here at
  ``add_peer`` and copied with plain ``memmove`` (no syscall);
* any other registered host memory is reached with ``process_vm_readv``/``writev``,
  up to IOV_MAX descriptors per syscall;
* VRAM goes through CUDA IPC when a GPU is present.

A transfer's notification is sent after its last byte landed, and ``notify`` goes through
the same queue of jobs, run one after another, so every notification to a peer arrives in
the order of the calls that produced it. A peer's death is seen through a pidfd and its closed
socket; transfers touching it end FAILED.

Why one module of ~760 lines: the agent, its registration tables' use, the copy worker and
the notification channel share one lock and one life cycle; the pure parts (descriptor
tables, planning, the native copy) already live in their own modules.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import math
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from kvwire.errors import (
    ConfigError,
    PeerMetadataError,
    RegistrationError,
    TransferFailedError,
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
    as_message,
)
from kvwire_shm import _cma, _cuda, _memcopy
from kvwire_shm._cma import CmaError, allow_any_ptracer
from kvwire_shm._executor import Executor, Split
from kvwire_shm._native_load import NATIVE
from kvwire_shm._notify import NotifyHub, connect, frame
from kvwire_shm._planning import (
    INLINE_BYTES,
    INLINE_ROWS,
    Batch,
    Request,
    checked_pair,
    plan,
    plan_few,
    plan_host,
)
from kvwire_shm._segments import PeerMapping, SegmentInfo, segment_of
from kvwire_shm._tables import CMA, CUDA, DRAM, LOCAL, MAPPED, VRAM, Row, Table

_MAGIC = "kvwire-shm"
_VERSION = 1
_PREFAULT_STEP = 16 << 20
"""Bytes of a peer's segment mapped per idle step of the worker (about a millisecond)."""


class _RegionMeta(msgspec.Struct, array_like=True):
    addr: int
    length: int
    device_id: int
    kind: str
    seg_fd: int = -1
    seg_token: str = ""
    seg_base: int = 0
    seg_size: int = 0
    cuda_handle: bytes = b""
    cuda_base: int = 0


class _AgentMeta(msgspec.Struct, array_like=True):
    magic: str
    version: int
    name: str
    pid: int
    address: bytes
    regions: list[_RegionMeta]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_AgentMeta)


@dataclass
class _Registration:
    regions: list[_RegionMeta]


@dataclass(eq=False)
class _Peer:
    name: str
    pid: int
    pidfd: int
    sock: socket.socket
    table: Table
    mappings: list[PeerMapping] = field(default_factory=list)
    cuda_ptrs: list[tuple[int, int]] = field(default_factory=list)
    broken: str | None = None
    _poller: Any = None

    def gone(self) -> bool:
        """Whether the peer process has exited (its pidfd turned readable); inside a job
        only (jobs never overlap, whichever thread runs them)."""
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self.pidfd, select.POLLIN)
        return bool(self._poller.poll(0))

    def send(self, payload: bytes) -> None:
        if self.broken is not None:
            raise OSError(self.broken)
        try:
            self.sock.sendall(frame(payload))
        except OSError as exc:
            self.broken = f"notification channel to {self.name!r} broke: {exc}"
            raise

    def close(self, lib: _cuda._Cuda | None) -> None:
        self.sock.close()
        os.close(self.pidfd)
        for mapping in self.mappings:
            mapping.close()
        self.mappings.clear()
        if lib is not None:
            for ptr, device in self.cuda_ptrs:
                lib.set_device(device)
                lib.close_handle(ptr)
        self.cuda_ptrs.clear()


@dataclass(eq=False)
class _Xfer:
    owner: ShmTransport
    peer: _Peer
    write: bool
    batches: list[Batch] | Request
    notify: bytes | None
    state: XferState = XferState.PENDING
    released: bool = False
    error: str | None = None


class _Aborted(Exception):
    """A chunk found its transfer released or the agent closed: copy nothing more."""


_PrefaultStep = tuple[PeerMapping, int, int]


class ShmTransport:
    """One agent of the shm transport. ``ShmTransport(name, cuda=None)``.

    ``cuda``: None uses CUDA IPC when a GPU is present, False never does.
    """

    conformance_allocators = ("kvwire_shm:allocate",)
    """Extra host allocators the conformance suite runs its memory tests over."""
    conformance_thresholds: ClassVar[dict[str, tuple[int, ...]]] = {
        "transfer_bytes": (_memcopy.CHUNK_BYTES, _memcopy.SHARE_FROM),
        "span_bytes": (_memcopy.GATHER_BELOW, _memcopy.CONCURRENT_FROM, _memcopy.RELEASE_FROM),
        "descriptors": (_cma.IOV_MAX,),
    }
    """Where the copy strategy changes: the suite moves sizes on both sides of each."""

    def __init__(self, name: str, **options: Any) -> None:
        unknown = set(options) - {"cuda"}
        if unknown:
            raise ConfigError(f"shm transport: unknown option(s) {', '.join(sorted(unknown))}")
        if not name:
            raise ConfigError("shm transport: an agent needs a non-empty name")
        self._name = name
        want_cuda = options.get("cuda")
        self._cuda = _cuda.cuda() if want_cuda is not False else None
        if want_cuda is True and self._cuda is None:
            raise ConfigError("shm transport: cuda=True but no CUDA device is available")
        kinds = {MemKind.DRAM} | ({MemKind.VRAM} if self._cuda is not None else set())
        self._caps = Capabilities(mem_kinds=frozenset(kinds), ordered_notifications=True)
        allow_any_ptracer()
        self._lock = threading.Lock()
        self._closed = False
        self._registrations: dict[int, _Registration] = {}
        self._reg_ids = itertools.count(1)
        self._local = Table([])
        self._peers: dict[str, _Peer] = {}
        self._xfers: set[_Xfer] = set()
        self._inbox: list[tuple[str, bytes]] = []
        self._activity = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._waiters = 0
        """Threads inside ``wait``: the last one out closes the eventfd after ``close``."""
        self._help = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        """Readable when a transfer with chunks to share started: ``wait`` comes to help."""
        self._executor = Executor(on_split=self._call_for_help)
        self._retiring: set[_Peer] = set()
        """Peers replaced or removed whose resources a queued job will free."""
        self._prefault: collections.deque[_PrefaultStep] = collections.deque()
        self._hub = NotifyHub(name, self._on_notification)
        self._worker = threading.Thread(
            target=self._work, name=f"kvwire-shm-worker-{name}", daemon=True
        )
        self._worker.start()

    # -- properties -------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    # -- memory -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosedError(f"shm agent {self._name!r} is closed")

    def register(self, regions: Sequence[Region]) -> object:
        self._check_open()
        metas = [self._describe(region) for region in regions]
        if not metas:
            raise RegistrationError("register needs at least one region")
        with self._lock:
            handle = next(self._reg_ids)
            self._registrations[handle] = _Registration(metas)
            self._rebuild_local()
        return handle

    def _describe(self, region: Region) -> _RegionMeta:
        if not isinstance(region, Region):
            raise RegistrationError(f"expected a kvwire.transport.Region, got {type(region)!r}")
        if region.kind is MemKind.VRAM:
            if self._cuda is None:
                raise RegistrationError("VRAM regions need CUDA, which this agent does not have")
            try:
                base, _ = self._cuda.allocation_of(region.addr, region.device_id)
                handle = _cuda.export_handle(self._cuda, base, region.device_id)
            except _cuda.CudaError as exc:
                raise RegistrationError(f"cannot export VRAM region: {exc}") from exc
            return _RegionMeta(
                region.addr,
                region.length,
                region.device_id,
                "VRAM",
                cuda_handle=handle,
                cuda_base=base,
            )
        seg = segment_of(region.addr, region.length)
        if seg is None:
            return _RegionMeta(region.addr, region.length, region.device_id, "DRAM")
        return _RegionMeta(
            region.addr,
            region.length,
            region.device_id,
            "DRAM",
            seg_fd=seg.fd,
            seg_token=seg.token,
            seg_base=seg.base,
            seg_size=seg.size,
        )

    def _rebuild_local(self) -> None:
        rows = [
            Row(m.addr, m.length, m.device_id, VRAM if m.kind == "VRAM" else DRAM, LOCAL)
            for reg in self._registrations.values()
            for m in reg.regions
        ]
        self._local = Table(rows)

    def deregister(self, handle: object) -> None:
        self._check_open()
        with self._lock:
            if not isinstance(handle, int) or handle not in self._registrations:
                raise RegistrationError(f"unknown registration handle {handle!r}")
            del self._registrations[handle]
            self._rebuild_local()

    def local_metadata(self) -> bytes:
        self._check_open()
        with self._lock:
            regions = [m for reg in self._registrations.values() for m in reg.regions]
        meta = _AgentMeta(_MAGIC, _VERSION, self._name, os.getpid(), self._hub.address, regions)
        return _encoder.encode(meta)

    # -- peers ------------------------------------------------------------------------

    def add_peer(self, blob: bytes) -> str:
        self._check_open()
        try:
            meta = _decoder.decode(blob)
        except (msgspec.DecodeError, TypeError) as exc:
            raise PeerMetadataError(f"not shm transport metadata: {exc}") from exc
        if meta.magic != _MAGIC or meta.version != _VERSION:
            raise PeerMetadataError(f"not shm transport metadata ({meta.magic} v{meta.version})")
        try:
            pidfd = os.pidfd_open(meta.pid)
        except OSError as exc:
            raise UnknownPeerError(f"peer {meta.name!r} (pid {meta.pid}) is gone: {exc}") from exc
        try:
            sock = connect(meta.address, self._name)
        except OSError as exc:
            os.close(pidfd)
            raise UnknownPeerError(f"cannot reach peer {meta.name!r}: {exc}") from exc
        peer = _Peer(meta.name, meta.pid, pidfd, sock, Table([]))
        try:
            peer.table = Table([self._route(peer, m) for m in meta.regions])
        except TransportError:
            peer.close(self._cuda)
            raise
        with self._lock:
            old = self._peers.get(meta.name)
            self._peers[meta.name] = peer
        if old is not None:
            self._retire(old)
        steps = self._prefault_steps(peer, meta.regions)
        if steps:
            # Queued behind jobs that may still use the peer this one replaced.
            self._executor.submit(functools.partial(self._prefault.extend, steps))
        return meta.name

    @staticmethod
    def _prefault_steps(peer: _Peer, regions: list[_RegionMeta]) -> list[_PrefaultStep]:
        """The peer's registered spans inside mapped segments, cut into worker-sized steps.

        Without this the first transfers over a fresh mapping pay a page fault per few pages
        (about half again the copy time); only registered spans are touched, so pages the
        peer never offered are not made resident here.
        """
        bases = {mapping.peer_base: mapping for mapping in peer.mappings}
        steps = []
        for m in regions:
            mapping = bases.get(m.seg_base) if m.seg_fd >= 0 else None
            if mapping is None:
                continue
            first = m.addr - m.seg_base
            for offset in range(first, first + m.length, _PREFAULT_STEP):
                steps.append((mapping, offset, min(_PREFAULT_STEP, first + m.length - offset)))
        return steps

    def _route(self, peer: _Peer, m: _RegionMeta) -> Row:
        kind = VRAM if m.kind == "VRAM" else DRAM
        if kind == VRAM:
            if self._cuda is None:
                raise PeerMetadataError(f"peer {peer.name!r} offers VRAM but CUDA is unavailable")
            try:
                ptr = _cuda.open_handle(self._cuda, m.cuda_handle, m.device_id)
            except _cuda.CudaError as exc:
                raise PeerMetadataError(f"cannot open peer VRAM: {exc}") from exc
            peer.cuda_ptrs.append((ptr, m.device_id))
            return Row(m.addr, m.length, m.device_id, kind, CUDA, ptr - m.cuda_base)
        if m.seg_fd >= 0:
            for mapping in peer.mappings:
                if mapping.peer_base == m.seg_base:
                    return Row(
                        m.addr, m.length, m.device_id, kind, MAPPED, mapping.addr - m.seg_base
                    )
            try:
                info = SegmentInfo(m.seg_fd, m.seg_token, m.seg_base, m.seg_size)
                mapping = PeerMapping(peer.pid, info)
            except (OSError, ValueError):
                return Row(m.addr, m.length, m.device_id, kind, CMA)
            peer.mappings.append(mapping)
            return Row(m.addr, m.length, m.device_id, kind, MAPPED, mapping.addr - m.seg_base)
        return Row(m.addr, m.length, m.device_id, kind, CMA)

    def remove_peer(self, peer: str) -> None:
        self._check_open()
        with self._lock:
            gone = self._peers.pop(peer, None)
        if gone is None:
            raise UnknownPeerError(f"no peer named {peer!r}")
        self._retire(gone)

    def _retire(self, peer: _Peer) -> None:
        """Free a peer's resources once every job queued before this call has ended."""
        with self._lock:
            self._retiring.add(peer)

        def retire() -> None:
            with self._lock:
                if peer not in self._retiring:
                    return  # close() got there first
                self._retiring.discard(peer)
            peer.close(self._cuda)

        self._executor.submit(retire)

    def _peer(self, name: str) -> _Peer:
        with self._lock:
            peer = self._peers.get(name)
        if peer is None:
            raise UnknownPeerError(f"no peer named {name!r}; call add_peer with its metadata")
        return peer

    # -- transfers --------------------------------------------------------------------

    def read(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        return self._post(peer, local, remote, notify, write=False)

    def write(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        return self._post(peer, local, remote, notify, write=True)

    def _post(
        self, peer_name: str, local: Descs, remote: Descs, notify: bytes | None, *, write: bool
    ) -> _Xfer:
        """Check the descriptors here (a bad one raises at once) and leave the rest to the
        worker: splitting by route and coalescing happen off the caller's thread, except
        where VRAM is involved and the split itself can reject the transfer."""
        self._check_open()
        notify = None if notify is None else as_message(notify)
        peer = self._peer(peer_name)
        few = plan_few(self._local, peer.table, local, remote, write=write)
        if few is not None:
            xfer = _Xfer(self, peer, write, [], notify)
            with self._lock:
                self._xfers.add(xfer)
            few_job = functools.partial(self._start_few, xfer, *few)
            if not self._executor.run_now(few_job):
                self._executor.submit(few_job)
            return xfer
        host = self._plan_host(peer, local, remote, write)
        batches: list[Batch] | Request
        if host is not None:
            batches = host
            rows = local.shape[0]  # (an int64 array: _plan_host took it)
            small = rows <= INLINE_ROWS and sum(b.total for b in host) <= INLINE_BYTES
        else:
            local, remote = checked_pair(local, remote)
            table = self._local  # swapped whole under the lock, never changed in place
            li = table.locate(local, "local")
            ri = peer.table.locate(remote, "remote")
            request = Request(table, peer.table, li, ri, local, remote)
            batches = request
            if table.has_vram or peer.table.has_vram:
                batches = self._plan(request, write)
            small = (
                isinstance(batches, Request)
                and local.shape[0] <= INLINE_ROWS
                and int(local[:, 1].sum()) <= INLINE_BYTES
            )
        xfer = _Xfer(self, peer, write, batches, notify)
        with self._lock:
            self._xfers.add(xfer)
        job = functools.partial(self._start, xfer)
        executor = self._executor
        # A small transfer is copied here; a planned one starts here (a few us).
        started = executor.run_now(job) if small else host is not None and executor.start_now(job)
        if not started:
            executor.submit(job)
        return xfer

    # The planners as methods: the conformance suite's broken variants override them.
    def _plan_host(
        self, peer: _Peer, local: Descs, remote: Descs, write: bool
    ) -> list[Batch] | None:
        return plan_host(self._local, peer.table, local, remote, write=write)

    _plan = staticmethod(plan)

    def _start_few(
        self, xfer: _Xfer, route: int, dst: list[int], src: list[int], length: list[int]
    ) -> None:
        """The job of a transfer planned by ``plan_few``: copy, then end (which checks that
        the peer lived through the copy); one step, so nothing to split. No check before
        the copy: a dead peer fails CMA (ESRCH), and its segment stays mapped."""
        if xfer.released or self._closed:
            return
        error: Exception | None = None
        try:
            if route == CMA:
                _cma.copy_few(xfer.peer.pid, dst, src, length, write=xfer.write)
            else:
                _memcopy.copy_few(dst, src, length)
        except Exception as exc:  # expected or a bug: either way this transfer FAILS
            error = exc
        except BaseException as exc:  # Ctrl-C on the caller's thread: it FAILS, and goes on
            self._end(xfer, exc)
            raise
        self._end(xfer, error)

    def _xfer(self, handle: object) -> _Xfer:
        if not isinstance(handle, _Xfer) or handle.owner is not self:
            raise TransportError(f"not a transfer handle of agent {self._name!r}: {handle!r}")
        if handle.released:
            raise TransportError("transfer handle was already released")
        return handle

    def poll(self, handle: object) -> XferState:
        self._check_open()
        return self._xfer(handle).state

    def resource_counts(self) -> dict[str, int]:
        """What the agent holds, for the conformance suite's accounting."""
        with self._lock:
            return {
                "transfers": len(self._xfers),
                "peers": len(self._peers),
                "retiring": len(self._retiring),
                "registrations": len(self._registrations),
            }

    def failure_reason(self, handle: object) -> str | None:
        """Why a transfer FAILED (None while it has not)."""
        return self._xfer(handle).error

    def release(self, handle: object) -> None:
        self._check_open()
        xfer = self._xfer(handle)
        with self._lock:
            xfer.released = True
            self._xfers.discard(xfer)

    # -- notifications ----------------------------------------------------------------

    def notify(self, peer: str, message: bytes) -> None:
        self._check_open()
        message = as_message(message)
        target = self._peer(peer)
        if target.broken is not None:
            raise TransferFailedError(target.broken)
        self._executor.submit(functools.partial(self._send_quietly, target, message))

    @staticmethod
    def _send_quietly(peer: _Peer, message: bytes) -> None:
        """A ``notify`` that fails after it was accepted marks the channel broken, which the
        next ``notify`` or transfer to that peer reports."""
        with contextlib.suppress(OSError):
            peer.send(message)

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        self._check_open()
        with self._lock:
            out, self._inbox = self._inbox, []
        return out

    def _on_notification(self, sender: str, payload: bytes) -> None:
        with self._lock:
            self._inbox.append((sender, payload))
        self._signal()

    def wait(self, timeout: float) -> None:
        """Block until a transfer ended or a notification arrived since the last ``wait``,
        or for ``timeout`` seconds (rounded up to whole milliseconds).

        While it waits, this thread shares the copying of a large running transfer with
        the worker, so ``wait`` may return up to one chunk's copy (~0.2 ms) after
        ``timeout``.
        """
        deadline = time.monotonic() + max(0.0, timeout)
        with self._lock:
            self._check_open()
            self._waiters += 1
        try:
            poller = select.poll()
            poller.register(self._activity, select.POLLIN)
            poller.register(self._help, select.POLLIN)
            while True:
                while time.monotonic() < deadline and self._executor.help():
                    pass
                left = math.ceil(max(0.0, deadline - time.monotonic()) * 1000)
                ready = {fd for fd, _ in poller.poll(left)}
                if self._help in ready:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self._help)
                if self._activity in ready or not ready:
                    break
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._activity)
        finally:
            with self._lock:
                self._waiters -= 1
                if self._closed and not self._waiters:
                    self._close_activity()

    def _close_activity(self) -> None:
        """Close the eventfds once (under the lock, with nobody left in ``wait``)."""
        if self._activity >= 0:
            os.close(self._activity)
            os.close(self._help)
            self._activity = self._help = -1

    def _signal(self) -> None:
        """Wake ``wait``. An eventfd rather than a condition variable: the GIL is let go
        during the write, so a waiter woken on this core runs on at once instead of
        bouncing off the GIL the worker still holds."""
        with contextlib.suppress(OSError):  # full counter (still a wake-up), or closed
            os.eventfd_write(self._activity, 1)

    def _call_for_help(self) -> None:
        with contextlib.suppress(OSError):
            os.eventfd_write(self._help, 1)

    # -- the worker and the jobs -------------------------------------------------------

    def _work(self) -> None:
        executor = self._executor
        while True:
            if executor.step():
                continue
            if executor.stopped:
                return
            if self._prefault and executor.exclusive(self._prefault_one):
                continue
            executor.wait_ready(None if not self._prefault else 0.001)

    def _prefault_one(self) -> None:
        """Map in one step of a new peer's segments; only between jobs, so never a mapping
        that a job is closing."""
        try:
            mapping, offset, length = self._prefault.popleft()
        except IndexError:
            return
        try:
            mapping.populate(offset, length)
        except OSError:  # the kernel cannot: the first copies fault instead
            self._prefault.clear()

    def _start(self, xfer: _Xfer) -> Split | None:
        """The job of one transfer: check the peer, plan, and hand out the copy as chunks."""
        if xfer.released or self._closed:
            return None
        try:
            if xfer.peer.gone():
                raise TransferFailedError(f"peer {xfer.peer.name!r} (pid {xfer.peer.pid}) is gone")
            if isinstance(xfer.batches, Request):
                xfer.batches = self._plan(xfer.batches, xfer.write)
            copies: list[Callable[[], object]] = []
            shared = False
            for batch in xfer.batches:
                more, concurrent = self._copies(xfer, batch)
                copies += more
                shared = shared or concurrent
            chunks = [functools.partial(self._chunk, xfer, copy) for copy in copies]
        except Exception as exc:  # expected or a bug: either way this transfer FAILS
            self._end(xfer, exc)
            return None
        return Split(chunks, functools.partial(self._end, xfer), shared=shared)

    def _copies(self, xfer: _Xfer, batch: Batch) -> tuple[list[Callable[[], object]], bool]:
        """The calls that copy one batch, and whether threads gain by sharing them."""
        if batch.bounds is not None:  # planned whole by the C helper
            if batch.route == CMA:
                chunks = _cma.planned_chunks(
                    xfer.peer.pid, batch.dst, batch.src, batch.length, batch.bounds,
                    write=xfer.write,
                )  # fmt: skip
                return chunks, True
            return _memcopy.planned_chunks(
                batch.dst, batch.src, batch.length, batch.bounds,
                total=batch.total, merged=batch.merged,
            )  # fmt: skip
        if batch.route == CMA:
            cma_chunks = _cma.chunks if NATIVE is None else _cma.native_chunks
            return cma_chunks(
                xfer.peer.pid, batch.dst, batch.src, batch.length, write=xfer.write
            ), True
        if batch.route == MAPPED:
            if NATIVE is not None:
                return _memcopy.native_chunks(batch.dst, batch.src, batch.length)
            return _memcopy.chunks(batch.dst, batch.src, batch.length)
        lib = self._cuda
        assert lib is not None
        ends = list(itertools.accumulate(batch.length.tolist()))
        cuda: list[Callable[[], object]] = [
            functools.partial(
                lib.copy_all,
                batch.dst[a:b].tolist(),
                batch.src[a:b].tolist(),
                batch.length[a:b].tolist(),
                batch.device,
            )
            for a, b in itertools.pairwise(_memcopy.group_bounds(ends))
        ]
        return cuda, True

    def _chunk(self, xfer: _Xfer, copy: Callable[[], object]) -> None:
        if xfer.released or self._closed:
            raise _Aborted
        copy()

    def _end(self, xfer: _Xfer, error: BaseException | None) -> None:
        """After the last chunk (or a failed start): DONE with the notification sent, or
        FAILED with the reason; nothing for a transfer released or closed midway."""
        if isinstance(error, _Aborted) or xfer.released:
            return
        if error is not None and not isinstance(error, Exception):  # the copy was cut short
            error = TransferFailedError(f"interrupted ({type(error).__name__})")
        try:
            if error is not None:
                raise error
            if xfer.peer.gone():
                raise TransferFailedError(f"peer {xfer.peer.name!r} died during the transfer")
            if xfer.notify is not None:
                try:
                    xfer.peer.send(xfer.notify)
                except OSError as exc:
                    raise TransferFailedError(f"notification not delivered: {exc}") from exc
            xfer.state = XferState.DONE
        except (TransportError, CmaError, _cuda.CudaError) as exc:
            xfer.error = str(exc)
            xfer.state = XferState.FAILED
        except Exception as exc:  # a bug must fail the transfer, not hang its poller
            xfer.error = f"{type(exc).__name__}: {exc}"
            xfer.state = XferState.FAILED
        self._signal()

    # -- shutdown ---------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._executor.stop()  # jobs never started are dropped: their transfers FAIL below
        self._worker.join()
        self._executor.drain()  # a chunk still running in a thread inside ``wait`` ends
        with self._lock:
            pending = [x for x in self._xfers if x.state is XferState.PENDING]
            peers = list(self._peers.values()) + list(self._retiring)
            self._peers.clear()
            self._retiring.clear()
            self._xfers.clear()
        for xfer in pending:
            xfer.error = "agent closed"
            xfer.state = XferState.FAILED
        for peer in peers:
            peer.close(self._cuda)
        self._hub.close()
        self._signal()
        with self._lock:
            if not self._waiters:
                self._close_activity()

    def __repr__(self) -> str:
        return f"ShmTransport(name={self._name!r}, peers={sorted(self._peers)})"
