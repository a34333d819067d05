"""``kvwire bench wire``: encode and decode of the v13 handshake, beside vLLM's definitions.

The message is what one rank of a Llama-3-8B engine publishes: 32 layers with K and V in
separate regions (64 regions), their names, members and memory kinds, and a 2 KiB transport
blob. The baseline is vLLM 0.31.0's own way: plain dataclasses with the same fields (written
out below from the protocol's field list), encoded and decoded by msgspec, and for the
handshake the two-phase decode exactly as vLLM's worker performs it, which builds a fresh
``msgspec.msgpack.Decoder`` for each phase of every handshake. A second ratio gives the
dataclasses decoders built once, to separate what the Struct schema buys from what caching
the decoders buys.

Both sides must produce the same bytes; that is checked before anything is timed. The
contenders take turns in short batches timed by this process's CPU clock with the garbage
collector paused, and each ratio is the median of the per-repetition ratios.
"""

from __future__ import annotations

import argparse
import hashlib
import random
from abc import ABC
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from kvwire.bench.report import (
    Report,
    Result,
    Timing,
    cpu_clock,
    gc_paused,
    paired_ratio,
    repeat_interleaved,
)
from kvwire.wire import (
    AgentMetadata,
    decode,
    decode_handshake,
    decode_handshake_payload,
    encode,
    encode_handshake_payload,
)

LAYERS = 32
REGIONS = 2 * LAYERS
BLOB_BYTES = 2048
NUM_BLOCKS = 8192
BLOCK_LEN = 16 * 8 * 128 * 2  # 16 tokens x 8 KV heads x 128 dims x bf16, one of K or V
BATCH_S = 0.004
"""Length of one timed batch: short, so a burst of load from other processes spoils few."""
BATCH_S_QUICK = 0.002
SMALL_REGIONS = 2  # one layer's K and V: the fixed per-message cost dominates


# --- vLLM 0.31.0's definitions, as a baseline -------------------------------------------
# Plain dataclasses with the v13 field list in wire order; msgspec encodes them exactly as
# it encodes kvwire's Structs, which is what makes the comparison like for like. Written
# independently of kvwire.wire, so the interop tests also use them as "vLLM's side";
# tests/bench checks them against the golden vectors.


class _ConnectorHandshakeBase(ABC):  # noqa: B024 - mirrors vLLM's field-less base class
    """Stands in for vLLM's ``KVConnectorHandshakeMetadata`` (an ABC with no fields)."""


@dataclass
class VllmAgentMetadata:
    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    region_members: list[list[str]] = field(default_factory=list)
    packed_member_layouts: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class VllmHandshakePayload(_ConnectorHandshakeBase):
    compatibility_hash: str
    agent_metadata_bytes: bytes


def vllm_decode_handshake(data: bytes, local_hash: str) -> VllmAgentMetadata:
    """The consumer's two-phase decode the way vLLM 0.31.0 does it: decoders per call."""
    payload = msgspec.msgpack.Decoder(VllmHandshakePayload).decode(data)
    if payload.compatibility_hash != local_hash:
        raise RuntimeError("compatibility hash mismatch")
    return msgspec.msgpack.Decoder(VllmAgentMetadata).decode(payload.agent_metadata_bytes)


def _cached_vllm_decode() -> Callable[[bytes, str], VllmAgentMetadata]:
    """The same decode with both decoders built once: dataclasses at their best."""
    outer = msgspec.msgpack.Decoder(VllmHandshakePayload)
    inner = msgspec.msgpack.Decoder(VllmAgentMetadata)

    def decode_once(data: bytes, local_hash: str) -> VllmAgentMetadata:
        payload = outer.decode(data)
        if payload.compatibility_hash != local_hash:
            raise RuntimeError("compatibility hash mismatch")
        return inner.decode(payload.agent_metadata_bytes)

    return decode_once


# --- the message ---------------------------------------------------------------------------


