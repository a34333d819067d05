"""KVWireConnector on vLLM's hybrid KV cache manager (on by default): a sliding-window
group beside a full-attention one, grouped, planned and allocated by vLLM's own code (every
group's layer ``j`` in one slab, so the regions are shared, group -1). D checks, the moment
its model would first read them, every prompt token of the full-attention layers and every
token the window layers' next token attends to, each group with its own content, and the
test asserts how many bytes that is: a window left unmoved fails it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from harness import (
    Geometry,
    SchedulerEngine,
    Zygote,
    engines,
    load_refused,
    prefill,
    registered_by_each,
    step_both,
    transfer,
    transfer_many,
    wait_until,
)

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
    per_token = GEO.token_bytes
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
    stock, ours = registered_by_each(
        zygote, geo=GEO, extra_config={"transport": "nixl"}, mode="pull", hma=True, window=WINDOW
    )
    assert ours["regions"] == stock["regions"] and len(ours["regions"]) == GEO.layers // 2
    assert ours["groups"] == stock["groups"] == [-1] * (GEO.layers // 2)


@pytest.mark.parametrize(("tp", "layers"), [(1, 8), (2, 8), (1, 9), (1, 7)])
def test_mamba_regions_are_what_stock_registers(zygote: Zygote, tp: int, layers: int) -> None:
    """With Mamba groups each slab holds an attention page or a padded state: stock
    registers it once, shared (-1), names it after its first layer of either kind, and
    advertises one layer's state sizes on this rank. Layer counts that are not whole
    repeats of the pattern make vLLM group the layers otherwise (a slab's first layer may
    then be a Mamba one)."""
    answers = registered_by_each(
        zygote, geo=replace(MAMBA_GEO, layers=layers), hma=True, mamba=MAMBA, tp=tp,
        extra_config={"transport": "nixl"},
    )  # fmt: skip
    keys = ("regions", "names", "groups", "blocks", "ssm_sizes")
    stock, ours = ({k: answer[k] for k in keys} for answer in answers)
    assert ours == stock
    assert ours["groups"] == [-1] * len(ours["regions"])
    assert ours["ssm_sizes"] == [s // tp for s in _mamba_sizes()]


PAIR_SIZES = [
    (pair, tp)
    for pair in sorted(PAIRS)
    for tp in (["1-1"] if pair == "kvwire-shm" else ["1-1", "1-2", "2-1"])
]
"""Each pair at equal and unequal TP sizes; kvwire's shared memory at equal sizes only (the
planner is the same over NIXL, which runs them all)."""


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(("pair", "tp"), PAIR_SIZES)
def test_sliding_window(zygote: Zygote, pair: str, mode: str, tp: str) -> None:
    p_tp, d_tp = (int(n) for n in tp.split("-"))
    state, outputs = _window_pair(zygote, pair, mode, p_tp, d_tp)
    for rid, tokens in REQUESTS.items():
        assert sorted(map(len, outputs[rid]["remote_block_ids"])) == exchanged_lengths(tokens)
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


MAMBA = 3
"""Mamba2 layers after each attention layer (Jamba's 1:7 and Nemotron-H's ratios, in
small): vLLM makes a group of each kind's ``j``-th layers, so every slab holds one
attention page and three states."""
MAMBA_GEO = Geometry(layers=8)
MAMBA_REQUESTS = {"req-boundary": (7, 257), "req-partial": (8, 300)}
"""Prompt lengths, each its own content: D loads all but the last token (P never computes
it), so 257 tokens load exactly 8 blocks and D's state is the 8th block's; 300 load 299
into a partial block."""


def _mamba_sizes() -> tuple[int, int]:
    """(conv, temporal) state bytes of one of the harness's Mamba2 layers at TP 1, from
    the mixer's sizes (bf16 conv state, fp32 temporal state)."""
    from vllm_engine import MAMBA_CONV, MAMBA_GROUPS, MAMBA_HEAD_DIM, MAMBA_HEADS, MAMBA_STATE

    conv = (MAMBA_HEADS * MAMBA_HEAD_DIM + 2 * MAMBA_GROUPS) * (MAMBA_CONV - 1) * 2
    return conv, MAMBA_HEADS * MAMBA_HEAD_DIM * MAMBA_STATE * 4


