"""Prefill on one engine, copy its KV by hand along kvwire's plans, decode on another.

No transport and no runtime: this isolates kvwire's *meaning* of bytes. Token-identical
continuations across TP pairs, layouts, K/V splitting, prefix hits on the consumer and MLA
prove that descriptors, head slices and block ids mean the same thing on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

from kvwire.examples.engine import CacheConfig, Engine, ModelConfig  # noqa: E402
from kvwire.examples.engine.handcopy import hand_transfer  # noqa: E402

DENSE = ModelConfig()  # 8 query heads, 2 KV heads: TP 4 puts one KV head on two ranks
MLA = ModelConfig(mla=True, seed=1)
TOKENS = 32
PROMPTS = {
    "short": [(5 * i + 1) % 256 for i in range(11)],
    "aligned": [(3 * i + 7) % 256 for i in range(32)],
    "ragged": [(11 * i + 2) % 256 for i in range(45)],
}
_expected: dict[tuple[ModelConfig, str], list[int]] = {}


def monolithic(model: ModelConfig, prompt_name: str) -> list[int]:
    key = (model, prompt_name)
    if key not in _expected:
        engine = Engine(model, CacheConfig(tp_size=1, block_size=16))
        _expected[key] = engine.generate(PROMPTS[prompt_name], TOKENS)
    return _expected[key]


@dataclass(frozen=True)
class Pair:
    p_tp: int
    d_tp: int
    p_layout: str = "HND"
    d_layout: str = "HND"
    mode: str = "pull"
    split: bool = False
    p_block: int = 16
    d_block: int = 16
    mla: bool = False

    def __str__(self) -> str:
        bits = [f"{self.p_tp}{self.p_layout}->{self.d_tp}{self.d_layout}", self.mode]
        if self.split:
            bits.append("split")
        if self.p_block != self.d_block:
            bits.append(f"b{self.p_block}->{self.d_block}")
        if self.mla:
            bits.append("mla")
        return "-".join(bits)


PAIRS = [
    Pair(1, 1),
    Pair(2, 4),
    Pair(4, 2, "NHD", "NHD", mode="push"),
    Pair(2, 1, "NHD", "NHD"),
    Pair(1, 8, "HND", "NHD", mode="push"),
    Pair(8, 2, "NHD", "HND"),
    Pair(2, 4, split=True, mode="push"),
    Pair(4, 1, "NHD", "HND", split=True),
    Pair(2, 2, p_block=8, d_block=16),
    Pair(4, 2, mla=True),
    Pair(1, 4, "NHD", "NHD", mode="push", mla=True),
]


def run_pair(pair: Pair, prompt_name: str, *, warm_prefix: list[int] | None = None) -> list[int]:
    model = MLA if pair.mla else DENSE
    prompt = PROMPTS[prompt_name]
    p = Engine(
        model,
        CacheConfig(
            tp_size=pair.p_tp, layout=pair.p_layout, kv_split=pair.split, block_size=pair.p_block
        ),
    )
    d = Engine(
        model,
        CacheConfig(
            tp_size=pair.d_tp, layout=pair.d_layout, kv_split=pair.split, block_size=pair.d_block
        ),
    )
    if warm_prefix is not None:
        d.generate(warm_prefix, 2)
    p.admit("req", prompt)
    first = p.step("req")
    seq = d.admit("req", prompt)
    if warm_prefix is not None:
        assert seq.num_cached == len(warm_prefix) // pair.d_block * pair.d_block > 0
    moved = hand_transfer(p, "req", d, "req", mode=pair.mode)
    assert moved > 0
    out = [d.step("req") for _ in range(TOKENS)]
    assert out[0] == first
    return out  # type: ignore[return-value]


@pytest.mark.parametrize("pair", PAIRS, ids=str)
@pytest.mark.parametrize("prompt_name", ["short", "ragged"])
def test_handcopied_kv_continues_identically(pair: Pair, prompt_name: str) -> None:
    model = MLA if pair.mla else DENSE
    assert run_pair(pair, prompt_name) == monolithic(model, prompt_name)


@pytest.mark.parametrize("pair", [Pair(2, 4), Pair(4, 2, "NHD", "HND", mode="push")], ids=str)
def test_prefix_cached_on_consumer(pair: Pair) -> None:
    prompt = PROMPTS["ragged"]
    warm = prompt[:33]  # D computes two full blocks of this prefix itself
    out = run_pair(pair, "ragged", warm_prefix=warm)
    assert out == monolithic(DENSE, "ragged")


def test_block_aligned_prompt() -> None:
    assert run_pair(Pair(2, 1, "HND", "NHD"), "aligned") == monolithic(DENSE, "aligned")


def test_corrupted_block_changes_the_output() -> None:
    """The comparison can fail: one garbled block on D changes the continuation."""
    prompt = PROMPTS["ragged"]
    p = Engine(DENSE, CacheConfig(tp_size=2))
    d = Engine(DENSE, CacheConfig(tp_size=4, layout="NHD"))
    p.admit("req", prompt)
    p.step("req")
    d.admit("req", prompt)
    hand_transfer(p, "req", d, "req")
    block = d.blocks_to_receive("req")[1]
    workers = d.ranks.workers  # type: ignore[attr-defined]
    workers[0].kv.tensors[0][block].normal_(generator=torch.Generator().manual_seed(5))
    out = [d.step("req") for _ in range(TOKENS)]
    assert out != monolithic(DENSE, "ragged")
