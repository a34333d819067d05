"""R-SWA (vLLM's ``RSWASpec``, the attention its ``deepseek_v2`` model makes for
Unlimited-OCR) through KVWireConnector on vLLM's defaults: every layer full attention
whose blocks between the prompt and the last ``rswa_window`` generated tokens vLLM frees
while decoding. When a prefill ends, nothing is freed yet: the group holds the whole
prompt, and stock exchanges its list whole, as a full-attention group's. Built from vLLM's
spec class, planned and allocated by vLLM's own code (its ``RSWAManager`` runs the group);
D checks every prompt token of every layer, and the test asserts how many bytes that is."""

from __future__ import annotations

from typing import Any

import pytest
from harness import (
    Geometry,
    Zygote,
    engines,
    pair_cases,
    pair_transfer,
    step_both,
    transfer_many,
    wait_until,
)

RSWA_WINDOW = 128
"""The decode window (vLLM's default for the model)."""
GEO = Geometry(layers=4)
REQUESTS = {"req-200": 200, "req-300": 300}
"""One content: the longer prompt hits the shorter's blocks in P's prefix cache."""
INDEX = 11
CASES = pair_cases()


@pytest.mark.parametrize(("pair", "tp", "mode"), CASES)
def test_rswa(zygote: Zygote, pair: str, tp: str, mode: str) -> None:
    """Every pair, TP size and mode: P's params carry the whole prompt's list, no null
    block in it, and D holds every prompt token of every layer, byte for byte, on every
    rank."""
    state, outputs = pair_transfer(
        zygote, pair, tp, mode, INDEX, REQUESTS, geo=GEO, rswa=RSWA_WINDOW
    )
    for rid, tokens in REQUESTS.items():
        (blocks,) = outputs[rid]["remote_block_ids"]
        assert len(blocks) == -(-tokens // GEO.block_size) and 0 not in blocks, rid
        assert state["checked"][rid] == [0, GEO.token_bytes * GEO.layers * tokens], rid


def _past_prompt(p: Any, max_tokens: int) -> dict[str, Any] | None:
    """P prefills a 250-token prompt with a 16-token decode window and decodes on to
    ``max_tokens``; its params (None: none offered)."""
    p.add("req", INDEX, 250, {"do_remote_decode": True}, max_tokens=max_tokens)
    wait_until(lambda: "req" in p.state.get("outputs", {}), p.step, 30, "P to finish")
    params: dict[str, Any] | None = p.state["outputs"]["req"]
    return params


@pytest.mark.parametrize("p_conn", ["KVWireConnector", "NixlConnector"])
def test_a_p_that_decoded_within_its_window_moves_the_prompt(zygote: Zygote, p_conn: str) -> None:
    """At 279 tokens vLLM has freed no whole block between the prompt's last block (tokens
    224-255) and the window (263 on): P's list is whole, and a D loading the 250-token
    prompt gets every byte of it."""
    with engines(
        zygote, p_conn, "KVWireConnector", geo=GEO, hma=True, rswa=16,
        extra_config={"transport": "nixl"},
    ) as (p, d):  # fmt: skip
        params = _past_prompt(p, 30)
        assert params is not None and 0 not in params["remote_block_ids"][0]
        d.add("req", INDEX, 250, params)
        step_both(p, d, lambda: "req" in d.state.get("outputs", {}), "D to load the prompt")
        assert d.state["checked"]["req"] == [0, GEO.token_bytes * GEO.layers * 250]


@pytest.mark.parametrize("max_tokens", [60, 100])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_p_that_decoded_past_its_window_offers_nothing(
    zygote: Zygote, mode: str, max_tokens: int
) -> None:
    """At 309 tokens vLLM has freed the block after the prompt's last one (the window
    starts at 293), at 349 two: its null block stands in the list once or twice (measured
    with two: the producer refused the list and the engine's step stopped; with one, a D
    whose prompt reached into the gap would read the null block as P's KV). P offers no
    KV, frees every block at once and keeps serving; a proxy's D computes the prompt."""
    with engines(
        zygote, "KVWireConnector", "KVWireConnector", geo=GEO, mode=mode, hma=True, rswa=16,
        extra_config={"transport": "nixl"},
    ) as (p, d):  # fmt: skip
        p.step()
        free = p.state["free_blocks"]
        assert _past_prompt(p, max_tokens) is None
        computed = 250 + max_tokens - 1
        assert any(
            f"KV of req not offered: vLLM freed R-SWA blocks inside its list ({computed} " in line
            for line in p.peer.log
        ), p.peer.log[-3:]
        assert p.state["free_blocks"] == free
        state = transfer_many(p, d, INDEX + 1, {"req-next": 200})  # and P keeps serving
        assert state["checked"]["req-next"][0] == 0
