"""Every public decoder of :mod:`kvwire.wire`, as a fuzz target taking raw bytes.

One table serves the Hypothesis tests (``tests/fuzz``) and the atheris harness
(``fuzz/fuzz_decoders.py``), so both fuzz the same entry points with the same rule: the only
exception a decoder may raise on hostile input is :class:`~kvwire.errors.WireDecodeError`
(plus :class:`~kvwire.errors.IncompatiblePeerError` where a compatibility check is asked
for: refusing a peer is that call's documented answer, not a decode failure).

A target that decodes successfully is also re-encoded: what kvwire accepted from a peer it
must be able to write back unchanged, or a relay (the proxy, a logging tool) would crash on
a message kvwire itself let in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

import kvwire
from kvwire import wire
from kvwire.errors import IncompatiblePeerError, WireDecodeError
from kvwire.wire import codec
from kvwire.wire.compat import CompatFactors

LOCAL_FACTORS = CompatFactors.build(
    vllm_version="0.31.0",
    model="fuzz/model",
    dtype="bfloat16",
    num_kv_heads=8,
    head_size=128,
    num_hidden_layers=32,
    attn_backend_name="FLASH_ATTN",
)
"""The factors the compatibility-checking target runs with (its seeds carry this hash)."""
LOCAL_HASH = LOCAL_FACTORS.hash()

# Field names of kv_transfer_params, for turning arbitrary values into near-valid dicts.
PARAM_KEYS: tuple[str, ...] = tuple(
    f.name for f in msgspec.structs.fields(wire.KVTransferParamsV15)
)


@dataclass(frozen=True)
class Target:
    """One decoder: ``call`` takes the fuzz bytes and returns what the decoder returned."""

    name: str
    call: Callable[[bytes], Any]
    seeds: str
    """Which seed family (see :mod:`kvwire_fuzz.corpus`) gives valid inputs for it."""
    allowed: tuple[type[BaseException], ...] = (WireDecodeError,)


class UnexpectedException(AssertionError):
    """A decoder let something other than an allowed kvwire error out."""


def run(target: Target, data: bytes) -> Any:
    """Run ``target`` on ``data``; ``None`` when it raised an allowed error.

    Anything else that escapes is re-raised as :class:`UnexpectedException` chained to the
    original, so a fuzzer reports the target and the offending exception in one line.
    """
    try:
        result = target.call(data)
    except target.allowed:
        return None
    except Exception as exc:
        raise UnexpectedException(
            f"{target.name}: {type(exc).__name__}: {exc!s:.300} (input {len(data)} bytes)"
        ) from exc
    _check_reencodes(target, result)
    return result


def _check_reencodes(target: Target, result: Any) -> None:
    if not isinstance(result, msgspec.Struct):
        return
    try:
        again = kvwire.decode(kvwire.encode(result), type(result))
    except Exception as exc:
        raise UnexpectedException(
            f"{target.name}: decoded {type(result).__name__} does not re-encode: "
            f"{type(exc).__name__}: {exc!s:.300}"
        ) from exc
    if kvwire.encode(again) != kvwire.encode(result):
        raise UnexpectedException(f"{target.name}: {type(result).__name__} changed on re-encode")


# ------------------------------------------------------------------- input adaptors


def as_text(data: bytes) -> str:
    """Bytes as a str the way a careless caller might build one: invalid UTF-8 becomes lone
    surrogates, which no encoder will take back."""
    return data.decode("utf-8", "surrogateescape")


def as_mapping(data: bytes) -> dict[Any, Any]:
    """Bytes as a dict for the dict form of ``parse_kv_transfer_params``.

    A msgpack map is used as is; any other value is put under a real field name chosen by
    the first byte, so wrong-typed values reach each field's validation.
    """
    try:
        obj = msgspec.msgpack.decode(data[1:]) if data else {}
    except (msgspec.DecodeError, RecursionError, ValueError):
        obj = data[1:]
    if isinstance(obj, dict):
        return obj
    key = PARAM_KEYS[data[0] % len(PARAM_KEYS)] if data else PARAM_KEYS[0]
    return {key: obj}


def _params(version: int, adapt: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def call(data: bytes) -> Any:
        params = wire.parse_kv_transfer_params(adapt(data), version=version)
        params.as_dict()
        if not params.missing_for_recv():
            params.req_meta()
        return params

    return call


def _decode_as(cls: type[Any]) -> Callable[[bytes], Any]:
    return lambda data: kvwire.decode(data, cls)


def _handshake(version: int) -> Callable[[bytes], Any]:
    return lambda data: wire.decode_handshake(data, local_hash=None, version=version)


def _handshake_checked(data: bytes) -> Any:
    payload = wire.decode_handshake_payload(data)
    wire.peer_version(payload)
    return wire.decode_handshake(
        data, local_hash=LOCAL_HASH, version=13, local_factors=LOCAL_FACTORS
    )


def _identity(data: bytes) -> bytes:
    return data


TARGETS: tuple[Target, ...] = (
    Target("handshake_payload", wire.decode_handshake_payload, "payload"),
    Target("handshake_v13", _handshake(13), "payload"),
    Target("handshake_v14", _handshake(14), "payload"),
    Target("handshake_v15", _handshake(15), "payload"),
    Target(
        "handshake_checked",
        _handshake_checked,
        "payload",
        (WireDecodeError, IncompatiblePeerError),
    ),
    Target("agent_metadata_v13", _decode_as(wire.AgentMetadataV13), "metadata"),
    Target("agent_metadata_v14", _decode_as(wire.AgentMetadataV14), "metadata"),
    Target("handshake_request", wire.decode_handshake_request, "request"),
    Target("decode_handshake_request", _decode_as(wire.HandshakeRequest), "request"),
    Target("clock_reply", wire.decode_clock_reply, "clock"),
    Target("decode_clock_reply", _decode_as(wire.ClockReply), "clock"),
    Target("lease_query", wire.decode_lease_query, "lease"),
    Target("lease_reply", wire.decode_lease_reply, "lease"),
    Target("decode_lease_query", _decode_as(wire.LeaseQuery), "lease"),
    Target("decode_lease_reply", _decode_as(wire.LeaseReply), "lease"),
    Target("notification", wire.decode_notification, "notification"),
    Target("completion", wire.decode_completion, "notification"),
    Target("heartbeat", wire.decode_heartbeat, "notification"),
    Target("push_registration", wire.decode_push_registration, "notification"),
    Target("decode_completion", _decode_as(wire.Completion), "notification"),
    Target("decode_heartbeat", _decode_as(wire.Heartbeat), "notification"),
    Target("decode_push_registration", _decode_as(wire.PushRegistration), "notification"),
    Target("decode_payload", _decode_as(wire.HandshakePayload), "payload"),
    Target("decode_kvwire_hello", _decode_as(wire.KVWireHello), "hello"),
    Target("kv_params_v13", _params(13, _identity), "params"),
    Target("kv_params_v14", _params(14, _identity), "params"),
    Target("kv_params_v15", _params(15, _identity), "params"),
    Target("kv_params_text_v13", _params(13, as_text), "params"),
    Target("kv_params_text_v15", _params(15, as_text), "params"),
    Target("kv_params_dict_v13", _params(13, as_mapping), "params_dict"),
    Target("kv_params_dict_v15", _params(15, as_mapping), "params_dict"),
    Target("decode_kv_params_v13", _decode_as(wire.KVTransferParamsV13), "params"),
    Target("decode_kv_params_v15", _decode_as(wire.KVTransferParamsV15), "params"),
    Target("untyped", codec.decode_untyped, "payload"),
)

BY_NAME: dict[str, Target] = {t.name: t for t in TARGETS}


def run_all(data: bytes) -> None:
    """Run every target on ``data`` (the Hypothesis tests' oracle)."""
    for target in TARGETS:
        run(target, data)
