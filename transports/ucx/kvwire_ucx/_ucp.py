"""A thin ctypes binding to the parts of UCP (UCX's protocol layer) the adapter needs.

This is the only module of ``kvwire_ucx`` that touches ctypes. It binds the libucx-cu12
wheel's ``libucp.so`` at ABI level, so installing kvwire needs no compiler. Every structure
below mirrors the UCX 1.22 headers field by field (``ucp/api/ucp.h``, ``ucp_def.h``); the
offsets are pinned by ``tests/ucx/test_ucx_binding.py`` against figures taken from a C
compiler, because the wheel is built with ``--disable-params-check`` and a wrong layout would
corrupt memory instead of failing cleanly. Each struct starts with a ``field_mask`` and we set
only the bits of the fields we fill, which is what keeps the binding valid across UCX minor
versions.

Objects here are deliberately dumb: no locks and no threads. UCP workers are created in
``UCS_THREAD_MODE_SERIALIZED``; the adapter serialises every call into one worker with its
own lock. Completion callbacks run inside :meth:`Worker.progress` (on whichever thread
called it) and only append to lists that the caller drains afterwards, so no UCP call is
ever made from inside a callback.

Every UCS status other than ``UCS_OK``/``UCS_INPROGRESS`` becomes a
:class:`kvwire.errors.TransportError` (or the subclass the call site names) whose ``status``
is the UCS name, for example ``"UCS_ERR_UNREACHABLE"``.

Why one module of ~970 lines: it is the whole ctypes binding of the UCP calls the adapter
uses (structs, constants, function prototypes and their thin wrappers), kept together so
that every foreign declaration can be checked against ``ucp.h`` in one place.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    Union,
    byref,
    c_char,
    c_char_p,
    c_int,
    c_int8,
    c_size_t,
    c_uint,
    c_uint32,
    c_uint64,
    c_ulong,
    c_void_p,
)
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvwire.errors import TransportError, TransportUnavailableError
from kvwire_ucx._native_load import NATIVE

Array = npt.NDArray[np.int64] | npt.NDArray[np.uint64]

# --------------------------------------------------------------------------------------
# Constants (ucs/type/status.h, ucp/api/ucp.h, ucp/api/ucp_def.h; UCS_BIT(i) == 1 << i)
# --------------------------------------------------------------------------------------

UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_BUSY = -15
UCS_ERR_CONNECTION_RESET = -25

STATUS_NAMES: dict[int, str] = {
    0: "UCS_OK",
    1: "UCS_INPROGRESS",
    -1: "UCS_ERR_NO_MESSAGE",
    -2: "UCS_ERR_NO_RESOURCE",
    -3: "UCS_ERR_IO_ERROR",
    -4: "UCS_ERR_NO_MEMORY",
    -5: "UCS_ERR_INVALID_PARAM",
    -6: "UCS_ERR_UNREACHABLE",
    -7: "UCS_ERR_INVALID_ADDR",
    -8: "UCS_ERR_NOT_IMPLEMENTED",
    -9: "UCS_ERR_MESSAGE_TRUNCATED",
    -10: "UCS_ERR_NO_PROGRESS",
    -11: "UCS_ERR_BUFFER_TOO_SMALL",
    -12: "UCS_ERR_NO_ELEM",
    -13: "UCS_ERR_SOME_CONNECTS_FAILED",
    -14: "UCS_ERR_NO_DEVICE",
    -15: "UCS_ERR_BUSY",
    -16: "UCS_ERR_CANCELED",
    -17: "UCS_ERR_SHMEM_SEGMENT",
    -18: "UCS_ERR_ALREADY_EXISTS",
    -19: "UCS_ERR_OUT_OF_RANGE",
    -20: "UCS_ERR_TIMED_OUT",
    -21: "UCS_ERR_EXCEEDS_LIMIT",
    -22: "UCS_ERR_UNSUPPORTED",
    -23: "UCS_ERR_REJECTED",
    -24: "UCS_ERR_NOT_CONNECTED",
    -25: "UCS_ERR_CONNECTION_RESET",
    -80: "UCS_ERR_ENDPOINT_TIMEOUT",
}


def status_name(status: int) -> str:
    """The UCS name of a status code (link and endpoint failures are ranges in UCS)."""
    if status in STATUS_NAMES:
        return STATUS_NAMES[status]
    if -59 <= status <= -40:
        return f"UCS_ERR_LINK_FAILURE({status})"
    if -89 <= status <= -60:
        return f"UCS_ERR_ENDPOINT_FAILURE({status})"
    return f"UCS_STATUS({status})"


# ucp_params_t.field_mask / features
UCP_PARAM_FIELD_FEATURES = 1 << 0
UCP_PARAM_FIELD_MT_WORKERS_SHARED = 1 << 5
UCP_PARAM_FIELD_NAME = 1 << 8
UCP_FEATURE_RMA = 1 << 1
UCP_FEATURE_WAKEUP = 1 << 4
UCP_FEATURE_AM = 1 << 6

# ucp_worker_params_t.field_mask
UCP_WORKER_PARAM_FIELD_THREAD_MODE = 1 << 0
UCP_WORKER_PARAM_FIELD_EVENTS = 1 << 2
UCP_WORKER_PARAM_FIELD_NAME = 1 << 6
UCP_WAKEUP_RMA = 1 << 0
UCP_WAKEUP_TX = 1 << 10
UCP_WAKEUP_RX = 1 << 11

# ucs_thread_mode_t
UCS_THREAD_MODE_SINGLE = 0
UCS_THREAD_MODE_SERIALIZED = 1
UCS_THREAD_MODE_MULTI = 2

# ucp_worker_attr_t / ucp_context_attr_t field masks
UCP_WORKER_ATTR_FIELD_ADDRESS = 1 << 1
UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER = 1 << 3
UCP_ATTR_FIELD_MEMORY_TYPES = 1 << 2

# ucp_ep_params_t
UCP_EP_PARAM_FIELD_REMOTE_ADDRESS = 1 << 0
UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE = 1 << 1
UCP_EP_PARAM_FIELD_ERR_HANDLER = 1 << 2
UCP_EP_PARAM_FIELD_NAME = 1 << 7
UCP_ERR_HANDLING_MODE_NONE = 0
UCP_ERR_HANDLING_MODE_PEER = 1
UCP_EP_CLOSE_FLAG_FORCE = 1 << 0

# ucp_mem_map_params_t
UCP_MEM_MAP_PARAM_FIELD_ADDRESS = 1 << 0
UCP_MEM_MAP_PARAM_FIELD_LENGTH = 1 << 1
UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE = 1 << 4

# ucs_memory_type_t
UCS_MEMORY_TYPE_HOST = 0
UCS_MEMORY_TYPE_CUDA = 1

# ucp_request_param_t.op_attr_mask
UCP_OP_ATTR_FIELD_CALLBACK = 1 << 1
UCP_OP_ATTR_FIELD_USER_DATA = 1 << 2
UCP_OP_ATTR_FIELD_FLAGS = 1 << 4
UCP_OP_ATTR_FIELD_MEMORY_TYPE = 1 << 6
UCP_OP_ATTR_FIELD_MEMH = 1 << 8

# active messages
UCP_AM_HANDLER_PARAM_FIELD_ID = 1 << 0
UCP_AM_HANDLER_PARAM_FIELD_FLAGS = 1 << 1
UCP_AM_HANDLER_PARAM_FIELD_CB = 1 << 2
UCP_AM_HANDLER_PARAM_FIELD_ARG = 1 << 3
UCP_AM_FLAG_WHOLE_MSG = 1 << 0
UCP_AM_SEND_FLAG_EAGER = 1 << 1
UCP_AM_RECV_ATTR_FLAG_RNDV = 1 << 17

_PTR_LIMIT = 1 << 64
_ERR_PTR_MIN = _PTR_LIMIT - 100
"""``UCS_PTR_IS_ERR``: a returned pointer at or above ``(uintptr_t)UCS_ERR_LAST``."""

# --------------------------------------------------------------------------------------
# Structures (x86-64 / aarch64 LP64 layouts of UCX 1.22)
# --------------------------------------------------------------------------------------

ucs_status_t = c_int8
"""``ucs_status_t`` is a *packed* enum in UCX: one signed byte, not an int."""


class UcpParams(Structure):
    """``ucp_params_t`` (88 bytes)."""

    _fields_ = (
        ("field_mask", c_uint64),
        ("features", c_uint64),
        ("request_size", c_size_t),
        ("request_init", c_void_p),
        ("request_cleanup", c_void_p),
        ("tag_sender_mask", c_uint64),
        ("mt_workers_shared", c_int),
        ("estimated_num_eps", c_size_t),
        ("estimated_num_ppn", c_size_t),
        ("name", c_char_p),
        ("node_local_id", c_size_t),
    )


class UcsCpuSet(Structure):
    """``ucs_cpu_set_t``: 1024 bits."""

    _fields_ = (("ucs_bits", c_ulong * 16),)


class UcpWorkerParams(Structure):
    """``ucp_worker_params_t`` (200 bytes)."""

    _fields_ = (
        ("field_mask", c_uint64),
        ("thread_mode", c_int),
        ("cpu_mask", UcsCpuSet),
        ("events", c_uint),
        ("user_data", c_void_p),
        ("event_fd", c_int),
        ("flags", c_uint64),
        ("name", c_char_p),
        ("am_alignment", c_size_t),
        ("client_id", c_uint64),
    )


class UcpWorkerAttr(Structure):
    """``ucp_worker_attr_t`` (80 bytes)."""

    _fields_ = (
        ("field_mask", c_uint64),
        ("thread_mode", c_int),
        ("address_flags", c_uint32),
        ("address", c_void_p),
        ("address_length", c_size_t),
        ("max_am_header", c_size_t),
        ("name", c_char * 32),
        ("max_debug_string", c_size_t),
    )


class UcpContextAttr(Structure):
    """``ucp_context_attr_t`` (72 bytes)."""

    _fields_ = (
        ("field_mask", c_uint64),
        ("request_size", c_size_t),
        ("thread_mode", c_int),
        ("memory_types", c_uint64),
        ("name", c_char * 32),
        ("device_counter_size", c_size_t),
    )


ErrHandlerFn = CFUNCTYPE(None, c_void_p, c_void_p, ucs_status_t)
"""``void (*)(void *arg, ucp_ep_h ep, ucs_status_t status)``."""

SendCallbackFn = CFUNCTYPE(None, c_void_p, ucs_status_t, c_void_p)
"""``ucp_send_nbx_callback_t``: ``void (*)(void *request, ucs_status_t, void *user_data)``."""

AmRecvCallbackFn = CFUNCTYPE(
    ucs_status_t, c_void_p, c_void_p, c_size_t, c_void_p, c_size_t, c_void_p
)
"""``ucp_am_recv_callback_t``: (arg, header, header_length, data, length, param) -> status."""


class UcpErrHandler(Structure):
    """``ucp_err_handler_t``."""

    _fields_ = (("cb", ErrHandlerFn), ("arg", c_void_p))


class UcsSockAddr(Structure):
    """``ucs_sock_addr_t``."""

    _fields_ = (("addr", c_void_p), ("addrlen", c_uint32))


class UcpEpParams(Structure):
    """``ucp_ep_params_t`` (104 bytes)."""

    _fields_ = (
        ("field_mask", c_uint64),
        ("address", c_void_p),
        ("err_mode", c_int),
        ("err_handler", UcpErrHandler),
        ("user_data", c_void_p),
        ("flags", c_uint),
        ("sockaddr", UcsSockAddr),
        ("conn_request", c_void_p),
        ("name", c_char_p),
        ("local_sockaddr", UcsSockAddr),
    )


class UcpMemMapParams(Structure):
    """``ucp_mem_map_params_t`` (48 bytes)."""

    _fields_ = (
        ("field_mask", c_uint64),
        ("address", c_void_p),
        ("length", c_size_t),
        ("flags", c_uint),
        ("prot", c_uint),
        ("memory_type", c_int),
        ("exported_memh_buffer", c_void_p),
    )


class _RequestCallback(Union):
    _fields_ = (("send", SendCallbackFn), ("raw", c_void_p))


class UcpRequestParam(Structure):
    """``ucp_request_param_t`` (96 bytes)."""

    _fields_ = (
        ("op_attr_mask", c_uint32),
        ("flags", c_uint32),
        ("request", c_void_p),
        ("cb", _RequestCallback),
        ("datatype", c_uint64),
        ("user_data", c_void_p),
        ("reply_buffer", c_void_p),
        ("memory_type", c_int),
        ("recv_info", c_void_p),
        ("memh", c_void_p),
        ("remote_datatype", c_uint64),
        ("remote", c_void_p),
        ("remote_count", c_size_t),
    )


class UcpAmHandlerParam(Structure):
    """``ucp_am_handler_param_t`` (32 bytes)."""

    _fields_ = (
        ("field_mask", c_uint64),
        ("id", c_uint),
        ("flags", c_uint32),
        ("cb", AmRecvCallbackFn),
        ("arg", c_void_p),
    )


class UcpAmRecvParam(Structure):
    """``ucp_am_recv_param_t`` (16 bytes)."""

    _fields_ = (("recv_attr", c_uint64), ("reply_ep", c_void_p))


# --------------------------------------------------------------------------------------
# Library loading
# --------------------------------------------------------------------------------------

_EXTRA_HINT = "install the extra: pip install 'kvwire[ucx]' (the libucx-cu12 wheel)"

# (name, restype, argtypes) of every function the binding calls.
_PROTOTYPES: tuple[tuple[str, Any, tuple[Any, ...]], ...] = (
    ("ucp_get_version_string", c_char_p, ()),
    ("ucp_config_read", ucs_status_t, (c_char_p, c_char_p, POINTER(c_void_p))),
    ("ucp_config_modify", ucs_status_t, (c_void_p, c_char_p, c_char_p)),
    ("ucp_config_release", None, (c_void_p,)),
    (
        "ucp_init_version",
        ucs_status_t,
        (c_uint, c_uint, POINTER(UcpParams), c_void_p, POINTER(c_void_p)),
    ),
    ("ucp_cleanup", None, (c_void_p,)),
    ("ucp_context_query", ucs_status_t, (c_void_p, POINTER(UcpContextAttr))),
    ("ucp_worker_create", ucs_status_t, (c_void_p, POINTER(UcpWorkerParams), POINTER(c_void_p))),
    ("ucp_worker_destroy", None, (c_void_p,)),
    ("ucp_worker_query", ucs_status_t, (c_void_p, POINTER(UcpWorkerAttr))),
    ("ucp_worker_release_address", None, (c_void_p, c_void_p)),
    ("ucp_worker_progress", c_uint, (c_void_p,)),
    ("ucp_worker_get_efd", ucs_status_t, (c_void_p, POINTER(c_int))),
    ("ucp_worker_arm", ucs_status_t, (c_void_p,)),
    ("ucp_worker_signal", ucs_status_t, (c_void_p,)),
    ("ucp_worker_set_am_recv_handler", ucs_status_t, (c_void_p, POINTER(UcpAmHandlerParam))),
    ("ucp_ep_create", ucs_status_t, (c_void_p, POINTER(UcpEpParams), POINTER(c_void_p))),
    ("ucp_ep_close_nbx", c_void_p, (c_void_p, c_void_p)),
    ("ucp_ep_flush_nbx", c_void_p, (c_void_p, c_void_p)),
    ("ucp_mem_map", ucs_status_t, (c_void_p, POINTER(UcpMemMapParams), POINTER(c_void_p))),
    ("ucp_mem_unmap", ucs_status_t, (c_void_p, c_void_p)),
    ("ucp_rkey_pack", ucs_status_t, (c_void_p, c_void_p, POINTER(c_void_p), POINTER(c_size_t))),
    ("ucp_rkey_buffer_release", None, (c_void_p,)),
    ("ucp_ep_rkey_unpack", ucs_status_t, (c_void_p, c_char_p, POINTER(c_void_p))),
    ("ucp_rkey_destroy", None, (c_void_p,)),
    # Hot path: plain integers in, so ctypes converts as little as possible per call.
    ("ucp_get_nbx", c_void_p, (c_void_p, c_void_p, c_size_t, c_uint64, c_void_p, c_void_p)),
    ("ucp_put_nbx", c_void_p, (c_void_p, c_void_p, c_size_t, c_uint64, c_void_p, c_void_p)),
    (
        "ucp_am_send_nbx",
        c_void_p,
        (c_void_p, c_uint, c_void_p, c_size_t, c_void_p, c_size_t, c_void_p),
    ),
    ("ucp_request_check_status", ucs_status_t, (c_void_p,)),
    ("ucp_request_free", None, (c_void_p,)),
    ("ucs_status_string", c_char_p, (ucs_status_t,)),
)


class Library:
    """``libucp`` with every prototype the binding uses declared."""

    def __init__(self, ucp: ctypes.CDLL, path: str) -> None:
        self.path = path
        self._ucp = ucp
        for name, restype, argtypes in _PROTOTYPES:
            fn = getattr(ucp, name)
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name, fn)
        address = _address_of(ucp)
        progress, check_status = address("ucp_worker_progress"), address("ucp_request_check_status")
        free = address("ucp_request_free")
        self.native_get = (address("ucp_get_nbx"), free, progress, check_status)
        """What the C helper's ``rma`` calls to get (function addresses)."""
        self.native_put = (address("ucp_put_nbx"), free, progress, check_status)

    def __getattr__(self, name: str) -> Any:  # prototypes are set in __init__
        raise AttributeError(name)

    @property
    def version(self) -> str:
        raw: bytes = self.ucp_get_version_string()
        return raw.decode()

    def describe(self, status: int) -> str:
        raw: bytes | None = self.ucs_status_string(status)
        return raw.decode() if raw else status_name(status)