def mamba_checked_bytes(tokens: int) -> int:
    """What D must check of one prompt: every loaded token (all but the last) of the
    attention layers, and every Mamba layer's state after them."""
    per_token = MAMBA_GEO.token_bytes
    attention = MAMBA_GEO.layers // (MAMBA + 1)
    state = sum(_mamba_sizes())
    return per_token * attention * (tokens - 1) + state * (MAMBA_GEO.layers - attention)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(("pair", "tp"), PAIR_SIZES)
def test_mamba(zygote: Zygote, pair: str, mode: str, tp: str) -> None:
    """A hybrid Mamba2 model on vLLM's defaults (hybrid manager, prefix caching: states at
    block boundaries), its groups planned and allocated by vLLM: P computes all but the
    last token, and D holds, the moment its model would first read them, every loaded
    token's KV and every Mamba layer's state after them, each group with its own content.
    Between unequal TP sizes each D rank holds its slice of every part of the state."""
    _mamba_pair(zygote, pair, mode, tp)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("pair", ["kvwire-nixl", "stock-P-kvwire-D", "kvwire-P-stock-D"])
def test_mamba_with_a_host_buffer(zygote: Zygote, pair: str, mode: str) -> None:
    """Every kvwire engine of the pair stages through its host copy (``kv_buffer_device:
    "cpu"``; a stock engine on CPU stages nothing): the states share the slabs with the
    attention pages, and D holds both, byte for byte, in its device cache."""
    _mamba_pair(zygote, pair, mode, "1-1", host_buffer=True)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("pair", ["kvwire-nixl", "stock-P-kvwire-D", "kvwire-P-stock-D"])
def test_mamba_prefix_hits_on_both_sides(zygote: Zygote, pair: str, mode: str) -> None:
    """A prompt repeated with 80 tokens more: P and D each find its first 224 tokens (7
    blocks) in their own prefix cache. D holds no state at a block boundary of a loaded
    prompt (it loads P's state after the prompt, in a partial block), so its hit is its
    attention groups' alone: vLLM keeps it only for a connector that loads every state
    whole beside it, as both do. D then holds every loaded token's KV and the state."""
    p_conn, d_conn, transport = PAIRS[pair]
    with engines(
        zygote, p_conn, d_conn, geo=MAMBA_GEO, mode=mode, hma=True, mamba=MAMBA,
        extra_config={"transport": transport},
    ) as (p, d):  # fmt: skip
        transfer(p, d, "req-first", 9, 250)
        state = transfer(p, d, "req-again", 9, 330)
        p_hits = p.state["hits"]
    assert p_hits["req-again"] == state["hits"]["req-again"] == 224
    assert state["checked"]["req-again"] == [0, mamba_checked_bytes(330)]


