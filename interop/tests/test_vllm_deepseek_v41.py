"""DeepSeek-V4.1 in KVWireConnector: V4.1's caches as vLLM's own modules make them (per
layer a windowed latent in 32-token blocks; at ratio 1 or 2 a compressed latent; at ratio
2 also the indexer's keys and the compressor's ring, ``CircularBufferSpec``: the open
group's rows, one block a request), grouped, planned and allocated by vLLM's own code:
three groups of 32, 256 and 8 tokens over one backing of rows.

With a ring, a stock engine registers each layer's page of a row apart, in allocation
order, pages at one address as one region (its "CSA-linear" mode), and kvwire registers
the same regions, but where stock's region is shorter than a page at its address (which
leaves that page's tail behind): kvwire's is the longest page's there.

P fills each page of each of its blocks with content of its own (request, group, layer,
block position; a ring's by the tokens computed), and D checks, byte for byte, the pages
its next token reads: the window's, every compressed block's and each ring whole."""

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
    step_both,
    wait_until,
)

RATIOS = [0, 2, 1, 2]
"""Compress ratio per layer: a window-only layer, then V4.1's 2, 1 and 2."""
GEO = Geometry(model="mla", layers=len(RATIOS), num_blocks=512, block_size=256)
V41 = {"deepseek_v4": RATIOS, "v41": True, "layout": "BLHNC", "hma": True}
PROMPTS = {"req-1000": (41, 1000), "req-769": (43, 769)}
"""Per request, its content index (each its own: no prefix-cache hit between them) and
tokens: 1000 ends inside a block of every group and an odd count leaves a ring half
open."""


def v41_groups(ratios: list[int]) -> tuple[list[tuple[int, int, list[int]]], int]:
    """(per token group vLLM makes of V4.1's caches: block tokens, window tokens, each
    layer's page bytes; the ring group's bytes, all its layers' pages), from the specs of
    V4.1's own modules and vLLM's own grouping."""
    import vllm_engine
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import CircularBufferSpec, SlidingWindowSpec

    start = {
        "model": "mla", "layers": len(ratios), "num_blocks": GEO.num_blocks, "tp_size": 1,
        "block_size": GEO.block_size, "connector": "NixlConnector", "role": "P",
        "engine_id": "v41-expected", **V41, "deepseek_v4": ratios,
    }  # fmt: skip
    config = vllm_engine.build_vllm_config(start)
    specs = vllm_engine.deepseek_v41_specs(config, ratios)
    tokens, ring = [], 0
    for group in get_kv_cache_groups(config, specs):
        first = specs[group.layer_names[0]]
        pages = [int(specs[name].real_page_size_bytes) for name in group.layer_names]
        if isinstance(first, CircularBufferSpec):
            ring += sum(pages)
            continue
        window = int(first.sliding_window) if isinstance(first, SlidingWindowSpec) else 0
        tokens.append((int(first.block_size), window, pages))
    return tokens, ring


