"""``kvwire bench layout``: descriptor building for a Llama-3-70B request, beside a plain loop.

The request: 80 layers with K and V in separate regions (160 regions), 8 KV heads of 128
bf16 values, 16-token blocks, 4096 tokens (256 blocks). At TP 8 every rank holds one head,
so one block of one region is 4 KiB and the request is 40,960 descriptors per rank unless
coalesced. The baseline is the straightforward way: a Python loop over regions and blocks
appending one tuple per descriptor, measured in the same run on the same ids; its output is
checked equal to kvwire's before anything is timed.
"""

from __future__ import annotations

import argparse

import numpy as np

from kvwire.bench.report import Report, Result, repeat
from kvwire.layout import Descs, PeerLayout
from kvwire.layout.geometry import BlockRegion, KVGeometry, RemoteGeometry, heads_per_rank

LAYERS = 80
KV_HEADS = 8
HEAD_DIM = 128
DTYPE_BYTES = 2
BLOCK = 16
TOKENS = 4096
CAPACITY = 2048  # blocks per region


def llama70b_rank(tp_rank: int, tp_size: int, base: int, device: int) -> KVGeometry:
    block_len = heads_per_rank(tp_size, KV_HEADS) * BLOCK * HEAD_DIM * DTYPE_BYTES
    region_bytes = block_len * CAPACITY
    regions = [
        BlockRegion(
            base_addr=base + i * region_bytes,
            block_len=block_len,
            num_blocks=CAPACITY,
            name=f"layers.{i // 2}.{'kv'[i % 2]}",
        )
        for i in range(2 * LAYERS)
    ]
    return KVGeometry(
        regions,
        kv_cache_layout="HND",
        block_size=BLOCK,
        total_kv_heads=KV_HEADS,
        tp_rank=tp_rank,
        tp_size=tp_size,
        device_id=device,
    )


def loop_plan(
    local: KVGeometry,
    remote: KVGeometry,
    local_ids: list[int],
    remote_ids: list[int],
    rank_offset: int,
) -> tuple[Descs, Descs]:
    """The baseline: one Python iteration per region and block (vLLM's formulas)."""
    local_rows: list[tuple[int, int, int]] = []
    remote_rows: list[tuple[int, int, int]] = []
    for lr, rr in zip(local.regions, remote.regions, strict=True):
        length = lr.block_len
        for lid, rid in zip(local_ids, remote_ids, strict=True):
            local_rows.append((lr.base_addr + lid * lr.block_stride, length, local.device_id))
            remote_rows.append(
                (rr.base_addr + rid * rr.block_stride + rank_offset, length, remote.device_id)
            )
    return np.array(local_rows, dtype=np.int64), np.array(remote_rows, dtype=np.int64)


def _measure(
    report: Report, prefix: str, p_tp: int, d_tp: int, repeats: int, rng: np.random.Generator
) -> None:
    d_rank = d_tp - 1
    p_rank = d_rank * p_tp // d_tp
    consumer = llama70b_rank(d_rank, d_tp, 1 << 40, 0)
    producer = llama70b_rank(p_rank, p_tp, 1 << 44, 1)
    remote = RemoteGeometry.from_local(producer, engine_id="prefill")
    blocks = TOKENS // BLOCK
    local_ids = rng.permutation(CAPACITY)[:blocks]
    remote_ids = rng.permutation(CAPACITY)[:blocks]

    handshake = repeat(lambda: PeerLayout(consumer, remote, mode="pull"), repeats=repeats)
    layout = PeerLayout(consumer, remote, mode="pull", coalesce=False)
    plan = layout.plan([local_ids], [remote_ids])
    rank_offset = (d_rank % (d_tp // p_tp)) * consumer.regions[0].block_len if d_tp > p_tp else 0
    lids, rids = local_ids.tolist(), remote_ids.tolist()
    loop_local, loop_remote = loop_plan(consumer, producer, lids, rids, rank_offset)
    if not (
        np.array_equal(loop_local, plan.local_descs)
        and np.array_equal(loop_remote, plan.remote_descs)
    ):
        raise AssertionError(f"{prefix}: kvwire and the loop disagree")
    count = plan.num_descs

    fast = repeat(lambda: layout.plan([local_ids], [remote_ids]), repeats=repeats * 4)
    slow = repeat(lambda: loop_plan(consumer, producer, lids, rids, rank_offset), repeats=repeats)
    baseline = "per-block Python loop"
    report.add(
        Result(
            f"{prefix}descs_per_s",
            count / fast.median,
            "descs/s",
            baseline=baseline,
            ratio=slow.median / fast.median,
            min=count / fast.max,
            max=count / fast.min,
        )
    )
    report.add(
        Result(
            f"{prefix}ratio_vs_loop",
            slow.median / fast.median,
            "x",
            baseline=f"{baseline}: {slow.median * 1e3:.2f} ms",
        )
    )
    report.add(
        Result(f"{prefix}plan_ms", fast.median * 1e3, "ms", min=fast.min * 1e3, max=fast.max * 1e3)
    )
    report.add(
        Result(f"{prefix}loop_ms", slow.median * 1e3, "ms", min=slow.min * 1e3, max=slow.max * 1e3)
    )
    report.add(Result(f"{prefix}descs", float(count), "descs"))
    report.add(
        Result(
            f"{prefix}handshake_ms",
            handshake.median * 1e3,
            "ms",
            min=handshake.min * 1e3,
            max=handshake.max * 1e3,
        )
    )


def _coalescing(report: Report, repeats: int) -> None:
    """The contiguous TP8 case: a request allocated as one run of blocks on both sides."""
    consumer = llama70b_rank(0, 8, 1 << 40, 0)
    producer = llama70b_rank(0, 8, 1 << 44, 1)
    remote = RemoteGeometry.from_local(producer, engine_id="prefill")
    blocks = TOKENS // BLOCK
    local_ids = np.arange(100, 100 + blocks)
    remote_ids = np.arange(700, 700 + blocks)
    merged = PeerLayout(consumer, remote, mode="pull", coalesce=True)
    plain = PeerLayout(consumer, remote, mode="pull", coalesce=False)
    coalesced = merged.plan([local_ids], [remote_ids])
    uncoalesced = plain.plan([local_ids], [remote_ids])
    timing = repeat(lambda: merged.plan([local_ids], [remote_ids]), repeats=repeats * 4)
    report.add(
        Result(
            "coalesced_descs",
            float(coalesced.num_descs),
            "descs",
            baseline="uncoalesced",
            ratio=uncoalesced.num_descs / max(1, coalesced.num_descs),
        )
    )
    report.add(Result("uncoalesced_descs", float(uncoalesced.num_descs), "descs"))
    report.add(
        Result(
            "coalesced_plan_ms",
            timing.median * 1e3,
            "ms",
            min=timing.min * 1e3,
            max=timing.max * 1e3,
        )
    )


def run(args: argparse.Namespace) -> Report:
    repeats = 3 if getattr(args, "quick", False) else 9
    rng = np.random.default_rng(70)
    report = Report("layout")
    _measure(report, "", 8, 8, repeats, rng)
    _measure(report, "tp2_to_tp8.", 2, 8, repeats, rng)
    _coalescing(report, repeats)
    report.sweeps["request"] = {
        "model": "Llama-3-70B",
        "layers": LAYERS,
        "regions": 2 * LAYERS,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "dtype_bytes": DTYPE_BYTES,
        "block_size": BLOCK,
        "tokens": TOKENS,
    }
    return report
