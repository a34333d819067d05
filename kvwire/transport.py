"""The block-move interface every kvwire transport adapter implements.

The shape follows NIXL's agent API, because that is what serving engines already speak:
register memory, exchange an opaque metadata blob, post one-sided READs and WRITEs of
descriptor arrays with an optional notification, poll, release. The core never imports an
adapter; adapters are found through the ``kvwire.transports`` entry-point group, so a
third-party transport installs and loads exactly like ours.

Contract (the conformance suite enforces it):

* A notification attached to a transfer is delivered to the peer only after all of that
  transfer's bytes are visible in the peer's memory.
* ``poll`` returning ``DONE`` means every byte of the transfer has landed; ``FAILED`` is
  reported, never dropped; a terminal state is final: ``poll`` answers the same however
  often it is called before ``release``. A dead peer's transfers end ``FAILED``, whatever
  memory it held.
* ``release`` of a running transfer is safe (it aborts or detaches); releasing twice is an
  error only in the sense of raising ``TransportError``, never a crash. After ``release``
  the agent keeps nothing of the transfer: runs of transfers and releases leave its
  records, threads, descriptors and mappings where they were.
* A row of length 0 is legal and moves nothing; one transfer's rows may fall in any
  registered regions of either side.
* ``deregister`` removes exactly the registration named; handles are never reused;
  deregistering twice, or a handle never issued, raises ``TransportError``.
* ``add_peer`` of a known peer (a repeat, or a refresh with more regions) returns the same
  name, makes every region of the new blob usable and frees the old entry's resources;
  a blob that is not this transport's raises ``PeerMetadataError``. After ``remove_peer``
  posts naming the peer raise until it is added again.
* ``wait(timeout)`` returns within about ``timeout`` seconds when nothing happens.
* Every method raises :class:`kvwire.errors.TransportError` subclasses, never a backend's
  raw exception.
* After ``close()`` no thread, file descriptor or mapping of the transport remains, and
  every call but ``close`` raises ``TransportError``.

docs/writing-a-transport.md lists each clause with the conformance test that enforces it.

Descriptors are ``(N, 3)`` ``int64`` numpy arrays of ``(address, length, device_id)``; the
local and remote arrays of one transfer pair up row by row and must have equal lengths.

Optional extras (not part of the Protocol; used when present; each declared as a Protocol
in ``kvwire_conformance.extras``, or here when the runtime uses it): ``prepare(peer, local,
remote)`` (:class:`PreparesTables`), tables of every row transfers with a peer may post,
taken once per handshake so requests can be made by index; a ``failure_reason(handle)``
method saying why a transfer FAILED; a ``resource_counts()`` method counting what the agent
holds; on the factory or the agent's class, a ``conformance_allocators`` tuple of
``"module:function"`` host allocators, which the conformance suite and
``kvwire bench transport`` also run over, and ``conformance_thresholds``, the sizes where
the adapter changes strategy. docs/transports.md has the contract in prose.
"""

from __future__ import annotations

import enum
import importlib
import logging
import os
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from kvwire.errors import DescriptorError, TransportError, TransportUnavailableError

ENTRY_POINT_GROUP = "kvwire.transports"

Descs = npt.NDArray[np.int64]
"""An ``(N, 3)`` int64 array of ``(address, length, device_id)`` rows."""


class MemKind(str, enum.Enum):
    """Where a region lives; the string values are the ones vLLM puts on the wire."""

    DRAM = "DRAM"
    VRAM = "VRAM"


class XferState(enum.Enum):
    """The state ``poll`` reports for a posted transfer."""

    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"


@dataclass(frozen=True)
class Region:
    """A span of memory to register: host memory (DRAM) or a device's (VRAM)."""

    addr: int
    length: int
    device_id: int = 0
    kind: MemKind = MemKind.DRAM

    def __post_init__(self) -> None:
        if self.addr < 0 or self.length <= 0:
            raise DescriptorError(
                f"region needs a non-negative address and a positive length, "
                f"got addr={self.addr} length={self.length}"
            )


@dataclass(frozen=True)
class Capabilities:
    """What an adapter can do; the conformance suite skips what is absent, with a reason."""

    read: bool = True
    write: bool = True
    notifications: bool = True
    mem_kinds: frozenset[MemKind] = field(default_factory=lambda: frozenset({MemKind.DRAM}))
    cross_process: bool = True
    cross_host: bool = False
    max_descriptors: int | None = None
    ordered_notifications: bool = False
    """Notifications from one peer arrive in the order they were sent."""


