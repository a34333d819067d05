"""``make test`` runs the unit suite in two halves (the Makefile's ``UNIT_A`` and
``UNIT_B``): a test directory in neither would never run in CI, one in both would run
twice, side by side with itself."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _half(makefile: str, name: str) -> list[str]:
    found = re.search(rf"^{name} = ((?:.*\\\n)*.*)$", makefile, re.MULTILINE)
    assert found, f"the Makefile defines no {name}"
    return found.group(1).replace("\\\n", " ").split()


def test_the_halves_hold_every_test_directory_once() -> None:
    makefile = (ROOT / "Makefile").read_text()
    halves = _half(makefile, "UNIT_A") + _half(makefile, "UNIT_B")
    with_tests = sorted(
        f"tests/{d.name}"
        for d in (ROOT / "tests").iterdir()
        if d.is_dir() and any(d.rglob("test_*.py"))
    )
    assert sorted(halves) == with_tests
    assert not list((ROOT / "tests").glob("test_*.py")), (
        "a test file outside the halves' directories"
    )
