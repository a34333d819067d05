"""KVWireConnector on vLLM's hybrid KV cache manager (on by default): a sliding-window
group beside a full-attention one, grouped, planned and allocated by vLLM's own code (every
group's layer ``j`` in one slab, so the regions are shared, group -1). D checks, the moment
its model would first read them, every prompt token of the full-attention layers and every
token the window layers' next token attends to, each group with its own content, and the
test asserts how many bytes that is: a window left unmoved fails it."""

from __future__ import annotations

from typing import Any

import pytest
from harness import Geometry, SchedulerEngine, Zygote, transfer_many

from kvwire.demo.models import CacheSpec, preset

WINDOW = 64
"""Tokens: engines exchange a window group's last cdiv(64, 32) + 1 = 3 blocks of 32."""
REQUESTS = {"req-even": 288, "req-odd": 300}
"""Prompt lengths, one content: 288 tokens end on a block boundary, so the exchanged tail
begins with vLLM's null block (the window has left block 6); 300 share those 9 blocks on
P (a prefix-cache hit: both requests hold them at once) and end in a partial block."""
INDEX = 5
GEO = Geometry(layers=4)

PAIRS = {
    "kvwire-shm": ("KVWireConnector", "KVWireConnector", "shm"),
    "kvwire-nixl": ("KVWireConnector", "KVWireConnector", "nixl"),
    "stock-P-kvwire-D": ("NixlConnector", "KVWireConnector", "nixl"),
    "kvwire-P-stock-D": ("KVWireConnector", "NixlConnector", "nixl"),
}


def _engine(
    role: str, connector: str, zygote: Zygote, transport: str, mode: str, tp: int = 1
) -> SchedulerEngine:
    extra: dict[str, Any] = {"transport": transport}
    return SchedulerEngine(
        role, connector, zygote, geo=GEO, extra_config=extra, mode=mode, tp=tp, hma=True,
        window=WINDOW,
    )  # fmt: skip


def checked_bytes(prompt: int) -> int:
    """What D must check of one prompt: every token in the full-attention layers, the
    window layers' tokens from ``prompt - W + 1`` on in whole blocks, the last block's
    prompt tokens included."""
    spec = CacheSpec(preset(GEO.model), GEO.layers, GEO.num_blocks, 0, 1, GEO.block_size)
    per_token = spec.block_len // GEO.block_size
    window_first = (prompt - WINDOW + 1) // GEO.block_size * GEO.block_size
    per_kind = GEO.layers // 2
    return per_token * per_kind * (prompt + (prompt - window_first))


def exchanged_lengths(prompt: int) -> list[int]:
    """How many ids each group's list in P's params has: all of the prompt's blocks, and
    the window's last cdiv(W, 32) + 1, as a stock P sends them."""
    blocks = -(-prompt // GEO.block_size)
    return sorted([blocks, min(blocks, -(-WINDOW // GEO.block_size) + 1)])


def test_regions_and_groups_are_what_stock_registers(zygote: Zygote) -> None:
    """Each slab holds one layer of every group: stock registers it once, shared (-1)."""
    found = {}
    for connector in ("NixlConnector", "KVWireConnector"):
        engine = _engine("P", connector, zygote, "nixl", "pull")
        try:
            found[connector] = engine.peer.call({"op": "regions"})
        finally:
            engine.close()
    stock, ours = found["NixlConnector"], found["KVWireConnector"]
    assert ours["regions"] == stock["regions"] and len(ours["regions"]) == GEO.layers // 2
    assert ours["groups"] == stock["groups"] == [-1] * (GEO.layers // 2)


@pytest.mark.parametrize("tp", ["1-1", "1-2", "2-1"])
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_sliding_window(zygote: Zygote, pair: str, mode: str, tp: str) -> None:
    p_tp, d_tp = (int(n) for n in tp.split("-"))
    state, outputs = _window_pair(zygote, pair, mode, p_tp, d_tp)
    for rid, tokens in REQUESTS.items():
        assert sorted(map(len, outputs[rid]["remote_block_ids"])) == exchanged_lengths(tokens)
        assert state["checked"][rid] == [0, checked_bytes(tokens)], rid


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("pair", ["stock-P-kvwire-D", "kvwire-P-stock-D"])
def test_sliding_window_on_vllm_032(zygote_032: Zygote, pair: str, mode: str) -> None:
    """The same groups on vLLM 0.32.0's manager and connector (version 14)."""
    state, _ = _window_pair(zygote_032, pair, mode, 1, 1)
    for rid, tokens in REQUESTS.items():
        assert state["checked"][rid] == [0, checked_bytes(tokens)], rid


def _window_pair(
    zygote: Zygote, pair: str, mode: str, p_tp: int, d_tp: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both prompts from P to D: D's state (every request checked) and P's params."""
    p_conn, d_conn, transport = PAIRS[pair]
    p = _engine("P", p_conn, zygote, transport, mode, p_tp)
    try:
        d = _engine("D", d_conn, zygote, transport, mode, d_tp)
        try:
            state = transfer_many(p, d, INDEX, REQUESTS)
            for rid in REQUESTS:
                assert rid in state["checked"], (rid, state["invalid"], d.peer.log[-3:])
            return state, p.state["outputs"]
        finally:
            d.close()
    finally:
        p.close()


def _spec(kind: str) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    page = {"num_kv_heads": 8, "head_size": 128, "dtype": torch.bfloat16}
    specs = {
        "full": lambda: FullAttentionSpec(block_size=32, **page),
        "window": lambda: SlidingWindowSpec(block_size=32, sliding_window=64, **page),
        "full-64": lambda: FullAttentionSpec(block_size=64, **page),
        "chunked": lambda: ChunkedLocalAttentionSpec(
            block_size=32, attention_chunk_size=128, **page
        ),
        "mamba": lambda: MambaSpec(
            block_size=32, shapes=((4, 64), (8, 16)), dtypes=(torch.bfloat16,) * 2
        ),
    }
    return specs[kind]()


REFUSED = {
    "mamba": (["full", "mamba"], "KV-cache group 1 is MambaSpec"),
    "chunked-local": (["full", "chunked"], "KV-cache group 1 is ChunkedLocalAttentionSpec"),
    "unequal-pages": (["full", "full-64"], "KV-cache group 1's pages"),
    "windows-only": (["window"], "every KV-cache group has a sliding window"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_groups_kvwire_cannot_move_are_refused_by_name(case: str) -> None:
    """What kvwire does not move yet fails the engine's startup (either role runs this
    check when vLLM builds the connector), naming the group and why, so no request is ever
    reported done without a group's KV."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from kvwire.errors import ConfigError
    from kvwire.integrations.vllm.geometry import group_kinds

    kinds, message = REFUSED[case]
    groups = [KVCacheGroupSpec([f"layer{i}"], _spec(kind)) for i, kind in enumerate(kinds)]
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    with pytest.raises(ConfigError, match=message):
        group_kinds(config, 32)
    accepted = [KVCacheGroupSpec(["a"], _spec("full")), KVCacheGroupSpec(["b"], _spec("window"))]
    ok = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=accepted)
    assert len(group_kinds(ok, 32)) == 2