@pytest.mark.parametrize(
    ("kinds", "replicated"),
    [
        (["v4-compressed", "v4-window", "v4-compressor"], True),
        (["v4-compressed", "full"], False),
        (["v4-compressed", "mla", "mamba-replicated"], False),
        (["v4-compressed", "mla", "gdn"], True),
        (["v4-compressed", "mla", "gdn", "gdn-wide"], False),
        (["v4-compressed", "mla", "mamba"], False),
    ],
)  # fmt: skip
def test_rows_of_gqa_pages_or_states_are_each_ranks_own(kinds: list[str], replicated: bool) -> None:
    """Rows of MLA pages are the same on every TP rank (read from one producer rank
    between any TP sizes), and so are they beside one TP-sharded state whose parts kvwire
    knows (Glm5Next's KDA, a GDN-kind state: sliced between unequal TP sizes); a row
    holding a GQA page, a state replicated across ranks, states of two shapes or one
    kvwire cannot slice is each rank's own (moved rank to rank, equal TP sizes)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from kvwire.integrations.vllm.groups import row_block_sizes, rows_replicated

    groups = [KVCacheGroupSpec([f"layer{i}"], _spec(kind)) for i, kind in enumerate(kinds)]
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    assert row_block_sizes(config) and rows_replicated(config) is replicated


UNEQUAL_PAIRS = [
    ("kvwire-nixl", "pull"),
    ("kvwire-nixl", "push"),
    ("stock-P-kvwire-D", "pull"),
]
"""A kvwire D plans a pull from a stock P itself; the other stock cells are refused
(:func:`test_a_stock_peer_of_another_block_size_is_refused_in_push`) or stock's own
(a stock D of larger blocks reads wrong bytes from a stock P too)."""


@pytest.mark.parametrize(("pair", "mode"), UNEQUAL_PAIRS)
@pytest.mark.parametrize("blocks", ["32-64", "64-32"])
def test_mamba_unequal_block_sizes(zygote: Zygote, blocks: str, pair: str, mode: str) -> None:
    """Unequal block sizes (stock: not supported for hybrid models), kvwire on both sides
    or a kvwire D pulling from a stock P: the attention pages move by token and the state
    after the loaded tokens lands in the block D's model reads it from, wherever D's
    blocks end."""
    _mamba_pair(zygote, pair, mode, "1-1", blocks)


@pytest.mark.parametrize("pair", ["stock-P-kvwire-D", "kvwire-P-stock-D"])
def test_a_stock_peer_of_another_block_size_is_refused_in_push(zygote: Zygote, pair: str) -> None:
    """In push the kvwire side handshakes the stock one (P to write, D to register) and
    refuses a stock peer of another block size there, naming both sizes, before any write:
    a kvwire P writes nothing and frees the prompt's blocks; a kvwire D reports the
    request failed (by request, as for every hybrid model: vLLM computes it)."""
    p_conn, d_conn, _ = PAIRS[pair]
    sides = [
        SchedulerEngine(
            role, connector, zygote, geo=replace(MAMBA_GEO, block_size=block), mode="push",
            hma=True, mamba=MAMBA, extra_config={"transport": "nixl"},
        )
        for role, connector, block in (("P", p_conn, 32), ("D", d_conn, 64))
    ]  # fmt: skip
    p, d = sides
    try:
        index, tokens = MAMBA_REQUESTS["req-partial"]
        d.add("req-bs", index, tokens, prefill(p, "req-bs", index, tokens))
        kvwire = p if pair == "kvwire-P-stock-D" else d
        role = "producer" if kvwire is p else "consumer"
        held = {"producer": (64, 32), "consumer": (32, 64)}[role]
        refusal = f"with blocks of {held[0]} tokens, and this {role}'s hold {held[1]}"
        # The kvwire side ends the request: P frees its blocks, or D reports it received
        # (failed, by request: vLLM computes it).
        ended = "sent" if kvwire is p else "received"
        step_both(
            p, d, lambda: "req-bs" in kvwire.state.get(ended, []), "the kvwire side to end it"
        )
        log = kvwire.state.get("log", []) + kvwire.peer.log
        assert any(refusal in line for line in log), log[-3:]
        if kvwire is p:
            assert p.peer.call({"op": "stats"})["stats"]["bytes"] == 0  # nothing written
        else:
            assert "req-bs" in d.state["failed"], d.state["failed"]
        assert "req-bs" not in d.state.get("checked", {})
    finally:
        for engine in reversed(sides):
            engine.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("pair", sorted(set(PAIRS) - {"kvwire-shm"}))
def test_mamba_beside_a_sliding_window(zygote: Zygote, pair: str, mode: str) -> None:
    """All three kinds in one model (full attention, sliding-window attention, Mamba2,
    interleaved): three groups of vLLM's sharing each slab. D checks every loaded token of
    the full layers, the window's tokens of the window layers and every Mamba layer's state
    after them, the byte count asserted, so any group left unmoved fails it."""
    p_conn, d_conn, transport = PAIRS[pair]
    geo = Geometry(layers=8)  # full, Mamba, window, Mamba, over again
    with engines(
        zygote, p_conn, d_conn, geo=geo, mamba=1, window=WINDOW, hma=True, mode=mode,
        extra_config={"transport": transport},
    ) as (p, d):  # fmt: skip
        for rid, (index, tokens) in MAMBA_REQUESTS.items():
            state = transfer(p, d, rid, index, tokens)
    per_token = geo.token_bytes
    for rid, (_, tokens) in MAMBA_REQUESTS.items():
        loaded = tokens - 1  # D computes the last token itself (the Mamba layers' rule)
        window_first = (loaded - WINDOW + 1) // geo.block_size * geo.block_size
        attention = 2 * per_token * (loaded + (loaded - window_first))
        assert state["checked"][rid] == [0, attention + 4 * sum(_mamba_sizes())], rid


def test_a_hybrid_models_failed_load_is_reported_by_request(zygote: Zygote) -> None:
    """A block id names a page of one KV-cache group only, so vLLM stops an engine of
    several groups that reports failed loads by block: kvwire's D reports the request
    (``failed_recving``), vLLM ends it by its policy (the default fails it), and D goes on
    serving. P dies after its prefill; D's next request, from a new P, checks."""

    def engine(role: str, **kw: Any) -> SchedulerEngine:
        return SchedulerEngine(
            role, "KVWireConnector", zygote, geo=MAMBA_GEO, hma=True, mamba=MAMBA,
            extra_config={"transport": "nixl"}, **kw,
        )  # fmt: skip

    d = engine("D")
    try:
        p = engine("P")
        try:
            params = prefill(p, "req-lost", 7, 257)
        finally:
            p.close()
        d.add("req-lost", 7, 257, params)
        wait_until(lambda: "req-lost" in d.state.get("outputs", {}), d.step, 60, "D to end it")
        assert d.state["failed"] == ["req-lost"] and d.state["invalid"] == []
        assert "req-lost" not in d.state["checked"]
        p = engine("P")
        try:
            d.add("req-next", 8, 300, prefill(p, "req-next", 8, 300))
            step_both(p, d, lambda: "req-next" in d.state["checked"], "D to check it")
            assert d.state["checked"]["req-next"] == [0, mamba_checked_bytes(300)]
        finally:
            p.close()
    finally:
        d.close()