def checked_bytes(prompt: int, ratios: list[int] = RATIOS) -> int:
    """What one D rank checks of a prompt: the token groups' pages it reads and the
    rings."""
    groups, ring = v41_groups(ratios)
    return held_bytes(groups, prompt) + ring


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_deepseek_v41(zygote: Zygote, pair: str, mode: str) -> None:
    """TP 1 to 1: P's params carry a window's tail, the compressed blocks and the ring's
    one block; D holds every page its next token reads, rings included."""
    state, outputs = pair_moved(zygote, pair, "1-1", mode, PROMPTS, geo=GEO, **V41)
    for rid, (_, tokens) in PROMPTS.items():
        window, compressed, ring = map(len, outputs[rid]["remote_block_ids"])
        assert (compressed, ring) == (-(-tokens // GEO.block_size), 1), rid
        assert window == -(-128 // 32) + 1, rid
        assert state["checked"][rid] == [0, checked_bytes(tokens)], rid


@pytest.mark.parametrize(
    ("pair", "mode", "tp"),
    [(pair, mode, tp) for pair in sorted(PAIRS) if pair != "kvwire-shm"
     for mode in ("pull", "push") for tp in ("1-2", "2-1")],
)  # fmt: skip
def test_deepseek_v41_tensor_parallel(zygote: Zygote, pair: str, mode: str, tp: str) -> None:
    """V4.1's caches, its rings too, are the same on every TP rank: every D rank holds
    every page it reads, each from one P rank."""
    prompt = {"req-1000": PROMPTS["req-1000"]}
    state, _ = pair_moved(zygote, pair, tp, mode, prompt, geo=GEO, **V41)
    d_tp = int(tp.split("-")[1])
    assert state["checked"]["req-1000"] == [0, checked_bytes(1000) * d_tp]


NIXL_CASES = [
    (pair, mode) for pair in sorted(PAIRS) if pair != "kvwire-shm" for mode in ("pull", "push")
]


@pytest.mark.parametrize(("pair", "mode"), NIXL_CASES)
def test_deepseek_v41_chunked_prefill(zygote: Zygote, pair: str, mode: str) -> None:
    """P computes each prompt in steps of 300 tokens, its rings rewritten at every step:
    D holds each ring as P left it after the prompt's last token (a ring moved with an
    earlier chunk fails), and every other page it reads."""
    p_conn, d_conn, transport = PAIRS[pair]
    with engines(
        zygote, p_conn, d_conn, {"scheduler": {"batch_tokens": 300}}, None, geo=GEO,
        extra_config={"transport": transport}, mode=mode, **V41,
    ) as (p, d):  # fmt: skip
        state = move_all(p, d, PROMPTS)
    for rid, (_, tokens) in PROMPTS.items():
        assert state["checked"][rid] == [0, checked_bytes(tokens)], rid


@pytest.mark.parametrize(("pair", "mode"), NIXL_CASES)
def test_deepseek_v41_prefix_hits(zygote: Zygote, pair: str, mode: str) -> None:
    """A prompt repeated with 5 tokens more: P and D each find its first 1024 tokens in
    their own prefix cache (vLLM caches no ring, and takes the hit beside it), D loads the
    rest and P's rings, and holds every page its next token reads."""
    p_conn, d_conn, transport = PAIRS[pair]
    with engines(
        zygote, p_conn, d_conn, geo=GEO, extra_config={"transport": transport}, mode=mode, **V41
    ) as (p, d):
        move_all(p, d, {"req-first": (45, 1025)})
        state = move_all(p, d, {"req-again": (45, 1030)})
        p_hits = p.state["hits"]
    assert p_hits["req-again"] == state["hits"]["req-again"] == 1024
    assert state["checked"]["req-again"] == [0, checked_bytes(1030)]


COMPRESSED_FIRST = [2, 0, 2, 1]
"""Layer 0 compresses: vLLM orders the compressed group first, so each row starts with a
compressed latent's page (74880 bytes), then a window's (19008) and a ring's (32768)."""


def test_deepseek_v41_regions_are_what_stock_registers(zygote: Zygote) -> None:
    """Stock registers V4.1's rows page by page: each address once (a window's page, a
    compressed latent's and a ring's start a row together: shared, -1), as long as the
    last MLA page there, named after its first cache in allocation order; kvwire the
    same, so a mixed pair pairs region for region."""
    stock, ours = _registered(zygote, RATIOS)
    for key in ("regions", "names", "groups", "layout", "blocks"):
        assert ours[key] == stock[key], key
    assert ours["groups"][0] == -1 and len(ours["regions"]) == 9


def test_a_region_stock_makes_shorter_than_a_page_is_kvwires_longest(zygote: Zygote) -> None:
    """With the compressed group first, stock's region at the rows' start is the window's
    page (19008 bytes, the last MLA page there) and leaves the compressed latent's and the
    ring's tails behind (measured between two stock engines: 228,852 of 1,683,232 bytes D
    reads, the request completed); kvwire's is the longest page there, every other region
    the same."""
    stock, ours = _registered(zygote, COMPRESSED_FIRST)
    assert stock["regions"][0][1] == 19008 and ours["regions"][0][1] == 74880
    assert ours["regions"][1:] == stock["regions"][1:]
    for key in ("names", "groups", "layout", "blocks"):
        assert ours[key] == stock[key], key


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("pair", ["kvwire-shm", "kvwire-nixl"])
def test_deepseek_v41_compressed_first(zygote: Zygote, pair: str, mode: str) -> None:
    """Two kvwire engines move every page D reads, the compressed latents' and rings'
    tails included."""
    prompt = {"req-1000": PROMPTS["req-1000"]}
    options = {**V41, "deepseek_v4": COMPRESSED_FIRST}
    state, _ = pair_moved(zygote, pair, "1-1", mode, prompt, geo=GEO, **options)
    assert state["checked"]["req-1000"] == [0, checked_bytes(1000, COMPRESSED_FIRST)]


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("pair", ["stock-P-kvwire-D", "kvwire-P-stock-D"])
def test_deepseek_v41_compressed_first_with_a_stock_peer_fails_at_the_handshake(
    zygote: Zygote, pair: str, mode: str
) -> None:
    """The regions differ in length, so a mixed pair fails at the handshake, the side
    that checks naming region 0's two lengths: D fails the request and reads none of
    it."""
    p_conn, d_conn, transport = PAIRS[pair]
    with engines(
        zygote, p_conn, d_conn, geo=GEO, mode=mode, **{**V41, "deepseek_v4": COMPRESSED_FIRST},
        # a pushing P that fails the handshake never registers: D fails the request when
        # its registration timeout ends (30 s by default; 10 s outlasts the handshake)
        extra_config={"transport": transport, "push_registration_timeout": 10},
    ) as (p, d):  # fmt: skip
        p.add("req", 41, 1000)
        wait_until(lambda: "req" in p.state.get("outputs", {}), p.step, 60, "P to finish")
        d.add("req", 41, 1000, p.state["outputs"]["req"])
        step_both(p, d, lambda: "req" in d.state.get("failed", []), "D to fail the request")
        assert "req" not in d.state["checked"]
        logs = p.peer.log + d.peer.log
        assert any("74880" in line and "19008" in line for line in logs), logs[-3:]


def _registered(zygote: Zygote, ratios: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(stock's, kvwire's) regions of V4.1 with these compress ratios."""
    geo = Geometry(model="mla", layers=len(ratios), num_blocks=64, block_size=256)
    options: dict[str, Any] = {**V41, "deepseek_v4": ratios}
    return registered_by_each(zygote, geo=geo, extra_config={"transport": "nixl"}, **options)


@pytest.mark.parametrize(("pair", "mode"), NIXL_CASES)
def test_deepseek_v41_in_blnhc(zygote: Zygote, pair: str, mode: str) -> None:
    """The other layout V4.1's indexer backend takes: in rows every layer's page of a
    block is one span in either, so kvwire registers what stock does, and D holds every
    page it reads (the ``BLNHC`` refusal of rings is for rings beside attention, outside
    rows)."""
    state, _ = pair_moved(zygote, pair, "1-1", mode, PROMPTS, geo=GEO, **{**V41, "layout": "BLNHC"})
    for rid, (_, tokens) in PROMPTS.items():
        assert state["checked"][rid] == [0, checked_bytes(tokens)], rid
