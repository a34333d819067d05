"""A host buffer over a device KV cache (``kv_buffer_device: "cpu"``), with stock's meaning.

On a device platform stock registers a host copy of its KV cache and stages blocks through
it: P copies a finished prompt's blocks to the host before a peer reads them, D copies what
it received to the device before vLLM schedules the request. On a CPU platform neither
kind of engine stages (the cache is host memory already). No GPU runs here, so a kvwire
engine is told its CPU cache stands for a device's (the harness's ``host_buffer``): it then
registers only the host copy, and a byte that skipped a copy is not where D's model reads
it. The stock engine beside it runs as a CPU engine does, without a host buffer: the wire
is the same either way.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import Geometry, Zygote, assert_moved, engines, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

TOKENS = 100  # 3 full blocks + a partial one (32-token blocks)
PAIRS = {
    "kvwire-nixl": ("KVWireConnector", "KVWireConnector"),
    "stock-P-kvwire-D": ("NixlConnector", "KVWireConnector"),
    "kvwire-P-stock-D": ("KVWireConnector", "NixlConnector"),
}
MODELS: dict[str, dict[str, Any]] = {
    "dense": {},
    "mla": {"geo": Geometry(model="mla", layers=2)},  # 16-token kernel blocks: 2 per block
    "window": {"window": 48, "hma": True},  # two groups sharing the slabs
    # DeepSeek-V3.2: each layer's indexer keys beside its latent, a page of their own.
    "sparse-mla": {"geo": Geometry(model="mla", layers=2), "indexer": True},
}
MODES = ("pull", "push")
CASES = [(model, pair, mode, "1-1") for model in MODELS for pair in sorted(PAIRS) for mode in MODES]
CASES += [("dense", "kvwire-nixl", "pull", "1-2"), ("dense", "kvwire-nixl", "push", "2-1")]


@pytest.mark.parametrize(("model", "pair", "mode", "tp"), CASES)
def test_host_buffer(zygote: Zygote, model: str, pair: str, mode: str, tp: str) -> None:
    """Every kvwire engine of the pair stages through its host copy; D's model finds
    every prompt token's KV in its device cache, byte for byte, on every rank."""
    p_conn, d_conn = PAIRS[pair]
    p_tp, d_tp = (int(n) for n in tp.split("-"))
    options = dict(MODELS[model])
    with engines(
        zygote, p_conn, d_conn, {"tp": p_tp, "host_buffer": p_conn == "KVWireConnector"},
        {"tp": d_tp, "host_buffer": d_conn == "KVWireConnector"},
        extra_config={"transport": "nixl"}, mode=mode, **options,
    ) as (p, d):  # fmt: skip
        assert_moved(p, d, "req-h", 31, TOKENS)
        # A second request into blocks the first left in the host copy: its own bytes.
        assert_moved(p, d, "req-h2", 37, TOKENS + 40)


def test_a_chunked_prompt_is_staged_step_by_step(zygote: Zygote) -> None:
    """P computes the prompt in 40-token steps, layer by layer (each step writes only its
    tokens, so a block one step half fills is finished by the next): every step's blocks
    reach the host, a half-filled one again once it is full."""
    p_options = {"host_buffer": True, "layerwise": True, "scheduler": {"batch_tokens": 40}}
    with engines(
        zygote, "KVWireConnector", "KVWireConnector", p_options, {"host_buffer": True},
        extra_config={"transport": "nixl"},
    ) as (p, d):  # fmt: skip
        assert_moved(p, d, "req-c", 71, 150)


def test_a_prefix_hit_on_p_is_staged(zygote: Zygote) -> None:
    """P computed a prompt for itself (never staged: no remote decode), then a request
    sharing its first two blocks hits them in P's prefix cache: they reach the host too."""
    with engines(
        zygote, "KVWireConnector", "KVWireConnector", {"host_buffer": True}, {},
        extra_config={"transport": "nixl"},
    ) as (p, d):  # fmt: skip
        p.add("req-local", 73, 64, {"do_remote_decode": False})
        wait_until(lambda: "req-local" in p.state.get("outputs", {}), p.step, 30, "P: req-local")
        assert_moved(p, d, "req-hit", 73, TOKENS)
        assert p.state["hits"]["req-hit"] == 64