@runtime_checkable
class Transport(Protocol):
    """One agent of a transport: a process's endpoint for moving registered memory."""

    @property
    def name(self) -> str:
        """This agent's name, unique among the agents that talk to each other."""
        ...

    @property
    def capabilities(self) -> Capabilities: ...

    def register(self, regions: Sequence[Region]) -> object:
        """Register memory for transfers; returns an opaque handle for ``deregister``."""
        ...

    def deregister(self, handle: object) -> None: ...

    def local_metadata(self) -> bytes:
        """The blob a peer passes to ``add_peer``; carried in ``AgentMetadata.agent_metadata``.

        Must describe every region registered so far.
        """
        ...

    def add_peer(self, blob: bytes) -> str:
        """Make a peer known from its metadata blob; returns the peer's name."""
        ...

    def remove_peer(self, peer: str) -> None: ...

    def read(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        """Post a one-sided READ of ``remote`` (peer memory) into ``local``; returns a handle."""
        ...

    def write(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        """Post a one-sided WRITE of ``local`` into ``remote`` (peer memory)."""
        ...

    def poll(self, handle: object) -> XferState: ...

    def release(self, handle: object) -> None:
        """Forget a transfer; aborts it if still running."""
        ...

    def notify(self, peer: str, message: bytes) -> None:
        """Send a notification that is not attached to a transfer."""
        ...

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        """Every notification received since the last call, as ``(peer name, message)``."""
        ...

    def wait(self, timeout: float) -> None:
        """Block until a transfer may have finished or a notification may have arrived.

        Returns early on activity, otherwise after ``timeout`` seconds. Lets a driver sleep
        instead of spinning; an adapter with nothing better may simply sleep briefly.
        """
        ...

    def close(self) -> None: ...


@runtime_checkable
class PreparesTables(Protocol):
    """An optional extra: a transport that prepares descriptor lists ahead of transfers
    (NIXL's ``prep_xfer_dlist``) and makes a request by row index when every row of it is a
    table row.

    The runtime calls ``prepare`` after each handshake with a peer rank, passing
    ``kvwire.layout.PeerLayout.tables`` (this agent's rows, the peer's rows), then posts a
    request whose rows do not merge well with ``read_rows`` / ``write_rows`` and the plan's
    index arrays (``PeerLayout.plan(rows=True)``). ``read`` and ``write`` stay right for any
    rows. The transport drops the tables when the peer is added again or removed, or a local
    registration changes, so a request is never made from lists that describe memory as it
    was: the row calls raise instead, and the runtime posts rows until the next handshake.
    """

    def prepare(self, peer: str, local: Descs, remote: Descs) -> None: ...

    def read_rows(
        self,
        peer: str,
        local_rows: npt.NDArray[np.int64],
        remote_rows: npt.NDArray[np.int64],
        notify: bytes | None = None,
    ) -> object:
        """``read`` of the tables' rows by index; :class:`kvwire.errors.UnpreparedTablesError`
        when the transport holds no tables for the peer (never prepared, or dropped)."""
        ...

    def write_rows(
        self,
        peer: str,
        local_rows: npt.NDArray[np.int64],
        remote_rows: npt.NDArray[np.int64],
        notify: bytes | None = None,
    ) -> object: ...


class DelegatingTransport:
    """Forwards every call of the transport interface to ``inner``: the base of a wrapper
    that changes a few of them (a shared agent's per-side view, fault injection), so no
    wrapper repeats the interface."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    def register(self, regions: Sequence[Region]) -> object:
        return self.inner.register(regions)

    def deregister(self, handle: object) -> None:
        self.inner.deregister(handle)

    def local_metadata(self) -> bytes:
        return self.inner.local_metadata()

    def add_peer(self, blob: bytes) -> str:
        return self.inner.add_peer(blob)

    def remove_peer(self, peer: str) -> None:
        self.inner.remove_peer(peer)

    def read(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        return self.inner.read(peer, local, remote, notify)

    def write(self, peer: str, local: Descs, remote: Descs, notify: bytes | None = None) -> object:
        return self.inner.write(peer, local, remote, notify)

    def poll(self, handle: object) -> XferState:
        return self.inner.poll(handle)

    def release(self, handle: object) -> None:
        self.inner.release(handle)

    def failure_reason(self, handle: object) -> str | None:
        return failure_detail(self.inner, handle)

    def notify(self, peer: str, message: bytes) -> None:
        self.inner.notify(peer, message)

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        return self.inner.drain_notifications()

    def wait(self, timeout: float) -> None:
        self.inner.wait(timeout)

    def close(self) -> None:
        self.inner.close()


class DelegatingTables(DelegatingTransport):
    """A :class:`DelegatingTransport` over an agent that prepares descriptor tables
    (:class:`PreparesTables`), forwarding those calls too. The agent is checked once, here:
    a protocol ``isinstance`` costs microseconds, too much for every post."""

    def __init__(self, inner: Transport) -> None:
        if not isinstance(inner, PreparesTables):
            raise TypeError(f"transport {inner.name!r} prepares no descriptor tables")
        super().__init__(inner)
        self._tables = inner

    def prepare(self, peer: str, local: Descs, remote: Descs) -> None:
        self._tables.prepare(peer, local, remote)

    def read_rows(
        self,
        peer: str,
        local_rows: npt.NDArray[np.int64],
        remote_rows: npt.NDArray[np.int64],
        notify: bytes | None = None,
    ) -> object:
        return self._tables.read_rows(peer, local_rows, remote_rows, notify)

    def write_rows(
        self,
        peer: str,
        local_rows: npt.NDArray[np.int64],
        remote_rows: npt.NDArray[np.int64],
        notify: bytes | None = None,
    ) -> object:
        return self._tables.write_rows(peer, local_rows, remote_rows, notify)


def failure_detail(transport: object, handle: object) -> str | None:
    """A transport's word on why a transfer failed, where it has one (``failure_reason`` is
    an optional extra): detail for a message, never an error of its own. A wrapper may
    hand out handles of its own, which the agent it wraps does not know; that says nothing."""
    why = getattr(transport, "failure_reason", None)
    if not callable(why):
        return None
    try:
        reason = why(handle)
    except TransportError:
        return None
    return None if reason is None else str(reason)


TransportFactory = Callable[..., Transport]
"""``factory(name: str, **options) -> Transport``; what the entry point names."""


def available() -> dict[str, str]:
    """Installed transports: entry-point name -> ``module:attr``."""
    eps = importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)
    return {ep.name: ep.value for ep in eps}


def load(name: str) -> TransportFactory:
    """The factory of a transport, by entry-point name or ``module:attr``.

    The adapter's module is imported only here, so ``import kvwire`` never pulls in NIXL or
    UCX. A missing optional dependency surfaces as :class:`TransportUnavailableError` that
    names the extra to install.
    """
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = __import__(module_name, fromlist=[attr])
            factory: TransportFactory = getattr(module, attr)
        except (ImportError, AttributeError, ValueError) as exc:
            raise TransportUnavailableError(f"cannot load transport {name!r}: {exc}") from exc
        _check_factory(name, factory)
        return factory
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            try:
                loaded: TransportFactory = ep.load()
            except (ImportError, AttributeError) as exc:
                raise TransportUnavailableError(
                    f"transport {name!r} is installed but cannot be imported ({exc}); "
                    f"install its extra: pip install 'kvwire[{name}]'"
                ) from exc
            return loaded
    known = ", ".join(sorted(available())) or "none"
    raise TransportUnavailableError(f"no transport named {name!r} (installed: {known})")


_TRANSPORT_METHODS = ("register", "local_metadata", "add_peer", "read", "poll", "close")


def _check_factory(name: str, factory: object) -> None:
    """A ``module:attr`` that names something else (a module, a constant, a class without
    the transport's methods) is refused here, not found out in a worker process."""
    if isinstance(factory, types.ModuleType) or not callable(factory):
        raise TransportUnavailableError(
            f"{name!r} is a {type(factory).__name__}, not a transport factory"
        )
    if isinstance(factory, type):
        missing = [m for m in _TRANSPORT_METHODS if not callable(getattr(factory, m, None))]
        if missing:
            raise TransportUnavailableError(
                f"{name!r} is not a transport class (it lacks {', '.join(missing)})"
            )


def create(transport: str, name: str, **options: Any) -> Transport:
    """Load a transport by name and start one agent of it."""
    agent = load(transport)(name, **options)
    missing = [m for m in _TRANSPORT_METHODS if not callable(getattr(agent, m, None))]
    if missing:
        raise TransportUnavailableError(
            f"{transport!r} made a {type(agent).__name__}, not a transport "
            f"(it lacks {', '.join(missing)})"
        )
    return agent


def as_descs(descs: npt.ArrayLike) -> Descs:
    """Validate and normalise a descriptor array to C-contiguous ``(N, 3)`` int64."""
    arr = np.ascontiguousarray(descs, dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise DescriptorError(f"descriptors must have shape (N, 3), got {arr.shape}")
    if arr.shape[0] and ((arr[:, 0] < 0).any() or (arr[:, 1] < 0).any()):
        raise DescriptorError("descriptors must have non-negative addresses and lengths")
    return arr


def as_message(message: object) -> bytes:
    """A notification as ``bytes``; :class:`TransportError` for anything not bytes-like.

    ``bytes(message)`` alone would not do: it turns an int into that many zero bytes and
    raises a bare ``TypeError`` for a str, neither of which the contract allows.
    """
    if isinstance(message, bytes):
        return message
    if isinstance(message, (bytearray, memoryview)):
        return bytes(message)
    raise TransportError(f"a notification must be bytes, got {type(message).__name__}")


def check_pair(local: Descs, remote: Descs) -> None:
    """Raise unless two descriptor arrays pair up row by row with equal lengths."""
    if local.shape != remote.shape:
        raise DescriptorError(
            f"local and remote descriptor counts differ: {local.shape[0]} vs {remote.shape[0]}"
        )
    if local.shape[0] and not np.array_equal(local[:, 1], remote[:, 1]):
        bad = int(np.flatnonzero(local[:, 1] != remote[:, 1])[0])
        raise DescriptorError(
            f"descriptor {bad}: local length {int(local[bad, 1])} != "
            f"remote length {int(remote[bad, 1])}"
        )


KEYED_ROWS = 1024
"""Transfers of at most this many descriptors get a :func:`descs_key`; above it the
transfer itself dwarfs planning it, and hashing the key would not pay."""

_INT64 = np.dtype(np.int64)


def descs_key(local: object, remote: object) -> tuple[bytes, bytes] | None:
    """The exact bytes of a small ``(N, 3)`` int64 descriptor pair, or None.

    Adapters key what they prepared for a transfer (a NIXL request, planned UCX rows) by
    it, so the same descriptors moving again skip validation and planning: the key only
    finds work done earlier from arrays with the very same content, validated then
    (``tobytes`` copies in C order, so views and copies of one array give one key).
    Anything else returns None and takes the validating path. Kept to a handful of
    attribute reads, since this is the 4 KiB hot path (the dtype test is by identity:
    numpy's native int64 dtype is one object; any other spelling merely validates).
    """
    if type(local) is not np.ndarray or type(remote) is not np.ndarray:
        return None
    shape = local.shape
    if (
        local.dtype is not _INT64
        or remote.dtype is not _INT64
        or shape != remote.shape
        or len(shape) != 2
        or shape[1] != 3
        or shape[0] > KEYED_ROWS
    ):
        return None
    return local.tobytes(), remote.tobytes()


def region_of_array(array: npt.NDArray[Any]) -> Region:
    """The host region a C-contiguous numpy array occupies."""
    if not array.flags.c_contiguous:
        raise DescriptorError("only C-contiguous arrays can be registered")
    return Region(addr=int(array.ctypes.data), length=int(array.nbytes), device_id=0)


def region_of_tensor(tensor: Any) -> Region:
    """The region a contiguous torch tensor occupies, on the CPU (DRAM) or a GPU (VRAM).

    Takes the tensor duck-typed so this module never imports torch.
    """
    if not tensor.is_contiguous():
        raise DescriptorError("only contiguous tensors can be registered")
    nbytes = int(tensor.numel()) * int(tensor.element_size())
    device = tensor.device
    if device.type == "cuda":
        return Region(int(tensor.data_ptr()), nbytes, int(device.index or 0), MemKind.VRAM)
    if device.type != "cpu":
        raise DescriptorError(f"tensors on {device.type!r} cannot be registered")
    return Region(int(tensor.data_ptr()), nbytes, 0, MemKind.DRAM)


def wait_for(
    transport: Transport,
    handle: object,
    timeout: float,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> XferState:
    """Poll ``handle`` until it leaves PENDING or ``timeout`` seconds pass; the last state."""
    deadline = clock() + timeout
    state = transport.poll(handle)
    while state is XferState.PENDING:
        remaining = deadline - clock()
        if remaining <= 0:
            break
        transport.wait(min(remaining, 0.01))
        state = transport.poll(handle)
    return state


NO_NATIVE_VAR = "KVWIRE_NO_NATIVE"
"""Set (to anything but ``0``) to run every transport's pure-Python path instead of its C
helper; the tests run both."""


def load_native_helper(module: str, fallback: str) -> types.ModuleType | None:
    """A transport's optional compiled helper, or None with one warning line naming why.

    The core carries no native code; this only imports a transport's own extension module
    (``module``, e.g. ``"kvwire_shm._native"``) so every adapter turns its helper off, and
    says so, the same way. ``fallback`` is what runs instead, for the warning.
    """
    package = module.split(".", 1)[0]
    if os.environ.get(NO_NATIVE_VAR, "") not in ("", "0"):
        why = f"{NO_NATIVE_VAR} is set"
    else:
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            why = f"not built: {exc}"
    logging.getLogger(package).warning("%s: native helper off (%s); %s", package, why, fallback)
    return None
