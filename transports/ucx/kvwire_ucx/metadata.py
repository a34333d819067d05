"""The ucx transport's metadata blob: worker address and packed remote keys.

A peer needs exactly two things to read or write our memory: our UCP worker address (to
create an endpoint) and, per registered region, its range and the packed rkey. The blob is
msgpack via msgspec, tagged with a format name so a future layout can be told apart.
"""

from __future__ import annotations

import os
import socket

import msgspec

from kvwire.errors import PeerMetadataError

FORMAT = "kvwire-ucx/1"
MAX_BLOB = 64 * 1024 * 1024


class RegionInfo(msgspec.Struct, array_like=True, frozen=True):
    """One registered region as a peer sees it."""

    addr: int
    length: int
    device_id: int
    kind: str
    rkey: bytes


class UcxMetadata(msgspec.Struct, array_like=True, frozen=True, tag=FORMAT):
    """Everything a peer's ``add_peer`` needs."""

    name: str
    worker_address: bytes
    regions: list[RegionInfo]
    ucx_version: str = ""
    host_id: str = ""
    """Kernel boot id, host name and pid namespace: equal means pids mean the same here."""
    pid: int = 0
    start_time: int = 0
    """The agent process's start time (``/proc/<pid>/stat`` field 22), against pid reuse."""


def local_host_id() -> str:
    """Identifies this kernel: processes with equal ids can use shared memory and CMA."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    if not boot:
        return ""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}@{socket.gethostname()}#{pidns}"


def process_start_time(pid: int) -> int:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks after boot); 0 when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return 0
    # The command name (field 2) may hold spaces; fields resume after its closing ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[19]) if len(fields) > 19 else 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(UcxMetadata)


def encode(meta: UcxMetadata) -> bytes:
    return _encoder.encode(meta)


def decode(blob: bytes) -> UcxMetadata:
    """Decode a peer's blob; anything malformed becomes :class:`PeerMetadataError`."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise PeerMetadataError(f"ucx metadata must be bytes, got {type(blob).__name__}")
    if len(blob) > MAX_BLOB:
        raise PeerMetadataError(f"ucx metadata of {len(blob)} bytes exceeds {MAX_BLOB}")
    try:
        meta = _decoder.decode(blob)
    except msgspec.DecodeError as exc:
        raise PeerMetadataError(f"not a {FORMAT} metadata blob: {exc}") from exc
    if not meta.name:
        raise PeerMetadataError("ucx metadata names no agent")
    if not meta.worker_address:
        raise PeerMetadataError("ucx metadata carries no worker address")
    for i, region in enumerate(meta.regions):
        if region.addr < 0 or region.length <= 0 or region.addr + region.length >= 1 << 63:
            raise PeerMetadataError(
                f"ucx metadata region {i} has an invalid range ({region.addr}, {region.length})"
            )
        if not region.rkey:
            raise PeerMetadataError(f"ucx metadata region {i} has no rkey")
    return meta
