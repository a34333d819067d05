"""Deliberately broken transports, one plausible bug each: the conformance suite must fail
every one of them, in the test named beside it.

Loaded by name (``kvwire_broken_shm:<variant>``) in the suite's subprocesses, so this file
sits on their PYTHONPATH. Two families:

* wrappers (``independent=True``) around any adapter, ``-o inner=shm|nixl|ucx``: bugs an
  author can make whatever moves the bytes;
* subclasses of :class:`ShmTransport` that break one of its own code paths.

:data:`VARIANTS` is the library; docs/writing-a-transport.md has the same table, and
tests/transport/test_conformance_teeth.py checks both.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from kvwire_shm import ShmTransport
from kvwire_shm import transport as shm
from kvwire_shm._cma import IOV_MAX
from kvwire_shm._executor import Split
from kvwire_shm._memcopy import GATHER_BELOW
from kvwire_shm._tables import CMA, MAPPED, Row, Table

from kvwire.errors import PeerMetadataError, RegistrationError
from kvwire.transport import (
    Capabilities,
    DelegatingTransport,
    Descs,
    MemKind,
    Region,
    Transport,
    XferState,
    create,
)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    section: str
    """The contract section of docs/writing-a-transport.md it breaks."""
    breaks: str
    caught_by: str
    """The conformance test that must fail for it."""
    make: Callable[..., Transport]
    independent: bool
    timeout: float = 60.0
    """``kvwire conformance --timeout`` for its run (short for a variant that hangs)."""
    inners: tuple[str, ...] = ("shm",)
    """The adapters it runs over (a wrapper: every one its catching test can reach)."""
    module: str = "kvwire_broken_shm"
    """The module its factory is loaded from (``module:name``)."""


# -- wrappers: bugs independent of the adapter -------------------------------------------


class _DropsLastDescriptor(DelegatingTransport):
    def read(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        return self.inner.read(peer, local[:-1], remote[:-1], notify)

    def write(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        return self.inner.write(peer, local[:-1], remote[:-1], notify)


class _TruncatesAtZeroLengthRow(DelegatingTransport):
    """Treats a row of length 0 as the end of the list."""

    @staticmethod
    def _cut(local: Descs, remote: Descs) -> tuple[Descs, Descs]:
        zero = np.flatnonzero(np.asarray(local)[:, 1] == 0)
        end = int(zero[0]) if zero.shape[0] else len(local)
        return local[:end], remote[:end]

    def read(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        return self.inner.read(peer, *self._cut(local, remote), notify)

    def write(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        return self.inner.write(peer, *self._cut(local, remote), notify)


class _RefusesZeroLengthRows(DelegatingTransport):
    def read(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        if len(local) and not np.asarray(local)[:, 1].all():
            raise shm.DescriptorError("zero-length descriptor")
        return self.inner.read(peer, local, remote, notify)

    def write(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        if len(local) and not np.asarray(local)[:, 1].all():
            raise shm.DescriptorError("zero-length descriptor")
        return self.inner.write(peer, local, remote, notify)


class _RawErrorOnWrongShape(DelegatingTransport):
    """Reads the device column before the descriptors are validated."""

    def read(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        self.devices = set(np.asarray(local)[:, 2].tolist())
        return self.inner.read(peer, local, remote, notify)

    def write(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        self.devices = set(np.asarray(local)[:, 2].tolist())
        return self.inner.write(peer, local, remote, notify)


@dataclasses.dataclass(eq=False)
class _Queued:
    post: Callable[[], object]
    since: float
    inner: object = None


class _DoneBeforeCopy(DelegatingTransport):
    """Reports DONE while the transfer is still queued or running.

    The queue holds each transfer back HOLD_S before posting it (on a later poll, on the
    caller's thread), so a suite that reads memory once DONE always finds it stale: over a
    fast adapter a plain "DONE while PENDING" would be a race the copy often wins.
    """

    HOLD_S = 0.3

    def _queue(self, op: Callable[..., object], *args: Any) -> _Queued:
        args = tuple(np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in args)
        return _Queued(lambda: op(*args), time.monotonic())

    def read(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        return self._queue(self.inner.read, peer, local, remote, notify)

    def write(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        return self._queue(self.inner.write, peer, local, remote, notify)

    def poll(self, handle: object) -> XferState:
        if not isinstance(handle, _Queued):
            return self.inner.poll(handle)
        if handle.inner is None and time.monotonic() - handle.since >= self.HOLD_S:
            handle.inner = handle.post()
        state = XferState.PENDING if handle.inner is None else self.inner.poll(handle.inner)
        return XferState.DONE if state is XferState.PENDING else state

    def release(self, handle: object) -> None:
        if not isinstance(handle, _Queued):
            self.inner.release(handle)
        elif handle.inner is not None:
            self.inner.release(handle.inner)


class _FailedPollsPendingAgain(DelegatingTransport):
    """Reports FAILED once, then forgets it (the record was reset on report)."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self._told: set[int] = set()

    def poll(self, handle: object) -> XferState:
        state = self.inner.poll(handle)
        if state is XferState.FAILED:
            if id(handle) in self._told:
                return XferState.PENDING
            self._told.add(id(handle))
        return state


class _DonePollsPendingAgain(DelegatingTransport):
    """After DONE was reported three times, reports PENDING (a recycled slot)."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self._told: dict[int, int] = {}

    def poll(self, handle: object) -> XferState:
        state = self.inner.poll(handle)
        if state is XferState.DONE:
            seen = self._told[id(handle)] = self._told.get(id(handle), 0) + 1
            if seen > 3:
                return XferState.PENDING
        return state


class _FailureReportedAsDone(DelegatingTransport):
    def poll(self, handle: object) -> XferState:
        state = self.inner.poll(handle)
        return XferState.DONE if state is XferState.FAILED else state


class _UnknownDeregisterRaisesKeyError(DelegatingTransport):
    """Hands out its own handle numbers and looks them up without a check."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self._handles: dict[object, object] = {}
        self._ids = itertools.count(1)

    def register(self, regions: Sequence[Region]) -> object:
        handle = next(self._ids)
        self._handles[handle] = self.inner.register(regions)
        return handle

    def deregister(self, handle: object) -> None:
        self.inner.deregister(self._handles.pop(handle))


class _ReAddIsRefused(DelegatingTransport):
    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self._known: set[str] = set()

    def add_peer(self, blob: bytes) -> str:
        name = self.inner.add_peer(blob)
        if name in self._known:
            raise PeerMetadataError(f"peer {name!r} is already known")
        self._known.add(name)
        return name

    def remove_peer(self, peer: str) -> None:
        self.inner.remove_peer(peer)
        self._known.discard(peer)


class _RemovePeerForgetsNothing(DelegatingTransport):
    def remove_peer(self, peer: str) -> None:
        return None


class _ForeignMetadataRawError(DelegatingTransport):
    """Peeks at a length header before handing the blob to the adapter."""

    def add_peer(self, blob: bytes) -> str:
        (self.last_header,) = struct.unpack_from("<I", blob)
        return self.inner.add_peer(blob)


class _NamesEverySenderAlike(DelegatingTransport):
    """Caches the sender's name from the first notification it ever saw."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self._sender: str | None = None

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        got = self.inner.drain_notifications()
        if got and self._sender is None:
            self._sender = got[0][0]
        return [(self._sender or s, m) for s, m in got]


class _NotifyGoesToFirstPeer(DelegatingTransport):
    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self._first: str | None = None

    def add_peer(self, blob: bytes) -> str:
        name = self.inner.add_peer(blob)
        self._first = self._first or name
        return name

    def notify(self, peer: str, message: bytes) -> None:
        self.inner.notify(self._first or peer, message)


class _NotifiesBeforeData(DelegatingTransport):
    """Sends the notification, then holds the data back a while before moving it.

    The hold widens the window in which the peer, woken by the early notification, reads
    stale memory: without it, this bug is a race the suite would usually (not always) win.
    """

    HOLD_S = 0.3

    def read(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        if notify is not None:
            self.inner.notify(peer, notify)
            time.sleep(self.HOLD_S)
        return self.inner.read(peer, local, remote)

    def write(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        if notify is not None:
            self.inner.notify(peer, notify)
            time.sleep(self.HOLD_S)
        return self.inner.write(peer, local, remote)


class _DropsNotifications(DelegatingTransport):
    """Loses every tenth notification it receives."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self._seen = 0

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        out = []
        for entry in self.inner.drain_notifications():
            self._seen += 1
            if self._seen % 10:
                out.append(entry)
        return out


class _DuplicatesNotifications(DelegatingTransport):
    """Hands out every tenth notification twice."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self._seen = 0

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        out = []
        for entry in self.inner.drain_notifications():
            self._seen += 1
            out += [entry, entry] if self._seen % 10 == 0 else [entry]
        return out


class _ReordersNotifications(DelegatingTransport):
    """Claims ordered notifications, then hands each batch out newest first."""

    @property
    def capabilities(self) -> Capabilities:
        return dataclasses.replace(self.inner.capabilities, ordered_notifications=True)

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        return self.inner.drain_notifications()[::-1]


class _WaitSleepsWholeSeconds(DelegatingTransport):
    def wait(self, timeout: float) -> None:
        time.sleep(math.ceil(timeout))


class _LeaksThreadOnClose(DelegatingTransport):
    def close(self) -> None:
        self.inner.close()
        threading.Thread(target=threading.Event().wait, name="forgotten", daemon=True).start()


class _LeaksFdOnClose(DelegatingTransport):
    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self._log = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)

    def close(self) -> None:
        self.inner.close()  # self._log stays open


class _ThreadPerTransfer(DelegatingTransport):
    """Starts a watcher thread per transfer that only ``close`` stops."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self._stop = threading.Event()

    def _watch(self) -> None:
        threading.Thread(target=self._stop.wait, name="xfer-watch", daemon=True).start()

    def read(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        self._watch()
        return self.inner.read(peer, local, remote, notify)

    def write(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        self._watch()
        return self.inner.write(peer, local, remote, notify)

    def close(self) -> None:
        self._stop.set()
        self.inner.close()


class _ClosedAgentAcceptsRegister(DelegatingTransport):
    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self._closed = False

    def register(self, regions: Sequence[Region]) -> object:
        return object() if self._closed else self.inner.register(regions)

    def close(self) -> None:
        self._closed = True
        self.inner.close()


class _CloseHangs(DelegatingTransport):
    """Waits in ``close`` for a worker that nobody ever told to stop."""

    def close(self) -> None:
        self.inner.close()
        threading.Event().wait()


# -- shm subclasses: bugs in the adapter's own paths --------------------------------------


class _SharedCopyDropsLastChunk(ShmTransport):
    def _copies(self, xfer: Any, batch: Any) -> tuple[list[Callable[[], object]], bool]:
        copies, shared = super()._copies(xfer, batch)
        if batch.route == MAPPED and shared:
            copies = copies[:-1]
        return copies, shared


class _GatherPathDropsLastByte(ShmTransport):
    def _copies(self, xfer: Any, batch: Any) -> tuple[list[Callable[[], object]], bool]:
        n = int(batch.length.shape[0])
        if batch.route == MAPPED and n > 64 and int(batch.length.sum()) < GATHER_BELOW * n:
            batch = dataclasses.replace(batch, length=batch.length - 1)
        return super()._copies(xfer, batch)


class _CmaSkipsAFullLastBatch(ShmTransport):
    def _copies(self, xfer: Any, batch: Any) -> tuple[list[Callable[[], object]], bool]:
        n = int(batch.length.shape[0])
        if batch.route == CMA and n and n % IOV_MAX == 0:
            keep = slice(0, n - IOV_MAX)
            bounds = batch.bounds  # (planned by the C helper: its chunks go too)
            if bounds is not None:
                bounds = [b for b in bounds if b < n - IOV_MAX] + [n - IOV_MAX]
            batch = dataclasses.replace(
                batch,
                dst=batch.dst[keep],
                src=batch.src[keep],
                length=batch.length[keep],
                bounds=bounds,
            )
        return super()._copies(xfer, batch)


class _MappedWriteGoesBackwards(ShmTransport):
    """The single-route fast paths (the C helper's plan, and numpy's without it) swap
    source and destination of a WRITE."""

    @staticmethod
    def _plan(request: Any, write: bool) -> list[Any]:
        batches = ShmTransport._plan(request, write)
        uniform = not (request.local_t.has_vram or request.remote_t.has_vram)
        if write and uniform and request.remote_t.route == MAPPED:
            return [dataclasses.replace(b, dst=b.src, src=b.dst) for b in batches]
        return batches

    def _plan_host(self, peer: Any, local: Any, remote: Any, write: bool) -> list[Any] | None:
        batches = super()._plan_host(peer, local, remote, write)
        if batches is not None and write and peer.table.route == MAPPED:
            return [dataclasses.replace(b, dst=b.src, src=b.dst) for b in batches]
        return batches


class _OnlyFirstBatch(ShmTransport):
    """Moves only the first route's batch of a transfer over mixed kinds of memory."""

    @staticmethod
    def _plan(request: Any, write: bool) -> list[Any]:
        return ShmTransport._plan(request, write)[:1]


class _ReadDoneBeforeLastChunk(ShmTransport):
    """Ends a READ (DONE, notification sent) when all but its last chunk are copied, and
    copies that one afterwards: the finish callback and the last chunk swapped."""

    WRITE = False

    def _start(self, xfer: Any, *args: Any) -> Any:
        split = super()._start(xfer, *args)
        if split is None or xfer.write != self.WRITE or len(split.chunks) < 2:
            return split
        *first, last = split.chunks
        finish = split.finish

        def finish_then_copy_last(error: BaseException | None) -> None:
            finish(error)
            last()

        return Split(first, finish_then_copy_last, shared=split.shared)


class _DeadMappedPeerStillDone(ShmTransport):
    """Only watches peers it reaches by syscall: mapped memory 'still works'."""

    def add_peer(self, blob: bytes) -> str:
        name = super().add_peer(blob)
        peer = self._peers[name]
        if peer.table.route == MAPPED:
            peer.gone = lambda: False  # type: ignore[method-assign]
        return name


class _StartOnlyTable(Table):
    """The one-region fast path of the lookup compares a descriptor's start only."""

    def find(self, addr: int, length: int) -> int:
        if self._one is not None:
            return 0 if addr >= self._one[0] else -1
        return super().find(addr, length)

    def locate(self, descs: Descs, side: str) -> Any:
        if self._one is not None and descs.shape[0] and int(descs[:, 0].min()) >= self._one[0]:
            return np.zeros(descs.shape[0], dtype=np.int64)
        return super().locate(descs, side)


class _WriteDoneBeforeLastChunk(_ReadDoneBeforeLastChunk):
    """The same swap, in a WRITE."""

    WRITE = True


class _OneRegionEndUnchecked(ShmTransport):
    """Looks up a peer's descriptors in a :class:`_StartOnlyTable`."""

    def add_peer(self, blob: bytes) -> str:
        name = super().add_peer(blob)
        peer = self._peers[name]
        table = peer.table
        rows = [
            Row(int(a), int(e - a), int(d), int(k), int(r), int(delta))
            for a, e, d, k, r, delta in zip(
                table.starts, table.ends, table.devs, table.kinds, table.routes, table.deltas,
                strict=True,
            )
        ]  # fmt: skip
        peer.table = _StartOnlyTable(rows)
        return name


class _ReleaseKeepsRecords(ShmTransport):
    def release(self, handle: object) -> None:
        self._check_open()
        self._xfer(handle).released = True  # never leaves self._xfers


class _ReleaseTwiceIsSilent(ShmTransport):
    def release(self, handle: object) -> None:
        if isinstance(handle, shm._Xfer) and handle.released:
            return
        super().release(handle)


class _DeregisterRemovesNewest(ShmTransport):
    def deregister(self, handle: object) -> None:
        self._check_open()
        with self._lock:
            if not isinstance(handle, int) or handle not in self._registrations:
                raise RegistrationError(f"unknown registration handle {handle!r}")
            del self._registrations[max(self._registrations)]
            self._rebuild_local()


class _ReusesRegistrationIds(ShmTransport):
    def register(self, regions: Sequence[Region]) -> object:
        self._check_open()
        metas = [self._describe(region) for region in regions]
        if not metas:
            raise RegistrationError("register needs at least one region")
        with self._lock:
            handle = next(i for i in itertools.count(1) if i not in self._registrations)
            self._registrations[handle] = shm._Registration(metas)
            self._rebuild_local()
        return handle


class _MetadataCachedAtFirstCall(ShmTransport):
    _cached: bytes | None = None

    def local_metadata(self) -> bytes:
        if self._cached is None:
            self._cached = super().local_metadata()
        return self._cached


class _ReAddKeepsStaleRegions(ShmTransport):
    def add_peer(self, blob: bytes) -> str:
        name = shm._decoder.decode(blob).name if blob[:1] else ""
        if name and name in self._peers:
            return name
        return super().add_peer(blob)


class _ReAddLeaksOldPeer(ShmTransport):
    def _retire(self, peer: Any) -> None:
        return None  # the replaced or removed entry keeps its socket, pidfd and mappings


class _UnknownPeerKeyError(ShmTransport):
    def _peer(self, name: str) -> Any:
        with self._lock:
            return self._peers[name]


# -- the library --------------------------------------------------------------------------


def _wrapper(cls: type[DelegatingTransport]) -> Callable[..., Transport]:
    def make(name: str, inner: str = "shm", **options: Any) -> Transport:
        return cls(create(inner, name, **options))

    return make


def _subclass(cls: type[Any]) -> Callable[..., Transport]:
    def make(name: str, **options: Any) -> Transport:
        agent: Transport = cls(name, **options)
        return agent

    return make


def adapter_variants(
    entries: Sequence[tuple[str, str, str, str, type[Any]]], inner: str, module: str
) -> dict[str, Variant]:
    """The variants of one adapter's library (subclasses of ``inner``'s agent class), each
    factory also set as ``module.NAME`` so ``module:NAME`` loads it."""
    out: dict[str, Variant] = {}
    namespace = sys.modules[module].__dict__
    for name, section, breaks, test, cls in entries:
        make = _subclass(cls)
        out[name] = Variant(
            name, section, breaks, test, make, False, inners=(inner,), module=module
        )
        namespace[name] = make
    return out


_MOVE = "Moving bytes"
_DONE = "Completion"
_REL = "Release"
_REG = "Registration"
_PEER = "Peers and metadata"
_NOTE = "Notifications"
_ERR = "Errors"
_WAIT = "Waiting"
_CLOSE = "Close and resources"

_LIBRARY: list[tuple[str, str, str, str, type[Any]]] = [
    # name, section, what it breaks, catching test, class
    (
        "drops_last_descriptor",
        _MOVE,
        "ignores the last row of every transfer",
        "test_read_moves_exact_bytes",
        _DropsLastDescriptor,
    ),
    (
        "truncates_at_zero_length_row",
        _MOVE,
        "stops at the first row of length 0",
        "test_zero_length_rows_move_nothing",
        _TruncatesAtZeroLengthRow,
    ),
    (
        "refuses_zero_length_rows",
        _MOVE,
        "rejects a transfer with a row of length 0",
        "test_zero_length_rows_move_nothing",
        _RefusesZeroLengthRows,
    ),
    (
        "shared_copy_drops_last_chunk",
        _MOVE,
        "shm: a mapped copy of 32 MiB+ shared between threads loses its last chunk",
        "test_sizes_on_both_sides_of_each_threshold",
        _SharedCopyDropsLastChunk,
    ),
    (
        "gather_path_drops_last_byte",
        _MOVE,
        "shm: rows averaging under 32 B (numpy gather path) lose their last byte",
        "test_sizes_on_both_sides_of_each_threshold",
        _GatherPathDropsLastByte,
    ),
    (
        "cma_skips_a_full_last_batch",
        _MOVE,
        "shm: a CMA transfer of a multiple of 1024 rows skips its last syscall",
        "test_sizes_on_both_sides_of_each_threshold",
        _CmaSkipsAFullLastBatch,
    ),
    (
        "mapped_write_goes_backwards",
        _MOVE,
        "shm: the fast path for a peer with only mapped memory reads instead of writing",
        "test_one_transfer_spans_several_regions",
        _MappedWriteGoesBackwards,
    ),
    (
        "only_first_batch",
        _MOVE,
        "shm: a transfer over two kinds of peer memory moves only the first kind's rows",
        "test_one_transfer_spans_several_regions",
        _OnlyFirstBatch,
    ),
    (
        "done_before_copy",
        _DONE,
        "reports DONE while the transfer is still queued",
        "test_write_moves_exact_bytes",
        _DoneBeforeCopy,
    ),
    (
        "failed_polls_pending_again",
        _DONE,
        "a FAILED transfer polls PENDING the second time",
        "test_transfers_to_a_dead_peer_fail",
        _FailedPollsPendingAgain,
    ),
    (
        "done_polls_pending_again",
        _DONE,
        "a DONE transfer polls PENDING from the fourth time",
        "test_a_finished_handle_polls_the_same_every_time",
        _DonePollsPendingAgain,
    ),
    (
        "failure_reported_as_done",
        _DONE,
        "turns FAILED into DONE",
        "test_transfers_to_a_dead_peer_fail",
        _FailureReportedAsDone,
    ),
    (
        "read_done_before_last_chunk",
        _DONE,
        "shm: a READ is DONE, its notification sent, before its last chunk is copied",
        "test_a_read_is_done_only_after_its_last_byte",
        _ReadDoneBeforeLastChunk,
    ),
    (
        "write_done_before_last_chunk",
        _DONE,
        "shm: a WRITE is DONE, its notification sent, before its last chunk is copied",
        "test_a_write_is_done_only_after_its_last_byte",
        _WriteDoneBeforeLastChunk,
    ),
    (
        "dead_mapped_peer_still_done",
        _DONE,
        "shm: a dead peer whose memory is all mapped still gets DONE transfers",
        "test_a_peer_dying_holding_each_kind_of_memory",
        _DeadMappedPeerStillDone,
    ),
    (
        "release_keeps_records",
        _REL,
        "shm: release marks a transfer but keeps it forever",
        "test_release_lets_go_of_each_transfer",
        _ReleaseKeepsRecords,
    ),
    (
        "release_twice_is_silent",
        _REL,
        "shm: a second release of a handle is accepted",
        "test_release_of_a_running_transfer",
        _ReleaseTwiceIsSilent,
    ),
    (
        "deregister_removes_newest",
        _REG,
        "shm: deregister drops the newest registration",
        "test_deregistering_each_registration",
        _DeregisterRemovesNewest,
    ),
    (
        "reuses_registration_ids",
        _REG,
        "shm: handle numbers are reused after deregister",
        "test_deregistering_each_registration",
        _ReusesRegistrationIds,
    ),
    (
        "unknown_deregister_raises_keyerror",
        _REG,
        "a handle it never issued raises KeyError from deregister",
        "test_deregistering_each_registration",
        _UnknownDeregisterRaisesKeyError,
    ),
    (
        "metadata_cached_at_first_call",
        _REG,
        "shm: local_metadata omits regions registered after its first call",
        "test_re_adding_a_peer_refreshes_it",
        _MetadataCachedAtFirstCall,
    ),
    (
        "re_add_keeps_stale_regions",
        _PEER,
        "shm: add_peer of a known peer keeps its old regions",
        "test_re_adding_a_peer_refreshes_it",
        _ReAddKeepsStaleRegions,
    ),
    (
        "re_add_leaks_old_peer",
        _PEER,
        "shm: a replaced or removed peer keeps its socket, pidfd and mappings",
        "test_re_adding_a_peer_refreshes_it",
        _ReAddLeaksOldPeer,
    ),
    (
        "re_add_is_refused",
        _PEER,
        "add_peer of a known peer raises",
        "test_re_adding_a_peer_refreshes_it",
        _ReAddIsRefused,
    ),
    (
        "remove_peer_forgets_nothing",
        _PEER,
        "remove_peer does nothing",
        "test_re_adding_a_peer_refreshes_it",
        _RemovePeerForgetsNothing,
    ),
    (
        "foreign_metadata_raw_error",
        _PEER,
        "a short foreign blob raises struct.error",
        "test_foreign_metadata_is_refused",
        _ForeignMetadataRawError,
    ),
    (
        "notifies_before_data",
        _NOTE,
        "sends a transfer's notification before its bytes",
        "test_write_notification_arrives_after_its_data",
        _NotifiesBeforeData,
    ),
    (
        "names_every_sender_alike",
        _NOTE,
        "names every sender after the first one it saw",
        "test_several_peers_at_once",
        _NamesEverySenderAlike,
    ),
    (
        "notify_goes_to_first_peer",
        _NOTE,
        "plain notifications all go to the first peer added",
        "test_several_peers_at_once",
        _NotifyGoesToFirstPeer,
    ),
    (
        "drops_notifications",
        _NOTE,
        "loses every tenth notification",
        "test_notifications_arrive_exactly_once",
        _DropsNotifications,
    ),
    (
        "duplicates_notifications",
        _NOTE,
        "hands out every tenth notification twice",
        "test_notifications_arrive_exactly_once",
        _DuplicatesNotifications,
    ),
    (
        "reorders_notifications",
        _NOTE,
        "claims ordered notifications, hands them out reversed",
        "test_notifications_keep_their_order",
        _ReordersNotifications,
    ),
    (
        "raw_error_on_wrong_shape",
        _ERR,
        "a descriptor array of the wrong shape raises IndexError",
        "test_bad_descriptors_are_a_transport_error",
        _RawErrorOnWrongShape,
    ),
    (
        "unknown_peer_keyerror",
        _ERR,
        "shm: an unknown peer name raises KeyError",
        "test_bad_descriptors_are_a_transport_error",
        _UnknownPeerKeyError,
    ),
    (
        "one_region_end_unchecked",
        _ERR,
        "shm: a peer's only region is bounded at its start, not its end",
        "test_bad_descriptors_are_a_transport_error",
        _OneRegionEndUnchecked,
    ),
    (
        "wait_sleeps_whole_seconds",
        _WAIT,
        "wait(timeout) sleeps ceil(timeout) seconds",
        "test_wait_returns_within_its_timeout",
        _WaitSleepsWholeSeconds,
    ),
    (
        "leaks_thread_on_close",
        _CLOSE,
        "leaves a thread running after close",
        "test_close_leaves_no_threads_fds_or_mappings",
        _LeaksThreadOnClose,
    ),
    (
        "leaks_fd_on_close",
        _CLOSE,
        "leaves a file descriptor open after close",
        "test_close_leaves_no_threads_fds_or_mappings",
        _LeaksFdOnClose,
    ),
    (
        "thread_per_transfer",
        _CLOSE,
        "starts a thread per transfer that only close stops",
        "test_transfers_and_releases_return_resources_to_baseline",
        _ThreadPerTransfer,
    ),
    (
        "closed_agent_accepts_register",
        _CLOSE,
        "register after close returns a handle",
        "test_a_closed_agent_refuses_every_call",
        _ClosedAgentAcceptsRegister,
    ),
    (
        "close_hangs",
        _CLOSE,
        "close never returns",
        "test_a_closed_agent_refuses_every_call",
        _CloseHangs,
    ),
]

_POLLS_FAILED = (_FailedPollsPendingAgain, _FailureReportedAsDone)
VARIANTS: dict[str, Variant] = {}
for _name, _section, _breaks, _test, _cls in _LIBRARY:
    _independent = issubclass(_cls, DelegatingTransport)
    _make = _wrapper(_cls) if _independent else _subclass(_cls)
    _inners = ("shm",)
    if _independent:
        # nixl refuses a post to a dead peer at once, so no poll of it ever sees FAILED.
        _inners = ("shm", "ucx") if _cls in _POLLS_FAILED else ("shm", "nixl", "ucx")
    _timeout = 5.0 if _name == "close_hangs" else 60.0
    VARIANTS[_name] = Variant(
        _name, _section, _breaks, _test, _make, _independent, _timeout, _inners
    )
    globals()[_name] = _make


class _ClaimsVram(DelegatingTransport):
    """Claims VRAM that its inner agent cannot register."""

    @property
    def capabilities(self) -> Capabilities:
        kinds = self.inner.capabilities.mem_kinds | {MemKind.VRAM}
        return dataclasses.replace(self.inner.capabilities, mem_kinds=kinds)


def claims_vram(name: str, inner: str = "shm", **options: Any) -> Transport:
    """Outside the library: on a host without a GPU the suite cannot check the claim and
    must say so; with one, it must fail it (the inner shm agent runs without CUDA)."""
    if inner == "shm":
        options = {**options, "cuda": False}
    return _ClaimsVram(create(inner, name, **options))
