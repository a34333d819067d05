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


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(1, 16),
    counts=st.lists(st.integers(0, 96), min_size=1, max_size=4),
)
def test_one_whole_split_or_a_named_refusal(num_blocks: int, counts: list[int]) -> None:
    views = {f"layer{i}": torch.empty((n, 2), dtype=torch.uint8) for i, n in enumerate(counts)}
    if any(n == 0 or n % num_blocks for n in counts):
        with pytest.raises(ConfigError, match="whole number of kernel blocks per block"):
            kernel_ratio(views, num_blocks)
    elif len({n // num_blocks for n in counts}) > 1:
        with pytest.raises(ConfigError, match="different numbers of kernel blocks"):
            kernel_ratio(views, num_blocks)
    else:
        assert kernel_ratio(views, num_blocks) == counts[0] // num_blocks


def test_a_view_without_a_block_axis_is_refused() -> None:
    with pytest.raises(ConfigError, match="layer flat"):
        kernel_ratio({"flat": torch.empty(32, dtype=torch.uint8)}, 16)
