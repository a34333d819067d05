"""kvwire reproduces every golden vector made by vLLM 0.31/0.32/0.33, in both directions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

import kvwire
from kvwire.wire.compat import CompatFactors, SpeculativeFactors

VECTOR_DIR = Path(__file__).resolve().parent.parent / "vectors"
VECTORS = sorted(
    (json.loads(path.read_text()) for path in VECTOR_DIR.glob("vllm-*-nixl-v*.json")),
    key=lambda doc: doc["connector_version"],
)


def _cases(section: str) -> list[Any]:
    out = []
    for doc in VECTORS:
        items = doc[section] if isinstance(doc[section], list) else [doc[section]]
        for index, item in enumerate(items):
            version = doc["connector_version"]
            out.append(pytest.param(version, item, id=f"v{version}-{index}"))
    return out


def test_every_version_has_a_vector_file() -> None:
    assert [doc["connector_version"] for doc in VECTORS] == [13, 14, 15]


def _metadata_fields(fields: dict[str, Any]) -> dict[str, Any]:
    fields = dict(fields)
    fields["agent_metadata"] = bytes.fromhex(fields["agent_metadata"]["hex"])
    fields["ssm_sizes"] = tuple(fields["ssm_sizes"])
    fields["packed_member_layouts"] = {
        name: tuple(layout) for name, layout in fields["packed_member_layouts"].items()
    }
    return fields


@pytest.mark.parametrize(("version", "case"), _cases("agent_metadata"))
def test_agent_metadata_both_ways(version: int, case: dict[str, Any]) -> None:
    cls = kvwire.protocol(version).AgentMetadata
    expected = _metadata_fields(case["fields"])
    # Same field names in the same order as vLLM's dataclass of that release.
    assert list(cls.__struct_fields__) == list(case["fields"])
    assert kvwire.encode(cls(**expected)).hex() == case["msgpack"]
    decoded = kvwire.decode(bytes.fromhex(case["msgpack"]), cls)
    assert {name: getattr(decoded, name) for name in expected} == expected


@pytest.mark.parametrize(("version", "case"), _cases("handshake_payload"))
def test_handshake_payload_both_ways(version: int, case: dict[str, Any]) -> None:
    inner = bytes.fromhex(case["agent_metadata_msgpack"])
    wire = kvwire.encode_handshake_payload(inner, compatibility_hash=case["compatibility_hash"])
    assert wire.hex() == case["msgpack"]
    payload = kvwire.decode_handshake_payload(bytes.fromhex(case["msgpack"]))
    assert payload.compatibility_hash == case["compatibility_hash"]
    assert payload.agent_metadata_bytes == inner
    assert payload.kvwire is None
    metadata = kvwire.decode_handshake(
        bytes.fromhex(case["msgpack"]), local_hash=case["compatibility_hash"], version=version
    )
    assert type(metadata) is kvwire.protocol(version).AgentMetadata
    assert kvwire.encode(metadata) == inner
    # Re-encoding from the decoded metadata object gives vLLM's bytes again.
    again = kvwire.encode_handshake_payload(metadata, compatibility_hash=case["compatibility_hash"])
    assert again.hex() == case["msgpack"]


def _speculative(inputs: dict[str, Any] | None) -> SpeculativeFactors | None:
    if inputs is None:
        return None
    aux = inputs["aux"]
    return SpeculativeFactors(
        method=inputs["method"],
        model=inputs["model"],
        revision=inputs["revision"],
        parallel_drafting=inputs["parallel_drafting"],
        kv_cache_dtype=inputs["kv_cache_dtype"],
        auxiliary_layer_ids=None if aux is None else tuple(aux),
    )


@pytest.mark.parametrize(("version", "case"), _cases("compatibility_hash"))
def test_compatibility_hash(version: int, case: dict[str, Any]) -> None:
    inputs = case["inputs"]
    factors = CompatFactors.build(
        vllm_version=inputs["vllm_version"],
        model=inputs["model"],
        dtype=inputs["dtype"],
        num_kv_heads=inputs["num_kv_heads"],
        head_size=inputs["head_size"],
        num_hidden_layers=inputs["num_hidden_layers"],
        attn_backend_name=inputs["attn_backend_name"],
        cache_dtype=inputs["cache_dtype"],
        is_hma_enabled=inputs["is_hma_enabled"],
        transfer_mode=inputs["transfer_mode"],
        speculative=_speculative(inputs["speculative"]),
        connector_version=version,
    )
    assert factors.as_dict() == case["factors"]
    assert list(factors.as_dict()) == list(case["factors"])
    assert factors.hash() == case["hash"]
    assert kvwire.compatibility_hash(case["factors"]) == case["hash"]
    assert CompatFactors.from_dict(case["factors"]) == factors


@pytest.mark.parametrize(("version", "case"), _cases("handshake_request"))
def test_handshake_request_both_ways(version: int, case: dict[str, Any]) -> None:
    del version
    wire = kvwire.encode_handshake_request(case["pp_rank"], case["tp_rank"])
    assert wire.hex() == case["msgpack"]
    request = kvwire.HandshakeRequest(pp_rank=case["pp_rank"], tp_rank=case["tp_rank"])
    assert kvwire.encode(request).hex() == case["msgpack"]
    assert kvwire.decode_handshake_request(bytes.fromhex(case["msgpack"])) == request
    assert kvwire.decode(bytes.fromhex(case["msgpack"]), kvwire.HandshakeRequest) == request


@pytest.mark.parametrize(("version", "case"), _cases("handshake_clock"))
def test_clock_reply_both_ways(version: int, case: dict[str, Any]) -> None:
    del version
    assert kvwire.encode_clock_reply(case["perf_counter"]).hex() == case["msgpack"]
    assert kvwire.decode_clock_reply(bytes.fromhex(case["msgpack"])) == case["perf_counter"]
    reply = kvwire.decode(bytes.fromhex(case["msgpack"]), kvwire.ClockReply)
    assert reply.timestamp == case["perf_counter"]
    assert kvwire.encode(reply).hex() == case["msgpack"]


@pytest.mark.parametrize(("version", "case"), _cases("push_reg"))
def test_push_registration_both_ways(version: int, case: dict[str, Any]) -> None:
    del version
    registration = kvwire.PushRegistration(**case["registration"])
    assert list(kvwire.PushRegistration.__struct_fields__) == list(case["registration"])
    assert kvwire.encode(registration).hex() == case["notif"]
    assert kvwire.encode_push_registration(registration).hex() == case["notif"]
    decoded = kvwire.decode_notification(bytes.fromhex(case["notif"]))
    assert isinstance(decoded, kvwire.PushRegistration)
    assert msgspec.to_builtins(decoded) == case["registration"]


@pytest.mark.parametrize(("version", "case"), _cases("completion_notif"))
def test_completion_both_ways(version: int, case: dict[str, Any]) -> None:
    del version
    wire = kvwire.encode_completion(case["remote_request_id"], case["consumers"])
    assert wire.hex() == case["notif"]
    completion = kvwire.Completion(request_id=case["remote_request_id"], count=case["consumers"])
    assert kvwire.encode(completion).hex() == case["notif"]
    decoded = kvwire.decode_notification(bytes.fromhex(case["notif"]))
    assert decoded == completion


@pytest.mark.parametrize(("version", "case"), _cases("heartbeat_notif"))
def test_heartbeat_both_ways(version: int, case: dict[str, Any]) -> None:
    del version
    assert kvwire.encode_heartbeat(case["req_ids"]).hex() == case["notif"]
    decoded = kvwire.decode_notification(bytes.fromhex(case["notif"]))
    assert isinstance(decoded, kvwire.Heartbeat)
    assert decoded.request_ids == tuple(case["req_ids"])
    assert kvwire.encode(decoded).hex() == case["notif"]


@pytest.mark.parametrize(("version", "case"), _cases("kv_transfer_params"))
def test_kv_transfer_params_both_ways(version: int, case: dict[str, Any]) -> None:
    params = kvwire.parse_kv_transfer_params(case["kv_transfer_params"], version=version)
    assert type(params) is kvwire.protocol(version).KVTransferParams
    req_meta = params.req_meta()
    assert type(req_meta) is kvwire.protocol(version).ReqMeta
    assert type(req_meta.remote) is kvwire.protocol(version).RemoteMeta
    assert msgspec.to_builtins(req_meta) == case["req_meta"]
    assert params.as_dict() == case["kv_transfer_params"]
    # The same params arriving as JSON text or msgpack bytes give the same view.
    as_json = msgspec.json.encode(case["kv_transfer_params"])
    assert kvwire.parse_kv_transfer_params(as_json, version=version) == params
    assert kvwire.decode(kvwire.encode(params), type(params)) == params
