"""Fuzzing every decoder of kvwire.wire: only WireDecodeError may come out, quickly, small.

Bounded versions of what ``make fuzz`` runs for as long as it is given: random bytes,
structure-aware mutations of vLLM's golden vectors (bit flips, truncations, splices, length
prefixes claiming up to 4 GiB, wrong types, deep nesting, dropped and repeated fields),
wrong argument types and oversize input. Hypothesis's per-example deadline catches a
decoder that hangs; tracemalloc catches one that allocates what a header claims instead of
what the input holds.
"""

from __future__ import annotations

import json
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from types import FrameType
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvwire_fuzz.corpus import all_seeds, seeds
from kvwire_fuzz.mutate import GIB, nest
from kvwire_fuzz.shape import SIZED, sized_header, walk
from kvwire_fuzz.strategies import mutated, params_mappings
from kvwire_fuzz.targets import (
    LOCAL_FACTORS,
    LOCAL_HASH,
    TARGETS,
    run,
    run_all,
)

import kvwire
from kvwire import wire
from kvwire.errors import IncompatiblePeerError, WireDecodeError

# A decoder takes microseconds; two seconds per example (every target, up to ~1.6 MB of
# input) means a hang, not a slow machine.
FUZZ = settings(
    deadline=timedelta(seconds=2),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@contextmanager
def peak_allocation() -> Iterator[list[int]]:
    """Bytes allocated at the peak of the block, above what was live when it started."""
    out = [0]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        yield out
        out[0] = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_every_public_decoder_is_fuzzed() -> None:
    """Each public ``decode*``/``parse*`` function of kvwire.wire is entered by some target
    on its seeds (calls made only to check re-encoding do not count)."""
    assert {t.seeds for t in TARGETS} <= set(seeds())
    assert all(seeds()[family] for family in seeds()), "a seed family is empty"
    public = {n for n in wire.__all__ if n.startswith(("decode", "parse_"))}
    codes = {getattr(wire, name).__code__: name for name in public}
    reached: set[str] = set()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or frame.f_code not in codes:
            return
        caller = frame.f_back
        while caller is not None:
            if caller.f_code.co_name == "_check_reencodes":
                return
            caller = caller.f_back
        reached.add(codes[frame.f_code])

    sys.setprofile(profile)
    try:
        for target in TARGETS:
            for seed in seeds()[target.seeds]:
                run(target, seed)
    finally:
        sys.setprofile(None)
    assert public <= reached, f"not fuzzed: {sorted(public - reached)}"


def test_seeds_decode_cleanly_through_their_targets() -> None:
    """The mutations start from valid input: each family's seeds decode in its targets."""
    for target in TARGETS:
        if target.name == "handshake_checked":
            continue  # its seeds include refused peers on purpose
        results = [run(target, seed) for seed in seeds()[target.seeds]]
        assert any(r is not None for r in results), f"{target.name}: no seed decodes"


@settings(FUZZ, max_examples=2000)
@given(st.binary(max_size=1024))
def test_fuzz_random_bytes(data: bytes) -> None:
    run_all(data)


@settings(FUZZ, max_examples=1500)
@given(
    st.sampled_from(
        [
            b"PUSH_REG:",
            b"HB:",
            b"{",
            b" {",
            b"\x81",
            b"\x83",
            b"\xde\x00\x14",
            b"\x94\xc4\x0ekvwire_lease_q",
        ]
    ),
    st.binary(max_size=512),
)
def test_fuzz_random_bytes_behind_a_real_prefix(prefix: bytes, data: bytes) -> None:
    run_all(prefix + data)


@settings(FUZZ, max_examples=6000)
@given(mutated())
def test_fuzz_mutated_valid_encodings(data: bytes) -> None:
    run_all(data)


@settings(FUZZ, max_examples=400)
@given(mutated())
def test_fuzz_buffer_type_does_not_change_the_outcome(data: bytes) -> None:
    for target in TARGETS:
        if "text" in target.name or "dict" in target.name:
            continue  # these adapt bytes into str/dict first: the buffer type never reaches them
        want = _outcome(target.call, data)
        for view in (bytearray(data), memoryview(data)):
            assert _outcome(target.call, view) == want, target.name  # type: ignore[arg-type]


def _outcome(call: Callable[[bytes], Any], data: bytes) -> Any:
    try:
        result = call(data)
    except (WireDecodeError, IncompatiblePeerError) as exc:
        return type(exc)
    return msgspec.msgpack.encode(result)  # bytes compare NaN equal to itself


@settings(FUZZ, max_examples=800)
@given(params_mappings(), st.sampled_from([13, 14, 15]))
def test_fuzz_kv_transfer_params_dicts(params: dict[Any, Any], version: int) -> None:
    try:
        parsed = wire.parse_kv_transfer_params(params, version=version)
    except WireDecodeError:
        return
    if not parsed.missing_for_recv():
        parsed.req_meta()


@settings(FUZZ, max_examples=1000)
@given(
    st.sampled_from(["", "{", '{"remote_host": "']),
    st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=64),
    st.sampled_from([13, 15]),
)
def test_fuzz_kv_transfer_params_text(prefix: str, text: str, version: int) -> None:
    """Any str, lone surrogates included (Python builds them; no peer can send them)."""
    with suppress(WireDecodeError):
        wire.parse_kv_transfer_params(prefix + text, version=version)


