"""Speculative decoding in running engines: both engines run a drafter (vLLM's
``SpeculativeConfig``, its lookahead and block-drop rules vLLM's own), its KV layer beside
the target's.

An EAGLE-family drafter reads the target's hidden states, so both kinds of engine hash it
(a pair with another drafter, or none, on one side is refused by the hash). Its attention
layer has the target's page, so vLLM puts it in the target's group, and its KV moves with
the prompt's. A multi-module MTP drafter reads ``k`` tokens ahead during prefill: P leaves
``k - 1`` prompt tokens to D, which with a Mamba model's own rule (D computes the last
token) makes P stop ``max(1, k - 1)`` tokens short.
"""

from __future__ import annotations

import pytest
from harness import Geometry, SchedulerEngine, Zygote, assert_moved, engines, prefill, step_both

from kvwire.demo.models import preset

TOKENS = 100
PAIRS = {
    "kvwire-nixl": ("KVWireConnector", "KVWireConnector"),
    "stock-P-kvwire-D": ("NixlConnector", "KVWireConnector"),
    "kvwire-P-stock-D": ("KVWireConnector", "NixlConnector"),
}
EAGLE_GEO = Geometry(layers=3)
"""Two target layers and the drafter's."""


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_an_eagle_drafters_kv_moves_with_the_prompt(zygote: Zygote, pair: str, mode: str) -> None:
    """Both engines draft with EAGLE: they accept each other's hash, and D holds every
    prompt token's KV in every layer, the drafter's included."""
    p_conn, d_conn = PAIRS[pair]
    with engines(
        zygote, p_conn, d_conn, geo=EAGLE_GEO, extra_config={"transport": "nixl"}, mode=mode,
        drafter="eagle:1",
    ) as (p, d):  # fmt: skip
        checked = assert_moved(p, d, "req-e", 51, TOKENS)
    model = preset(EAGLE_GEO.model)
    assert checked == TOKENS * EAGLE_GEO.layers * model.kv_heads * model.content_bytes


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_a_drafter_on_one_side_is_refused_by_the_hash(zygote: Zygote, pair: str) -> None:
    """P drafts and D does not: D's handshake fails on the compatibility hash, names it,
    and D reads nothing (vLLM's engines refuse each other the same way)."""
    p_conn, d_conn = PAIRS[pair]
    with engines(
        zygote, p_conn, d_conn, {"drafter": "eagle:1"}, {}, geo=EAGLE_GEO,
        extra_config={"transport": "nixl"},
    ) as (p, d):  # fmt: skip
        params = prefill(p, "req-x", 53, TOKENS)
        d.add("req-x", 53, TOKENS, params)
        step_both(p, d, lambda: "req-x" in d.state.get("outputs", {}), "D to give up on req-x")
        assert "req-x" not in d.state.get("checked", {}), d.state["checked"]
        log = " ".join(d.state.get("log", []) + d.peer.log)
        # A stock D logs the handshake it failed; a kvwire D names the factor (a stock P
        # sends only its hash).
        named = {
            "kvwire-nixl": "speculative_config",
            "stock-P-kvwire-D": "compatibility hash mismatch",
            "kvwire-P-stock-D": "handshake_failed",
        }[pair]
        assert named in log, log[-2000:]


MTP = "mtp:3"
"""Three speculative tokens from three MTP modules: vLLM's prefill lookahead is 3."""


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_an_mtp_drafter_beside_mamba_state(zygote: Zygote, pair: str, mode: str) -> None:
    """A hybrid Mamba model with a multi-module MTP drafter: P computes all but the
    prompt's last two tokens (the drafter's lookahead), the Mamba group's speculative
    scratch slots stay behind, and D holds every loaded token's KV and the state after
    them."""
    p_conn, d_conn = PAIRS[pair]
    sides = []
    try:
        for role, connector in zip("PD", (p_conn, d_conn), strict=True):
            sides.append(
                SchedulerEngine(
                    role, connector, zygote, geo=Geometry(layers=9), mode=mode,
                    hma=True, mamba=3, drafter=MTP, extra_config={"transport": "nixl"},
                )
            )  # fmt: skip
        p, d = sides
        params = prefill(p, "req-t", 57, 300)
        assert params["remote_num_tokens"] == 298, params
        # The attention group's blocks, then each Mamba group's running state alone.
        assert [len(g) for g in params["remote_block_ids"]] == [10, 1, 1], params
        d.add("req-t", 57, 300, params)
        step_both(p, d, lambda: "req-t" in d.state.get("checked", {}), "D to check req-t")
        wrong, checked = d.state["checked"]["req-t"]
        assert checked > 0 and wrong == 0, (wrong, checked)
    finally:
        for engine in reversed(sides):
            engine.close()


MLA_MTP_GEO = Geometry(model="mla", layers=3)
"""Two MLA target layers and the MTP module's (DeepSeek-V3's one-module MTP)."""


INDEXER = 132
"""Bytes a token of DeepSeek-V3.2's indexer keys (interop/vllm_engine.py's INDEXER_BYTES)."""


@pytest.mark.parametrize("indexer", [False, True], ids=["mla", "sparse"])
@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_an_mtp_drafter_of_an_mla_model(
    zygote: Zygote, pair: str, mode: str, indexer: bool
) -> None:
    """DeepSeek-V3's (and V3.2's, with its indexer) speculative decoding: an MLA model with
    its one-module MTP drafter on both engines, whose latent vLLM groups with the
    target's. P computes the whole prompt (one module reads no token ahead), and D holds
    every prompt token's latent (and indexer keys) in every layer, the drafter's
    included."""
    p_conn, d_conn = PAIRS[pair]
    with engines(
        zygote, p_conn, d_conn, geo=MLA_MTP_GEO, extra_config={"transport": "nixl"}, mode=mode,
        drafter="mtp:1", indexer=indexer,
    ) as (p, d):  # fmt: skip
        checked = assert_moved(p, d, "req-d", 59, TOKENS)
    latent = preset(MLA_MTP_GEO.model).latent_dim * 2 + (INDEXER if indexer else 0)
    assert checked == TOKENS * MLA_MTP_GEO.layers * latent