def rank_metadata_fields(regions: int = REGIONS, blob_bytes: int = BLOB_BYTES) -> dict[str, object]:
    """Field values of one rank's metadata, shaped as vLLM fills them for a dense model.

    K and V of a layer are separate regions that share the layer's name; ``region_members``
    stays empty (vLLM fills it only for hybrid and packed caches). ``blob_bytes`` stands in
    for the transport's agent blob.
    """
    rng = random.Random(regions)
    region_bytes = BLOCK_LEN * NUM_BLOCKS
    base = 0x7F00_0000_0000
    return {
        "engine_id": "prefill-engine-0f3a9c",
        "agent_metadata": rng.randbytes(blob_bytes),
        "kv_caches_base_addr": [base + i * region_bytes for i in range(regions)],
        "device_id": 3,
        "num_blocks": NUM_BLOCKS,
        "block_lens": [BLOCK_LEN] * regions,
        "block_strides": [BLOCK_LEN] * regions,
        "kv_cache_layout": "HND",
        "block_size": 16,
        "ssm_sizes": (0, 0),
        "attn_backend_name": "FLASH_ATTN",
        "physical_blocks_per_logical_kv_block": 1,
        "region_num_blocks": [NUM_BLOCKS] * regions,
        "region_group_ids": [0] * regions,
        "region_names": [f"model.layers.{i // 2}.self_attn.attn" for i in range(regions)],
        "region_mem_types": ["VRAM"] * regions,
        "dcp_size": 1,
        "pcp_size": 1,
        "region_members": [],
        "packed_member_layouts": {},
    }


class _Message:
    """One metadata message in both definitions, with its bytes checked equal."""

    def __init__(self, regions: int, local_hash: str) -> None:
        fields = rank_metadata_fields(regions)
        self.ours = msgspec.convert(fields, AgentMetadata)
        self.theirs = VllmAgentMetadata(**fields)  # type: ignore[arg-type]
        self.md_bytes = encode(self.ours)
        if _ENCODER.encode(self.theirs) != self.md_bytes:
            raise AssertionError("wire bench: kvwire and vLLM definitions encode differently")
        self.payload = encode_handshake_payload(self.md_bytes, compatibility_hash=local_hash)
        if _ENCODER.encode(VllmHandshakePayload(local_hash, self.md_bytes)) != self.payload:
            raise AssertionError("wire bench: the handshake payloads differ")
        if vllm_decode_handshake(self.payload, local_hash) != self.theirs:
            raise AssertionError("wire bench: the vLLM-definition decode lost information")
        if decode_handshake(self.payload, local_hash=local_hash) != self.ours:
            raise AssertionError("wire bench: kvwire's decode lost information")

    def decode_contenders(self, local_hash: str) -> dict[str, Callable[[], object]]:
        payload = self.payload
        cached = _cached_vllm_decode()
        return {
            "kvwire": lambda: decode_handshake(payload, local_hash=local_hash),
            "vllm": lambda: vllm_decode_handshake(payload, local_hash),
            "vllm_cached": lambda: cached(payload, local_hash),
        }

    def encode_contenders(self, local_hash: str) -> dict[str, Callable[[], object]]:
        ours, theirs = self.ours, self.theirs

        def vllm_encode() -> bytes:
            inner = _ENCODER.encode(theirs)
            return _ENCODER.encode(VllmHandshakePayload(local_hash, inner))

        return {
            "kvwire": lambda: encode_handshake_payload(ours, compatibility_hash=local_hash),
            "vllm": vllm_encode,
        }


_ENCODER = msgspec.msgpack.Encoder()

_LABELS = {
    "vllm": "vLLM 0.31.0 definitions (dataclass)",
    "vllm_cached": "vLLM definitions, decoders built once",
}