def test_lone_surrogate_text_is_a_decode_error() -> None:
    """Found by this fuzz test: str.encode() raised UnicodeEncodeError out of the parser."""
    with pytest.raises(WireDecodeError, match="not valid Unicode"):
        wire.parse_kv_transfer_params('{"remote_host": "\ud800"}')


# ------------------------------------------------------------------- deterministic sweeps

WRONG_ARGUMENTS: tuple[Any, ...] = (None, 0, -1, 1.5, [], (), {1, 2}, object(), b"x"[0])

BYTE_DECODERS: dict[str, Callable[[Any], Any]] = {
    "decode_handshake_payload": wire.decode_handshake_payload,
    "decode_handshake": lambda d: wire.decode_handshake(d, local_hash=None),
    "decode_handshake_checked": lambda d: wire.decode_handshake(d, local_hash=LOCAL_HASH),
    "decode_handshake_request": wire.decode_handshake_request,
    "decode_clock_reply": wire.decode_clock_reply,
    "decode_notification": wire.decode_notification,
    "decode_completion": wire.decode_completion,
    "decode_heartbeat": wire.decode_heartbeat,
    "decode_push_registration": wire.decode_push_registration,
    "decode_lease_query": wire.decode_lease_query,
    "decode_lease_reply": wire.decode_lease_reply,
    "parse_kv_transfer_params": wire.parse_kv_transfer_params,
    **{
        f"decode[{cls.__name__}]": (lambda c: lambda d: kvwire.decode(d, c))(cls)
        for cls in (
            wire.AgentMetadataV13,
            wire.AgentMetadataV14,
            wire.HandshakePayload,
            wire.HandshakeRequest,
            wire.ClockReply,
            wire.Completion,
            wire.Heartbeat,
            wire.PushRegistration,
            wire.LeaseQuery,
            wire.LeaseReply,
            wire.KVTransferParamsV13,
            wire.KVTransferParamsV15,
        )
    },
}


@pytest.mark.parametrize("name", sorted(BYTE_DECODERS))
def test_wrong_argument_types_are_decode_errors(name: str) -> None:
    for arg in WRONG_ARGUMENTS:
        with pytest.raises(WireDecodeError):
            BYTE_DECODERS[name](arg)


def test_deep_nesting_is_a_decode_error_at_any_depth() -> None:
    class Fixed:  # a Chooser that always takes the same branch
        def __init__(self, *answers: int) -> None:
            self.answers = list(answers)

        def integer(self, low: int, high: int) -> int:
            return min(max(self.answers.pop(0), low), high)

    inputs: list[bytes] = []
    for depth_index in range(4):  # 2, 64, 1_000, 100_000 levels
        for wrapper_index in range(3):  # one-element arrays, maps, array16s
            for prefix, seed in (
                (b"", seeds()["payload"][0]),
                (b"", seeds()["metadata"][0]),
                (b"PUSH_REG:", seeds()["notification"][0].removeprefix(b"PUSH_REG:")),
            ):
                # node 0 is the whole message, node 1 the first key of these map seeds
                for node in (0, 1):
                    inputs.append(prefix + nest(seed, Fixed(node, depth_index, wrapper_index)))
    assert len(set(inputs)) == len(inputs)
    inputs.append(b"\x91" * 1_000_000 + b"\xc0")
    inputs.append(b"\x81\xa1k" * 1_000_000 + b"\xc0")
    inputs.append(b'{"remote_block_ids": ' + b"[" * 1_000_000 + b"]" * 1_000_000 + b"}")
    for data in inputs:
        run_all(data)


