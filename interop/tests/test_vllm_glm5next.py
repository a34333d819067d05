"""Glm5Next in KVWireConnector: its caches as vLLM's own code makes them (KDA layers'
states by the KDA layer's own spec method, and per sparse-attention layer the MLA latent,
the indexer's pooled keys and its tail ring by ``common/attention.py``'s classes),
aligned, grouped, planned and allocated by vLLM.

vLLM 0.32.0 lays them out as five groups over one buffer of rows (three of states, one of
latents and pooled keys, one of tail rings), each TP rank's rows its own. vLLM 0.31.0
lays them out layer-outermost (``LBHNC``, the one layout its tail's backend takes): a slab
per MLA layer holding its latents, split into kernel blocks of 64 tokens, and the KDA
states of one layer of each state group, and a slab per indexer holding its pooled keys
with its tail (a ``KpoolTailSpec`` ring, a group of its own) laid over their bytes. kvwire
moves either between kvwire engines and with stock engines both ways. P fills each page
of each of its blocks with content of its own (request, group, layer, block position,
rank; a ring's and a state's by the tokens computed), and D checks, byte for byte, every
page its next token reads: the latents and pooled keys of the prompt, each tail ring and
each state whole."""

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

GEO = Geometry(model="mla", layers=8, num_blocks=32, block_size=256)
"""Eight layers (KDA three times, then sparse MLA attention, twice) in 256-token blocks,
which vLLM's hybrid alignment keeps at TP 1 and 2 (a latent page holds a KDA state)."""
LAYOUT = "BLHNC" if PROTOCOL_VERSION >= 14 else "LBHNC"
"""The layout the installed vLLM resolves for Glm5Next: its tail ring's backend takes that
one alone (the harness refuses another)."""
G5: dict[str, Any] = {"glm5next": True, "layout": LAYOUT, "hma": True}
"""vLLM's defaults: the hybrid manager, prefix caching (states kept at block boundaries),
the layout vLLM resolves."""
PROMPTS = {"req-300": (41, 300), "req-77": (43, 77)}
"""Per request, its content index and tokens: 300 ends inside a second block, 77 inside
the first; both leave a tail ring of 4 half open."""
STOCK = ["stock-P-kvwire-D", "kvwire-P-stock-D"]


@functools.cache
def checked_bytes(prompt: int, tp: int = 1) -> int:
    """What one D rank checks of a prompt (built once per prompt and TP size)."""
    import built_caches
    import glm5next

    start = {
        "model": GEO.model, "layers": GEO.layers, "num_blocks": GEO.num_blocks, "tp_size": tp,
        "block_size": GEO.block_size, "connector": "NixlConnector", "role": "P",
        "engine_id": "g5-expected", **G5,
    }  # fmt: skip
    return built_caches.checked_bytes(
        start, lambda config: glm5next.build(config, GEO.layers)[0], prompt
    )


def moved(
    zygote: Zygote, pair: str, tp: str, mode: str, prompts: dict[str, tuple[int, int]],
    **options: Any,
) -> None:  # fmt: skip
    """The pair moves ``prompts`` and D rank r holds, byte for byte, what P rank r
    computed."""
    state, _ = pair_moved(zygote, pair, tp, mode, prompts, geo=GEO, **{**G5, **options})
    size = int(tp.split("-")[1])
    for rid, (_, tokens) in prompts.items():
        assert state["checked"][rid] == [0, size * checked_bytes(tokens, size)], rid


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("pair", ["kvwire-nixl", *STOCK])
def test_glm5next(zygote: Zygote, pair: str, mode: str) -> None:
    """TP 1 to 1, between kvwire engines and with a stock engine both ways: D holds
    every page it reads, each state and tail ring whole."""
    moved(zygote, pair, "1-1", mode, PROMPTS)


TENSOR_PARALLEL = [("kvwire-shm", "push"), *((p, "pull") for p in STOCK)]
"""TP 2 to 2 cells."""


@pytest.mark.parametrize(("pair", "mode"), TENSOR_PARALLEL)
def test_glm5next_tensor_parallel(zygote: Zygote, pair: str, mode: str) -> None:
    """TP 2 to 2: each rank's rows, or slabs, are its own (its shard of every KDA state
    beside the latents), and D rank r holds what P rank r computed."""
    moved(zygote, pair, "2-2", mode, PROMPTS)


def test_glm5next_without_prefix_caching(zygote: Zygote) -> None:
    """Prefix caching off: one state a request, in blocks of the model's whole length."""
    moved(zygote, "kvwire-nixl", "1-1", "pull", PROMPTS, prefix_caching=False)


@pytest.mark.parametrize(("pair", "mode"), [("kvwire-nixl", "pull"), *((p, "push") for p in STOCK)])
def test_glm5next_prefix_hits(zygote: Zygote, pair: str, mode: str) -> None:
    """A prompt repeated with 200 tokens more: P finds its first 512 in its own prefix
    cache (two whole blocks, a state kept at the boundary), D as many, and D holds every
    page its next token reads."""
    p_conn, d_conn, transport = PAIRS[pair]
    with engines(
        zygote, p_conn, d_conn, geo=GEO, extra_config={"transport": transport}, mode=mode, **G5
    ) as (p, d):
        move_all(p, d, {"req-first": (45, 600)})
        state = move_all(p, d, {"req-again": (45, 800)})
        p_hits = p.state["hits"]
    assert p_hits["req-again"] == state["hits"]["req-again"] == 512
    assert state["checked"]["req-again"] == [0, checked_bytes(800)]


