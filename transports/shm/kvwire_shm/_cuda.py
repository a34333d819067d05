"""CUDA IPC for VRAM regions, through the CUDA runtime via ctypes (no torch needed).

A registering process exports an IPC handle for the allocation holding each VRAM region;
the peer opens it once in ``add_peer`` and copies with ``cudaMemcpy`` (unified addressing,
so one call serves device-device, host-device and device-host). Everything here is loaded
lazily and only when a CUDA driver is present, so CPU-only hosts never pay for it.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from typing import Any

IPC_HANDLE_BYTES = 64
_MEMCPY_DEFAULT = 4
_IPC_LAZY_PEER_ACCESS = 1


class CudaError(RuntimeError):
    """A CUDA runtime call failed."""


class _Cuda:
    def __init__(self, rt: Any, drv: Any) -> None:
        self.rt = rt
        self.drv = drv
        self.lock = threading.Lock()

    def check(self, code: int, what: str) -> None:
        if code != 0:
            self.rt.cudaGetErrorString.restype = ctypes.c_char_p
            msg = self.rt.cudaGetErrorString(code)
            raise CudaError(f"{what}: CUDA error {code} ({msg.decode() if msg else '?'})")

    def set_device(self, device: int) -> None:
        self.check(self.rt.cudaSetDevice(device), "cudaSetDevice")

    def device_count(self) -> int:
        count = ctypes.c_int(0)
        if self.rt.cudaGetDeviceCount(ctypes.byref(count)) != 0:
            return 0
        return count.value

    def allocation_of(self, ptr: int, device: int) -> tuple[int, int]:
        """(base, size) of the cudaMalloc allocation that holds ``ptr``."""
        self.set_device(device)
        self.check(self.rt.cudaFree(None), "cudaFree(0)")
        base = ctypes.c_uint64(0)
        size = ctypes.c_size_t(0)
        code = self.drv.cuMemGetAddressRange_v2(
            ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)
        )
        if code != 0:
            raise CudaError(f"cuMemGetAddressRange: CUDA driver error {code}")
        return int(base.value), int(size.value)

    def close_handle(self, ptr: int) -> None:
        self.rt.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr))

    def copy(self, dst: int, src: int, nbytes: int, device: int) -> None:
        self.set_device(device)
        self.check(
            self.rt.cudaMemcpy(
                ctypes.c_void_p(dst),
                ctypes.c_void_p(src),
                ctypes.c_size_t(nbytes),
                _MEMCPY_DEFAULT,
            ),
            "cudaMemcpy",
        )

    def copy_all(self, dst: list[int], src: list[int], nbytes: list[int], device: int) -> None:
        """One ``copy`` per span: a chunk of a transfer, on whichever thread runs it."""
        for d, s, n in zip(dst, src, nbytes, strict=True):
            self.copy(d, s, n, device)


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


_state: dict[str, _Cuda | None] = {}


def _runtime_candidates() -> list[str]:
    names = ["libcudart.so", "libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0"]
    for root in ("/usr/local/cuda/lib64", "/usr/local/cuda/lib"):
        names += sorted(glob.glob(os.path.join(root, "libcudart.so*")))
    return names


def cuda() -> _Cuda | None:
    """The CUDA runtime if a driver and at least one device are present, else None."""
    if "rt" in _state:
        return _state["rt"]
    _state["rt"] = None
    try:
        drv = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for name in _runtime_candidates():
        try:
            rt = ctypes.CDLL(name)
        except OSError:
            continue
        rt.cudaIpcOpenMemHandle.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            _IpcHandle,
            ctypes.c_uint,
        ]
        lib = _Cuda(rt, drv)
        if lib.device_count() > 0:
            _state["rt"] = lib
        break
    return _state["rt"]


def open_handle(lib: _Cuda, handle: bytes, device: int) -> int:
    """Open a peer's IPC handle (struct passed by value, as the runtime expects)."""
    lib.set_device(device)
    ptr = ctypes.c_void_p(0)
    value = _IpcHandle.from_buffer_copy(handle)
    lib.check(
        lib.rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), value, _IPC_LAZY_PEER_ACCESS),
        "cudaIpcOpenMemHandle",
    )
    return int(ptr.value or 0)


def export_handle(lib: _Cuda, base: int, device: int) -> bytes:
    lib.set_device(device)
    handle = _IpcHandle()
    lib.check(lib.rt.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(base)), "export")
    return ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES)


def malloc(lib: _Cuda, nbytes: int, device: int) -> int:
    """Device memory for tests and the bench (freed with :func:`free`)."""
    lib.set_device(device)
    ptr = ctypes.c_void_p(0)
    lib.check(lib.rt.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), "cudaMalloc")
    return int(ptr.value or 0)


def free(lib: _Cuda, ptr: int, device: int) -> None:
    lib.set_device(device)
    lib.check(lib.rt.cudaFree(ctypes.c_void_p(ptr)), "cudaFree")
