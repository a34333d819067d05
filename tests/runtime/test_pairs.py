"""Every P/D pair kvwire accepts moves exactly the request's bytes, end to end.

Hypothesis draws a pair (block sizes either way and equal, kernel blocks, TP pairs, both
layouts, MLA, two KV-cache groups with a sliding-window tail or a ring, packed rows,
prefix hits on D, prompts ending mid-block, pull and push, and engine mistakes) and runs
it through real ``Producer`` / ``Consumer`` runtimes in two processes over shared memory. The oracle
(:mod:`kvwire.pairs.oracle`) checks every (layer, token, head, channel) D must hold, that
nothing else of D's was written and that P's KV was only read. A pair kvwire does not
support, or an argument it cannot honour, must end refused with a cause, never done.

The second half plants back the bugs this test was written to find (the consumer trimming
P's list by block count; block ids accepted flat, as floats or as strings) and shows the
same search finds each of them. ``kvwire pairs --seconds N`` runs the search for longer.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from kvwire.pairs.cases import cases
from kvwire.pairs.oracle import Case, Side
from kvwire.pairs.run import PairRunner

pytestmark = pytest.mark.slow

EXAMPLES = 120


@pytest.fixture(scope="module")
def runner() -> Iterator[PairRunner]:
    with PairRunner() as pair_runner:
        yield pair_runner


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(case=cases(tp=(1, 2, 4), unsupported=True))
def test_every_pair_ends_with_its_own_bytes_or_a_named_refusal(
    runner: PairRunner, case: Case
) -> None:
    verdict = runner.run(case)
    assert verdict.ok, str(verdict)


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(case=cases(tp=(1, 2, 4), unsupported=True, rings=True))
def test_every_pair_with_a_ring_ends_with_its_own_bytes_or_a_named_refusal(
    runner: PairRunner, case: Case
) -> None:
    """Group 1 a ring (vLLM's ``CircularBufferSpec``), its prompt mostly past the ring's
    capacity: moved whole and sliced as its region's pages, or refused where the
    producer's ring is another count's."""
    verdict = runner.run(case)
    assert verdict.ok, str(verdict)


def test_the_issue_cases_end_done_with_the_right_bytes(runner: PairRunner) -> None:
    """The reports that started this test: P with 16-token blocks, D with 32 (64 and 40
    tokens), pull and push."""
    for mode in ("pull", "push"):
        for tokens in (64, 40):
            verdict = runner.run(
                Case(Side(1, "HND", 16), Side(1, "HND", 32), tokens=tokens, mode=mode)
            )
            assert verdict.kind == "done", str(verdict)


@pytest.mark.parametrize(
    ("plant", "case"),
    [
        ("trim-by-count", Case(Side(1, "HND", 16), Side(1, "HND", 32), tokens=64)),
        ("trim-by-count", Case(Side(1, "HND", 16), Side(1, "HND", 32), tokens=64, mode="push")),
        ("lenient-ids", Case(Side(), Side(), tokens=64, ids_form="flat", pass_tokens=False)),
        ("lenient-ids", Case(Side(), Side(), tokens=40, ids_form="float")),
        ("lenient-ids", Case(Side(), Side(), tokens=40, ids_form="str")),
    ],
    ids=["trim-pull", "trim-push", "flat", "float", "str"],
)
def test_each_planted_bug_is_a_violation(plant: str, case: Case) -> None:
    # A planted run may hang until the wait ends: that is a violation too, found sooner.
    with PairRunner(wait_s=5, plant=plant) as planted:
        assert not planted.run(case).ok
    with PairRunner() as fixed:
        assert fixed.run(case).ok


@pytest.mark.parametrize("plant", ["trim-by-count", "lenient-ids"])
def test_the_random_search_finds_each_planted_bug(plant: str) -> None:
    """Not the hand-picked cases above: the same strategy the property test draws from,
    searching until it meets a violation (a bounded number of examples)."""
    found: list[str] = []
    with PairRunner(wait_s=5, plant=plant) as planted:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            phases=(Phase.generate,),  # the first violation is the answer; no shrinking
        )
        @given(case=cases(tp=(1, 2, 4), unsupported=True))
        def search(case: Case) -> None:
            verdict = planted.run(case)
            if not verdict.ok:
                found.append(str(verdict))
            assert verdict.ok

        with pytest.raises(AssertionError):
            search()
    assert found, f"{plant}: no violation in {EXAMPLES} examples"
