"""How many kernel blocks each of vLLM's blocks is, read from the layers' views: one
whole number for every layer, or a ConfigError naming the cause (the engine then fails at
startup instead of registering regions a peer would misplan)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.errors import ConfigError
from kvwire.integrations.vllm.geometry import kernel_ratio


@settings(max_examples=300, deadline=None)
@given(
    num_blocks=st.integers(1, 16),
    views=st.lists(
        st.tuples(st.integers(0, 96), st.sampled_from([2, 3, 4]), st.booleans(), st.booleans()),
        min_size=1,
        max_size=4,
    ),
)
def test_one_whole_split_or_a_named_refusal(
    num_blocks: int, views: list[tuple[int, int, bool, bool]]
) -> None:
    """Each view: (blocks first, values a block, whether its blocks are one run, whether
    it is a pooled layer's). A pooled layer's view of vLLM's own blocks, each one run
    (vLLM 0.31.0's Glm5Next indexer keys), splits into the others' kernel blocks where its
    block divides into them; any other view must be split alike."""
    made = {}
    for i, (n, page, run, _) in enumerate(views):
        full = torch.empty((n, page + (0 if run else 1)), dtype=torch.uint8)
        made[f"layer{i}"] = full if run else full[:, :page]
    pooled = frozenset(f"layer{i}" for i, view in enumerate(views) if view[3])
    counts = [n for n, _, _, _ in views]

    def splits(n: int, run: bool, is_pooled: bool) -> bool:
        return n == num_blocks and (run or n == 1) and is_pooled

    split = {
        n // num_blocks for n, _, run, p in views
        if n and not n % num_blocks and not splits(n, run, p)
    }  # fmt: skip
    ratio = next(iter(split), 1)
    whole = [page for n, page, run, p in views if splits(n, run, p)]
    if any(n == 0 or n % num_blocks for n in counts):
        with pytest.raises(ConfigError, match="whole number of kernel blocks per block"):
            kernel_ratio(made, num_blocks, pooled)
    elif len(split) > 1:
        with pytest.raises(ConfigError, match="different numbers of kernel blocks"):
            kernel_ratio(made, num_blocks, pooled)
    elif any(page % ratio for page in whole):
        with pytest.raises(ConfigError, match="do not split into"):
            kernel_ratio(made, num_blocks, pooled)
    else:
        assert kernel_ratio(made, num_blocks, pooled) == ratio


def test_a_view_without_a_block_axis_is_refused() -> None:
    with pytest.raises(ConfigError, match="layer flat"):
        kernel_ratio({"flat": torch.empty(32, dtype=torch.uint8)}, 16)
