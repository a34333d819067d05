"""The conformance suite has teeth: it fails every deliberately broken variant.

Each variant of the library (:mod:`variant_library`: the shm variants and wrappers, and
the NIXL and UCX adapters' own) runs through ``kvwire conformance``
exactly as an adapter author would run it, restricted with ``-k`` to the test that must
catch it (the full suite for the unmodified adapters runs in test_shm_conformance.py and
the nixl/ucx test directories). Runs go six at a time: each is mostly waiting (on its
peer process, or for a notification or a resource count the broken variant never gives),
so six processes keep two cores busy: the shm library took 44 s this way against 105 s in
one process. The variants that wrap any adapter run over nixl and ucx as well, beside
those adapters' own variants. ``scripts/teeth_repeat.py`` runs chosen variants many times
in a row (the "caught on every run" evidence).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
DOC = HERE.parents[1] / "docs" / "writing-a-transport.md"
sys.path.insert(0, str(HERE))
from kvwire_broken_shm import Variant  # noqa: E402
from variant_library import VARIANTS  # noqa: E402
from variant_suites import class_name  # noqa: E402

PARALLEL = 6
HANG_TIMEOUT_S = 5.0


def _conformance(transport: str, *extra: str) -> tuple[int, dict[str, Any], float]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    env.setdefault("UCX_NET_DEVICES", "lo")
    cmd = [sys.executable, "-m", "kvwire.cli", "conformance", transport, "--json", *extra]
    start = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - start
    assert done.stdout.strip(), f"no report (status {done.returncode}): {done.stderr[-2000:]}"
    return done.returncode, json.loads(done.stdout), took


def _failed(report: dict[str, Any]) -> dict[str, str]:
    return {
        t["test"].split("::")[-1].split("[")[0]: t["detail"]
        for t in report["tests"]
        if t["outcome"] in ("failed", "error")
    }


def _run_library(variants: list[Variant], inner: str, tmp: Path) -> None:
    """Every variant's suite, its catching test only, in PARALLEL pytest processes."""
    caught = catches(variants, inner, tmp)
    escaped = [f"{v.name} over {inner}: {caught[v.name]}" for v in variants if caught[v.name]]
    assert not escaped, "the suite let these variants through:\n" + "\n".join(escaped)


def catches(variants: list[Variant], inner: str, tmp: Path) -> dict[str, str]:
    """One run of each variant's catching test over ``inner``: variant name -> "" where
    the test failed (caught), else what it did instead (scripts/teeth_repeat.py too)."""
    groups = [variants[i::PARALLEL] for i in range(PARALLEL)]
    with ThreadPoolExecutor(PARALLEL) as pool:
        reports = list(
            pool.map(
                lambda g: _run_group(g[1], inner, tmp / f"{inner}-{g[0]}.json"), enumerate(groups)
            )
        )
    outcomes = {t["test"]: t for report in reports for t in report["tests"]}
    out: dict[str, str] = {}
    for v in variants:
        mine = {
            node: t
            for node, t in outcomes.items()
            if f"::{class_name(v.name)}::{v.caught_by}" in node
        }
        if any(t["outcome"] in ("failed", "error") for t in mine.values()):
            out[v.name] = ""
        else:
            ran = {node.split("::")[-1]: t["outcome"] for node, t in mine.items()}
            out[v.name] = f"{v.caught_by} {ran or 'did not run'}"
    return out