def test_the_layout_and_the_groups_are_vllms_own() -> None:
    """What the tests above start engines with is what vLLM resolves for Glm5Next, and the
    groups kvwire makes of it: in 0.32.0 the layout ``BLHNC``, rows of states, latents and
    pooled keys, rings; in 0.31.0 ``LBHNC``, latents and pooled keys split into kernel
    blocks of 64 tokens (the latents' views, by vLLM's model runner), the tail ring and
    the states. A 0.31.0 tail laid out block-outermost (which vLLM takes when configured,
    though the tail's backend does not) is refused by name at the worker's startup."""
    import glm5next
    import vllm_engine

    from kvwire.errors import ConfigError
    from kvwire.integrations.vllm.config import kvwire_config
    from kvwire.integrations.vllm.geometry import layer_geometry
    from kvwire.integrations.vllm.groups import group_kinds
    from kvwire.layout import RegionKind

    start = {
        "model": GEO.model, "layers": GEO.layers, "num_blocks": GEO.num_blocks, "tp_size": 1,
        "block_size": GEO.block_size, "connector": "NixlConnector", "role": "P",
        "engine_id": "g5-layout", **G5,
    }  # fmt: skip
    config = vllm_engine.build_vllm_config(start)
    config.cache_config.kv_cache_layout = None  # vLLM resolves it
    caches, backends = glm5next.build(config, GEO.layers)
    planned, views = vllm_engine.allocate_rows(config, caches, GEO.num_blocks, backends)
    layout = config.cache_config.get_resolved_kv_cache_layout().name
    assert layout == LAYOUT
    kinds = group_kinds(planned, GEO.block_size)
    ssm, attention, ring = RegionKind.SSM, RegionKind.ATTENTION, RegionKind.RING
    if PROTOCOL_VERSION >= 14:
        assert kinds == (ssm, ssm, ssm, attention, ring)
        return
    assert kinds == (attention, ring, ssm, ssm, ssm)
    assert views["model.layers.3.self_attn.attn"].shape[:3] == (GEO.num_blocks * 4, 1, 64)
    config.cache_config.kv_cache_layout = "BLHNC"
    _, rows = vllm_engine.allocate_rows(config, caches, GEO.num_blocks, backends)
    with pytest.raises(ConfigError, match=r"BLHNC with vLLM 0\.31\.0's Glm5Next tail"):
        layer_geometry(rows, planned, kvwire_config(config), config)


def pulled_by_stock(zygote: Zygote, p_conn: str, tp: str) -> dict[str, Any]:
    """A stock D's state once it pulled a prompt from a P of ``p_conn``, at TP sizes
    ``P-D``."""
    p_tp, d_tp = (int(n) for n in tp.split("-"))
    with engines(
        zygote, p_conn, "NixlConnector", {"tp": p_tp}, {"tp": d_tp}, geo=GEO, mode="pull",
        extra_config={"transport": "nixl"}, **G5,
    ) as (p, d):  # fmt: skip
        return move_all(p, d, {"req-77": PROMPTS["req-77"]})


UNEQUAL = [
    ("kvwire-nixl", "1-2", "pull"),
    ("kvwire-nixl", "2-1", "pull"),
    ("kvwire-nixl", "1-2", "push"),
    ("kvwire-nixl", "2-1", "push"),
    ("stock-P-kvwire-D", "1-2", "pull"),
    ("stock-P-kvwire-D", "2-1", "pull"),
    ("stock-P-kvwire-D", "1-2", "push"),
    ("stock-P-kvwire-D", "2-1", "push"),
    ("kvwire-P-stock-D", "2-1", "pull"),
    ("kvwire-P-stock-D", "1-2", "push"),
    ("kvwire-P-stock-D", "2-1", "push"),
]
"""Every pair of TP 1 and 2 but a stock D pulling at TP 1 to 2
(:func:`test_glm5next_stock_d_reads_alike_from_either_p`)."""


@pytest.mark.parametrize(("pair", "tp", "mode"), UNEQUAL)
def test_glm5next_between_unequal_tp(zygote: Zygote, pair: str, tp: str, mode: str) -> None:
    """Latents, pooled keys and tails are every rank's, read from one producer rank; each
    D rank holds its slice of every KDA state (its part of each of q's, k's and v's conv
    columns and of the temporal state's heads), read from the producer ranks that hold it:
    in vLLM 0.32.0's rows (a row moved as its block's group's kind: a state sliced, any
    other page whole; kvwire refused such pairs before, moving rows whole) as in 0.31.0's
    slabs (where a kvwire D of TP 1 read a request from one producer rank only, as for
    MLA alone, and was done with half of every state not its own)."""
    moved(zygote, pair, tp, mode, PROMPTS)


@pytest.mark.parametrize("tp", ["1-2", "2-2"])
def test_glm5next_stock_d_reads_alike_from_either_p(zygote: Zygote, tp: str) -> None:
    """Pulling, a stock D plans its reads itself and never says its TP size to P, so a
    kvwire P registers what stock registers and serves its reads as a stock P does: a
    stock D of TP 2 holds every byte right, from either P of TP 1 or 2."""
    from_stock = pulled_by_stock(zygote, "NixlConnector", tp)
    from_kvwire = pulled_by_stock(zygote, "KVWireConnector", tp)
    assert from_stock["checked"]["req-77"] == [0, 2 * checked_bytes(77, 2)]
    assert from_kvwire["checked"] == from_stock["checked"]
