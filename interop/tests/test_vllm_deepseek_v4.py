"""DeepSeek-V4 in KVWireConnector: V4's caches as vLLM's own modules make them (per layer a
windowed latent; with compression, the compressed latents, the compressor's states and,
at ratio 4, the indexer's keys and states), grouped, planned and allocated by vLLM's own
code. That is five groups of four block sizes (64, 64, 256, 4, 8 tokens) over one backing
whose rows are a block id each, every group's layers overlaying the row.

P exchanges a window group's last ``cdiv(window, block) + 1`` blocks (the first may be
vLLM's null block) and every block of the 256-token group; D keeps, per group, the tail of
P's list its own allocation asks for. The engine fills each layer's page of each of P's
blocks with content of its own (request, group, layer, block position) and D checks, byte
for byte, the pages its next token reads."""

from __future__ import annotations

from typing import Any

import pytest
from harness import (
    PAIRS,
    Geometry,
    Zygote,
    engines,
    held_bytes,
    move_all,
    pair_moved,
    registered_by_each,
)

RATIOS = [1, 4, 128, 4, 128, 4]
"""Compress ratio per layer: a window-only layer, then V4's alternating 4 and 128."""
GEO = Geometry(model="mla", layers=len(RATIOS), num_blocks=512, block_size=256)
"""512 rows of 141696 bytes: room for the 1000-token prompt's 411 blocks on P at once."""
V4 = {"deepseek_v4": RATIOS, "layout": "BLHNC", "hma": True}
PROMPTS = {"req-1000": (41, 1000), "req-768": (43, 768)}
"""Per request, its content index (each its own: no prefix-cache hit between them) and
tokens: 1000 ends inside a block of every group; 768 ends on a 256-token boundary."""
CASES = [(pair, mode) for pair in sorted(PAIRS) for mode in ("pull", "push")]


def v4_groups(fp8_ds_mla: bool = True) -> list[tuple[int, int, list[int]]]:
    """Per group vLLM makes of V4's caches: (block tokens, window tokens (0: none), each
    layer's page bytes, unpadded: what vLLM's view of a block holds), from the specs of
    vLLM's own modules and its own grouping."""
    import vllm_engine
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    start = {
        "model": "mla", "layers": len(RATIOS), "num_blocks": GEO.num_blocks, "tp_size": 1,
        "block_size": GEO.block_size, "connector": "NixlConnector", "role": "P",
        "engine_id": "v4-expected", "layout": "BLHNC", "hma": True, "deepseek_v4": RATIOS,
    }  # fmt: skip
    config = vllm_engine.build_vllm_config({**start, "bf16": not fp8_ds_mla})
    specs = vllm_engine.deepseek_v4_specs(config, RATIOS, fp8_ds_mla)
    out = []
    for group in get_kv_cache_groups(config, specs):
        first = specs[group.layer_names[0]]  # the scheduler keeps blocks by the first's
        window = int(first.sliding_window) if isinstance(first, SlidingWindowSpec) else 0
        pages = [int(specs[name].real_page_size_bytes) for name in group.layer_names]
        out.append((int(first.block_size), window, pages))
    return out