def _length_claims() -> list[bytes]:
    """Every seed with each of its length prefixes rewritten to claim 1 GiB (and 4 GiB-1
    for the outermost one): the input still holds only the seed's few hundred bytes."""
    out: list[bytes] = []
    for seed in all_seeds():
        base = seed[len(b"PUSH_REG:") :] if seed.startswith(b"PUSH_REG:") else seed
        prefix = seed[: len(seed) - len(base)]
        for i, node in enumerate(n for n in walk(base) if n.kind in SIZED):
            for claim in (GIB, (1 << 32) - 1) if i == 0 else (GIB,):
                head = sized_header(node, claim)
                out.append(
                    prefix + base[: node.offset] + head + base[node.offset + node.header_len :]
                )
    for marker in (b"\xc6", b"\xdb", b"\xdd", b"\xdf"):  # bin, str, array, map alone
        out.append(marker + GIB.to_bytes(4, "big"))
        out.append(b"PUSH_REG:" + marker + GIB.to_bytes(4, "big") + b"\x00" * 64)
    return out


def test_length_claims_of_1_gib_cost_no_memory() -> None:
    claims = _length_claims()
    assert len(claims) > 500
    worst = (0, b"")
    for data in claims:
        with peak_allocation() as peak:
            run_all(data)
        worst = max(worst, (peak[0], data))
    # What each target allocates for a few hundred bytes of input, re-encoding included;
    # allocating the claim would be 1 GiB.
    assert worst[0] < 256 * 1024, f"{worst[0]} bytes for {worst[1][:40].hex()}"


# (decoder, its size limit): inputs one byte over the limit are refused unread.
LIMITED: tuple[tuple[str, Callable[[Any], Any], int], ...] = (
    ("decode_handshake_payload", wire.decode_handshake_payload, wire.DEFAULT_MAX_SIZE),
    (
        "decode_handshake",
        lambda d: wire.decode_handshake(d, local_hash=None),
        wire.DEFAULT_MAX_SIZE,
    ),
    ("decode[AgentMetadataV14]", BYTE_DECODERS["decode[AgentMetadataV14]"], wire.DEFAULT_MAX_SIZE),
    ("decode_handshake_request", wire.decode_handshake_request, 64),
    ("decode_clock_reply", wire.decode_clock_reply, 16),
    ("decode_lease_query", wire.decode_lease_query, 1024),
    ("decode_lease_reply", wire.decode_lease_reply, 16 + 9 * 64),
    ("decode_notification", wire.decode_notification, wire.DEFAULT_MAX_NOTIFICATION_SIZE),
    (
        "decode[PushRegistration]",
        BYTE_DECODERS["decode[PushRegistration]"],
        wire.DEFAULT_MAX_NOTIFICATION_SIZE,
    ),
    ("parse_kv_transfer_params", wire.parse_kv_transfer_params, wire.DEFAULT_MAX_SIZE),
)


@pytest.mark.parametrize(("name", "decoder", "limit"), LIMITED, ids=[n for n, _, _ in LIMITED])
def test_oversize_input_is_refused_without_copying_it(
    name: str, decoder: Callable[[Any], Any], limit: int
) -> None:
    for data in (b"PUSH_REG:" + b"\x00" * limit, b"{" + b" " * limit, b"\x90" * (limit + 1)):
        for given_as in (data, memoryview(data)):
            with peak_allocation() as peak, pytest.raises(WireDecodeError, match="limit"):
                decoder(given_as)
            assert peak[0] < 64 * 1024, f"{name} allocated {peak[0]} bytes"


