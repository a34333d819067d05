"""Chunked local attention (Llama 4) through KVWireConnector on vLLM's defaults: three
layers of vLLM's ``ChunkedLocalAttentionSpec`` (a token attends only to the tokens of its
own 64-token chunk) then a full-attention one, grouped, planned and allocated by vLLM's own
code (on 0.31.0 and 0.32.0 the hybrid manager stays on for such a model). vLLM swaps a
chunked group's blocks before the last chunk for its null block, and stock exchanges the
list whole, null blocks and all. D checks, the moment its model would first read them,
every prompt token of the full-attention layers and every token of the chunk its next
token is in, each group with its own content, and the test asserts how many bytes that
is."""

from __future__ import annotations

import pytest
from harness import (
    PAIRS,
    Geometry,
    Zygote,
    engines,
    pair_cases,
    pair_transfer,
    registered_by_each,
    transfer_many,
)

CHUNK = 64
"""Tokens of an attention chunk: two 32-token blocks."""
GEO = Geometry(layers=8)
"""Layers 0-2 and 4-6 chunked, 3 and 7 full: vLLM makes three chunked groups and a full
one, two layers each, every group's layer ``j`` in slab ``j``."""
REQUESTS = {"req-200": 200, "req-300": 300}
"""Prompt lengths, one content (the longer hits the shorter's blocks in P's prefix cache):
200 tokens end inside a chunk's first block, 300 inside its second."""
BOUNDARY = {"req-256": 256}
"""A prompt ending on a chunk's boundary: D's next token starts a chunk and reads none of
the prompt's tokens in the chunked layers, and every chunked list is null blocks alone.
Where a stock engine plans the transfer (a stock D pulling, a stock P pushing) it fails
as between two stock engines (measured: a pulling stock D stops on an assertion in
``_read_blocks``, a pushing stock P never finishes the request), so it runs where kvwire
plans."""
INDEX = 9
CASES = pair_cases()


def checked_bytes(prompt: int) -> int:
    """What D must check of one prompt: every token in the full-attention layers, and in
    the chunked ones the tokens of the chunk the next token (position ``prompt``) is in."""
    per_token = GEO.token_bytes
    full = GEO.layers // 4
    in_chunk = prompt - prompt // CHUNK * CHUNK
    return per_token * (full * prompt + (GEO.layers - full) * in_chunk)


@pytest.mark.parametrize(("pair", "tp", "mode"), CASES)
def test_chunked_local_attention(zygote: Zygote, pair: str, tp: str, mode: str) -> None:
    """Every pair, TP size and mode: P's params carry each group's whole list (as stock's
    do: a chunked list leads with null blocks), and D holds, byte for byte, what its next
    token reads, on every rank; a prompt on a chunk's boundary too where kvwire plans."""
    p_conn, d_conn, _ = PAIRS[pair]
    planner = d_conn if mode == "pull" else p_conn
    prompts = {**REQUESTS, **BOUNDARY} if planner == "KVWireConnector" else REQUESTS
    state, outputs = pair_transfer(zygote, pair, tp, mode, INDEX, prompts, geo=GEO, chunk=CHUNK)
    for rid, tokens in prompts.items():
        lists = outputs[rid]["remote_block_ids"]
        blocks = -(-tokens // GEO.block_size)
        dropped = tokens // CHUNK * CHUNK // GEO.block_size  # the chunks before the last
        assert [len(g) for g in lists] == [blocks] * 4, rid
        assert [g[:dropped].count(0) for g in lists] == [dropped] * 3 + [0], rid
        assert state["checked"][rid] == [0, checked_bytes(tokens)], rid


def test_chunked_local_regions_are_what_stock_registers(zygote: Zygote) -> None:
    """Each slab holds one layer of every group: stock registers it once, shared (-1)."""
    stock, ours = registered_by_each(
        zygote, geo=GEO, extra_config={"transport": "nixl"}, hma=True, chunk=CHUNK
    )
    keys = ("regions", "names", "groups", "blocks")
    assert {k: ours[k] for k in keys} == {k: stock[k] for k in keys}
    assert ours["groups"] == [-1] * (GEO.layers // 4)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("pair", ["kvwire-nixl", "stock-P-kvwire-D", "kvwire-P-stock-D"])
def test_chunked_local_attention_with_chunked_prefill(zygote: Zygote, pair: str, mode: str) -> None:
    """P computes each prompt in steps of 48 tokens (steps and attention chunks ending apart,
    vLLM dropping a chunk's blocks as the next one is computed): D holds, byte for byte, what
    its next token reads."""
    p_conn, d_conn, transport = PAIRS[pair]
    with engines(
        zygote, p_conn, d_conn, {"scheduler": {"batch_tokens": 48}}, None, geo=GEO, mode=mode,
        hma=True, chunk=CHUNK, extra_config={"transport": transport},
    ) as (p, d):  # fmt: skip
        state = transfer_many(p, d, INDEX, REQUESTS)
    for rid, tokens in REQUESTS.items():
        assert state["checked"][rid] == [0, checked_bytes(tokens)], rid
