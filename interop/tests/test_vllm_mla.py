"""MLA models in KVWireConnector: DeepSeek-V3's geometry (one latent of 576 values per
token and layer, no heads), planned and allocated by vLLM's own code with vLLM's CPU MLA
backend (which runs 16-token kernel blocks, so each 32-token block is two). The latent is
the same on every TP rank, so unequal TP sizes move whole pages: every D rank reads its
copy from one P rank.

Sparse MLA (DeepSeek-V3.2) adds per layer its indexer's key cache (132 bytes a token, the
same on every rank). vLLM 0.31.0 does not give it a group of its own: both caches are MLA
specs of one block size, so its grouping makes one group of per-layer specs
(``UniformTypeKVCacheSpecs``), each layer's tensor with its own page, all the latents
allocated before the first indexer cache."""

from __future__ import annotations

import pytest
from harness import (
    Geometry,
    Zygote,
    assert_moved,
    engines,
    registered_by_each,
    transfer_many,
)

from kvwire.demo.models import preset

GEO = Geometry(model="mla", layers=2)
TOKENS = 100  # 3 full blocks + a partial one
PAIRS = {
    "kvwire-shm": ("KVWireConnector", "KVWireConnector", "shm"),
    "kvwire-nixl": ("KVWireConnector", "KVWireConnector", "nixl"),
    "stock-P-kvwire-D": ("NixlConnector", "KVWireConnector", "nixl"),
    "kvwire-P-stock-D": ("KVWireConnector", "NixlConnector", "nixl"),
}


CASES = [
    (pair, mode, tp)
    for pair in sorted(PAIRS)
    for mode in ("pull", "push")
    for tp in ("1-1", "1-2", "2-1")
]


@pytest.mark.parametrize(("pair", "mode", "tp"), CASES)
def test_mla(zygote: Zygote, pair: str, mode: str, tp: str) -> None:
    """Every D rank holds every prompt token's latent in every layer, byte for byte."""
    p_conn, d_conn, transport = PAIRS[pair]
    p_tp, d_tp = (int(n) for n in tp.split("-"))
    with engines(
        zygote, p_conn, d_conn, {"tp": p_tp}, {"tp": d_tp},
        geo=GEO, extra_config={"transport": transport}, mode=mode,
    ) as (p, d):  # fmt: skip
        checked = assert_moved(p, d, "req-m", 23, TOKENS)
    latent = preset(GEO.model).latent_dim * 2  # bfloat16
    assert checked == TOKENS * latent * GEO.layers * d_tp


INDEXER = 132
"""Bytes a token of the indexer's keys (interop/vllm_engine.py's INDEXER_BYTES)."""
SPARSE_CASES = [case for case in CASES if case[0] != "kvwire-shm"]
"""The shared-memory pair plans what NIXL's does (one region per layer, moved whole)."""


@pytest.mark.parametrize(("pair", "mode", "tp"), SPARSE_CASES)
def test_sparse_mla(zygote: Zygote, pair: str, mode: str, tp: str) -> None:
    """Every D rank holds every prompt token's latent and indexer keys in every layer,
    byte for byte, each from its own layer's cache (their pages differ, and so do their
    bytes)."""
    p_conn, d_conn, transport = PAIRS[pair]
    p_tp, d_tp = (int(n) for n in tp.split("-"))
    with engines(
        zygote, p_conn, d_conn, {"tp": p_tp}, {"tp": d_tp}, geo=GEO,
        extra_config={"transport": transport}, mode=mode, indexer=True,
    ) as (p, d):  # fmt: skip
        checked = assert_moved(p, d, "req-s", 29, TOKENS)
    latent = preset(GEO.model).latent_dim * 2  # bfloat16
    assert checked == TOKENS * (latent + INDEXER) * GEO.layers * d_tp


