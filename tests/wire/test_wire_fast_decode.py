"""The handshake decode's fast path and the memory-type literal: same answers, same limits."""

from __future__ import annotations

import msgspec
import pytest

import kvwire
from kvwire.wire.schemas import AgentMetadataV13

HASH = "a" * 64


def metadata(**changes: object) -> AgentMetadataV13:
    fields: dict[str, object] = {
        "engine_id": "p",
        "agent_metadata": b"blob",
        "kv_caches_base_addr": [1 << 40, (1 << 40) + (1 << 30)],
        "device_id": 0,
        "num_blocks": 8,
        "block_lens": [4096, 4096],
        "block_strides": [4096, 4096],
        "kv_cache_layout": "HND",
        "block_size": 16,
        "ssm_sizes": (0, 0),
        "attn_backend_name": "FLASH_ATTN",
        "physical_blocks_per_logical_kv_block": 1,
        "region_mem_types": ["VRAM", "DRAM"],
    }
    fields.update(changes)
    return AgentMetadataV13(**fields)  # type: ignore[arg-type]


def test_every_input_type_decodes_to_the_same_metadata() -> None:
    md = metadata()
    wire = kvwire.encode_handshake_payload(md, compatibility_hash=HASH)
    # bytes take the fast path; bytearray and memoryview the full one
    for data in (wire, bytearray(wire), memoryview(wire)):
        assert kvwire.decode_handshake(data, local_hash=HASH) == md
        assert kvwire.decode_handshake(data, local_hash=None) == md


@pytest.mark.parametrize("kind", ["DRAM", "VRAM", "BLK", "OBJ", "FILE"])
def test_every_nixl_memory_type_is_accepted(kind: str) -> None:
    md = metadata(region_mem_types=[kind, "VRAM"])
    wire = kvwire.encode_handshake_payload(md, compatibility_hash=HASH)
    assert kvwire.decode_handshake(wire, local_hash=HASH).region_mem_types == [kind, "VRAM"]


@pytest.mark.parametrize("kind", ["HBM", "vram", "", "VRAM\x00"])
def test_a_memory_type_nixl_cannot_address_is_a_decode_error(kind: str) -> None:
    # Built from a dict: the Struct itself would refuse the value at encode time.
    raw = msgspec.msgpack.encode({**msgspec.structs.asdict(metadata()), "region_mem_types": [kind]})
    with pytest.raises(kvwire.WireDecodeError, match="region_mem_types"):
        kvwire.decode(raw, kvwire.AgentMetadata)
    wire = kvwire.encode_handshake_payload(raw, compatibility_hash=HASH)
    with pytest.raises(kvwire.WireDecodeError, match="agent metadata"):
        kvwire.decode_handshake(wire, local_hash=HASH)


def test_fast_path_keeps_the_size_limit() -> None:
    inner = kvwire.encode(metadata(agent_metadata=b"x" * 5000))
    wire = kvwire.encode_handshake_payload(inner, compatibility_hash=HASH)
    with pytest.raises(kvwire.WireDecodeError, match="exceeds the limit"):
        kvwire.decode_handshake(wire, local_hash=HASH, max_size=len(wire) - 1)
    assert kvwire.decode_handshake(wire, local_hash=HASH, max_size=len(wire)).device_id == 0


def test_fast_path_still_explains_a_hash_mismatch() -> None:
    wire = kvwire.encode_handshake_payload(metadata(), compatibility_hash="b" * 64)
    with pytest.raises(kvwire.IncompatiblePeerError):
        kvwire.decode_handshake(wire, local_hash=HASH)