def exchanged(groups: list[tuple[int, int, list[int]]], tokens: int) -> list[int]:
    """Per group, how many block ids P gives D: a window's last ``cdiv(window, block) +
    1``, else every block of the prompt."""
    counts = []
    for block, window, _ in groups:
        blocks = -(-tokens // block)
        counts.append(min(blocks, -(-window // block) + 1) if window else blocks)
    return counts


@pytest.mark.parametrize(("pair", "mode"), CASES)
def test_deepseek_v4(zygote: Zygote, pair: str, mode: str) -> None:
    """TP 1 to 1: D holds, byte for byte, every page of every layer its next token reads
    in each of V4's five groups (the latents of every block of the prompt, the windows'
    and states' last blocks), from P's exchanged tails."""
    state, outputs = pair_moved(zygote, pair, "1-1", mode, PROMPTS, geo=GEO, **V4)
    groups = v4_groups()
    for rid, (_, tokens) in PROMPTS.items():
        assert list(map(len, outputs[rid]["remote_block_ids"])) == exchanged(groups, tokens)
        assert state["checked"][rid] == [0, held_bytes(groups, tokens)], rid


@pytest.mark.parametrize(
    "ratios", [RATIOS, [4, 128, 1, 4]], ids=["window-first", "compressed-first"]
)
def test_deepseek_v4_regions_are_what_stock_registers(zygote: Zygote, ratios: list[int]) -> None:
    """Stock registers V4's one backing once, as rows of a block id (every group's, -1),
    named after its first cache in model-layer order (a window's, or a compressed
    latent's when layer 0 compresses); kvwire the same, so a mixed pair pairs region for
    region."""
    geo = Geometry(model="mla", layers=len(ratios), num_blocks=64, block_size=256)
    options = {**V4, "deepseek_v4": ratios}
    stock, ours = registered_by_each(zygote, geo=geo, extra_config={"transport": "nixl"}, **options)
    for key in ("regions", "names", "groups", "layout", "blocks"):
        assert ours[key] == stock[key], key
    assert stock["groups"] == [-1]


TP_CASES = [
    (pair, mode, tp)
    for pair in sorted(PAIRS)
    if pair != "kvwire-shm"
    for mode in ("pull", "push")
    for tp in ("1-2", "2-1")
]


@pytest.mark.parametrize(("pair", "mode", "tp"), TP_CASES)
def test_deepseek_v4_tensor_parallel(zygote: Zygote, pair: str, mode: str, tp: str) -> None:
    """V4's caches are the same on every TP rank (latents, indexer keys and compressor
    states alike): every D rank holds every page it reads, each from one P rank, whether
    D has more ranks than P or fewer."""
    prompt = {"req-1000": PROMPTS["req-1000"]}
    state, _ = pair_moved(zygote, pair, tp, mode, prompt, geo=GEO, **V4)
    d_tp = int(tp.split("-")[1])
    assert state["checked"]["req-1000"] == [0, held_bytes(v4_groups(), 1000) * d_tp]


NIXL_CASES = [
    (pair, mode) for pair in sorted(PAIRS) if pair != "kvwire-shm" for mode in ("pull", "push")
]


@pytest.mark.parametrize(("pair", "mode"), NIXL_CASES)
def test_deepseek_v4_chunked_prefill(zygote: Zygote, pair: str, mode: str) -> None:
    """P computes each prompt in steps of 300 tokens (ending inside blocks of every group,
    the windows dropping blocks meanwhile), its pages filling as their tokens are
    computed: D holds, byte for byte, what it reads, every page's last bytes included (a
    pushing kvwire P sends a prompt of several groups whole, with its last chunk)."""
    p_conn, d_conn, transport = PAIRS[pair]
    with engines(
        zygote, p_conn, d_conn, {"scheduler": {"batch_tokens": 300}}, None, geo=GEO,
        extra_config={"transport": transport}, mode=mode, **V4,
    ) as (p, d):  # fmt: skip
        state = move_all(p, d, PROMPTS)
    groups = v4_groups()
    for rid, (_, tokens) in PROMPTS.items():
        assert state["checked"][rid] == [0, held_bytes(groups, tokens)], rid


HIT = 1024
"""Tokens a repeated prompt finds in each engine's prefix cache. vLLM caches a windowed
group's blocks only where they end on a 256-token boundary before a prompt's last token,
and a D that loaded the prompt holds only each window's tail: the one boundary both keep
is 1024 for a 1025-token prompt, whose tail in every window group reaches back to it."""


@pytest.mark.parametrize(("pair", "mode"), NIXL_CASES)
def test_deepseek_v4_prefix_hits(zygote: Zygote, pair: str, mode: str) -> None:
    """A prompt repeated with 5 tokens more: P and D each find its first 1024 tokens in
    their own prefix cache (every group's blocks up to there), D loads only the rest from
    P's tails, and D holds, byte for byte, every page its next token reads, its own and
    the loaded ones."""
    p_conn, d_conn, transport = PAIRS[pair]
    with engines(
        zygote, p_conn, d_conn, geo=GEO, extra_config={"transport": transport}, mode=mode, **V4
    ) as (p, d):
        move_all(p, d, {"req-first": (45, HIT + 1)})
        state = move_all(p, d, {"req-again": (45, HIT + 6)})
        p_hits = p.state["hits"]
    assert p_hits["req-again"] == state["hits"]["req-again"] == HIT
    assert state["checked"]["req-again"] == [0, held_bytes(v4_groups(), HIT + 6)]


@pytest.mark.parametrize("pair", ["kvwire-nixl", "stock-P-kvwire-D", "kvwire-P-stock-D"])
def test_deepseek_v4_in_bf16(zygote: Zygote, pair: str) -> None:
    """V4's caches in bf16 (no page padded): stock registers the buffer as nine
    overlapping regions (the rows, then single layers' pages at shared addresses), kvwire
    as its rows. Two kvwire engines move every page D reads; a mixed pair fails at the
    handshake (a kvwire D names the region counts), and D loads nothing: it computes the
    prompt itself, never reads bytes that are not the request's."""
    p_conn, d_conn, transport = PAIRS[pair]
    # A refused pair's P holds the prompt until its lease runs out: a short one.
    lease = 30 if pair == "kvwire-nixl" else 3
    with engines(
        zygote, p_conn, d_conn, geo=GEO, extra_config={"transport": transport}, mode="pull",
        v4_bf16=True, lease=lease, **V4,
    ) as (p, d):  # fmt: skip
        state = move_all(p, d, {"req-1000": PROMPTS["req-1000"]})
        log = "\n".join(d.peer.log)
    if pair == "kvwire-nixl":
        assert state["checked"]["req-1000"] == [0, held_bytes(v4_groups(False), 1000)]
        return
    assert "req-1000" not in state["checked"] and "req-1000" in state["outputs"]
    if pair == "stock-P-kvwire-D":
        assert "region count: expected 1, got 9" in log, log


HOST_BUFFER = [
    *(
        (pair, mode, 300)
        for pair in sorted(PAIRS)
        if pair != "kvwire-shm"
        for mode in ("pull", "push")
    ),
    ("kvwire-nixl", "pull", 0),
    ("kvwire-nixl", "push", 0),
]


@pytest.mark.parametrize(("pair", "mode", "chunk"), HOST_BUFFER)
def test_deepseek_v4_with_a_host_buffer(zygote: Zygote, pair: str, mode: str, chunk: int) -> None:
    """A host buffer (``kv_buffer_device: cpu``) on the kvwire engines: P stages what each
    step computes, group by group, each group's blocks cut by its own block size (by the
    engine's, most pages a chunk computes stayed behind), and D holds every page it
    reads. The CPU half: a kvwire engine's CPU cache stands for a device's and stages
    through its host copy; a stock engine on a CPU platform stages nothing."""
    p_conn, d_conn, transport = PAIRS[pair]
    staged: dict[str, Any] = {"host_buffer": True}
    p_options = {**staged, "scheduler": {"batch_tokens": chunk}} if chunk else staged
    with engines(
        zygote, p_conn, d_conn, p_options, staged, geo=GEO,
        extra_config={"transport": transport}, mode=mode, **V4,
    ) as (p, d):  # fmt: skip
        state = move_all(p, d, PROMPTS)
    for rid, (_, tokens) in PROMPTS.items():
        assert state["checked"][rid] == [0, held_bytes(v4_groups(), tokens)], rid


def test_a_layer_outside_the_rows_is_refused_by_name() -> None:
    """The rows a V4 engine registers must hold every layer's view: a view in another
    allocation, or one reaching past its row, fails the engine's startup naming the
    layer (or the first layer, whose rows the others disagree with), instead of leaving
    bytes out of every transfer."""
    import torch

    from kvwire.errors import ConfigError
    from kvwire.integrations.vllm.geometry import row_regions

    rows = torch.zeros(8, 96, dtype=torch.uint8)
    good = {"model.layers.0.attn.swa_cache": rows[:, :64], "model.layers.0.attn": rows[:, 64:]}
    groups = {name: g for g, name in enumerate(good)}
    (region,) = row_regions(good, 8, "BLHNC", groups)
    assert (region.block_len, region.block_stride, region.group_id) == (96, 96, -1)
    elsewhere = {**good, "model.layers.0.attn": torch.zeros(8, 96, dtype=torch.uint8)[:, 64:]}
    with pytest.raises(
        ConfigError, match=r"layer model\.layers\.0\.attn(\.swa_cache)?: .* not inside them"
    ):
        row_regions(elsewhere, 8, "BLHNC", groups)
    other_rows = rows.view(-1).as_strided((8, 32), (48, 1), 64)  # rows of another width
    past = {**good, "model.layers.0.attn": other_rows}
    with pytest.raises(
        ConfigError, match=r"layer model\.layers\.0\.attn(\.swa_cache)?: .* not inside them"
    ):
        row_regions(past, 8, "BLHNC", groups)
