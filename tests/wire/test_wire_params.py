"""The typed view of kv_transfer_params: validation and vLLM's reading rules."""

from __future__ import annotations

import msgspec
import pytest

import kvwire

D_SIDE = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "engine-p",
    "remote_request_id": "cmpl-1",
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
}


def test_sizes_default_to_one_and_optional_fields_to_none() -> None:
    meta = kvwire.parse_kv_transfer_params(D_SIDE).req_meta()
    assert (meta.tp_size, meta.dcp_size, meta.pp_size, meta.remote_block_size) == (1, 1, 1, None)
    assert meta.remote.blocks_expiry_time is None and meta.remote.num_tokens is None


def test_unknown_keys_are_ignored_like_vllm() -> None:
    params = kvwire.parse_kv_transfer_params({**D_SIDE, "some_future_key": [1]})
    assert params.as_dict() == D_SIDE


def test_v15_generation_defaults_to_zero() -> None:
    meta = kvwire.parse_kv_transfer_params(D_SIDE, version=15).req_meta()
    assert meta.remote.registration_generation == 0  # type: ignore[attr-defined]


def test_v13_view_ignores_v15_key() -> None:
    params = kvwire.parse_kv_transfer_params({**D_SIDE, "remote_registration_generation": 3})
    assert not hasattr(params.req_meta().remote, "registration_generation")


def test_producer_side_params_have_no_remote() -> None:
    params = kvwire.parse_kv_transfer_params({"do_remote_decode": True})
    assert params.do_remote_decode and not params.do_remote_prefill
    assert params.missing_for_recv() == [
        "remote_block_ids",
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
    ]
    with pytest.raises(kvwire.WireDecodeError, match="remote_engine_id"):
        params.req_meta()


@pytest.mark.parametrize(
    "change",
    [
        {"remote_port": 70000},
        {"remote_port": "5600"},
        {"tp_size": 0},
        {"remote_block_ids": [[-1]]},
        {"remote_block_ids": [1, 2]},
        {"transfer_mode": "teleport"},
        {"do_remote_prefill": "yes"},
        {"remote_registration_generation": -1},
        {"remote_block_ids": [[10**26]]},  # JSON carries it; no int64 holds it
        {"tp_size": 1 << 63},
        {"remote_num_tokens": 1 << 64},
    ],
)
def test_invalid_values_are_decode_errors(change: dict[str, object]) -> None:
    with pytest.raises(kvwire.WireDecodeError):
        kvwire.parse_kv_transfer_params({**D_SIDE, **change}, version=15)


@pytest.mark.parametrize(
    "data",
    [
        b"{",
        b"[1]",
        b'{"remote_port": 1e999999}',
        b"\xc1",
        b"\x91\x01",
        b'{"do_remote_prefill": true, "remote_block_ids": [[99999999999999999999992404, 1]]}',
    ],
)
def test_invalid_encodings_are_decode_errors(data: bytes) -> None:
    with pytest.raises(kvwire.WireDecodeError):
        kvwire.parse_kv_transfer_params(data)


def test_msgpack_and_json_inputs_agree() -> None:
    expected = kvwire.parse_kv_transfer_params(D_SIDE)
    assert kvwire.parse_kv_transfer_params(msgspec.msgpack.encode(D_SIDE)) == expected
    assert kvwire.parse_kv_transfer_params(msgspec.json.encode(D_SIDE).decode()) == expected


@pytest.mark.parametrize(
    "data",
    [
        b'{"remote_host": "\xed\xa0\x8010.0.0.1"}',  # an encoded lone surrogate: not UTF-8
        b'{"remote_host": "\\ud800"}',  # a lone surrogate escape
        b'{"remote_engine_id": "\\uDFFFx"}',
    ],
)
def test_json_strings_that_are_not_unicode_are_decode_errors(data: bytes) -> None:
    """Found by tests/fuzz: json.loads let lone surrogates in, and the view would not
    re-encode."""
    with pytest.raises(kvwire.WireDecodeError, match=r"Unicode|UTF-8"):
        kvwire.parse_kv_transfer_params(data)
    with pytest.raises(kvwire.WireDecodeError):
        kvwire.parse_kv_transfer_params(data.decode("utf-8", "surrogatepass"))


def test_json_escapes_of_valid_text_are_kept() -> None:
    view = kvwire.parse_kv_transfer_params(b'{"remote_host": "h\\ud83d\\ude00", "x": "\\ud800"}')
    assert view.remote_host == "h\U0001f600"  # a surrogate pair; the unknown key is dropped
    assert kvwire.decode(kvwire.encode(view), type(view)) == view