def _batch(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    def run_batch() -> None:
        with gc_paused():
            for _ in range(calls):
                fn()

    return run_batch


def _calls_for(fn: Callable[[], object], *, budget_s: float) -> int:
    """How many calls of ``fn`` fill about ``budget_s``: long enough to time, short enough
    that a burst of load from other processes spoils few batches."""
    probe = 10
    with gc_paused():
        t0 = cpu_clock()
        for _ in range(probe):
            fn()
        per_call = (cpu_clock() - t0) / probe
    return max(probe, int(budget_s / max(per_call, 1e-9)))


def _per_call_us(t: Timing, calls: int) -> Timing:
    scale = 1e6 / calls
    return Timing(
        t.median * scale, t.min * scale, t.max * scale, tuple(v * scale for v in t.samples)
    )


def _time_us(
    contenders: dict[str, Callable[[], object]], *, budget_s: float, repeats: int
) -> dict[str, Timing]:
    """Microseconds per call of each contender, timed in turns (see repeat_interleaved)."""
    calls = min(_calls_for(fn, budget_s=budget_s) for fn in contenders.values())
    batches = {name: _batch(fn, calls) for name, fn in contenders.items()}
    timings = repeat_interleaved(batches, repeats=repeats, clock=cpu_clock)
    return {name: _per_call_us(t, calls) for name, t in timings.items()}


def _compare(
    report: Report,
    op: str,
    contenders: dict[str, Callable[[], object]],
    *,
    budget_s: float,
    repeats: int,
) -> dict[str, Timing]:
    """Add per-call microseconds of every contender and each baseline's ratio to kvwire's."""
    us = _time_us(contenders, budget_s=budget_s, repeats=repeats)
    ours = us["kvwire"]
    for name, t in us.items():
        report.add(Result(f"wire.{op}.{name}_us", t.median, "us", min=t.min, max=t.max))
    for name, t in us.items():
        if name == "kvwire":
            continue
        suffix = "ratio_vs_vllm" if name == "vllm" else "ratio_vs_vllm_cached"
        ratio = paired_ratio(t, ours)
        report.add(
            Result(
                f"wire.{op}.{suffix}",
                ratio.median,
                "x",
                baseline=f"{_LABELS[name]}: {t.median:.2f} us",
                ratio=ratio.median,
                min=ratio.min,
                max=ratio.max,
            )
        )
    return us


def run(args: argparse.Namespace) -> Report:
    quick = bool(getattr(args, "quick", False))
    budget_s = BATCH_S_QUICK if quick else BATCH_S
    repeats = 7 if quick else 21
    report = Report("wire")
    local_hash = hashlib.sha256(b"kvwire bench wire").hexdigest()

    msg = _Message(REGIONS, local_hash)
    small = _Message(SMALL_REGIONS, local_hash)
    report.add(Result("wire.agent_metadata.bytes", float(len(msg.md_bytes)), "B"))
    report.add(Result("wire.handshake_payload.bytes", float(len(msg.payload)), "B"))

    md_bytes, payload = msg.md_bytes, msg.payload
    md_decoder = msgspec.msgpack.Decoder(VllmAgentMetadata)
    payload_decoder = msgspec.msgpack.Decoder(VllmHandshakePayload)
    ours_md, theirs_md = msg.ours, msg.theirs
    comparisons: dict[str, dict[str, Callable[[], object]]] = {
        "decode_handshake": msg.decode_contenders(local_hash),
        "decode_agent_metadata": {
            "kvwire": lambda: decode(md_bytes, AgentMetadata),
            "vllm": lambda: md_decoder.decode(md_bytes),
        },
        "decode_handshake_payload": {
            "kvwire": lambda: decode_handshake_payload(payload),
            "vllm": lambda: payload_decoder.decode(payload),
        },
        "encode_handshake": msg.encode_contenders(local_hash),
        "encode_agent_metadata": {
            "kvwire": lambda: encode(ours_md),
            "vllm": lambda: _ENCODER.encode(theirs_md),
        },
        "small.decode_handshake": small.decode_contenders(local_hash),
        "small.encode_handshake": small.encode_contenders(local_hash),
    }
    for op, contenders in comparisons.items():
        _compare(report, op, contenders, budget_s=budget_s, repeats=repeats)
    _regions_sweep(report, local_hash, quick=quick, budget_s=budget_s, repeats=repeats)
    return report


def _regions_sweep(
    report: Report, local_hash: str, *, quick: bool, budget_s: float, repeats: int
) -> None:
    """Handshake decode time as the metadata grows: the saving is per message, not per byte."""
    points = (1, 8, 64, 256) if quick else (1, 2, 4, 8, 16, 32, 64, 128, 256)
    ours: list[float] = []
    lo: list[float] = []
    hi: list[float] = []
    vllm: list[float] = []
    cached: list[float] = []
    for regions in points:
        msg = _Message(regions, local_hash)
        contenders = msg.decode_contenders(local_hash)
        us = _time_us(contenders, budget_s=budget_s, repeats=repeats)
        ours.append(us["kvwire"].median)
        lo.append(us["kvwire"].min)
        hi.append(us["kvwire"].max)
        vllm.append(us["vllm"].median)
        cached.append(us["vllm_cached"].median)
    report.add_sweep(
        "wire.decode_handshake_vs_regions",
        points,
        ours,
        xlabel="KV regions in the agent metadata",
        ylabel="two-phase handshake decode (us)",
        label="kvwire",
        y_min=lo,
        y_max=hi,
        series={_LABELS["vllm"]: vllm, _LABELS["vllm_cached"]: cached},
        title="Handshake decode vs metadata size (2 KiB transport blob)",
    )