def _hostile_shapes(size: int) -> dict[str, tuple[Callable[[bytes], Any], bytes]]:
    """Inputs of about ``size`` bytes built to expand the most once decoded."""

    def key(name: str) -> bytes:
        return msgspec.msgpack.encode(name)

    def array(n: int) -> bytes:
        return b"\xdd" + n.to_bytes(4, "big")

    def table(n: int) -> bytes:
        return b"\xdf" + n.to_bytes(4, "big")

    md = lambda d: wire.decode_handshake(  # noqa: E731
        wire.encode_handshake_payload(d, compatibility_hash=LOCAL_HASH), local_hash=None
    )
    u16 = size // 3
    layouts = b"".join(key(f"{i:x}") + b"\x92\x01\x02" for i in range(size // 9))
    factors = b"".join(key(f"{i:x}") + b"\x90" for i in range(size // 7))
    hello = b"\x82" + key("connector_version") + b"\x0d" + key("factors")
    payload = b"\x83" + key("compatibility_hash") + key("x") + key("agent_metadata_bytes")
    payload += msgspec.msgpack.encode(seeds()["metadata"][0]) + key("kvwire") + hello
    return {
        "metadata: region_members of empty lists": (
            md,
            b"\x81" + key("region_members") + array(size) + b"\x90" * size,
        ),
        "metadata: block_lens of uint16": (
            md,
            b"\x81" + key("block_lens") + array(u16) + b"\xcd\x12\x34" * u16,
        ),
        "metadata: packed_member_layouts": (
            md,
            b"\x81" + key("packed_member_layouts") + table(size // 9) + layouts,
        ),
        "payload: kvwire factors of empty lists": (
            lambda d: wire.decode_handshake(d, local_hash=LOCAL_HASH, local_factors=LOCAL_FACTORS),
            payload + table(size // 7) + factors,
        ),
        "push registration: groups of empty lists": (
            wire.decode_notification,
            b"PUSH_REG:\x81" + key("local_block_ids") + array(size) + b"\x90" * size,
        ),
        "push registration: uint16 block ids": (
            wire.decode_notification,
            b"PUSH_REG:\x81"
            + key("local_block_ids")
            + b"\x91"
            + array(u16)
            + b"\xcd\x12\x34" * u16,
        ),
        "heartbeat: two-character ids": (wire.decode_notification, b"HB:" + b"ab," * u16 + b"ab"),
        "kv_transfer_params: msgpack groups": (
            wire.parse_kv_transfer_params,
            b"\x81" + key("remote_block_ids") + array(size) + b"\x90" * size,
        ),
        "kv_transfer_params: JSON unknown key": (
            wire.parse_kv_transfer_params,
            json.dumps({"x": [[]] * u16}).encode(),
        ),
    }


MAX_EXPANSION = 32
"""Worst case measured: ~25x (a heartbeat of two-character ids, JSON lists). Before the
outer-length caps in kvwire.wire.schemas, nested empty lists cost 64x."""


@pytest.mark.parametrize("shape", sorted(_hostile_shapes(64)))
def test_memory_stays_within_a_small_multiple_of_the_input(shape: str) -> None:
    decoder, data = _hostile_shapes(256 * 1024)[shape]
    with peak_allocation() as peak, suppress(WireDecodeError, IncompatiblePeerError):
        decoder(data)
    assert peak[0] <= MAX_EXPANSION * len(data), f"{peak[0] / len(data):.1f}x"


def test_refusal_of_a_peer_with_hostile_factors_is_one_short_line() -> None:
    factors = {f"factor{i}": "v" * 10_000 + "\n" for i in range(60)}
    hello = wire.KVWireHello(connector_version=13, factors=factors)  # type: ignore[arg-type]
    payload = msgspec.msgpack.encode(
        wire.HandshakePayload(
            compatibility_hash="0" * 64, agent_metadata_bytes=b"\x80", kvwire=hello
        )
    )
    with pytest.raises(IncompatiblePeerError) as err:
        wire.decode_handshake(payload, local_hash=LOCAL_HASH, local_factors=LOCAL_FACTORS)
    message = str(err.value)
    assert "\n" not in message
    assert len(message) < 3000
