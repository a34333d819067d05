"""Qwen4Exp in KVWireConnector: its caches as vLLM's own code makes them (the indexers'
raw-key rings and compressed keys from ``qsa_cache``'s classes, GDN and per-layer-embedding
states from ``MambaBase``'s spec, GQA attention pages), aligned, grouped, planned and
allocated by vLLM: six groups over one buffer of rows, each TP rank's rows its own.

P fills each page of each of its blocks with content of its own (request, group, layer,
block position, rank; a ring's and a state's by the tokens computed), and D checks, byte
for byte, every page its next token reads: the attention pages and compressed keys of the
prompt, each ring and each state whole.

A stock engine registers each address of the rows once, as long as the last MLA page
registered there (the compressed keys'), and moves the states' pages apart: in vLLM
0.32.0 the embeddings' state with its own length (``ple_block_len``, metadata v14), so a
kvwire engine advertises the same and moves with it; vLLM 0.31.0 moves that state with
the compressed keys' length, 5120 of its bytes, so a kvwire engine advertises the state's
page there, and a stock peer is refused at the handshake, by one side or the other."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from harness import (
    PAIRS,
    PROTOCOL_VERSION,
    Geometry,
    Zygote,
    engines,
    move_all,
    pair_moved,
)

GEO = Geometry(model="qwen3-30b-a3b", layers=8, num_blocks=32, block_size=16)
"""Eight layers (GDN three times, then sparse attention, twice; the embeddings' state on
layer 0), 4 KV heads of 128; vLLM aligns the attention block to 80 tokens, its page to a
GDN state's."""
Q4: dict[str, Any] = {"qwen4exp": True, "layout": "BLNHC", "hma": True}
"""vLLM's defaults: the hybrid manager, prefix caching (states kept at block boundaries,
``mamba_cache_mode`` "align"), the layout vLLM resolves (its indexers' backend takes only
the block-outermost ones)."""
PROMPTS = {"req-300": (41, 300), "req-77": (43, 77)}
"""Per request, its content index and tokens: 300 ends inside a block of 80, 77 inside
the first; both leave a ring of 4 half open."""
STOCK = ["stock-P-kvwire-D", "kvwire-P-stock-D"]


@functools.cache
def checked_bytes(prompt: int, tp: int = 1) -> int:
    """What one D rank checks of a prompt (built once per prompt and TP size: a vLLM
    config and two rounds of specs each time)."""
    import built_caches
    import qwen4exp
    import vllm_engine

    start = {
        "model": GEO.model, "layers": GEO.layers, "num_blocks": GEO.num_blocks, "tp_size": tp,
        "block_size": GEO.block_size, "connector": "NixlConnector", "role": "P",
        "engine_id": "q4-expected", **Q4,
    }  # fmt: skip
    model = vllm_engine.preset(GEO.model)
    return built_caches.checked_bytes(
        start,
        lambda config: qwen4exp.build(config, GEO.layers, model.kv_heads, model.head_dim)[0],
        prompt,
    )


def assert_moved(state: dict[str, Any], prompts: dict[str, tuple[int, int]], tp: int = 1) -> None:
    for rid, (_, tokens) in prompts.items():
        assert state["checked"][rid] == [0, tp * checked_bytes(tokens, tp)], rid


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("pair", ["kvwire-shm", "kvwire-nixl"])
def test_qwen4exp(zygote: Zygote, pair: str, mode: str) -> None:
    """TP 1 to 1 between kvwire engines: D holds every page it reads, each state and
    ring whole."""
    state, _ = pair_moved(zygote, pair, "1-1", mode, PROMPTS, geo=GEO, **Q4)
    assert_moved(state, PROMPTS)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_qwen4exp_tensor_parallel(zygote: Zygote, mode: str) -> None:
    """TP 2 to 2 between kvwire engines: each rank's rows are its own (its attention
    heads, its shard of every GDN state; the embeddings' state the same on both), and D
    rank r holds, byte for byte, what P rank r computed (content differs by rank)."""
    state, _ = pair_moved(zygote, "kvwire-nixl", "2-2", mode, PROMPTS, geo=GEO, **Q4)
    assert_moved(state, PROMPTS, 2)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_qwen4exp_without_prefix_caching(zygote: Zygote, mode: str) -> None:
    """Prefix caching off: one state a request (``mamba_cache_mode`` "none"), in blocks
    of the model's whole length, longer than any block of tokens."""
    state, _ = pair_moved(
        zygote, "kvwire-nixl", "1-1", mode, PROMPTS, geo=GEO, **{**Q4, "prefix_caching": False}
    )
    assert_moved(state, PROMPTS)


