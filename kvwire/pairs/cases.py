"""The pairs a property test draws: every axis kvwire's planner and machines handle.

Hypothesis strategies (Hypothesis is a test dependency; :mod:`kvwire.pairs` imports this
module only when asked to draw). Both the planner's oracle test and the runtime's
process-level test draw from here, so a new axis is exercised at both levels at once.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from kvwire.pairs.oracle import Case, Side

LAYOUTS = ("HND", "NHD")
FORMS = ("lists",) * 9 + ("flat", "float", "str")
"""Mostly right, so most drawn pairs move bytes; a quarter are an engine's mistake."""


@st.composite
def sides(draw: st.DrawFn, tp: tuple[int, ...] = (1, 2, 4, 8)) -> Side:
    block = draw(st.sampled_from([4, 8, 16, 32]))
    ppl = draw(st.sampled_from([p for p in (1, 2, 4) if block // p >= 2]))
    return Side(
        draw(st.sampled_from(tp)),
        draw(st.sampled_from(LAYOUTS)),
        block,
        ppl,
        draw(st.sampled_from([0, 8])),
    )


@st.composite
def cases(
    draw: st.DrawFn,
    tp: tuple[int, ...] = (1, 2, 4, 8),
    max_tokens: int = 90,
    unsupported: bool = False,
    rings: bool = False,
) -> Case:
    """A pair and a request. With ``unsupported`` the producer may omit the token count
    (which kvwire needs when the consumer's blocks are smaller than the producer's), the
    engines may pass their block ids in a wrong form, and a producer that passes its count
    may have computed past the consumer's prompt (generating more than one token). With
    ``rings`` group 1 is always a ring with layers, its prompt mostly past the ring's
    capacity (every slot rewritten)."""
    p, d = draw(sides(tp)), draw(sides(tp))
    tokens = draw(st.integers(1, max_tokens))
    mla = draw(st.booleans())
    packed = "" if rings else draw(st.sampled_from(["", "", "p", "d"]))
    groups = 1 if packed else 2
    ring = rings or (not packed and draw(st.integers(0, 5)) == 0)
    if rings and tokens <= p.block and tokens % 4:
        tokens += p.block
    if ring:  # group 1 a ring: its capacity is the model's, one block size, never split
        p, d = replace(p, ppl=1), replace(d, block=p.block, ppl=1)
    d_total = -(-tokens // d.block)
    pass_tokens = not unsupported or draw(st.sampled_from([True, True, True, False]))
    past = draw(st.sampled_from([0, 0, 0, 3, 17, 30])) if unsupported and pass_tokens else 0
    return Case(
        p,
        d,
        heads=draw(st.sampled_from([1, 2, 4, 8])),
        layers=draw(st.integers(groups, 3)),
        kv_split=not mla and draw(st.booleans()),
        mla=mla,
        groups=groups,
        tokens=tokens,
        hits=draw(st.integers(0, d_total - 1)),
        window=draw(st.sampled_from([0, 0, 5, 24])),
        coalesce=draw(st.booleans()),
        contiguous=draw(st.booleans()),
        pass_tokens=pass_tokens,
        past=past,
        mode=draw(st.sampled_from(["pull", "push"])),
        members=bool(packed) or draw(st.booleans()),
        packed=packed,
        ids_form=draw(st.sampled_from(FORMS)) if unsupported else "lists",
        ring=ring,
    )
