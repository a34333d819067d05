"""kvwire's UCX copy coexists with the UCX that NIXL bundles, in one process, either order.

Both load UCX with ``RTLD_LOCAL`` and NIXL's copies carry hashed sonames, so the two never
share symbols; this runs real transfers through both to show it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("ucx_with_nixl.py")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("nixl_cu12") is None, reason="nixl extra not installed"
    ),
]


@pytest.mark.parametrize(
    ("order", "checks"),
    [
        ("nixl-first", ["nixl", "kvwire-ucx after-nixl"]),
        ("ucx-first", ["kvwire-ucx before-nixl", "nixl", "kvwire-ucx after-nixl"]),
    ],
)
def test_both_ucx_copies_move_data_in_one_process(order: str, checks: list[str]) -> None:
    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN"}
    out = subprocess.run(
        [sys.executable, str(SCRIPT), order], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.endswith(": ok")]
    assert lines == [f"{check}: ok" for check in checks]