@pytest.mark.parametrize(
    ("mode", "host_buffer"), [("pull", False), ("push", False), ("pull", True)]
)
def test_a_state_for_another_token_count_is_refused(
    zygote: Zygote, mode: str, host_buffer: bool
) -> None:
    """P computed a count of tokens D does not load (here P's params say the whole prompt,
    as from a P that cut it by another rule): the Mamba state would be for the wrong
    token, so D reads nothing, reports the request failed by request, and P frees its
    blocks (a D with a host buffer copies nothing to its device)."""

    def engine(role: str) -> SchedulerEngine:
        return SchedulerEngine(
            role, "KVWireConnector", zygote, geo=MAMBA_GEO, hma=True, mamba=MAMBA, mode=mode,
            extra_config={"transport": "nixl"}, host_buffer=host_buffer,
        )  # fmt: skip

    p, d = engine("P"), None
    try:
        d = engine("D")
        params = {**prefill(p, "req-count", 7, 257), "remote_num_tokens": 257}
        log = load_refused(p, d, "req-count", 7, 257, params)
        assert any("P computed 257 of its tokens and this engine loads 256" in line
                   for line in log), log[-3:]  # fmt: skip
    finally:
        if d is not None:
            d.close()
        p.close()


def _mamba_pair(
    zygote: Zygote,
    pair: str,
    mode: str,
    tp: str,
    blocks: str = "32-32",
    host_buffer: bool = False,
) -> None:
    """``host_buffer``: each kvwire engine of the pair stages through a host copy."""
    p_conn, d_conn, transport = PAIRS[pair]
    engines = []
    sides = zip("PD", (p_conn, d_conn), tp.split("-"), blocks.split("-"), strict=True)
    try:
        for role, connector, size, block in sides:
            engines.append(
                SchedulerEngine(
                    role, connector, zygote, geo=replace(MAMBA_GEO, block_size=int(block)),
                    mode=mode, hma=True, mamba=MAMBA, extra_config={"transport": transport},
                    tp=int(size), host_buffer=host_buffer and connector == "KVWireConnector",
                )
            )  # fmt: skip
        p, d = engines
        p_block = int(blocks.split("-")[0])
        for rid, (index, tokens) in MAMBA_REQUESTS.items():
            params = prefill(p, rid, index, tokens)
            assert params["remote_num_tokens"] == tokens - 1, params
            lengths = [len(g) for g in params["remote_block_ids"]]
            assert lengths == [-(-(tokens - 1) // p_block), 1, 1, 1], params
        for rid, (index, tokens) in MAMBA_REQUESTS.items():
            d.add(rid, index, tokens, p.state["outputs"][rid])
        step_both(
            p, d,
            lambda: set(MAMBA_REQUESTS)
            <= set(d.state.get("checked", {})) & set(p.state.get("sent", [])),
            "D to check every request and P to free them",
        )  # fmt: skip
        for rid, (_, tokens) in MAMBA_REQUESTS.items():
            checked = mamba_checked_bytes(tokens)
            assert d.state["checked"][rid] == [0, checked], rid
    finally:
        for engine in reversed(engines):
            engine.close()


def _spec(kind: str) -> Any:
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        RSWASpec,
        SinkFullAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    page = {"num_kv_heads": 8, "head_size": 128, "dtype": torch.bfloat16}
    latent = {"num_kv_heads": 1, "head_size": 576, "dtype": torch.bfloat16}
    specs = {
        "full": lambda: FullAttentionSpec(block_size=32, **page),
        "window": lambda: SlidingWindowSpec(block_size=32, sliding_window=64, **page),
        "full-64": lambda: FullAttentionSpec(block_size=64, **page),
        "mla": lambda: MLAAttentionSpec(block_size=32, **latent),
        "mla-window": lambda: SlidingWindowMLASpec(block_size=32, sliding_window=64, **latent),
        # DeepSeek-V4's sliding-window latents and compressed latents, as its layers make them
        "v4-window": lambda: SlidingWindowMLASpec(
            block_size=32, sliding_window=128, alignment=512, model_version="deepseek_v4",
            num_kv_heads=1, head_size=512, dtype=torch.bfloat16,
        ),
        "v4-compressor": lambda: SlidingWindowMLASpec(
            block_size=4, sliding_window=8, alignment=512, num_kv_heads=1, max_tp_shards=1,
            head_size=2048, dtype=torch.float32,
        ),
        "v4-compressed": lambda: MLAAttentionSpec(
            block_size=32, tokens_per_state=4, alignment=512, model_version="deepseek_v4",
            num_kv_heads=1, head_size=512, dtype=torch.bfloat16,
        ),
        # a ring of the attention page moves (test_vllm_rings.py); another page does not
        "ring": lambda: CircularBufferSpec(block_size=32, **page),
        "ring-8": lambda: CircularBufferSpec(block_size=8, **{**page, "head_size": 512}),
        "ring-keys": lambda: CircularBufferSpec(block_size=32, head_size_v=0, **page),
        # vLLM 0.31.0 and 0.32.0 cannot schedule it (test_vllm_cannot_schedule_static_sinks)
        "static-sinks": lambda: SinkFullAttentionSpec(block_size=32, sink_len=32, **page),
        # R-SWA: the whole prompt when a prefill ends, as full attention
        "rswa": lambda: RSWASpec(block_size=32, rswa_window=64, **page),
        "chunked": lambda: ChunkedLocalAttentionSpec(
            block_size=32, attention_chunk_size=128, **page
        ),
        "mamba-unpadded": lambda: MambaSpec(
            block_size=32, shapes=((4, 64), (8, 16)), dtypes=(torch.bfloat16,) * 2
        ),
        "mamba": lambda: MambaSpec(
            block_size=32, shapes=((4, 64), (8, 16)), dtypes=(torch.bfloat16,) * 2,
            page_size_padded=131072,
        ),
        "mamba-replicated": lambda: MambaSpec(
            block_size=32, shapes=((4, 64), (8, 16)), dtypes=(torch.bfloat16,) * 2,
            page_size_padded=131072, tp_replicated=True,
        ),
        "mamba-short-conv": lambda: MambaSpec(
            block_size=32, shapes=((4, 64), (8, 16)), dtypes=(torch.bfloat16,) * 2,
            page_size_padded=131072, mamba_type=MambaAttentionBackendEnum.SHORT_CONV,
        ),
        "per-layer-heads": lambda: UniformTypeKVCacheSpecs(
            block_size=32, kv_cache_specs={
                "a": FullAttentionSpec(block_size=32, **page),
                "b": FullAttentionSpec(block_size=32, **{**page, "head_size": 64}),
            },
        ),
        "state-beside-attention": lambda: UniformTypeKVCacheSpecs(
            block_size=32, kv_cache_specs={
                "a": FullAttentionSpec(block_size=32, **page),
                "b": MambaSpec(
                    block_size=32, shapes=((4, 64), (8, 16)), dtypes=(torch.bfloat16,) * 2,
                ),
            },
        ),
        "gdn": lambda: MambaSpec(
            block_size=32, shapes=((48, 4), (2, 8, 8)), dtypes=(torch.bfloat16, torch.float32),
            mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        ),
        "gdn-wide": lambda: MambaSpec(
            block_size=32, shapes=((96, 4), (4, 8, 8)), dtypes=(torch.bfloat16, torch.float32),
            mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        ),
        "mamba-3-states": lambda: MambaSpec(
            block_size=32, shapes=((4, 64), (8, 16), (2,)), dtypes=(torch.bfloat16,) * 3,
            page_size_padded=131072,
        ),
    }  # fmt: skip
    return specs[kind]()


REFUSED = {
    "mamba-unpadded": (["full", "mamba-unpadded"], "group 1's state pages are 768 bytes"),
    "mamba-replicated": (["full", "mamba-replicated"], "group 1 is a TP-replicated MambaSpec"),
    "mamba-3-states": (["full", "mamba-3-states"], "group 1's MambaSpec has 3 state arrays"),
    "deepseek-v4-beside-a-window": (
        ["full", "v4-window", "window"],
        r"\(DeepSeek-V4's caches\) beside SlidingWindowSpec",
    ),
    "mla-windows-only": (["mla-window"], "no KV-cache group is full attention"),
    "unequal-pages": (["full", "full-64"], "KV-cache group 1's pages"),
    "per-layer-heads": (["per-layer-heads"], "holds layers of several page shapes"),
    "windows-only": (["window"], "no KV-cache group is full attention"),
    "chunks-only": (["chunked", "window"], "no KV-cache group is full attention"),
    "ring-of-another-page": (["full", "ring-8"], r"KV-cache group 1's pages \(block size 8"),
    "ring-of-keys-alone": (["full", "ring-keys"], "8 heads of 128, 65536 bytes"),
    "static-sinks": (["full", "static-sinks"], "KV-cache group 1 is SinkFullAttentionSpec"),
    "states-only": (["mamba"], "no KV-cache group is full attention"),
    "mamba-state-first": (["full", "mamba"], "set VLLM_SSM_CONV_STATE_LAYOUT=DS on every"),
    # Qwen4Exp's states in rows (beside compressed keys) move whole; stored state-first on
    # one engine and dim-first on the other they would move transposed
    "rows-state-first": (
        ["v4-compressed", "full", "mamba"],
        "set VLLM_SSM_CONV_STATE_LAYOUT=DS on every",
    ),
    "rows-state-beside-attention": (
        ["v4-compressed", "state-beside-attention"],
        "holds MambaSpec layers beside others",
    ),
    "mamba-short-conv": (["full", "mamba-short-conv"], "is a SHORT_CONV MambaSpec"),
    # HiSparse's host pool (vLLM runs it on CUDA only): refused by name, not by its views
    "host-resident": (["full", "mla@host"], "group 1 is host-resident"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_groups_kvwire_cannot_move_are_refused_by_name(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What kvwire does not move yet fails the engine's startup (either role runs this
    check when vLLM builds the connector), naming the group and why, so no request is ever
    reported done without a group's KV."""
    from vllm.model_executor.layers.mamba import mamba_utils
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from kvwire.errors import ConfigError
    from kvwire.integrations.vllm.groups import group_kinds

    def conv_layout(layout: str) -> None:
        monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", layout)
        mamba_utils.get_conv_state_layout.cache_clear()  # vLLM reads it once per process

    kinds, message = REFUSED[case]
    conv_layout("SD" if case.endswith("state-first") else "DS")
    try:
        groups = [
            KVCacheGroupSpec(
                [f"layer{i}"], _spec(kind.removesuffix("@host")), host_resident="@" in kind
            )
            for i, kind in enumerate(kinds)
        ]
        config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
        with pytest.raises(ConfigError, match=message):
            group_kinds(config, 32)
        conv_layout("DS")
        moved = ("full", "window", "chunked", "rswa", "ring", "mamba")
        accepted = [KVCacheGroupSpec([k], _spec(k)) for k in moved]
        ok = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=accepted)
        assert [k.value for k in group_kinds(ok, 32)] == ["attention"] * 4 + ["ring", "ssm"]
    finally:
        monkeypatch.undo()
        mamba_utils.get_conv_state_layout.cache_clear()


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_vllm_cannot_schedule_static_sinks(caching: bool) -> None:
    """Why kvwire may refuse static sinks (openpangu's ``SinkFullAttentionSpec``) while
    claiming every model stock serves: vLLM's own KV-cache manager, which its scheduler
    builds at startup, cannot be made for such a group in these releases (its manager's
    constructor lacks an argument vLLM passes every manager), so no engine of this vLLM
    serves one, with either connector. Should a release mend it, this fails, and kvwire's
    refusal (``static-sinks`` above) is to be replaced by moving them."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec(["layer0", "layer1"], _spec("static-sinks"))]
    config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)
    with pytest.raises(TypeError, match="needs_kv_cache_zeroing"):
        KVCacheManager(
            config,
            max_model_len=1024,
            scheduler_block_size=32,
            hash_block_size=32,
            enable_caching=caching,
        )
    dense = [KVCacheGroupSpec(["layer0", "layer1"], _spec("full"))]
    KVCacheManager(  # the same call for full attention starts
        KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=dense),
        max_model_len=1024,
        scheduler_block_size=32,
        hash_block_size=32,
        enable_caching=caching,
    )
