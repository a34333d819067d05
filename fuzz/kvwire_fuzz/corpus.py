"""Valid inputs to start mutating from: vLLM's golden vectors plus kvwire's own additions.

Mutating valid messages reaches the decoders' deep paths (field validation, the second
handshake phase, the compatibility explanation) that random bytes never reach. The golden
vectors are bytes vLLM itself produced; the extra seeds cover what only kvwire sends (the
``kvwire`` hello in a handshake payload, a payload with a mismatching hash).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import msgspec

from kvwire import wire
from kvwire_fuzz.targets import LOCAL_FACTORS, LOCAL_HASH

VECTORS = Path(__file__).resolve().parents[2] / "tests" / "vectors"

FAMILIES = (
    "payload",
    "hello",
    "metadata",
    "request",
    "clock",
    "lease",
    "notification",
    "params",
    "params_dict",
)


@functools.cache
def seeds() -> dict[str, tuple[bytes, ...]]:
    """Valid encodings per seed family (see :attr:`kvwire_fuzz.targets.Target.seeds`)."""
    out: dict[str, list[bytes]] = {family: [] for family in FAMILIES}
    for path in sorted(VECTORS.glob("*.json")):
        _add_vectors(out, json.loads(path.read_text()))
    _add_kvwire_payloads(out)
    _add_lease_messages(out)
    return {family: tuple(dict.fromkeys(items)) for family, items in out.items()}


def all_seeds() -> tuple[bytes, ...]:
    """Every seed of every family, without duplicates."""
    return tuple(dict.fromkeys(s for family in seeds().values() for s in family))


def _add_vectors(out: dict[str, list[bytes]], doc: dict[str, Any]) -> None:
    out["metadata"] += [bytes.fromhex(c["msgpack"]) for c in doc["agent_metadata"]]
    out["payload"] += [bytes.fromhex(c["msgpack"]) for c in doc["handshake_payload"]]
    out["request"] += [bytes.fromhex(c["msgpack"]) for c in doc["handshake_request"]]
    out["clock"].append(bytes.fromhex(doc["handshake_clock"]["msgpack"]))
    out["notification"] += [bytes.fromhex(c["notif"]) for c in doc["push_reg"]]
    out["notification"] += [bytes.fromhex(c["notif"]) for c in doc["completion_notif"]]
    out["notification"].append(bytes.fromhex(doc["heartbeat_notif"]["notif"]))
    for case in doc["kv_transfer_params"]:
        params = case["kv_transfer_params"]
        out["params"].append(msgspec.msgpack.encode(params))
        out["params"].append(json.dumps(params).encode())
        out["params_dict"].append(b"\x00" + msgspec.msgpack.encode(params))


def _add_lease_messages(out: dict[str, list[bytes]]) -> None:
    """The lease extension's query and answer (only kvwire sends them; no golden vector)."""
    out["lease"] += [
        wire.encode_lease_query(wire.LeaseQuery(0, 0, ["cmpl-1-0-deadbeef"])),
        wire.encode_lease_query(wire.LeaseQuery(1, 3, [f"req-{i}" for i in range(40)])),
        wire.encode_lease_reply(wire.LeaseReply([1234.5, None, 0.0])),
        wire.encode_lease_reply(wire.LeaseReply([])),
        msgspec.msgpack.encode(wire.LeaseQuery(0, 1, ["a"])),
        msgspec.msgpack.encode(wire.LeaseReply([5.0, None])),
    ]


def _add_kvwire_payloads(out: dict[str, list[bytes]]) -> None:
    """Payloads that take the compatibility-checking target past its hash comparison."""
    metadata = out["metadata"][0]
    other = msgspec.structs.replace(LOCAL_FACTORS, model="fuzz/other-model")
    out["hello"] += [
        msgspec.msgpack.encode(
            wire.KVWireHello(connector_version=13, factors=LOCAL_FACTORS.as_dict())
        ),
        msgspec.msgpack.encode(wire.KVWireHello(connector_version=15)),
    ]
    out["payload"] += [
        wire.encode_handshake_payload(metadata, compatibility_hash=LOCAL_HASH),
        wire.encode_handshake_payload(
            metadata, compatibility_hash=LOCAL_HASH, factors=LOCAL_FACTORS
        ),
        wire.encode_handshake_payload(metadata, compatibility_hash=other.hash(), factors=other),
        wire.encode_handshake_payload(metadata, compatibility_hash=other.hash()),
    ]
