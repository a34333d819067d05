"""Fixtures of the interop suite: one preloaded vLLM fork server per vLLM version."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from harness import VLLM_VERSION, Zygote  # noqa: E402

ROOT = HERE.parent.parent
VENVS = {"0.31.0": ROOT / ".venv-vllm", "0.32.0": ROOT / ".venv-vllm-0.32"}
"""The interop venvs (`make interop-venvs`): `make interop` runs this suite in each."""


@pytest.fixture(scope="session")
def zygote() -> Iterator[Zygote]:
    """The vLLM of this venv (the release the suite runs against), imported once."""
    z = Zygote(sys.executable)
    yield z
    z.close()


@pytest.fixture(scope="session")
def zygote_other() -> Iterator[Zygote]:
    """The other interop venv's vLLM, for the tests of engines of two releases."""
    (venv,) = (path for version, path in VENVS.items() if version != VLLM_VERSION)
    python = venv / "bin" / "python"
    assert python.exists(), f"{python} missing: run `make interop-venvs`"
    z = Zygote(str(python))
    yield z
    z.close()


os.environ.setdefault("UCX_NET_DEVICES", "lo")
# UCX's default way of installing its memory hooks ("bistro") rewrites eight functions'
# code, about 50 ms each on this 2-core machine: 0.43 s of every NIXL agent's creation,
# one agent per engine, most of an engine's start. "reloc" installs the same hooks through
# the relocation tables in 0.06 s; it cut this suite from 700 s to 509 s (vLLM 0.31.0,
# nothing else running). Every engine here loads NIXL's UCX alone; a process that also
# loads the libucx wheel's UCX aborts in reloc mode, so the unit suite keeps the default.
os.environ.setdefault("UCX_MEM_MMAP_HOOK_MODE", "reloc")