def _address_of(ucp: ctypes.CDLL) -> Callable[[str], int]:
    def address(name: str) -> int:
        return ctypes.cast(getattr(ucp, name), c_void_p).value or 0

    return address


_LIBRARY: Library | None = None


def load_library() -> Library:
    """Load the wheel's UCX libraries once per process.

    The libucx wheel's own loader opens ``libucs``, ``libuct`` and ``libucp`` with
    ``RTLD_LOCAL``, so UCX's symbols stay out of the global namespace and do not collide
    with another UCX copy (NIXL bundles its own) loaded into the same process.
    """
    global _LIBRARY
    if _LIBRARY is not None:
        return _LIBRARY
    try:
        import libucx
    except ImportError as exc:
        raise TransportUnavailableError(
            f"the ucx transport needs the UCX libraries: {_EXTRA_HINT}", status=None
        ) from exc
    try:
        handles = libucx.load_library()
    except OSError as exc:
        raise TransportUnavailableError(
            f"cannot load the UCX libraries ({exc}); {_EXTRA_HINT}"
        ) from exc
    ucp: ctypes.CDLL | None = None
    for handle in handles:
        if handle is not None and os.path.basename(str(handle._name)).startswith("libucp."):
            ucp = handle
    if ucp is None:
        raise TransportUnavailableError(f"libucp.so not found in the libucx package; {_EXTRA_HINT}")
    try:
        _LIBRARY = Library(ucp, str(ucp._name))
    except AttributeError as exc:
        raise TransportUnavailableError(
            f"libucp at {ucp._name} lacks a UCP 1.22 function ({exc}); {_EXTRA_HINT}"
        ) from exc
    return _LIBRARY


