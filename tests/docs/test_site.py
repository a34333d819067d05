"""The documentation site: builds strictly, covers every public name and CLI command, and
its generated pages match the code they are generated from."""

from __future__ import annotations

import html
import importlib.util
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path
from types import ModuleType

import pytest
import yaml  # type: ignore[import-untyped]

import kvwire
from kvwire.cli import COMMANDS
from kvwire.config import ENV_VARS, VLLM_EXTRA_CONFIG_KEYS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _gen_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built from the working tree, strict: any warning fails the build."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def _inventory(site: Path) -> set[str]:
    """Names of every object the API reference documents (mkdocstrings' objects.inv)."""
    raw = (site / "objects.inv").read_bytes()
    body = zlib.decompress(raw.split(b"\n", 4)[4]).decode()
    return {line.split(" ", 1)[0] for line in body.splitlines() if line}


def _page_text(site: Path, page: str) -> str:
    text = (site / page / "index.html").read_text()
    return html.unescape(re.sub(r"<[^>]+>", " ", text))


def test_every_public_name_has_an_api_entry(site: Path) -> None:
    documented = _inventory(site)
    missing = [name for name in kvwire.__all__ if f"kvwire.{name}" not in documented]
    assert not missing, f"kvwire.__all__ names without an API reference entry: {missing}"


@pytest.mark.parametrize(
    "package", ["kvwire.runtime", "kvwire.sidechannel", "kvwire.machine", "kvwire.config"]
)
def test_public_names_of_the_engine_facing_packages_are_documented(
    site: Path, package: str
) -> None:
    module = importlib.import_module(package)
    documented = _inventory(site)
    missing = [n for n in module.__all__ if f"{package}.{n}" not in documented]
    assert not missing, f"{package}: undocumented public names {missing}"


def test_every_cli_command_and_option_is_in_the_site(site: Path) -> None:
    text = _page_text(site, "generated/cli")
    for name in COMMANDS:
        assert f"kvwire {name}" in text, f"CLI command {name!r} missing from the site"
    from kvwire.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, cmd in sub.choices.items():  # type: ignore[union-attr]
        for action in cmd._actions:
            for flag in action.option_strings:
                assert flag in text, f"option {flag} of kvwire {name} missing from the site"


def test_every_configuration_knob_is_documented(site: Path) -> None:
    text = _page_text(site, "configuration")
    for var in ENV_VARS:
        assert var in text, f"{var} is not on the configuration page"
    for key in VLLM_EXTRA_CONFIG_KEYS:
        assert key in text, f"vLLM key {key!r} is not on the configuration page"


def test_every_page_is_in_the_navigation() -> None:
    class _Loader(yaml.SafeLoader):  # type: ignore[misc]
        pass

    # mkdocs.yml names a Python function for the mermaid fence; the nav needs none of it.
    _Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *_: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)

    def pages(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [p for item in node for p in pages(item)]
        if isinstance(node, dict):
            return [p for value in node.values() for p in pages(value)]
        return []

    in_nav = set(pages(config["nav"]))
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk - in_nav == set(), f"pages no one can navigate to: {on_disk - in_nav}"
    assert in_nav - on_disk == set(), f"navigation to missing pages: {in_nav - on_disk}"


def test_generated_pages_are_current() -> None:
    gen = _gen_docs()
    for name, render in gen.PAGES.items():
        path = DOCS / "generated" / name
        assert path.exists(), f"{path} missing: run python scripts/gen_docs.py"
        assert path.read_text() == render(), (
            f"docs/generated/{name} is stale: run python scripts/gen_docs.py (make docs does)"
        )


def test_state_diagrams_draw_every_transition_of_the_table() -> None:
    from kvwire.machine.table import TABLES, Internal

    page = (DOCS / "generated" / "state-machines.md").read_text()
    edges = set(re.findall(r"^    (\w+) --> (\w+) : (.+)$", page, re.MULTILINE))
    drawn = {(src, dst, label) for src, dst, labels in edges for label in labels.split(", ")}
    for table in TABLES.values():
        for (state, trigger), outcomes in table.items():
            name = trigger.__name__
            name = name.lower() if issubclass(trigger, Internal) else name
            for outcome, succ in outcomes.items():
                label = f"{name} / {outcome}" if outcome else name
                edge = (state.value, succ.value, label)
                assert edge in drawn, f"transition {edge} is not drawn"
