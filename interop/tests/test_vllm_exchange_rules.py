"""Which of a request's blocks cross between engines, per KV-cache group, as kvwire's
scheduler side cuts them and as stock's own scheduler (``get_exchange_clipped_blocks``) cuts
them, on the same vLLM configs: a stock peer reads or writes exactly its cut, so kvwire's
must be the same list. Hypothesis draws the groups (full attention, sliding windows of
attention and of MLA, Mamba groups with speculative scratch slots, DeepSeek-V4's groups of
four block sizes), vLLM's Mamba cache mode and the lists; the prompt's tokens D computes
itself are compared with stock's too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.integrations.vllm.config import kvwire_config
from kvwire.integrations.vllm.groups import prefill_backoff
from kvwire.integrations.vllm.scheduler import SchedulerSide

BLOCK = 16
PAGE = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}


def _config(kinds: tuple[str, ...], spec_slots: int) -> Any:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    page = FullAttentionSpec(block_size=BLOCK, **PAGE).page_size_bytes
    specs = {
        "full": lambda: FullAttentionSpec(block_size=BLOCK, **PAGE),
        "swa": lambda: SlidingWindowSpec(block_size=BLOCK, sliding_window=40, **PAGE),
        "chunked": lambda: ChunkedLocalAttentionSpec(
            block_size=BLOCK, attention_chunk_size=2 * BLOCK, **PAGE
        ),
        # vLLM's windowed MLA layer (one latent a token); its window another length
        "mla-swa": lambda: SlidingWindowMLASpec(
            block_size=BLOCK, sliding_window=72, num_kv_heads=1, head_size=576,
            dtype=torch.bfloat16,
        ),
        # DeepSeek-V4's groups, each of its own block size: compressed latents (a state a
        # 4 tokens), windowed latents, compressors' states (windows of 8 and 128 tokens)
        "v4-latent": lambda: MLAAttentionSpec(
            block_size=256, tokens_per_state=4, alignment=576, model_version="deepseek_v4",
            num_kv_heads=1, head_size=584, dtype=torch.uint8,
        ),
        "v4-window": lambda: SlidingWindowMLASpec(
            block_size=64, sliding_window=128, alignment=576, model_version="deepseek_v4",
            num_kv_heads=1, head_size=584, dtype=torch.uint8,
        ),
        "v4-state": lambda: SlidingWindowMLASpec(
            block_size=4, sliding_window=8, alignment=576, num_kv_heads=1, max_tp_shards=1,
            head_size=2048, dtype=torch.float32,
        ),
        "v4-state-8": lambda: SlidingWindowMLASpec(
            block_size=8, sliding_window=128, alignment=576, num_kv_heads=1, max_tp_shards=1,
            head_size=1024, dtype=torch.float32,
        ),
        "mamba": lambda: MambaSpec(
            block_size=BLOCK, shapes=((96, 3), (4, 16, 16)), dtypes=(torch.bfloat16,) * 2,
            page_size_padded=page, num_speculative_blocks=spec_slots,
        ),
    }  # fmt: skip
    groups = [KVCacheGroupSpec([f"layer{i}"], specs[k]()) for i, k in enumerate(kinds)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def _vllm_config(mode: str) -> Any:
    from vllm_engine import build_vllm_config

    start = {
        "role": "P", "connector": "KVWireConnector", "engine_id": "rules", "model": "llama-3-8b",
        "layers": 2, "num_blocks": 64, "block_size": BLOCK, "tp_size": 1, "hma": True,
        "mamba": 1, "extra_config": {"transfer_mode": "pull", "transport": "shm"},
    }  # fmt: skip
    config = build_vllm_config(start)
    config.cache_config.mamba_cache_mode = mode
    return config


@pytest.fixture(scope="module")
def sides() -> Any:
    """One pair of scheduler sides per (groups, scratch slots, cache mode), kept for the
    module: building a stock scheduler side is the slow part."""
    from vllm.distributed.kv_transfer.kv_connector import utils
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
        NixlPullConnectorScheduler,
    )
    from vllm_peer import _backend

    patch = pytest.MonkeyPatch()
    # No model runs here: the backend a CPU engine picks, as the harness's engines have it.
    patch.setattr(utils, "get_current_attn_backends", lambda *_a, **_k: [_backend(False)])
    patch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "0")  # kvwire's listener on any free port
    built: dict[tuple[Any, ...], tuple[Any, SchedulerSide, Any, Any]] = {}

    def get(kinds: tuple[str, ...], spec_slots: int, mode: str) -> tuple[Any, ...]:
        key = (kinds, spec_slots, mode)
        if key not in built:
            vllm_config, kv_cache_config = _vllm_config(mode), _config(kinds, spec_slots)
            stock = NixlPullConnectorScheduler(vllm_config, "rules", kv_cache_config)
            ours = SchedulerSide(vllm_config, kvwire_config(vllm_config), kv_cache_config)
            built[key] = (stock, ours, vllm_config, kv_cache_config)
        return built[key]

    yield get
    for _, ours, _, _ in built.values():
        ours.close()
    patch.undo()


@st.composite
def requests(draw: st.DrawFn) -> tuple[Any, ...]:
    kinds = draw(st.sampled_from([
        ("full",), ("full", "swa"), ("full", "mamba"), ("full", "swa", "mamba"),
        ("full", "mamba", "mamba"), ("full", "mla-swa"), ("full", "swa", "mla-swa"),
        ("full", "chunked"), ("full", "chunked", "swa"),
        ("v4-window", "v4-window", "v4-latent", "v4-state", "v4-state-8"),
    ]))  # fmt: skip
    lists = [
        # a chunked list leads with vLLM's null block, once per chunk no token reads now
        [0] * (draw(st.integers(0, 8)) if k == "chunked" else 0)
        + draw(
            st.lists(
                st.integers(0, 63), min_size=0 if k in ("full", "v4-latent") else 1, max_size=20
            )
        )
        for k in kinds
    ]
    return (
        kinds,
        draw(st.integers(0, 3)),
        draw(st.sampled_from(["none", "align", "all"])),
        lists,
    )


@settings(max_examples=120, deadline=None, derandomize=True)
@given(request=requests(), lookahead=st.integers(0, 4))
def test_kvwire_cuts_every_list_as_stock_does(
    sides: Any, request: tuple[Any, ...], lookahead: int
) -> None:
    """...and cuts the prompt by as many tokens, with a drafter's lookahead of any length
    (vLLM's own property, set here: no drafter is loaded)."""
    from vllm.config import VllmConfig

    kinds, spec_slots, mode, lists = request
    stock, ours, vllm_config, kv_cache_config = sides(kinds, spec_slots, mode)
    want = [list(g) for g in stock.get_exchange_clipped_blocks(tuple(lists))]
    assert ours.exchanged([list(g) for g in lists]) == want, (kinds, spec_slots, mode)
    # What P holds of them: each list's end, a chunked one without its leading null
    # blocks, every other one whole.
    for kind, sent, held in zip(kinds, want, ours.held(want), strict=True):
        lead = len(sent) - len(held)
        assert sent[lead:] == held, kind
        if kind == "chunked":
            assert set(sent[:lead]) <= {0} and held[:1] != [0], (sent, held)
        else:
            assert lead == 0, kind
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(VllmConfig, "num_prefill_lookahead_tokens", property(lambda _: lookahead))
        assert prefill_backoff(kv_cache_config, vllm_config) == stock._prefill_backoff()


MAMBA_KINDS = ("MAMBA1", "MAMBA2", "GDN_ATTN")


def _mamba_spec(kind: str, tp: int, a: int, b: int, rows: int) -> Any:
    """A Mamba spec of one rank of a TP-``tp`` model, shaped as that kind's mixer shapes
    it (sizes in whole-model units ``a`` and ``b``, each split over the ranks)."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    if kind == "MAMBA1":  # x columns, then (x, state)
        conv, temporal = (a * tp * 4 // tp, rows), (a * tp * 4 // tp, b)
    elif kind == "MAMBA2":  # x + 2 x groups columns, then (heads, head dim, state)
        heads, head_dim, groups = 2 * tp, a, b * tp
        conv = ((heads * head_dim + 2 * groups) // tp, rows)
        temporal = (heads // tp, head_dim, 16)
    else:  # GDN: 2 x key + value columns, then (value heads, value dim, key dim)
        key, v_heads, v_dim = a * tp, 2 * tp, b
        conv = ((2 * key + v_heads * v_dim) // tp, rows)
        temporal = (v_heads // tp, v_dim, 8)
    return MambaSpec(
        block_size=16, shapes=(conv, temporal), dtypes=(torch.bfloat16, torch.float32),
        mamba_type=MambaAttentionBackendEnum[kind],
    )  # fmt: skip


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(MAMBA_KINDS),
    tp=st.sampled_from([1, 2, 4]),
    a=st.integers(1, 24),
    b=st.integers(1, 24),
    rows=st.integers(1, 4),
)
def test_state_parts_are_stocks_conv_split(kind: str, tp: int, a: int, b: int, rows: int) -> None:
    """kvwire's parts of a Mamba state (what moves between unequal TP sizes) are the
    sub-projections stock's own ``derive_mamba_conv_split`` finds, then the temporal
    state, and its ``ssm_sizes`` are stock's, for each kind stock moves."""
    from vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils import (
        derive_mamba_conv_split,
    )
    from vllm.model_executor.layers.mamba import mamba_utils
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from kvwire.integrations.vllm.groups import ssm_parts, ssm_sizes

    spec = _mamba_spec(kind, tp, a, b, rows)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
        mamba_utils.get_conv_state_layout.cache_clear()
        try:
            split = derive_mamba_conv_split(spec, tp)
        finally:
            mamba_utils.get_conv_state_layout.cache_clear()
    config = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["m"], spec)]
    )
    assert ssm_sizes(config) == tuple(split.ssm_sizes)
    assert ssm_parts(config) == (*split.proj_bytes, split.ssm_sizes[1])


NAME_PARTS = st.sampled_from(
    [
        "model.layers.",
        "draft_model.layers.",
        "mtp.",
        ".self_attn.attn",
        ".self_attn.indexer.k_cache",
        ".mixer",
        "_",
        "a",
        "Z",
        ".",
    ]
)
NAMES = st.lists(
    st.lists(NAME_PARTS | st.integers(0, 200).map(str), min_size=1, max_size=6).map("".join),
    min_size=1,
    max_size=12,
    unique=True,
)


@settings(max_examples=300, deadline=None)
@given(names=NAMES)
def test_regions_are_ordered_as_stock_orders_them(names: list[str]) -> None:
    """A stock peer pairs regions by index, in the order its worker sorts the layer names
    (``_region_sort_key``); kvwire's order, on drawn names in any allocation order, is
    that one (numbers compared as numbers: ``layers.2`` before ``layers.10``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import _region_sort_key

    from kvwire.integrations.vllm.geometry import layer_order

    assert sorted(names, key=layer_order) == sorted(names, key=_region_sort_key)
