"""Property tests: valid messages round-trip and match vLLM-style dataclass encodings.

What arbitrary and mutated bytes do to every decoder is tested in ``tests/fuzz``.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvwire
from kvwire.wire.handshake import MAX_RANK

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

u64 = st.integers(min_value=0, max_value=2**64 - 1)
small = st.integers(min_value=0, max_value=2**31)
text = st.text(max_size=24)
ints = st.lists(u64, max_size=6)


def metadata_strategy(version: int) -> st.SearchStrategy[Any]:
    cls = kvwire.protocol(version).AgentMetadata
    fields: dict[str, st.SearchStrategy[Any]] = {
        "engine_id": text,
        "agent_metadata": st.binary(max_size=64),
        "kv_caches_base_addr": ints,
        "device_id": small,
        "num_blocks": small,
        "block_lens": ints,
        "block_strides": ints,
        "kv_cache_layout": st.sampled_from(["HND", "NHD"]),
        "block_size": small,
        "ssm_sizes": st.tuples(small, small),
        "attn_backend_name": text,
        "physical_blocks_per_logical_kv_block": small,
        "region_num_blocks": st.none() | ints,
        "region_group_ids": st.none() | ints,
        "region_names": st.none() | st.lists(text, max_size=4),
        "region_mem_types": st.none() | st.lists(st.sampled_from(["VRAM", "DRAM"]), max_size=4),
        "dcp_size": small,
        "pcp_size": small,
        "region_members": st.lists(st.lists(text, max_size=3), max_size=3),
        "packed_member_layouts": st.dictionaries(text, st.tuples(small, small), max_size=3),
    }
    if version >= 14:
        fields["ple_block_len"] = st.none() | small
    return st.builds(cls, **fields)


def vllm_style_dataclass(struct_type: type[Any]) -> type[Any]:
    """A plain dataclass with the Struct's fields, order and defaults: how vLLM declares it."""
    info = msgspec.inspect.type_info(struct_type)
    assert isinstance(info, msgspec.inspect.StructType)
    hints = typing.get_type_hints(struct_type)
    spec: list[Any] = []
    for f in info.fields:
        if f.required:
            spec.append((f.name, hints[f.name]))
        elif isinstance(f.default, list | dict):
            factory = type(f.default)
            spec.append((f.name, hints[f.name], dataclasses.field(default_factory=factory)))
        else:
            spec.append((f.name, hints[f.name], dataclasses.field(default=f.default)))
    return dataclasses.make_dataclass(f"Vllm{struct_type.__name__}", spec)


@pytest.mark.parametrize("version", [13, 14])
def test_metadata_bytes_equal_a_dataclass_encoding(version: int) -> None:
    cls = kvwire.protocol(version).AgentMetadata
    twin = vllm_style_dataclass(cls)

    @SETTINGS
    @given(metadata_strategy(version))
    def check(md: Any) -> None:
        wire = kvwire.encode(md)
        assert kvwire.decode(wire, cls) == md
        as_dataclass = twin(**{name: getattr(md, name) for name in cls.__struct_fields__})
        assert msgspec.msgpack.encode(as_dataclass) == wire
        assert msgspec.msgpack.decode(wire, type=twin) == as_dataclass

    check()


request_ids = st.text(min_size=1, max_size=40).filter(
    lambda s: not s.startswith("HB:") and not s.startswith("PUSH_REG:")
)
heartbeat_ids = st.text(min_size=1, max_size=20).filter(lambda s: "," not in s)
registrations = st.builds(
    kvwire.PushRegistration,
    request_id=text,
    decode_engine_id=text,
    decode_host=text,
    decode_port=st.integers(0, 65535),
    decode_tp_size=st.integers(1, 64),
    local_block_ids=st.lists(st.lists(small, max_size=8), max_size=3),
    remote_engine_id=text,
    remote_host=text,
    remote_port=st.integers(0, 65535),
    remote_tp_size=st.integers(1, 64),
    remote_pp_size=st.integers(1, 64),
)
notifications = (
    st.builds(kvwire.Completion, request_id=request_ids, count=st.integers(1, 10**9 - 1))
    | st.builds(kvwire.Heartbeat, request_ids=st.lists(heartbeat_ids, max_size=8).map(tuple))
    | registrations
)


@SETTINGS
@given(notifications)
def test_notifications_round_trip(msg: Any) -> None:
    assert kvwire.decode_notification(kvwire.encode(msg)) == msg


@SETTINGS
@given(st.integers(0, MAX_RANK - 1), st.integers(0, MAX_RANK - 1))
def test_handshake_request_round_trip(pp: int, tp: int) -> None:
    wire = kvwire.encode_handshake_request(pp, tp)
    assert kvwire.decode_handshake_request(wire) == kvwire.HandshakeRequest(pp, tp)


@SETTINGS
@given(st.integers(MAX_RANK, 2**63 - 1))
def test_handshake_request_rank_out_of_range_is_refused_both_ways(rank: int) -> None:
    with pytest.raises(kvwire.WireEncodeError):
        kvwire.encode_handshake_request(0, rank)
    forged = msgspec.msgpack.encode((b"get_meta_msg", rank, 0))
    with pytest.raises(kvwire.WireDecodeError, match="out of range"):
        kvwire.decode_handshake_request(forged)


@SETTINGS
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_clock_reply_round_trip(ts: float) -> None:
    assert kvwire.decode_clock_reply(kvwire.encode_clock_reply(ts)) == ts


@SETTINGS
@given(
    st.fixed_dictionaries(
        {"do_remote_prefill": st.booleans(), "do_remote_decode": st.booleans()},
        optional={
            "remote_block_ids": st.lists(st.lists(small, max_size=5), max_size=3),
            "remote_engine_id": text,
            "remote_request_id": text,
            "remote_host": text,
            "remote_port": st.integers(0, 65535),
            "tp_size": st.integers(1, 64),
            "dcp_size": st.integers(1, 64),
            "pp_size": st.integers(1, 64),
            "remote_block_size": st.integers(1, 1024),
            "remote_blocks_expiry_time": st.floats(allow_nan=False, allow_infinity=False),
            "remote_num_tokens": small,
            "transfer_mode": st.sampled_from(["pull", "push"]),
            "remote_registration_generation": small,
        },
    )
)
def test_kv_transfer_params_round_trip(params: dict[str, Any]) -> None:
    view = kvwire.parse_kv_transfer_params(params, version=15)
    assert view.as_dict() == params
    assert kvwire.decode(kvwire.encode(view), type(view)) == view


@SETTINGS
@given(metadata_strategy(13), st.text(max_size=64))
def test_handshake_round_trip(md: Any, compat_hash: str) -> None:
    wire = kvwire.encode_handshake_payload(md, compatibility_hash=compat_hash)
    assert kvwire.decode_handshake(wire, local_hash=compat_hash) == md
