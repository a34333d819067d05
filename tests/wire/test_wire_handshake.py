"""Two-phase handshake decode, version refusal, and kvwire's self-describing payload."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

import kvwire
from kvwire.bench.wire import VllmHandshakePayload
from kvwire.wire.compat import CompatFactors

VECTORS = Path(__file__).resolve().parent.parent / "vectors"
V13 = json.loads((VECTORS / "vllm-0.31.0-nixl-v13.json").read_text())
METADATA_BYTES = bytes.fromhex(V13["agent_metadata"][2]["msgpack"])
METADATA = kvwire.decode(METADATA_BYTES, kvwire.AgentMetadata)

OURS = CompatFactors.build(
    vllm_version="0.31.0",
    model="meta-llama/Llama-3.1-8B-Instruct",
    dtype="bfloat16",
    num_kv_heads=8,
    head_size=128,
    num_hidden_layers=32,
    attn_backend_name="FLASH_ATTN",
)
V14_PEER = msgspec.structs.replace(OURS, nixl_connector_version=14, vllm_version="0.32.0")


def test_matching_hash_decodes_metadata() -> None:
    wire = kvwire.encode_handshake_payload(METADATA, compatibility_hash=OURS.hash())
    assert kvwire.decode_handshake(wire, local_hash=OURS.hash()) == METADATA


def test_hash_is_checked_before_metadata_is_decoded() -> None:
    # The inner bytes are garbage: a mismatch must be reported as such, not as a decode error.
    wire = kvwire.encode_handshake_payload(b"\xc1garbage", compatibility_hash="f" * 64)
    with pytest.raises(kvwire.IncompatiblePeerError) as info:
        kvwire.decode_handshake(wire, local_hash=OURS.hash())
    assert info.value.remote_hash == "f" * 64
    assert info.value.local_hash == OURS.hash()


def test_enforcement_off_accepts_any_hash() -> None:
    wire = kvwire.encode_handshake_payload(METADATA, compatibility_hash="other")
    assert kvwire.decode_handshake(wire, local_hash=None) == METADATA


def test_enforcement_off_still_rejects_malformed_metadata() -> None:
    wire = kvwire.encode_handshake_payload(b"\x92\x01", compatibility_hash="x")
    with pytest.raises(kvwire.WireDecodeError):
        kvwire.decode_handshake(wire, local_hash=None)


def test_kvwire_peer_on_another_version_is_named() -> None:
    wire = kvwire.encode_handshake_payload(
        METADATA, compatibility_hash=V14_PEER.hash(), factors=V14_PEER
    )
    with pytest.raises(kvwire.IncompatiblePeerError) as info:
        kvwire.decode_handshake(wire, local_hash=OURS.hash(), local_factors=OURS)
    err = info.value
    assert (err.local_version, err.remote_version) == (13, 14)
    assert "version 14" in str(err) and "version 13" in str(err)
    assert err.differing == {
        "nixl_connector_version": (13, 14),
        "vllm_version": ("0.31.0", "0.32.0"),
    }


def test_kvwire_peer_version_known_even_without_local_factors() -> None:
    wire = kvwire.encode_handshake_payload(
        METADATA, compatibility_hash=V14_PEER.hash(), factors=V14_PEER
    )
    with pytest.raises(kvwire.IncompatiblePeerError) as info:
        kvwire.decode_handshake(wire, local_hash=OURS.hash())
    assert (info.value.local_version, info.value.remote_version) == (13, 14)


def test_plain_vllm_peer_on_another_version_is_recognised_from_the_hash() -> None:
    wire = kvwire.encode_handshake_payload(METADATA, compatibility_hash=V14_PEER.hash())
    with pytest.raises(kvwire.IncompatiblePeerError) as info:
        kvwire.decode_handshake(wire, local_hash=OURS.hash(), local_factors=OURS)
    assert info.value.remote_version == 14
    assert "nixl_connector_version" in info.value.differing


def test_push_pull_mismatch_with_plain_peer_names_transfer_mode() -> None:
    push = msgspec.structs.replace(OURS, transfer_mode="push")
    wire = kvwire.encode_handshake_payload(METADATA, compatibility_hash=push.hash())
    with pytest.raises(kvwire.IncompatiblePeerError) as info:
        kvwire.decode_handshake(wire, local_hash=OURS.hash(), local_factors=OURS)
    assert info.value.differing == {"transfer_mode": ("pull", "push")}


@pytest.mark.parametrize(
    ("factor", "value"),
    [
        ("is_hma_enabled", not OURS.is_hma_enabled),
        ("cache_dtype", "fp8_e4m3"),
        ("attn_backend_name", "FLASHINFER"),
        ("dtype", "torch.float16"),
    ],
)
def test_plain_vllm_peer_differing_in_one_factor_is_named(factor: str, value: object) -> None:
    """vLLM sends only a digest; kvwire finds the single change of its own factors that
    reproduces it, so the error names the factor instead of two hashes."""
    theirs = msgspec.structs.replace(OURS, **{factor: value})
    wire = kvwire.encode_handshake_payload(METADATA, compatibility_hash=theirs.hash())
    with pytest.raises(kvwire.IncompatiblePeerError) as info:
        kvwire.decode_handshake(wire, local_hash=OURS.hash(), local_factors=OURS)
    assert info.value.differing == {factor: (getattr(OURS, factor), value)}
    assert factor in str(info.value)


def test_kvwire_peer_names_differing_model() -> None:
    theirs = msgspec.structs.replace(OURS, model="Qwen/Qwen3-32B", num_kv_heads=4)
    wire = kvwire.encode_handshake_payload(
        METADATA, compatibility_hash=theirs.hash(), factors=theirs
    )
    with pytest.raises(kvwire.IncompatiblePeerError) as info:
        kvwire.decode_handshake(wire, local_hash=OURS.hash(), local_factors=OURS)
    assert info.value.differing == {
        "model": ("meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen3-32B"),
        "num_kv_heads": (8, 4),
    }
    assert "model" in str(info.value)


def test_unknown_plain_peer_gets_a_hint_from_its_metadata_keys() -> None:
    v14 = kvwire.protocol(14).AgentMetadata(
        **{name: getattr(METADATA, name) for name in METADATA.__struct_fields__}, ple_block_len=64
    )
    wire = kvwire.encode_handshake_payload(v14, compatibility_hash="e" * 64)
    with pytest.raises(kvwire.IncompatiblePeerError) as info:
        kvwire.decode_handshake(wire, local_hash=OURS.hash())
    assert info.value.remote_version is None
    assert "14 or later" in str(info.value)


def test_extension_is_invisible_to_vllm_and_absent_by_default() -> None:
    plain = kvwire.encode_handshake_payload(METADATA, compatibility_hash=OURS.hash())
    extended = kvwire.encode_handshake_payload(
        METADATA, compatibility_hash=OURS.hash(), factors=OURS
    )
    assert b"kvwire" not in plain and b"kvwire" in extended
    vllm = msgspec.msgpack.Decoder(VllmHandshakePayload)
    assert vllm.decode(plain) == vllm.decode(extended)
    payload = kvwire.decode_handshake_payload(extended)
    assert kvwire.wire.peer_version(payload) == 13
    assert payload.kvwire is not None and payload.kvwire.factors == OURS.as_dict()
    assert kvwire.decode_handshake(extended, local_hash=OURS.hash()) == METADATA


def test_v13_and_v14_metadata_cross_decode_like_vllm() -> None:
    """Unknown keys are skipped and missing defaults filled, as vLLM's msgspec does."""
    as_v14 = kvwire.decode(METADATA_BYTES, kvwire.protocol(14).AgentMetadata)
    assert as_v14.ple_block_len is None
    assert as_v14.packed_member_layouts == METADATA.packed_member_layouts
    back = kvwire.decode(kvwire.encode(as_v14), kvwire.AgentMetadata)
    assert back == METADATA