@pytest.mark.parametrize("tp", [1, 2])
def test_sparse_mla_regions_are_what_stock_registers(zygote: Zygote, tp: int) -> None:
    """Stock registers a region per cache, in model-layer order (each layer's latent, then
    its indexer keys), not in vLLM's allocation order; kvwire the same, so a mixed pair
    pairs region for region."""
    stock, ours = registered_by_each(
        zygote, geo=GEO, tp=tp, indexer=True, extra_config={"transport": "nixl"}
    )
    for key in ("regions", "names", "groups", "layout", "blocks"):
        assert ours[key] == stock[key], key
    assert len(ours["regions"]) == 2 * GEO.layers


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(("p_block", "d_block"), [(32, 64), (64, 32)])
@pytest.mark.parametrize("indexer", [False, True], ids=["mla", "sparse"])
def test_mla_unequal_block_sizes(
    zygote: Zygote, mode: str, p_block: int, d_block: int, indexer: bool
) -> None:
    """Two kvwire engines of unequal block sizes (each block two or four of the backend's
    16-token kernel blocks): every prompt token's latent (and indexer keys) reaches D,
    placed by token."""
    with engines(
        zygote, "KVWireConnector", "KVWireConnector",
        {"geo": Geometry(model="mla", layers=2, block_size=p_block)},
        {"geo": Geometry(model="mla", layers=2, block_size=d_block)},
        extra_config={"transport": "nixl"}, mode=mode, indexer=indexer,
    ) as (p, d):  # fmt: skip
        checked = assert_moved(p, d, "req-u", 61, 150)
    latent = preset(GEO.model).latent_dim * 2 + (INDEXER if indexer else 0)
    assert checked == 150 * latent * GEO.layers


@pytest.mark.parametrize("indexer", [False, True], ids=["mla", "sparse"])
@pytest.mark.parametrize("layout", ["BLHNC", "BLNHC"])
@pytest.mark.parametrize("pair", sorted(set(PAIRS) - {"kvwire-shm"}))
def test_mla_cross_layer_blocks(zygote: Zygote, pair: str, layout: str, indexer: bool) -> None:
    """vLLM's block-outermost layouts, every layer's latent (and indexer keys) of a block in
    one row: the rows move between either kind of engine, byte for byte. (vLLM splits no
    block of such a layout into kernel blocks, so the blocks are the CPU MLA backend's 16
    tokens.)"""
    p_conn, d_conn, transport = PAIRS[pair]
    geo = Geometry(model="mla", layers=2, block_size=16)
    with engines(
        zygote, p_conn, d_conn, geo=geo, extra_config={"transport": transport}, layout=layout,
        indexer=indexer,
    ) as (p, d):  # fmt: skip
        checked = assert_moved(p, d, "req-x", 67, TOKENS)
    latent = preset(GEO.model).latent_dim * 2 + (INDEXER if indexer else 0)
    assert checked == TOKENS * latent * GEO.layers


WINDOW = 64
"""Tokens: engines exchange a windowed group's last cdiv(64, 32) + 1 = 3 blocks of 32."""
WINDOW_GEO = Geometry(model="mla", layers=4)
WINDOW_REQUESTS = {"req-even": 288, "req-odd": 300}
"""One content: 288 tokens end on a block boundary (the exchanged tail begins with vLLM's
null block); 300 share those 9 blocks on P (a prefix-cache hit) and end in a partial one."""