def check(
    lib: Library, status: int, what: str, error: type[TransportError] = TransportError
) -> None:
    """Raise ``error`` unless ``status`` is ``UCS_OK``; keeps the UCS name in ``.status``."""
    if status != UCS_OK:
        name = status_name(status)
        raise error(f"{what} failed: {lib.describe(status)} ({name})", status=name)


def _pointer_status(ptr: int | None) -> int | None:
    """``UCS_PTR_STATUS`` of a returned ``ucs_status_ptr_t``: None for a live request."""
    if ptr is None:
        return UCS_OK
    if ptr >= _ERR_PTR_MIN:
        return ptr - _PTR_LIMIT
    return None


# --------------------------------------------------------------------------------------
# Context, memory, worker, endpoint
# --------------------------------------------------------------------------------------


class Context:
    """``ucp_context_h``: the UCX configuration (``UCX_*`` environment) and resources.

    ``UCX_TLS``, ``UCX_NET_DEVICES`` and every other ``UCX_*`` variable are read by
    ``ucp_config_read`` here; ``config`` overrides them (names without the ``UCX_`` prefix).
    """

    def __init__(
        self,
        lib: Library,
        *,
        name: str,
        config: dict[str, str] | None = None,
    ) -> None:
        self.lib = lib
        cfg = c_void_p()
        check(lib, lib.ucp_config_read(None, None, byref(cfg)), "ucp_config_read")
        try:
            for key, value in (config or {}).items():
                check(
                    lib,
                    lib.ucp_config_modify(cfg, key.encode(), str(value).encode()),
                    f"ucp_config_modify({key}={value})",
                )
            params = UcpParams()
            params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME
            params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP
            self._name = name.encode()[:31]
            params.name = self._name
            handle = c_void_p()
            check(
                lib,
                lib.ucp_init_version(1, 22, byref(params), cfg, byref(handle)),
                "ucp_init",
                TransportUnavailableError,
            )
        finally:
            lib.ucp_config_release(cfg)
        self.handle: int | None = handle.value
        attr = UcpContextAttr()
        attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES
        check(lib, lib.ucp_context_query(self.handle, byref(attr)), "ucp_context_query")
        self.memory_types = int(attr.memory_types)

    @property
    def supports_cuda(self) -> bool:
        """Whether this UCX build and machine can register CUDA device memory."""
        return bool(self.memory_types & (1 << UCS_MEMORY_TYPE_CUDA))

    def mem_map(self, address: int, length: int, *, cuda: bool = False) -> MemHandle:
        """Register ``[address, address + length)`` with every memory domain UCX uses."""
        params = UcpMemMapParams()
        params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH
        params.address = address
        params.length = length
        if cuda:
            params.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE
            params.memory_type = UCS_MEMORY_TYPE_CUDA
        memh = c_void_p()
        from kvwire.errors import RegistrationError

        check(
            self.lib,
            self.lib.ucp_mem_map(self.handle, byref(params), byref(memh)),
            f"ucp_mem_map({address:#x}, {length})",
            RegistrationError,
        )
        assert memh.value is not None
        return MemHandle(self, memh.value, address, length, cuda)

    def close(self) -> None:
        if self.handle is not None:
            self.lib.ucp_cleanup(self.handle)
            self.handle = None