@pytest.mark.parametrize("version", [13, 14, 15])
def test_protocol_namespace(version: int) -> None:
    proto = kvwire.protocol(version)
    assert proto.connector_version == version
    fields = proto.AgentMetadata.__struct_fields__
    assert ("ple_block_len" in fields) == (version >= 14)
    if version >= 14:
        assert fields.index("ple_block_len") == fields.index("pcp_size") + 1
    assert ("registration_generation" in proto.RemoteMeta.__struct_fields__) == (version >= 15)
    assert proto.HandshakePayload is kvwire.HandshakePayload


def test_default_names_are_v13() -> None:
    assert kvwire.AgentMetadata is kvwire.protocol(13).AgentMetadata
    assert len(kvwire.AgentMetadata.__struct_fields__) == 20


def test_unknown_version_is_a_config_error() -> None:
    with pytest.raises(kvwire.ConfigError, match="13, 14, 15"):
        kvwire.protocol(12)


@pytest.mark.parametrize(
    "data",
    [
        b"\x93\xa3get\x00\x00",  # tag as str, not bin
        b"\x93\xc4\x03get\x00\x00",  # wrong tag
        b"\x93\xc4\x0cget_meta_msg\xff\x00",  # negative rank
        b"\x92\xc4\x0cget_meta_msg\x00",  # two elements
        b"\x93\xc4\x0cget_meta_msg\x00",  # truncated
        b"\x94\xc4\x0cget_meta_msg\x00\x00\x00",  # extra element
        b"\x93" + b"\xc4\x0cget_meta_msg" + b"\x00" * 100,  # oversize
    ],
)
def test_bad_handshake_requests(data: bytes) -> None:
    with pytest.raises(kvwire.WireDecodeError):
        kvwire.decode_handshake_request(data)


