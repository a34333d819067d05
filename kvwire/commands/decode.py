"""Decode one wire message and print it as JSON.

Reads FILE (or stdin for '-'): raw message bytes, or the same bytes as hex text (detected,
or forced with --hex). Without --kind the message kind is recognised from its shape:
PUSH_REG/HB prefixes, a JSON object (kv_transfer_params), the handshake request's tag, a
handshake payload's two keys, agent metadata, a bare float (clock reply), a
kv_transfer_params map, and finally a "request_id:count" completion. Bytes fields print as
hex. ``schema_version`` in the output is the schema the message was decoded with: versions
14 and 15 share one agent-metadata schema, so a recognised v15 payload reports 14.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from typing import Any

from kvwire.errors import ConfigError, KVWireError, WireDecodeError

KINDS = (
    "handshake-payload",
    "agent-metadata",
    "handshake-request",
    "clock-reply",
    "notification",
    "completion",
    "heartbeat",
    "push-reg",
    "kv-transfer-params",
)

_HEX = re.compile(rb"\s*(?:[0-9a-fA-F]{2})+\s*")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="message bytes, or '-' for stdin")
    parser.add_argument("--kind", choices=KINDS, help="message kind (default: recognise it)")
    parser.add_argument(
        "--version",
        type=int,
        default=None,
        help="protocol version for agent metadata and kv_transfer_params (default: recognise "
        "it from the fields present, else 13)",
    )
    parser.add_argument("--hex", action="store_true", help="the input is hex text")


def run(args: argparse.Namespace) -> int:
    from kvwire.wire.versions import protocol

    if args.version is not None:
        protocol(args.version)  # refuse unknown versions up front
    data = _read(args.file)
    if not data.strip():
        raise ConfigError(f"{args.file} is empty: no message to decode")
    if args.hex or (_HEX.fullmatch(data) and not data.lstrip().startswith(b"{")):
        try:
            data = bytes.fromhex(data.decode("ascii"))
        except ValueError:
            raise ConfigError("input is not valid hex") from None
    if args.kind is not None:
        kind, version, message = _DECODERS[args.kind](data, args.version)
    else:
        kind, version, message = _recognise(data, args.version)
    out: dict[str, Any] = {"kind": kind}
    if version is not None:
        out["schema_version"] = version
    out["message"] = _jsonable(message)
    sys.stdout.write(json.dumps(out, indent=2) + "\n")
    return 0


def _read(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None


Decoded = tuple[str, int | None, Any]


def _handshake_payload(data: bytes, version: int | None) -> Decoded:
    from kvwire.wire.handshake import decode_handshake_payload

    payload = decode_handshake_payload(data)
    kind, found, metadata = _agent_metadata(payload.agent_metadata_bytes, version)
    del kind
    message: dict[str, Any] = {
        "compatibility_hash": payload.compatibility_hash,
        "agent_metadata": metadata,
    }
    if payload.kvwire is not None:
        message["kvwire"] = payload.kvwire
    return "handshake-payload", found, message


def _agent_metadata(data: bytes, version: int | None) -> Decoded:
    import msgspec

    from kvwire.wire.codec import decode_struct
    from kvwire.wire.versions import protocol

    if version is None:
        keys = decode_struct(data, dict[str, msgspec.Raw], what="agent metadata")
        version = 14 if "ple_block_len" in keys else 13
    metadata = decode_struct(data, protocol(version).AgentMetadata, what="agent metadata")
    return "agent-metadata", version, metadata


def _handshake_request(data: bytes, version: int | None) -> Decoded:
    from kvwire.wire.handshake import decode_handshake_request

    return "handshake-request", None, decode_handshake_request(data)


def _clock_reply(data: bytes, version: int | None) -> Decoded:
    from kvwire.wire.handshake import decode_clock_reply

    return "clock-reply", None, {"timestamp": decode_clock_reply(data)}


def _notification(data: bytes, version: int | None) -> Decoded:
    from kvwire.wire.notifications import decode_notification
    from kvwire.wire.schemas import Completion, Heartbeat

    message = decode_notification(data)
    if isinstance(message, Completion):
        return "completion", None, message
    if isinstance(message, Heartbeat):
        return "heartbeat", None, message
    return "push-reg", None, message


def _only(kind: str) -> Callable[[bytes, int | None], Decoded]:
    def decode(data: bytes, version: int | None) -> Decoded:
        found = _notification(data, version)
        if found[0] != kind:
            raise WireDecodeError(f"not a {kind} notification (it is a {found[0]})")
        return found

    return decode


def _kv_transfer_params(data: bytes, version: int | None) -> Decoded:
    from kvwire.wire.codec import decode_untyped
    from kvwire.wire.params import parse_kv_transfer_params

    if version is None:
        keys: Any = json.loads(data) if data.lstrip()[:1] == b"{" else decode_untyped(data)
        version = 15 if isinstance(keys, dict) and "remote_registration_generation" in keys else 13
    params = parse_kv_transfer_params(data, version=version)
    return "kv-transfer-params", version, params.as_dict()


_DECODERS: dict[str, Callable[[bytes, int | None], Decoded]] = {
    "handshake-payload": _handshake_payload,
    "agent-metadata": _agent_metadata,
    "handshake-request": _handshake_request,
    "clock-reply": _clock_reply,
    "notification": _notification,
    "completion": _only("completion"),
    "heartbeat": _only("heartbeat"),
    "push-reg": _only("push-reg"),
    "kv-transfer-params": _kv_transfer_params,
}


def _recognise(data: bytes, version: int | None) -> Decoded:
    from kvwire.wire.codec import decode_untyped
    from kvwire.wire.params import KVTransferParamsV15

    if data.startswith((b"PUSH_REG:", b"HB:")):
        return _notification(data, version)
    if data.lstrip().startswith(b"{"):
        return _kv_transfer_params(data, version)
    try:
        shape: Any = decode_untyped(data)
    except WireDecodeError:
        return _last_resort(data, version)
    if isinstance(shape, list):
        return _handshake_request(data, version)
    if isinstance(shape, float | int) and not isinstance(shape, bool):
        return _clock_reply(data, version)
    if isinstance(shape, dict):
        if "compatibility_hash" in shape:
            return _handshake_payload(data, version)
        if "engine_id" in shape:
            return _agent_metadata(data, version)
        if set(shape) & set(KVTransferParamsV15.__struct_fields__):
            return _kv_transfer_params(data, version)
    return _last_resort(data, version)


def _last_resort(data: bytes, version: int | None) -> Decoded:
    """Not msgpack of a known shape: a completion notification, or nothing we know."""
    try:
        return _notification(data, version)
    except KVWireError as exc:
        raise WireDecodeError(
            f"not a message kvwire recognises ({exc}); name it with --kind"
        ) from None


def _jsonable(value: Any) -> Any:
    import msgspec

    plain = msgspec.to_builtins(value, builtin_types=(bytes, bytearray, memoryview))
    return _hex_bytes(plain)


def _hex_bytes(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, dict):
        return {key: _hex_bytes(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_hex_bytes(item) for item in value]
    return value
