"""Fixtures of the interop suite: one preloaded vLLM fork server per vLLM version."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from harness import Zygote  # noqa: E402

ROOT = HERE.parent.parent
VENV_032 = ROOT / ".venv-vllm-0.32" / "bin" / "python"


@pytest.fixture(scope="session")
def zygote() -> Iterator[Zygote]:
    """vLLM 0.31.0 (this venv's), imported once."""
    z = Zygote(sys.executable)
    yield z
    z.close()


@pytest.fixture(scope="session")
def zygote_032() -> Iterator[Zygote]:
    """vLLM 0.32.0 (protocol v14) from .venv-vllm-0.32 (built by `make interop-venvs`)."""
    assert VENV_032.exists(), f"{VENV_032} missing: run `make interop-venvs`"
    z = Zygote(str(VENV_032))
    yield z
    z.close()


os.environ.setdefault("UCX_NET_DEVICES", "lo")
