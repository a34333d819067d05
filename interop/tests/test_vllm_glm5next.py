"""Glm5Next in KVWireConnector: its caches as vLLM's own code makes them (KDA layers'
states by the KDA layer's own spec method, and per sparse-attention layer the MLA latent,
the indexer's pooled keys and its tail ring by ``common/attention.py``'s classes),
aligned, grouped, planned and allocated by vLLM.

vLLM 0.32.0 lays them out as five groups over one buffer of rows (three of states, one of
latents and pooled keys, one of tail rings), each TP rank's rows its own; kvwire moves
them between kvwire engines and with stock engines both ways. P fills each page of each
of its blocks with content of its own (request, group, layer, block position, rank; a
ring's and a state's by the tokens computed), and D checks, byte for byte, every page its
next token reads: the latents and pooled keys of the prompt, each tail ring and each
state whole.

vLLM 0.31.0 makes the tail a ``KpoolTailSpec`` over the pooled keys' own bytes, in the
layer-outermost layout its tail's backend takes; kvwire refuses it at startup, by name,
and each test here asserts that refusal instead."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from harness import (
    PAIRS,
    PROTOCOL_VERSION,
    Geometry,
    PeerError,
    SchedulerEngine,
    Zygote,
    engines,
    move_all,
    pair_moved,
)

GEO = Geometry(model="mla", layers=8, num_blocks=32, block_size=256)
"""Eight layers (KDA three times, then sparse MLA attention, twice); vLLM aligns the block
to 256 tokens at TP 1 (a latent page holds a KDA state), 128 at TP 2."""
G5: dict[str, Any] = {"glm5next": True, "layout": "BLHNC", "hma": True}
"""vLLM's defaults: the hybrid manager, prefix caching (states kept at block boundaries),
the layout vLLM 0.32.0 resolves (its tail ring's backend takes only BLHNC)."""
PROMPTS = {"req-300": (41, 300), "req-77": (43, 77)}
"""Per request, its content index and tokens: 300 ends inside a second block, 77 inside
the first; both leave a tail ring of 4 half open."""
STOCK = ["stock-P-kvwire-D", "kvwire-P-stock-D"]
REFUSED_031 = "beside KpoolTailSpec: KVWireConnector moves such groups as rows"
"""How a kvwire engine of vLLM 0.31.0 refuses Glm5Next at its startup."""


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
    """vLLM 0.32.0: the pair moves ``prompts`` and D rank r holds, byte for byte, what P
    rank r computed. vLLM 0.31.0: the pair's kvwire engine refuses at its startup."""
    if PROTOCOL_VERSION < 14:
        p_tp, d_tp = (int(n) for n in tp.split("-"))
        refused_031(zygote, pair, p_tp, d_tp, mode)
        return
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


@pytest.mark.parametrize(("pair", "mode"), [("kvwire-shm", "push"), *((p, "pull") for p in STOCK)])
def test_glm5next_tensor_parallel(zygote: Zygote, pair: str, mode: str) -> None:
    """TP 2 to 2: each rank's rows are its own (its shard of every KDA state beside the
    latents), and D rank r holds what P rank r computed (content differs by rank)."""
    moved(zygote, pair, "2-2", mode, PROMPTS)


def test_glm5next_without_prefix_caching(zygote: Zygote) -> None:
    """Prefix caching off: one state a request, in blocks of the model's whole length."""
    moved(zygote, "kvwire-nixl", "1-1", "pull", PROMPTS, prefix_caching=False)


@pytest.mark.parametrize(("pair", "mode"), [("kvwire-nixl", "pull"), *((p, "push") for p in STOCK)])
def test_glm5next_prefix_hits(zygote: Zygote, pair: str, mode: str) -> None:
    """A prompt repeated with 200 tokens more: P finds its first 512 in its own prefix
    cache (two whole blocks, a state kept at the boundary), D as many, and D holds every
    page its next token reads."""
    if PROTOCOL_VERSION < 14:
        moved(zygote, pair, "1-1", mode, {"req-first": (45, 600)})
        return
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
    """What the tests above start engines with is what vLLM resolves for Glm5Next: in
    0.32.0 the layout ``BLHNC`` and groups kvwire moves (states, latents and pooled keys,
    rings); in 0.31.0 ``LBHNC`` (its tail's backend takes no other) and the ``KpoolTailSpec``
    group kvwire refuses, with the message the engines' startup gives, on vLLM's own
    config (the engines above run the check in ``BLHNC``, where it reads only the specs)."""
    import glm5next
    import vllm_engine

    from kvwire.errors import ConfigError
    from kvwire.integrations.vllm.groups import group_kinds
    from kvwire.layout import RegionKind

    start = {
        "model": GEO.model, "layers": GEO.layers, "num_blocks": GEO.num_blocks, "tp_size": 1,
        "block_size": GEO.block_size, "connector": "NixlConnector", "role": "P",
        "engine_id": "g5-layout", **G5,
    }  # fmt: skip
    config = vllm_engine.build_vllm_config(start)
    config.cache_config.kv_cache_layout = None  # vLLM resolves it
    caches, _ = glm5next.build(config, GEO.layers)
    planned, _ = vllm_engine.allocate_rows(config, caches, GEO.num_blocks)
    layout = config.cache_config.get_resolved_kv_cache_layout().name
    if PROTOCOL_VERSION < 14:
        assert layout == "LBHNC"
        with pytest.raises(ConfigError, match=REFUSED_031):
            group_kinds(planned, GEO.block_size)
        return
    assert layout == G5["layout"]
    kinds = group_kinds(planned, GEO.block_size)
    ssm, attention, ring = RegionKind.SSM, RegionKind.ATTENTION, RegionKind.RING
    assert kinds == (ssm, ssm, ssm, attention, ring)


def refused_031(zygote: Zygote, pair: str, p_tp: int, d_tp: int, mode: str) -> None:
    """vLLM 0.31.0: the pair's kvwire engine refuses Glm5Next at its startup, by name."""
    _, d_conn, transport = PAIRS[pair]
    role = "D" if d_conn == "KVWireConnector" else "P"
    with pytest.raises(PeerError, match=REFUSED_031):
        SchedulerEngine(
            role, "KVWireConnector", zygote, geo=GEO, mode=mode,
            tp=d_tp if role == "D" else p_tp, extra_config={"transport": transport}, **G5,
        ).close()  # fmt: skip


def unequal(
    zygote: Zygote, p_conn: str, d_conn: str, tp: str, mode: str, transport: str,
    timer: int = 5,
) -> tuple[dict, str]:  # fmt: skip
    """D's state and log once a prompt went between engines of unequal TP sizes; short
    timers (``timer`` seconds) for a refused pair: a refused P frees the prompt when its
    lease ends, a pushed-to D fails the request when no registration came."""
    p_tp, d_tp = (int(n) for n in tp.split("-"))
    extra = {"transport": transport, "push_registration_timeout": timer}
    with engines(
        zygote, p_conn, d_conn, {"tp": p_tp}, {"tp": d_tp}, geo=GEO, extra_config=extra,
        mode=mode, lease=timer, **G5,
    ) as (p, d):  # fmt: skip
        state = move_all(p, d, {"req-77": PROMPTS["req-77"]})
        return state, "\n".join(d.peer.log)


@pytest.mark.parametrize(
    ("pair", "tp", "mode"),
    [
        ("kvwire-nixl", "1-2", "pull"),
        ("kvwire-nixl", "2-1", "push"),
        ("stock-P-kvwire-D", "1-2", "pull"),
        ("stock-P-kvwire-D", "1-2", "push"),
        ("stock-P-kvwire-D", "2-1", "push"),
    ],
)
def test_glm5next_between_unequal_tp_is_refused_by_a_kvwire_d(
    zygote: Zygote, pair: str, tp: str, mode: str
) -> None:
    """A row holds a rank's own shard of each KDA state and moves whole: between unequal
    TP sizes a kvwire D refuses the producer at the handshake, by name, pulling or pushed
    to (a stock P pushing would write whole rows of another TP size: measured, done with
    most bytes wrong), and loads nothing; the engine computes the prompt itself."""
    p_tp, d_tp = (int(n) for n in tp.split("-"))
    if PROTOCOL_VERSION < 14:
        refused_031(zygote, pair, p_tp, d_tp, mode)
        return
    p_conn, d_conn, transport = PAIRS[pair]
    state, log = unequal(zygote, p_conn, d_conn, tp, mode, transport)
    assert "req-77" not in state["checked"] and state["failed"] == ["req-77"]
    assert "only between equal TP sizes" in log, log


def test_glm5next_from_a_kvwire_p_to_a_stock_d_of_another_tp_is_stocks_own_read(
    zygote: Zygote,
) -> None:
    """Pulling, a stock D plans its reads itself and never says its TP size to P, so no
    kvwire P can refuse it: vLLM 0.32.0's D reads Glm5Next's rows between TP 1 and 2 by
    its own rule and ends the request done with bytes not its own, from a kvwire P exactly
    as from a stock P (the same pages wrong), which is stock's to refuse."""
    if PROTOCOL_VERSION < 14:
        refused_031(zygote, "kvwire-P-stock-D", 1, 2, "pull")
        return
    # The harness's usual lease: these reads succeed and must end inside it, under load too.
    pair = ("1-2", "pull", "nixl", 30)
    from_stock, _ = unequal(zygote, "NixlConnector", "NixlConnector", *pair)
    from_kvwire, _ = unequal(zygote, "KVWireConnector", "NixlConnector", *pair)
    wrong, checked = from_stock["checked"]["req-77"]
    assert 0 < wrong < checked
    assert from_kvwire["checked"] == from_stock["checked"]