MOVING = ["kvwire-nixl", *STOCK] if PROTOCOL_VERSION >= 14 else ["kvwire-nixl"]
"""Pairs that move Qwen4Exp: with a stock peer, from vLLM 0.32.0 (0.31.0's are refused:
:func:`test_qwen4exp_beside_stock`)."""


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("pair", MOVING)
def test_qwen4exp_prefix_hits(zygote: Zygote, pair: str, mode: str) -> None:
    """A prompt repeated with 80 tokens more: P finds its first 240 in its own prefix
    cache (three whole blocks, a state kept at the boundary), D as many (its attention
    pages; it holds no state at a boundary of a loaded prompt, and loads the state whole),
    and D holds every page its next token reads."""
    p_conn, d_conn, transport = PAIRS[pair]
    with engines(
        zygote, p_conn, d_conn, geo=GEO, extra_config={"transport": transport}, mode=mode, **Q4
    ) as (p, d):
        move_all(p, d, {"req-first": (45, 250)})
        state = move_all(p, d, {"req-again": (45, 330)})
        p_hits = p.state["hits"]
    assert p_hits["req-again"] == state["hits"]["req-again"] == 240
    assert_moved(state, {"req-again": (45, 330)})


def kvwire_refuses(pair: str) -> bool:
    """Whether the kvwire side refuses a pair that cannot move: a kvwire D does, at its
    handshake, pulling or pushed to (before it registers); a kvwire P pushing to a stock D
    does not get to, the stock D refusing at its registration before P hears of the
    request."""
    return PAIRS[pair][1] == "KVWireConnector"


def refused(zygote: Zygote, pair: str, p_tp: int, d_tp: int, mode: str) -> tuple[dict, str]:
    """D's state and both engines' logs once a pair that cannot move Qwen4Exp ended a
    request: D never checked it (it loaded nothing) and finished it itself. Short timers:
    a refused P frees the prompt when its lease ends, a pushed-to D fails the request when
    no registration came."""
    p_conn, d_conn, transport = PAIRS[pair]
    extra = {"transport": transport, "push_registration_timeout": 5}
    with engines(
        zygote, p_conn, d_conn, {"tp": p_tp}, {"tp": d_tp}, geo=GEO, extra_config=extra,
        mode=mode, lease=5, **Q4,
    ) as (p, d):  # fmt: skip
        state = move_all(p, d, {"req-77": PROMPTS["req-77"]})
        log = "\n".join(p.peer.log + d.peer.log)
    assert "req-77" not in state["checked"] and "req-77" in state["outputs"]
    return state, log


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("tp", ["1-1", "2-2"])
@pytest.mark.parametrize("pair", STOCK)
def test_qwen4exp_beside_stock(zygote: Zygote, pair: str, tp: str, mode: str) -> None:
    """vLLM 0.32.0: a stock engine and a kvwire one move Qwen4Exp both ways, in pull and
    in push, at equal TP sizes (stock registers what kvwire registers, region for region).
    vLLM 0.31.0: stock would leave the embeddings' state's tail behind, and the pair is
    refused at the handshake, by name (a kvwire D names the region; a stock peer the
    embeddings' pages), D loading nothing."""
    size = int(tp.split("-")[1])
    if PROTOCOL_VERSION >= 14:
        state, _ = pair_moved(zygote, pair, tp, mode, PROMPTS, geo=GEO, **Q4)
        assert_moved(state, PROMPTS, size)
        return
    state, log = refused(zygote, pair, size, size, mode)
    assert state["failed"] == ["req-77"]
    if kvwire_refuses(pair):
        assert "region 0 (model.layers.0.ple) <-> remote 0 (model.layers.0.ple)" in log, log
    else:
        assert "PLE pages require identical P/D geometry" in log, log


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("tp", ["1-2", "2-1"])
@pytest.mark.parametrize("pair", ["kvwire-nixl", *STOCK])
def test_qwen4exp_between_unequal_tp_is_refused_at_the_handshake(
    zygote: Zygote, pair: str, tp: str, mode: str
) -> None:
    """A row holds a rank's own heads and state shards and moves whole: between unequal
    TP sizes the pair is refused at the handshake, by name: by a kvwire D (pulling or
    pushed to) or a kvwire P pushing, as by a stock side (stock: heads split in a layout
    whose heads are not contiguous; pushed, a stock D refuses at its registration), and D
    loads nothing."""
    p_tp, d_tp = (int(n) for n in tp.split("-"))
    _, log = refused(zygote, pair, p_tp, d_tp, mode)
    if kvwire_refuses(pair):
        assert "only between equal TP sizes" in log, log
    else:
        assert "Heterogeneous TP head-dimension splitting requires contiguous heads" in log, log
