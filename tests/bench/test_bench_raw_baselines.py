"""How ``kvwire bench transport`` finds a transport's raw-library baseline: kvwire's own
(nixl, ucx) are bench modules named in ``RAW_BASELINES``, imported only when that bench
asks for them; any other transport's module comes through the ``kvwire.rawbench``
entry-point group."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest

from kvwire.bench import transport as bench

PROBE = """
import json, sys
import kvwire.bench, kvwire.bench.transport
print(json.dumps(sorted(sys.modules)))
"""


def test_the_bench_imports_no_baseline_adapter_or_raw_library_until_asked() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = json.loads(result.stdout)
    assert "kvwire.bench.transport" in loaded  # the probe really ran
    heavy = {"torch", "nixl", "nixl_cu12", "libucx", "kvwire_nixl", "kvwire_ucx"}
    assert [name for name in loaded if name.split(".")[0] in heavy] == []
    assert set(bench.RAW_BASELINES.values()).isdisjoint(loaded)


def test_kvwire_own_baselines_are_bench_modules() -> None:
    nixl, ucx = bench._rawbench("nixl"), bench._rawbench("ucx")
    assert nixl.__name__ == "kvwire.bench.nixl_raw" and callable(nixl.paired_benchmark)
    assert ucx.__name__ == "kvwire.bench.ucx_raw"
    assert callable(ucx.same_memory_reader) and callable(ucx.raw_baseline)


def test_other_transports_are_found_through_the_entry_point_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A third-party transport's entry point is loaded; kvwire's own names never consult the
    group, so an older install's entry points (the modules once inside the adapters) are
    not loaded."""
    asked: list[tuple[str, str]] = []

    def entry_points(*, group: str, name: str) -> importlib.metadata.EntryPoints:
        asked.append((group, name))
        if name == "shm":
            return importlib.metadata.EntryPoints(())
        target = "json" if name == "mine" else "kvwire_nixl.rawbench"
        return importlib.metadata.EntryPoints([importlib.metadata.EntryPoint(name, target, group)])

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    assert bench._rawbench("mine") is json
    assert bench._rawbench("shm") is None
    assert bench._rawbench("nixl").__name__ == "kvwire.bench.nixl_raw"
    assert asked == [("kvwire.rawbench", "mine"), ("kvwire.rawbench", "shm")]