class MemHandle:
    """A mapped region (``ucp_mem_h``) and the request parameters that name it.

    ``param_address`` is the address of a ``ucp_request_param_t`` carrying this ``memh``;
    RMA calls on the region pass it so UCX skips its registration-cache lookup.
    """

    def __init__(self, context: Context, memh: int, address: int, length: int, cuda: bool) -> None:
        self._context = context
        self.memh: int | None = memh
        self.address = address
        self.length = length
        self.cuda = cuda
        self.param = UcpRequestParam()
        self.param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FIELD_MEMORY_TYPE
        self.param.memh = memh
        self.param.memory_type = UCS_MEMORY_TYPE_CUDA if cuda else UCS_MEMORY_TYPE_HOST
        self.param_address = ctypes.addressof(self.param)

    def pack_rkey(self) -> bytes:
        """The packed remote key a peer unpacks to access this region."""
        lib = self._context.lib
        buf = c_void_p()
        size = c_size_t()
        check(
            lib,
            lib.ucp_rkey_pack(self._context.handle, self.memh, byref(buf), byref(size)),
            "ucp_rkey_pack",
        )
        try:
            return ctypes.string_at(buf.value or 0, size.value)
        finally:
            lib.ucp_rkey_buffer_release(buf)

    def unmap(self) -> None:
        if self.memh is not None and self._context.handle is not None:
            from kvwire.errors import RegistrationError

            memh, self.memh = self.memh, None
            check(
                self._context.lib,
                self._context.lib.ucp_mem_unmap(self._context.handle, memh),
                "ucp_mem_unmap",
                RegistrationError,
            )


