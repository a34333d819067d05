"""A prefill engine whose token count is not the prompt D loads, through vLLM's own
scheduler and KV cache manager on its defaults.

A P asked for more than one token (``max_tokens`` above 1) finishes past the prompt: its
``remote_num_tokens`` is what it computed and its block lists end there, a window's list
clipped at that end by vLLM. A D sent the original prompt loads only the prompt. Before
kvwire placed the two counts apart, a kvwire D placed P's lists at its own prompt's end:
every byte of a dense model landed one block off and the request still completed
(8,192,000 of 8,192,000 checked bytes wrong, from a stock P and a kvwire P alike).

Now, pulling, D places P's lists by P's count and its own by the prompt: a dense model's
prompt moves with every byte right, as does a chunked model's while P stays in D's last
chunk, and a window or chunk P no longer holds all of fails the request by name (D drops
the null blocks leading P's lists first: placed by P's count, one would pass for a block
P holds). Pushing, P places D's blocks by its own count (PUSH_REG carries no count), so D
refuses the request, naming both counts. A P that computed fewer tokens than D loads is
refused the same way. A stock D pulling from a P past the prompt reads
the end of P's lists into its blocks and completes, wrong (measured between two stock
engines); a kvwire P cannot see D's count, so that cell is stock's and not claimed.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import Geometry, Zygote, engines, step_both, wait_until

PROMPT = 250
"""D's prompt: 8 blocks of 32 tokens, its last partly filled."""
GENERATED = 12
"""P's ``max_tokens``: it computes 261 tokens, into a 9th block."""
WINDOW = 64
"""The sliding window of every other layer: P's list at 261 tokens starts after the
tokens D's window at 250 attends to."""
CHUNK = 64
"""Llama 4's attention chunks (three chunked layers, then a full one): D's next token
attends to tokens [192, 250) of the chunked layers, which P past 255 no longer holds."""
GEO = Geometry(layers=8, num_blocks=128)
"""Room for a 250-token prompt in four groups' blocks."""
PAIRS = {
    "kvwire-P-kvwire-D": "KVWireConnector",
    "stock-P-kvwire-D": "NixlConnector",
}
REFUSED_LEASE = 5
"""P's lease where D refuses the request: a stock P that pushed frees its blocks only when
the lease ends, so the refusal tests wait that long (30 s on the harness's default)."""


def _run(
    zygote: Zygote, p_connector: str, mode: str, max_tokens: int, sent: int | None = None,
    **model: Any,
) -> tuple[dict[str, Any], list[str]]:  # fmt: skip
    """P prefills with ``max_tokens``; D (kvwire) gets its params (their count replaced by
    ``sent``) with the original prompt. D's state once it is done, and its log."""
    with engines(
        zygote, p_connector, "KVWireConnector", geo=GEO, hma=True, mode=mode,
        extra_config={"transport": "nixl"}, **model,
    ) as (p, d):  # fmt: skip
        p.add("req", 5, PROMPT, {"do_remote_decode": True}, max_tokens=max_tokens)
        wait_until(lambda: "req" in p.state.get("outputs", {}), p.step, 30, "P to finish")
        params = dict(p.state["outputs"]["req"])
        assert params["remote_num_tokens"] == PROMPT + max_tokens - 1, params
        if sent is not None:
            params["remote_num_tokens"] = sent
        d.add("req", 5, PROMPT, params)
        step_both(
            p, d,
            lambda: "req" in d.state.get("outputs", {}) and "req" in p.state["sent"],
            "D to end the request and P to free its blocks",
        )  # fmt: skip
        return d.state, list(d.peer.log)


@pytest.mark.parametrize(
    ("model", "generated", "checked"),
    [
        # every prompt token of the eight layers
        ({}, GENERATED, PROMPT * 8 * GEO.token_bytes),
        # P at 255 tokens, still in D's last chunk: the two full layers' prompt, and the
        # six chunked layers' tokens of that chunk
        ({"chunk": CHUNK}, 6, (2 * PROMPT + 6 * (PROMPT - 192)) * GEO.token_bytes),
    ],
    ids=["dense", "chunked"],
)
@pytest.mark.parametrize("pair", list(PAIRS))
def test_a_pulling_d_loads_its_prompt_from_a_p_that_generated_past_it(
    zygote: Zygote, pair: str, model: dict[str, int], generated: int, checked: int
) -> None:
    state, _ = _run(zygote, PAIRS[pair], "pull", generated, **model)
    assert state["failed"] == []
    assert state["checked"]["req"] == [0, checked]


@pytest.mark.parametrize("generated", [GENERATED, 7])
@pytest.mark.parametrize("model", [{"window": WINDOW}, {"chunk": CHUNK}], ids=["window", "chunked"])
@pytest.mark.parametrize("pair", list(PAIRS))
def test_a_window_p_no_longer_holds_is_refused_by_name(
    zygote: Zygote, pair: str, model: dict[str, int], generated: int
) -> None:
    """At 261 tokens P's window list starts blocks after what D's attends to; at 256 its
    first block is vLLM's null block standing for the one D's window starts in (stock's
    lists keep such placeholders), which D must not take for P's KV. Past 255 tokens P's
    chunked lists hold the next chunk only, their earlier blocks null blocks."""
    state, log = _run(zygote, PAIRS[pair], "pull", generated, **model)
    assert state["failed"] == ["req"] and "req" not in state["checked"]
    computed = PROMPT + generated - 1
    assert any(
        f"the producer computed {computed} tokens and its list starts past tokens" in line
        for line in log
    ), log[-3:]


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize(
    ("mode", "max_tokens", "sent", "why"),
    [
        ("push", GENERATED, None, "P computed 261 of its tokens and this engine loads 250; "
         "a pushing P places them by its own count"),
        ("pull", 1, 200, "P computed 200 of its tokens and this engine loads 250; P lacks "
         "the rest"),
        ("push", 1, 200, "P computed 200 of its tokens and this engine loads 250; P lacks "
         "the rest"),
    ],
)  # fmt: skip
def test_counts_d_cannot_place_fail_the_request_by_name(
    zygote: Zygote, pair: str, mode: str, max_tokens: int, sent: int | None, why: str
) -> None:
    """D reads nothing, reports the request failed, and P frees its blocks."""
    state, log = _run(zygote, PAIRS[pair], mode, max_tokens, sent, lease=REFUSED_LEASE)
    assert state["failed"] == ["req"] and "req" not in state["checked"]
    assert any(why in line for line in log), log[-3:]
