"""Puts ``fuzz/`` on the import path: the fuzz targets, seeds and mutators live there so the
long-running harness and these bounded tests share one definition of what is fuzzed."""

from __future__ import annotations

import sys
from pathlib import Path

_FUZZ_DIR = str(Path(__file__).resolve().parents[2] / "fuzz")
if _FUZZ_DIR not in sys.path:
    sys.path.insert(0, _FUZZ_DIR)
