"""The key adapters file prepared transfers under: only exact, already-shaped int64 pairs."""

from __future__ import annotations

import numpy as np

from kvwire.transport import KEYED_ROWS, descs_key


def test_key_is_the_exact_bytes_of_small_int64_pairs() -> None:
    small = np.arange(12, dtype=np.int64).reshape(4, 3)
    assert descs_key(small, small) == (small.tobytes(), small.tobytes())
    # A copy or an equal view gives the same key; other content gives another.
    assert descs_key(small.copy(), small[:, :]) == descs_key(small, small)
    assert descs_key(small + 1, small) != descs_key(small, small)


def test_anything_else_takes_the_validating_path() -> None:
    small = np.zeros((4, 3), dtype=np.int64)
    assert descs_key(small.astype(np.int32), small) is None
    assert descs_key(small.reshape(-1), small.reshape(-1)) is None
    assert descs_key(small, small[:2]) is None
    assert descs_key(small.tolist(), small) is None
    big = np.zeros((KEYED_ROWS + 1, 3), dtype=np.int64)
    assert descs_key(big, big) is None
    assert descs_key(big[:KEYED_ROWS], big[:KEYED_ROWS]) is not None
