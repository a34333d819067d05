"""KVWireConnector on vLLM's hybrid KV cache manager (on by default): a sliding-window
group beside a full-attention one, grouped, planned and allocated by vLLM's own code (every
group's layer ``j`` in one slab, so the regions are shared, group -1). D checks every
full-attention block and the window's tail, with each group's own content, the moment its
model would first read them."""

from __future__ import annotations

from typing import Any

import pytest
from harness import Geometry, SchedulerEngine, Zygote, transfer

from kvwire.demo.models import CacheSpec, preset

WINDOW = 64
"""Tokens: the window reaches the prompt's last 3 blocks of 32 (cdiv(64, 32) + 1)."""
TOKENS = 300
"""9 whole blocks and a partial one: the window's tail is a part of the prompt."""
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


def checked_bytes() -> int:
    """What D must check: the full-attention layers' whole prompt blocks and the window
    layers' whole blocks among the last ``cdiv(W, block) + 1`` (vLLM's exchanged tail)."""
    spec = CacheSpec(preset(GEO.model), GEO.layers, GEO.num_blocks, 0, 1, GEO.block_size)
    whole = TOKENS // GEO.block_size
    tail_first = -(-TOKENS // GEO.block_size) - (-(-WINDOW // GEO.block_size) + 1)
    per_kind = GEO.layers // 2
    return spec.block_len * per_kind * (whole + (whole - tail_first))


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
    p_conn, d_conn, transport = PAIRS[pair]
    p_tp, d_tp = (int(n) for n in tp.split("-"))
    p = _engine("P", p_conn, zygote, transport, mode, p_tp)
    try:
        d = _engine("D", d_conn, zygote, transport, mode, d_tp)
        try:
            state = transfer(p, d, "req-sw", 5, TOKENS)
            assert "req-sw" in state["checked"], (state["invalid"], d.peer.log[-3:])
            wrong, checked = state["checked"]["req-sw"]
            assert wrong == 0 and checked == checked_bytes()
        finally:
            d.close()
    finally:
        p.close()


def test_a_state_space_group_is_refused_by_name() -> None:
    """kvwire does not move Mamba state yet: an engine with such a group must fail when
    vLLM builds its connector (either role runs this check first), naming the group, never
    report a request done without its state."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    from kvwire.errors import ConfigError
    from kvwire.integrations.vllm.geometry import group_kinds

    attention = FullAttentionSpec(
        block_size=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
    )
    mamba = MambaSpec(block_size=32, shapes=((4, 64), (8, 16)), dtypes=(torch.bfloat16,) * 2)
    config = KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["a"], attention), KVCacheGroupSpec(["m"], mamba)],
    )
    with pytest.raises(ConfigError, match="KV-cache group 1 is MambaSpec"):
        group_kinds(config)