@pytest.mark.parametrize("data", [b"", b"\xcb\x7f\xf8" + b"\x00" * 6, b"\xa1x", b"\xcb\x00"])
def test_bad_clock_replies(data: bytes) -> None:
    with pytest.raises(kvwire.WireDecodeError):
        kvwire.decode_clock_reply(data)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1.0", True])
def test_clock_reply_refuses_to_encode_non_finite(bad: object) -> None:
    with pytest.raises(kvwire.WireEncodeError):
        kvwire.encode_clock_reply(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("ranks", [(-1, 0), (0, -1), (True, 0), (0, 1.0)])
def test_handshake_request_refuses_bad_ranks(ranks: tuple[object, object]) -> None:
    with pytest.raises(kvwire.WireEncodeError):
        kvwire.encode_handshake_request(*ranks)  # type: ignore[arg-type]


def test_size_limit_is_configurable() -> None:
    wire = kvwire.encode_handshake_payload(METADATA, compatibility_hash=OURS.hash())
    with pytest.raises(kvwire.WireDecodeError, match="exceeds the limit"):
        kvwire.decode_handshake(wire, local_hash=OURS.hash(), max_size=len(wire) - 1)
    assert kvwire.decode_handshake(wire, local_hash=OURS.hash(), max_size=len(wire)) == METADATA


def test_deep_nesting_is_a_decode_error() -> None:
    deep = b"\x91" * 200_000 + b"\x00"
    for type_ in (kvwire.AgentMetadata, kvwire.HandshakePayload):
        with pytest.raises(kvwire.WireDecodeError):
            kvwire.decode(deep, type_)
    with pytest.raises(kvwire.WireDecodeError):
        kvwire.wire.codec.decode_untyped(deep)


def test_encode_refuses_non_messages() -> None:
    for thing in (object(), {"a": 1}, b"raw", 3):
        with pytest.raises(kvwire.WireEncodeError):
            kvwire.encode(thing)


def test_decode_refuses_non_bytes_input() -> None:
    for thing in (None, "HB:a", 5, [1]):
        with pytest.raises(kvwire.WireDecodeError, match="expected bytes"):
            kvwire.decode(thing, kvwire.AgentMetadata)  # type: ignore[arg-type]
        with pytest.raises(kvwire.WireDecodeError, match="expected bytes"):
            kvwire.decode_notification(thing)  # type: ignore[arg-type]