@pytest.mark.parametrize("device", ["cpu", "cuda", "xpu"])
@pytest.mark.parametrize("buffer", ["cpu", "cuda", "xpu"])
def test_a_host_buffer_is_what_stock_stages(
    device: str, buffer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvwire stages exactly where stock's own scheduler side says it uses a host buffer:
    a ``cpu`` buffer on a platform whose device is not the CPU; and it refuses, by name,
    the buffers stock's table of devices refuses (a buffer on another device)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector import utils
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
        NixlPullConnectorScheduler,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import _NIXL_SUPPORTED_DEVICE
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm_engine import build_vllm_config
    from vllm_peer import _backend

    from kvwire.errors import ConfigError
    from kvwire.integrations.vllm.staging import wants_host_buffer

    start = {
        "role": "P", "connector": "NixlConnector", "engine_id": "stage", "model": "llama-3-8b",
        "layers": 2, "num_blocks": 16, "block_size": 32, "tp_size": 1,
    }  # fmt: skip
    config = build_vllm_config(start)
    transfer = config.kv_transfer_config
    config.kv_transfer_config = KVTransferConfig(
        kv_connector=transfer.kv_connector, kv_role=transfer.kv_role,
        engine_id=transfer.engine_id, kv_buffer_device=buffer,
        kv_connector_extra_config=transfer.kv_connector_extra_config,
    )  # fmt: skip
    page = FullAttentionSpec(block_size=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    group = KVCacheGroupSpec(["layer"], page)
    kv_cache_config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[group])
    monkeypatch.setattr(utils, "get_current_attn_backends", lambda *_a, **_k: [_backend(False)])
    monkeypatch.setattr(current_platform, "device_type", device)
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "0")
    if buffer not in _NIXL_SUPPORTED_DEVICE[device]:
        with pytest.raises(ConfigError, match=f"kv_buffer_device '{buffer}' on a {device}"):
            wants_host_buffer(config)
        return
    stock = NixlPullConnectorScheduler(config, "stage", kv_cache_config)
    assert wants_host_buffer(config) == stock.use_host_buffer


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_the_blocks_a_step_writes_are_those_its_tokens_touch(data: st.DataObject) -> None:
    """What a staged P copies to the host after a step (``SchedulerSide.written``): of an
    attention group, every block holding one of the step's tokens ``[start, end)`` and no
    other, however the range meets block boundaries; of a Mamba group, its running state
    (the list without its speculative scratch slots, cut as it crosses). The oracle asks,
    token by token, which block holds it."""
    from types import SimpleNamespace

    from kvwire.integrations.vllm.groups import Exchanged
    from kvwire.integrations.vllm.scheduler import SchedulerSide

    size = data.draw(st.sampled_from([16, 32, 64]), label="block_size")
    end = data.draw(st.integers(1, 8 * size), label="end")
    start = data.draw(st.integers(0, end - 1), label="start")
    kinds = data.draw(st.lists(st.sampled_from(["attention", "mamba"]), min_size=1, max_size=3))
    # DeepSeek-V4's groups each have a block size of their own, dividing the engine's.
    own = data.draw(st.booleans(), label="groups of their own block sizes")
    sizes = [
        data.draw(st.sampled_from([size // 4, size // 2, size])) if own else size for _ in kinds
    ]
    rules = [
        Exchanged(block_size=tokens if own else 0) if k == "attention" else Exchanged(spec_slots=2)
        for k, tokens in zip(kinds, sizes, strict=True)
    ]
    lists = [
        data.draw(
            st.lists(
                st.integers(1, 999), min_size=-(-end // t), max_size=-(-end // t) + 2, unique=True
            )
        )
        if k == "attention"
        else data.draw(st.lists(st.integers(1, 999), min_size=3, max_size=6, unique=True))
        for k, t in zip(kinds, sizes, strict=True)
    ]
    side = SchedulerSide.__new__(SchedulerSide)
    side.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=size))
    side.kv_cache_config = SimpleNamespace(
        kv_cache_groups=kinds, select_transfer_block_ids=lambda groups: groups
    )
    side.rules = tuple(rules)
    want = [
        [blocks[i] for i in sorted({t // tokens for t in range(start, end)})]
        if kind == "attention"
        else rule(blocks)
        for kind, rule, blocks, tokens in zip(kinds, rules, lists, sizes, strict=True)
    ]
    assert side.written(lists, start, end) == want
