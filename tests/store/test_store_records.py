"""Store records and keys without a server: what a reader accepts and refuses."""

from __future__ import annotations

import pytest

from kvwire.errors import HandshakeAuthError, MetadataStoreError
from kvwire.sidechannel.etcd import parse_store_url, prefix_end
from kvwire.sidechannel.store_records import decode_record, encode_record, parse_key, rank_key

SECRET = b"k" * 32
KEY = rank_key("abc123", "prefill/7", 1, 3)


def record(secret: bytes | None, key: bytes = KEY) -> bytes:
    return encode_record(
        key, b"payload-bytes", host="10.0.0.1", port=5600, clock=12.5, wall=1e9,
        role="producer", secret=secret,
    )  # fmt: skip


def test_keys_name_group_engine_and_rank() -> None:
    assert parse_key(KEY) == ("abc123", "prefill/7", (1, 3))
    assert parse_key(b"/kvwire/v1/engines/abc/e/x/1") is None
    assert parse_key(b"/other/abc/e/0/0") is None


def test_a_plain_record_round_trips() -> None:
    got = decode_record(KEY, record(None), None)
    assert (got.payload, got.host, got.port, got.role) == (
        b"payload-bytes",
        "10.0.0.1",
        5600,
        "producer",
    )


def test_a_sealed_record_opens_only_with_the_secret_and_under_its_own_key() -> None:
    sealed = record(SECRET)
    assert b"payload-bytes" not in sealed
    assert decode_record(KEY, sealed, SECRET).payload == b"payload-bytes"
    with pytest.raises(HandshakeAuthError):
        decode_record(KEY, sealed, b"x" * 32)  # another secret
    with pytest.raises(HandshakeAuthError):
        decode_record(rank_key("abc123", "prefill/7", 1, 4), sealed, SECRET)  # moved key
    with pytest.raises(HandshakeAuthError):
        decode_record(KEY, sealed, None)  # a reader without the secret
    with pytest.raises(HandshakeAuthError):
        decode_record(KEY, record(None), SECRET)  # a plain record where one is required


def test_garbage_is_a_store_error() -> None:
    with pytest.raises(MetadataStoreError):
        decode_record(KEY, b"\xc1 not msgpack", None)


def test_prefix_ranges_and_urls() -> None:
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert parse_store_url("etcd://[::1]:2379") == ("::1", 2379)
    with pytest.raises(MetadataStoreError):
        parse_store_url("http://h:1")
