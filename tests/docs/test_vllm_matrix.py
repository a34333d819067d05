"""Every test docs/vllm.md names as the proof of a matrix cell exists: a renamed or
deleted test would leave a cell claiming what nothing checks."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "vllm.md"
NODE = re.compile(r"`(interop/tests/[\w/]+\.py)::(\w+)`")


def _tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_every_proof_named_on_the_page_is_a_test() -> None:
    text = PAGE.read_text()
    matrix = text[text.index("## vLLM's compatibility matrix") :]
    named = NODE.findall(matrix)
    assert len(named) >= 12, "the matrix's proofs were not found"
    missing = [
        f"{path}::{name}"
        for path, name in named
        if not (ROOT / path).exists() or name not in _tests(ROOT / path)
    ]
    assert not missing, f"docs/vllm.md names tests that do not exist: {missing}"


def test_every_proof_key_in_the_table_is_listed() -> None:
    text = PAGE.read_text()
    matrix = text[text.index("## vLLM's compatibility matrix") :]
    table, proofs = matrix.split("Proofs:", 1)
    used = set(re.findall(r"\[([A-Z])\]", table))
    listed = set(re.findall(r"\*\*\[([A-Z])\]\*\*", proofs))
    assert used and used == listed, (sorted(used), sorted(listed))