@dataclass
class Completion:
    """A request that finished inside :meth:`Worker.progress`: its token and status."""

    token: int
    status: int


class Worker:
    """``ucp_worker_h``: progress engine, address, active-message handler, endpoints.

    Not thread-safe by itself (``UCS_THREAD_MODE_SERIALIZED``): the caller holds one lock
    around every method. Callbacks only record what happened, in :attr:`completions`,
    :attr:`messages` and :attr:`failed_endpoints`, which the caller takes after progress
    returns.
    """

    def __init__(self, context: Context, *, name: str, am_id: int) -> None:
        self.context = context
        self.lib = lib = context.lib
        params = UcpWorkerParams()
        params.field_mask = (
            UCP_WORKER_PARAM_FIELD_THREAD_MODE
            | UCP_WORKER_PARAM_FIELD_NAME
            | UCP_WORKER_PARAM_FIELD_EVENTS
        )
        params.thread_mode = UCS_THREAD_MODE_SERIALIZED
        params.events = UCP_WAKEUP_RMA | UCP_WAKEUP_TX | UCP_WAKEUP_RX
        self._name = name.encode()[:31]
        params.name = self._name
        handle = c_void_p()
        check(
            lib,
            lib.ucp_worker_create(context.handle, byref(params), byref(handle)),
            "ucp_worker_create",
        )
        self.handle: int | None = handle.value
        self.am_id = am_id
        self.completions: list[Completion] = []
        self.messages: list[tuple[bytes, bytes]] = []
        self.failed_endpoints: list[tuple[int, int]] = []
        self._pending_sends: dict[int, object] = {}
        self._next_token = 1
        # Callback trampolines must outlive the worker; keep them on it.
        self._on_send = SendCallbackFn(self._send_done)
        self._on_am = AmRecvCallbackFn(self._am_received)
        self._on_error = ErrHandlerFn(self._endpoint_failed)
        self._flush_param = UcpRequestParam()
        self._flush_param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA
        self._flush_param.cb.send = self._on_send
        self._am_param = UcpRequestParam()
        self._am_param.op_attr_mask = (
            UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS
        )
        self._am_param.flags = UCP_AM_SEND_FLAG_EAGER
        self._am_param.cb.send = self._on_send
        try:
            attr = UcpWorkerAttr()
            attr.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS | UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER
            check(lib, lib.ucp_worker_query(self.handle, byref(attr)), "ucp_worker_query")
            self.address = ctypes.string_at(attr.address, attr.address_length)
            self.max_am_header = int(attr.max_am_header)
            lib.ucp_worker_release_address(self.handle, attr.address)
            am = UcpAmHandlerParam()
            am.field_mask = (
                UCP_AM_HANDLER_PARAM_FIELD_ID
                | UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                | UCP_AM_HANDLER_PARAM_FIELD_CB
            )
            am.id = am_id
            am.flags = UCP_AM_FLAG_WHOLE_MSG
            am.cb = self._on_am
            check(
                lib,
                lib.ucp_worker_set_am_recv_handler(self.handle, byref(am)),
                "ucp_worker_set_am_recv_handler",
            )
        except BaseException:
            self.destroy()
            raise

    # -- callbacks (run inside ucp_worker_progress; record only) -------------------------

    def _send_done(self, request: int | None, status: int, user_data: int | None) -> None:
        token = int(user_data or 0)
        self._pending_sends.pop(token, None)
        self.completions.append(Completion(token, int(status)))
        if request:
            self.lib.ucp_request_free(request)

    def _am_received(
        self,
        arg: int | None,
        header: int | None,
        header_length: int,
        data: int | None,
        length: int,
        param: int | None,
    ) -> int:
        del arg
        head = ctypes.string_at(header or 0, header_length) if header_length else b""
        recv = UcpAmRecvParam.from_address(param) if param else None
        if recv is not None and recv.recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV:
            # Our senders force eager, so a rendezvous message is not ours.
            return UCS_OK
        body = ctypes.string_at(data or 0, length) if length else b""
        self.messages.append((head, body))
        return UCS_OK

    def _endpoint_failed(self, arg: int | None, ep: int | None, status: int) -> None:
        self.failed_endpoints.append((int(arg or 0), int(status)))

    # -- progress and sleeping ------------------------------------------------------------

    def progress(self) -> int:
        """One ``ucp_worker_progress``; the number of events it handled."""
        count: int = self.lib.ucp_worker_progress(self.handle)
        return count

    def progress_all(self) -> int:
        """Progress until the worker reports nothing left to do."""
        total = 0
        while True:
            n = self.progress()
            if not n:
                return total
            total += n

    def event_fd(self) -> int:
        """The worker's event file descriptor (readable when :meth:`arm`-ed and events come)."""
        fd = c_int()
        check(self.lib, self.lib.ucp_worker_get_efd(self.handle, byref(fd)), "ucp_worker_get_efd")
        return fd.value

    def arm(self) -> bool:
        """Arm the event fd; False if events are already pending (progress again first)."""
        status = self.lib.ucp_worker_arm(self.handle)
        if status == UCS_ERR_BUSY:
            return False
        check(self.lib, status, "ucp_worker_arm")
        return True

    def signal(self) -> None:
        """Make the event fd readable from any thread (wakes a sleeping progress thread)."""
        check(self.lib, self.lib.ucp_worker_signal(self.handle), "ucp_worker_signal")

    # -- endpoints ------------------------------------------------------------------------

    def token(self) -> int:
        """A fresh non-zero token for ``user_data`` of a request or an endpoint."""
        token = self._next_token
        self._next_token += 1
        return token

    def connect(self, address: bytes, *, token: int, peer_errors: bool, name: str) -> Endpoint:
        """Create an endpoint to a worker address (``ucp_ep_create``).

        With ``peer_errors`` the endpoint uses ``UCP_ERR_HANDLING_MODE_PEER`` and a failure
        is reported as ``(token, status)`` in :attr:`failed_endpoints`.
        """
        addr_buf = ctypes.create_string_buffer(address, len(address))
        params = UcpEpParams()
        params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_NAME
        params.address = ctypes.addressof(addr_buf)
        ep_name = name.encode()[:31]
        params.name = ep_name
        if peer_errors:
            params.field_mask |= (
                UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER
            )
            params.err_mode = UCP_ERR_HANDLING_MODE_PEER
            params.err_handler.cb = self._on_error
            params.err_handler.arg = token
        handle = c_void_p()
        from kvwire.errors import PeerMetadataError

        check(
            self.lib,
            self.lib.ucp_ep_create(self.handle, byref(params), byref(handle)),
            f"ucp_ep_create({name})",
            PeerMetadataError,
        )
        assert handle.value is not None
        return Endpoint(self, handle.value)

    def destroy(self) -> None:
        if self.handle is not None:
            self.lib.ucp_worker_destroy(self.handle)
            self.handle = None
            self._pending_sends.clear()


