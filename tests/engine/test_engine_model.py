"""The reference engine on its own: deterministic, TP/layout-invariant, and right.

"Right" is checked against a textbook dense forward pass (no cache, no paging, whole
sequence at once); "invariant" is bit-for-bit, because disaggregated serving is only
token-identical if the engine's arithmetic does not depend on how it was sharded or chunked.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvwire.errors import ConfigError  # noqa: E402
from kvwire.examples.engine import (  # noqa: E402
    BlockAllocator,
    CacheConfig,
    Engine,
    ModelConfig,
    OutOfBlocksError,
    cached_heads,
)
from kvwire.examples.engine.reference import reference_generate, reference_logits  # noqa: E402
from kvwire.layout.geometry import rank_heads  # noqa: E402

DENSE = ModelConfig()
MLA = ModelConfig(mla=True, seed=1)
PROMPT = [(7 * i + 3) % 256 for i in range(37)]  # not a multiple of the block size


def engine_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """Per-position logits of the paged engine over ``prompt``."""
    seq = engine.admit("probe", prompt)
    rows = []
    for position in range(len(prompt)):
        rows.append(engine.forward_token(prompt[position], position, seq.block_ids))
    engine.release("probe")
    return torch.stack(rows)


@pytest.mark.parametrize("model", [DENSE, MLA], ids=["gqa", "mla"])
def test_matches_dense_reference(model: ModelConfig) -> None:
    engine = Engine(model, CacheConfig(tp_size=2, layout="NHD", block_size=8))
    got = engine_logits(engine, PROMPT)
    want = reference_logits(model, engine.weights, PROMPT)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert engine.generate(PROMPT, 32) == reference_generate(model, engine.weights, PROMPT, 32)


@pytest.mark.parametrize("model", [DENSE, MLA], ids=["gqa", "mla"])
def test_bit_identical_across_tp_layout_and_split(model: ModelConfig) -> None:
    caches = [
        CacheConfig(tp_size=1, layout="HND"),
        CacheConfig(tp_size=2, layout="NHD", block_size=8),
        CacheConfig(tp_size=4, layout="HND", block_size=4),
        CacheConfig(tp_size=8, layout="NHD", kv_split=not model.mla),
    ]
    outputs = [engine_logits(Engine(model, cache), PROMPT) for cache in caches]
    for other in outputs[1:]:
        assert torch.equal(other, outputs[0])


def test_deterministic_and_chunked_prefill_is_identical() -> None:
    cache = CacheConfig(tp_size=2, block_size=8, prefix_caching=False)
    first = Engine(DENSE, cache).generate(PROMPT, 32)
    assert Engine(DENSE, cache).generate(PROMPT, 32) == first
    engine = Engine(DENSE, cache)
    engine.admit("r", PROMPT)
    steps = 0
    while engine.step("r", max_tokens=5) is None:
        steps += 1
    assert steps == len(PROMPT) // 5  # the prompt really was computed in several chunks
    out = [engine.requests["r"].tokens[-1]]
    out += [engine.step("r") for _ in range(31)]  # type: ignore[misc]
    assert out == first


def test_prefix_reuse_hits_and_keeps_output() -> None:
    engine = Engine(DENSE, CacheConfig(block_size=8, num_blocks=32))
    fresh = Engine(DENSE, CacheConfig(block_size=8, num_blocks=32))
    engine.generate(PROMPT, 4)
    other = [*PROMPT[:24], 1, 2, 3, 4, 5]
    seq = engine.admit("second", other)
    assert seq.num_cached == 24  # three full 8-token blocks reused
    engine.release("second")
    assert engine.generate(other, 32) == fresh.generate(other, 32)
    # a block-aligned prompt that is fully cached still recomputes its last token
    aligned = PROMPT[:32]
    engine.generate(aligned, 1)
    assert engine.admit("aligned", aligned).num_cached == 24


def test_allocator_free_list_and_eviction() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    a = alloc.admit("a", [1, 2, 3, 4, 5])
    assert len(a.block_ids) == 3 and alloc.num_free == 1
    with pytest.raises(OutOfBlocksError):
        alloc.admit("b", [9, 9, 9])
    a.num_computed = 5
    alloc.publish(a)
    a_blocks = list(a.block_ids)
    alloc.release(a)
    assert alloc.num_free == 4
    b = alloc.admit("b", [1, 2, 3, 4, 7])
    assert b.num_cached == 4 and b.block_ids[:2] == a_blocks[:2]
    alloc.release(b)
    # handing every block out again evicts the cached prefix
    c = alloc.admit("c", [5, 5, 5, 5, 5, 5, 5, 5])
    alloc.release(c)
    assert alloc.admit("d", [1, 2, 3, 4, 7]).num_cached == 0


def test_engine_heads_agree_with_kvwire_convention() -> None:
    for kv_heads, q_heads in ((2, 8), (4, 8), (1, 4), (8, 8)):
        model = ModelConfig(kv_heads=kv_heads, q_heads=q_heads)
        for tp in (1, 2, 4, 8):
            if q_heads % tp or max(tp, kv_heads) % min(tp, kv_heads):
                continue
            for rank in range(tp):
                assert list(cached_heads(model, rank, tp)) == list(rank_heads(rank, tp, kv_heads))


def test_bad_input_is_a_config_error() -> None:
    engine = Engine(DENSE, CacheConfig(num_blocks=2, block_size=4))
    with pytest.raises(ConfigError):
        engine.admit("x", [])
    with pytest.raises(ConfigError):
        engine.admit("x", [300])
    with pytest.raises(OutOfBlocksError):
        engine.admit("x", list(range(20)))
    with pytest.raises(ConfigError):
        CacheConfig(tp_size=3).check_model(DENSE)


def test_kvwire_and_its_cli_do_not_import_the_engine() -> None:
    import subprocess
    import sys

    code = (
        "import sys, kvwire, kvwire.cli, kvwire.commands.demo; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('kvwire.examples')]; "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
