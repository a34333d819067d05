"""What a rank publishes in the metadata store: the key layout and the record.

Keys: ``/kvwire/v1/engines/{compat hash}/{engine id}/{pp}/{tp}``, so a consumer watches its
own compatibility group only. Values: a :class:`StoreRecord` (msgpack) around the exact
handshake payload bytes a rank's listener serves; with a secret the payload is sealed and
tagged with the authenticated handshake's keys (:func:`kvwire.sidechannel.auth.seal_record`),
bound to the key, so a record copied to another key fails.
"""

from __future__ import annotations

import importlib.metadata

import msgspec

from kvwire.errors import HandshakeAuthError, MetadataStoreError
from kvwire.sidechannel.auth import open_record, seal_record

ROOT = b"/kvwire/v1/engines/"
CLOCK_UNCERTAINTY_S = 0.25
"""How far two hosts' wall clocks may differ (NTP): a store record's clock anchor maps a
producer's deadlines into ours through wall time, not through a measured round trip."""
_MAX_RECORD = 16 << 20

Rank = tuple[int, int]


def group_prefix(compat_hash: str) -> bytes:
    return ROOT + compat_hash.encode() + b"/"


def rank_key(compat_hash: str, engine_id: str, pp_rank: int, tp_rank: int) -> bytes:
    return group_prefix(compat_hash) + f"{engine_id}/{pp_rank}/{tp_rank}".encode()


def parse_key(key: bytes) -> tuple[str, str, Rank] | None:
    """``(compat hash, engine id, (pp, tp))`` of a record key; None for anything else."""
    if not key.startswith(ROOT):
        return None
    parts = key[len(ROOT) :].decode("utf-8", "replace").split("/")
    if len(parts) < 4 or not parts[0] or not parts[-2].isdigit() or not parts[-1].isdigit():
        return None
    return parts[0], "/".join(parts[1:-2]), (int(parts[-2]), int(parts[-1]))


class StoreRecord(msgspec.Struct, frozen=True, array_like=True):
    """One published rank: its handshake payload and what a peer needs besides it."""

    payload: bytes
    """The bytes the rank's listener serves (sealed when ``seal`` is set)."""
    host: str
    port: int
    """The rank's ZMQ listener: the fallback, and what ``kvwire fleet`` shows."""
    clock: float
    wall: float
    """The publisher's driver clock and wall clock read together: a consumer's clock offset."""
    kvwire_version: str
    role: str = ""
    """``producer`` or ``consumer`` (a push-mode consumer publishes too)."""
    seal: bytes = b""
    """With a secret: nonce and tag (``kvwire.sidechannel.auth``); empty when plain."""

    def header(self) -> bytes:
        """Every field but the payload and the seal: what the tag covers besides them."""
        return _encoder.encode(
            (self.host, self.port, self.clock, self.wall, self.kvwire_version, self.role)
        )


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StoreRecord)


def _kvwire_version() -> str:
    try:
        return importlib.metadata.version("kvwire")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a source tree
        return "unknown"


def encode_record(
    key: bytes,
    payload: bytes,
    *,
    host: str,
    port: int,
    clock: float,
    wall: float,
    role: str,
    secret: bytes | None,
) -> bytes:
    record = StoreRecord(payload, host, port, clock, wall, _kvwire_version(), role)
    if secret is not None:
        seal, sealed = seal_record(secret, key, record.header(), payload)
        record = msgspec.structs.replace(record, payload=sealed, seal=seal)
    return _encoder.encode(record)


def decode_record(key: bytes, value: bytes, secret: bytes | None) -> StoreRecord:
    """The record with its payload opened; HandshakeAuthError for a plain record when we
    hold a secret (or the reverse), a wrong secret or a tampered record."""
    if len(value) > _MAX_RECORD:
        raise MetadataStoreError(f"store record of {len(value)} bytes is too large")
    try:
        record = _decoder.decode(value)
    except msgspec.DecodeError as exc:
        raise MetadataStoreError(f"undecodable store record: {exc}") from None
    if secret is None:
        if record.seal:
            raise HandshakeAuthError("store record is sealed but this rank has no secret")
        return record
    payload = open_record(secret, key, record.header(), record.seal, record.payload)
    return msgspec.structs.replace(record, payload=payload, seal=b"")
