"""Hypothesis strategies over the fuzz corpus and mutations.

Hypothesis records every choice the mutators make, so a failure shrinks to the fewest and
smallest mutations of the smallest seed that still break a decoder.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from kvwire_fuzz.corpus import all_seeds, seeds
from kvwire_fuzz.mutate import mutate
from kvwire_fuzz.targets import PARAM_KEYS


class DrawChooser:
    """A :class:`kvwire_fuzz.mutate.Chooser` that draws from Hypothesis."""

    def __init__(self, draw: st.DrawFn) -> None:
        self._draw = draw

    def integer(self, low: int, high: int) -> int:
        return self._draw(st.integers(low, high))


@st.composite
def mutated(draw: st.DrawFn, family: str | None = None) -> bytes:
    """A valid seed (of ``family``, or any) after 1-4 mutations."""
    pool = seeds()[family] if family is not None else all_seeds()
    seed = draw(st.sampled_from(pool))
    return mutate(seed, pool, DrawChooser(draw))


# JSON-like values, including the shapes a schema never expects: deep lists, big ints,
# floats that are not numbers, and keys that are not strings.
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
json_like = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=4)
    ),
    max_leaves=20,
)


@st.composite
def params_mappings(draw: st.DrawFn) -> dict[Any, Any]:
    """A dict for ``parse_kv_transfer_params``: real keys with arbitrary values, some junk."""
    keys = draw(st.lists(st.sampled_from(PARAM_KEYS), max_size=6, unique=True))
    out: dict[Any, Any] = {key: draw(json_like) for key in keys}
    if draw(st.booleans()):
        out[draw(st.text(max_size=8) | st.integers())] = draw(json_like)
    return out