class Endpoint:
    """``ucp_ep_h``: RMA, flush and active messages towards one peer worker."""

    def __init__(self, worker: Worker, handle: int) -> None:
        self.worker = worker
        self.lib = worker.lib
        self.handle: int | None = handle

    def unpack_rkey(self, packed: bytes) -> int:
        """``ucp_ep_rkey_unpack``: the ``ucp_rkey_h`` (free it with :meth:`destroy_rkey`)."""
        from kvwire.errors import PeerMetadataError

        rkey = c_void_p()
        check(
            self.lib,
            self.lib.ucp_ep_rkey_unpack(self.handle, packed, byref(rkey)),
            "ucp_ep_rkey_unpack",
            PeerMetadataError,
        )
        assert rkey.value is not None
        return rkey.value

    def destroy_rkey(self, rkey: int) -> None:
        self.lib.ucp_rkey_destroy(rkey)

    def post_rma(
        self,
        write: bool,
        local_addrs: Sequence[int],
        lengths: Sequence[int],
        remote_addrs: Sequence[int],
        rkeys: Sequence[int],
        params: Sequence[int],
    ) -> int:
        """Post one ``ucp_get_nbx`` (or ``ucp_put_nbx``) per row, without waiting.

        UCP has no multi-element get (the 1.22 SGL datatype is documented for put only), so
        this is one ctypes call per (already coalesced) row, kept as tight as ctypes
        allows: arguments are plain ints and a request UCX hands back is released at once
        (``ucp_request_free`` lets it finish on its own); completion of the whole batch is
        observed with one :meth:`flush`. Raises on the first row UCX rejects.

        Returns how many rows were still running when posted; 0 means every row completed
        inside its call (for a get: the bytes are already in local memory).
        """
        if NATIVE is not None:
            return self.post_rma_native(
                write, local_addrs, lengths, remote_addrs, rkeys, params, wait_ns=0
            )
        fn = self.lib.ucp_put_nbx if write else self.lib.ucp_get_nbx
        free = self.lib.ucp_request_free
        ep = self.handle
        running = 0
        for la, n, ra, rk, pa in zip(
            local_addrs, lengths, remote_addrs, rkeys, params, strict=True
        ):
            req = fn(ep, la, n, ra, rk, pa)
            if req is not None:
                if req >= _ERR_PTR_MIN:
                    status = req - _PTR_LIMIT
                    check(self.lib, status, "ucp_put_nbx" if write else "ucp_get_nbx")
                free(req)
                running += 1
        return running

    def post_rma_native(
        self,
        write: bool,
        local_addrs: Sequence[int] | Array,
        lengths: Sequence[int] | Array,
        remote_addrs: Sequence[int] | Array,
        rkeys: Sequence[int] | Array,
        params: Sequence[int] | Array,
        *,
        wait_ns: int,
    ) -> int:
        """:meth:`post_rma` in the C helper: every row posted by one call (lists or
        contiguous 64-bit arrays), then the worker progressed until each request completed
        or ``wait_ns`` passed, the GIL released throughout; the same return and errors."""
        assert NATIVE is not None
        lib = self.lib
        functions = lib.native_put if write else lib.native_get
        worker = self.worker.handle or 0
        running, status, _ = NATIVE.rma(
            functions,
            worker,
            self.handle or 0,
            local_addrs,
            lengths,
            remote_addrs,
            rkeys,
            params,
            wait_ns,
        )
        if status:
            check(lib, status, "ucp_put_nbx" if write else "ucp_get_nbx")
        return int(running)

    def flush(self) -> tuple[int, int | None]:
        """``ucp_ep_flush_nbx``: ``(token, status)``; status None while still running.

        A running flush completes later as a :class:`Completion` with this token.
        """
        worker = self.worker
        token = worker.token()
        worker._flush_param.user_data = token
        req = self.lib.ucp_ep_flush_nbx(self.handle, byref(worker._flush_param))
        status = _pointer_status(req)
        if status is None:
            worker._pending_sends[token] = None
        return token, status

    def send_am(self, header: bytes, body: bytes) -> tuple[int, int | None]:
        """``ucp_am_send_nbx`` (eager): ``(token, status)``; None while still running.

        The buffers are kept alive until the completion callback fires.
        """
        worker = self.worker
        token = worker.token()
        head_buf = ctypes.create_string_buffer(header, len(header) or 1)
        body_buf = ctypes.create_string_buffer(body, len(body) or 1)
        worker._am_param.user_data = token
        req = self.lib.ucp_am_send_nbx(
            self.handle,
            worker.am_id,
            head_buf,
            len(header),
            body_buf,
            len(body),
            byref(worker._am_param),
        )
        status = _pointer_status(req)
        if status is None:
            worker._pending_sends[token] = (head_buf, body_buf)
        return token, status

    def close(self, progress: Callable[[], int], *, force: bool) -> None:
        """``ucp_ep_close_nbx``, progressing until the close completes.

        ``force`` closes without a goodbye to the peer (needed after a peer failure).
        """
        if self.handle is None:
            return
        handle, self.handle = self.handle, None
        param = UcpRequestParam()
        param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS
        param.flags = UCP_EP_CLOSE_FLAG_FORCE if force else 0
        req = self.lib.ucp_ep_close_nbx(handle, byref(param))
        if _pointer_status(req) is None:
            spins = 0
            while self.lib.ucp_request_check_status(req) == UCS_INPROGRESS:
                if not progress():
                    spins += 1
                    if spins > 200_000:
                        break
            self.lib.ucp_request_free(req)
