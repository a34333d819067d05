"""Ring groups (vLLM's ``CircularBufferSpec``) through KVWireConnector on vLLM's defaults.

A ring is one block a request whose slot ``t % block`` holds token ``t``'s keys: the latest
``block`` tokens', overwritten as the model computes more (DeepSeek-V4.1's compressor and
Qwen4Exp's indexers keep the keys of a group still being compressed so). vLLM's
``CircularBufferManager`` claims that one block; a stock engine, seeing a ring, registers
its regions in allocation order and exchanges the ring's one-block list whole. kvwire moves
it as :attr:`kvwire.layout.RegionKind.RING`: paired by position, sliced across TP as its
region's attention page, and for one token count only.

Here every odd layer is a ring of the attention page (built from vLLM's spec class,
grouped, planned and allocated by vLLM's own code, its manager running the group). P fills
each ring after the tokens it computed, D checks every slot of every ring layer after the
tokens it loaded, and every prompt token of every full-attention layer; the test asserts
how many bytes that is."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from harness import (
    PAIRS,
    Geometry,
    PeerError,
    Zygote,
    engines,
    load_refused,
    pair_cases,
    pair_transfer,
    prefill,
    registered_by_each,
    transfer,
    transfer_many,
)

GEO = Geometry(layers=4)
"""Layers 0 and 2 full attention, 1 and 3 rings: two groups sharing each slab."""
REQUESTS = {"req-200": 200, "req-20": 20}
"""One prompt past its rings' capacity (every slot overwritten: they hold tokens 168-199),
one shorter than a ring (slots 20-31 never written, so not checked)."""
INDEX = 17


def checked_bytes(tokens: int) -> int:
    """What D checks of one request on all its ranks: each full layer's prompt tokens and
    each ring layer's slots of the latest ``block`` tokens, every head."""
    half = GEO.layers // 2
    return GEO.token_bytes * half * (tokens + min(tokens, GEO.block_size))


@pytest.mark.parametrize(("pair", "tp", "mode"), pair_cases())
def test_rings(zygote: Zygote, pair: str, tp: str, mode: str) -> None:
    """Every pair, TP size and mode: P's params carry the whole prompt's list and the
    ring's one block, and D holds every byte its next token reads, on every rank."""
    state, outputs = pair_transfer(zygote, pair, tp, mode, INDEX, REQUESTS, geo=GEO, ring=True)
    for rid, tokens in REQUESTS.items():
        full, ring = outputs[rid]["remote_block_ids"]
        assert len(full) == -(-tokens // GEO.block_size) and len(ring) == 1, rid
        assert state["checked"][rid] == [0, checked_bytes(tokens)], rid


@pytest.mark.parametrize(("tp", "layers"), [(1, 4), (2, 4), (1, 5), (1, 7)])
def test_ring_regions_are_what_stock_registers(zygote: Zygote, tp: int, layers: int) -> None:
    """Stock registers a model with rings in the order vLLM allocated its layers, each
    slab once, shared (-1); kvwire the same. Layer counts that are not whole repeats make
    vLLM group the layers otherwise."""
    answers = registered_by_each(
        zygote, geo=replace(GEO, layers=layers), hma=True, ring=True, tp=tp,
        extra_config={"transport": "nixl"},
    )  # fmt: skip
    keys = ("regions", "names", "groups", "blocks")
    stock, ours = ({k: answer[k] for k in keys} for answer in answers)
    assert ours == stock
    assert -1 in ours["groups"]


@pytest.mark.parametrize(
    ("pair", "mode"), [(p, m) for p in sorted(PAIRS) for m in ("pull", "push")]
)
def test_a_ring_moves_beside_prefix_hits(zygote: Zygote, pair: str, mode: str) -> None:
    """A prompt repeated with 7 tokens more: D finds its first 192 tokens in its own
    prefix cache (vLLM caches no ring), loads the rest and P's ring, and holds every byte
    its next token reads."""
    p_conn, d_conn, transport = PAIRS[pair]
    with engines(
        zygote, p_conn, d_conn, geo=GEO, mode=mode, hma=True, ring=True,
        extra_config={"transport": transport},
    ) as (p, d):  # fmt: skip
        transfer(p, d, "req-first", INDEX, 193)
        state = transfer(p, d, "req-again", INDEX, 200)
    assert state["hits"]["req-again"] == 192
    assert state["checked"]["req-again"] == [0, checked_bytes(200)]


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("p_conn", ["KVWireConnector", "NixlConnector"])
def test_a_ring_for_another_count_fails_the_request_by_name(
    zygote: Zygote, p_conn: str, mode: str
) -> None:
    """P generated past the prompt, to 205 tokens (vLLM's rings would then hold the keys
    of its generated tokens too; the engine here fills them for the prompt alone): a D
    loading the 200-token prompt cannot start from a ring of another count, so it reads
    nothing, fails the request naming both counts, and P frees its blocks and serves
    on."""
    with engines(
        zygote, p_conn, "KVWireConnector", geo=GEO, mode=mode, hma=True, ring=True,
        extra_config={"transport": "nixl"},
    ) as (p, d):  # fmt: skip
        params = prefill(p, "req", INDEX, 200, max_tokens=6)
        assert params["remote_num_tokens"] == 205
        log = load_refused(p, d, "req", INDEX, 200, params)
        why = "P computed 205 of its tokens and this engine loads 200; a Mamba state or a ring"
        assert any(why in line for line in log), log[-3:]
        state = transfer_many(p, d, INDEX + 1, {"req-next": 100})
        assert state["checked"]["req-next"] == [0, checked_bytes(100)]


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"host_buffer": True}, "a ring group .CircularBufferSpec. with a host buffer"),
        ({"layout": "BLNHC"}, "KV cache layout BLNHC with a ring group"),
        ({"kernel_block": 16}, "a ring group .CircularBufferSpec. with kernel blocks of 16"),
    ],
    ids=["host-buffer", "BLNHC", "kernel-blocks"],
)
def test_rings_kvwire_does_not_move_are_refused_at_startup(
    zygote: Zygote, options: dict[str, Any], why: str
) -> None:
    """Stock does not stage a model with rings through a host buffer, and in ``BLNHC``
    registers a ring model's pages as spans they are not; a ring split into kernel blocks
    kvwire does not move: a kvwire engine refuses each when it starts, naming the
    cause."""
    with (
        pytest.raises(PeerError, match=f"ConfigError: {why}"),
        engines(
            zygote, "KVWireConnector", "KVWireConnector", geo=GEO, hma=True, ring=True,
            extra_config={"transport": "nixl"}, **options,
        ),
    ):  # fmt: skip
        pass