def _run_group(variants: list[Variant], inner: str, report: Path) -> dict[str, Any]:
    if not variants:
        return {"tests": []}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    env.setdefault("UCX_NET_DEVICES", "lo")
    env["KVWIRE_TEETH_INNER"] = inner
    env["KVWIRE_TEETH_VARIANTS"] = ",".join(v.name for v in variants)
    select = " or ".join(f"({class_name(v.name)} and {v.caught_by})" for v in variants)
    cmd = [
        sys.executable, "-m", "pytest", str(HERE / "variant_suites.py"), "-q",
        "-p", "no:cacheprovider", "--kvwire-timeout", "60", "--kvwire-report", str(report),
        "-k", select,
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert report.exists(), f"no report (status {done.returncode}): {done.stdout[-3000:]}"
    loaded: dict[str, Any] = json.loads(report.read_text())
    return loaded


def test_the_library_is_big_and_covers_every_contract_section() -> None:
    assert len(VARIANTS) >= 30
    sections = {v.section for v in VARIANTS.values()}
    doc = DOC.read_text()
    for section in sections:
        assert f"### {section}" in doc, f"docs/writing-a-transport.md has no {section!r} section"


def test_the_docs_table_lists_every_variant_and_its_catcher() -> None:
    rows = re.findall(
        r"^\| `([a-z_]+)` \| ([^|]+) \| ([^|]+) \| `(test_[a-z_]+)` \|", DOC.read_text(), re.M
    )
    documented = {name: test for name, _, _, test in rows}
    assert documented == {v.name: v.caught_by for v in VARIANTS.values()}


@pytest.mark.timeout(900)
def test_every_variant_is_caught_by_its_test(tmp_path: Path) -> None:
    _run_library([v for v in VARIANTS.values() if "shm" in v.inners], "shm", tmp_path)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("inner", ["nixl", "ucx"])
def test_adapter_variants_and_wrappers_are_caught_over(inner: str, tmp_path: Path) -> None:
    """The adapter's own variants (kvwire_broken_nixl, kvwire_broken_ucx) and every
    wrapper that reaches it."""
    _run_library([v for v in VARIANTS.values() if inner in v.inners], inner, tmp_path)


def test_a_hanging_close_fails_within_the_timeout_naming_the_test() -> None:
    code, report, took = _conformance(
        "kvwire_broken_shm:close_hangs",
        "-k",
        "test_a_closed_agent_refuses_every_call",
        "--timeout",
        str(HANG_TIMEOUT_S),
    )
    failed = _failed(report)
    assert code == 1 and "test_a_closed_agent_refuses_every_call" in failed, failed
    assert "Timeout" in failed["test_a_closed_agent_refuses_every_call"]
    # Probe, test, then the teardown's bounded closes of both agents: each at most the
    # timeout, plus interpreter and peer start-up.
    assert took < 4 * HANG_TIMEOUT_S + 30, f"the run took {took:.0f} s"


def test_an_unchecked_vram_claim_fails_unless_accepted() -> None:
    torch = pytest.importorskip("torch")
    code, report, _ = _conformance("kvwire_broken_shm:claims_vram", "-k", "vram")
    (entry,) = report["tests"]
    if torch.cuda.is_available():
        assert entry["outcome"] == "failed" and code == 1
        return
    assert entry["outcome"] == "unchecked", entry
    assert entry["detail"].startswith("could not check")
    assert code == 1 and not report["passed"], "an unchecked claim passed without the option"
    assert [c["claim"] for c in report["unchecked"]] == ["vram"]
    code, report, _ = _conformance(
        "kvwire_broken_shm:claims_vram", "-k", "vram", "--accept-unchecked"
    )
    assert code == 0 and report["passed"] and report["accepted_unchecked"], report
    assert [c["claim"] for c in report["unchecked"]] == ["vram"], "accepted but not named"


def test_injected_duplicate_notifications_fail_the_suite() -> None:
    code, report, _ = _conformance(
        "kvwire.testing.faulty_transport:faulty",
        "-o",
        "inner=shm",
        "-o",
        "duplicate_notifications=1.0",
        "-k",
        "exactly_once",
    )
    assert code != 0
    assert "test_notifications_arrive_exactly_once" in _failed(report)


def test_a_missing_transport_option_is_a_usage_error() -> None:
    cmd = [
        sys.executable,
        "-m",
        "kvwire.cli",
        "conformance",
        "kvwire.testing.faulty_transport:faulty",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "inner" in done.stderr