@pytest.mark.parametrize(("pair", "mode", "tp"), CASES)
def test_mla_sliding_window(zygote: Zygote, pair: str, mode: str, tp: str) -> None:
    """MLA layers with a sliding window beside full MLA layers (vLLM's MLA attention makes
    the windowed ones ``SlidingWindowMLASpec``): D holds every prompt token's latent in the
    full layers and the window's in the windowed ones, byte for byte, each group its own
    content, from the three-block tail stock exchanges."""
    p_conn, d_conn, transport = PAIRS[pair]
    p_tp, d_tp = (int(n) for n in tp.split("-"))
    with engines(
        zygote, p_conn, d_conn, {"tp": p_tp}, {"tp": d_tp}, geo=WINDOW_GEO,
        extra_config={"transport": transport}, mode=mode, window=WINDOW,
    ) as (p, d):  # fmt: skip
        state = transfer_many(p, d, 31, WINDOW_REQUESTS)
        outputs = p.state["outputs"]
    latent = preset(GEO.model).latent_dim * 2  # bfloat16
    block = WINDOW_GEO.block_size
    for rid, tokens in WINDOW_REQUESTS.items():
        blocks = -(-tokens // block)
        tail = min(blocks, -(-WINDOW // block) + 1)
        assert sorted(map(len, outputs[rid]["remote_block_ids"])) == sorted([blocks, tail])
        window_first = (tokens - WINDOW + 1) // block * block
        held = (tokens + tokens - window_first) * latent * WINDOW_GEO.layers // 2
        assert state["checked"][rid] == [0, held * d_tp], rid


def test_vllm_groups_no_indexer_beside_windowed_latents() -> None:
    """Why the sparse-MLA row's SWA cell is DeepSeek-V4's alone: vLLM's own grouping
    refuses DeepSeek-V3.2's indexer keys beside windowed MLA layers (their pages cannot
    share a slab), so the only sparse model with a window is V4, whose caches kvwire
    refuses by name (``test_vllm_hybrid.py::test_groups_kvwire_cannot_move_are_refused_by_name``).
    A vLLM that groups them fails this test: the cell is then for kvwire to move."""
    import vllm_engine
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

    start = {
        "model": "mla", "layers": 4, "num_blocks": 64, "tp_size": 1, "block_size": 32,
        "connector": "NixlConnector", "role": "P", "engine_id": "grouping", "indexer": True,
    }  # fmt: skip
    specs = vllm_engine.sparse_mla_specs(start)
    latent = specs[vllm_engine.vllm_peer.layer_names(start)[0]]
    for name in vllm_engine.vllm_peer.layer_names(start)[1::2]:
        del specs[name.replace(".attn", ".indexer.k_cache")]
        specs[name] = SlidingWindowMLASpec(
            block_size=latent.block_size, num_kv_heads=1, head_size=latent.head_size,
            dtype=latent.dtype, sliding_window=WINDOW,
        )  # fmt: skip
    with pytest.raises(NotImplementedError, match="cannot be padded"):
        get_kv_cache_groups(vllm_engine.build_vllm_config(start), specs)


def test_mla_window_regions_are_what_stock_registers(zygote: Zygote) -> None:
    """As for windowed attention, vLLM puts layer ``j`` of each MLA group in slab ``j``:
    stock registers each slab once, shared by both groups (-1), named after its full
    layer; kvwire the same, so a mixed pair pairs region for region."""
    stock, ours = registered_by_each(
        zygote, geo=WINDOW_GEO, window=WINDOW, extra_config={"transport": "nixl"}
    )
    for key in ("regions", "names", "groups", "layout", "blocks"):
        assert ours[key] == stock[key], key
    assert ours["groups"] == [-1] * (WINDOW_GEO.layers // 2)


@pytest.mark.parametrize("fp8_ds_mla", [True, False], ids=["fp8_ds_mla", "bf16"])
def test_deepseek_v4s_groups_are_rows_of_their_own_block_sizes(fp8_ds_mla: bool) -> None:
    """DeepSeek-V4's caches as vLLM's own modules make them, grouped by vLLM's own code
    (256-token blocks, a block-outermost layout, as V4 requires): the connector takes
    every group, in either cache layout, as rows of MLA pages, each group placed by its
    own block size (in bf16 no page is padded, so only V4's fields tell them apart)."""
    import vllm_engine
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvwire.integrations.vllm.groups import group_kinds, row_block_sizes

    ratios = [1, 4, 128, 4, 128, 4]
    start = {
        "model": "mla", "layers": len(ratios), "num_blocks": 64, "tp_size": 1,
        "block_size": 256, "connector": "KVWireConnector", "role": "P", "engine_id": "v4",
        "layout": "BLHNC", "hma": True,
    }  # fmt: skip
    config = vllm_engine.build_vllm_config(start)
    config.cache_config.cache_dtype = "fp8_ds_mla" if fp8_ds_mla else "auto"
    specs = vllm_engine.deepseek_v4_specs(config, ratios, fp8_ds_mla)
    groups = get_kv_cache_groups(config, specs)
    whole = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    assert row_block_sizes(whole) == (64, 64, 256, 4, 8)
    assert {k.value for k in group_kinds(whole, 256)} == {"attention"}
