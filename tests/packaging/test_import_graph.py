"""The import graph obeys docs/architecture.md: each package imports only what its row lists,
and no module imports (directly or around a loop) one that imports it back.

The table in the docs is the one statement of the rules; this test reads it, so the page and
the code cannot drift apart. Every ``import`` counts, including those inside functions: a
lazy import is still a dependency. The adapters' rule is also held by name
(:data:`INTERFACE`), so widening their row of the table cannot let tooling back into them.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = [
    ROOT / "kvwire",
    *sorted((ROOT / "transports").glob("*/kvwire_*")),
    ROOT / "conformance" / "kvwire_conformance",
]
ADAPTERS = sorted(path.name for path in (ROOT / "transports").glob("*/kvwire_*"))
INTERFACE = ("kvwire.errors", "kvwire.transport", "kvwire.layout")
"""All an adapter may import from kvwire: the transport interface and the core below it."""
CORE = (
    "kvwire.errors",
    "kvwire.logs",
    "kvwire.wire",
    "kvwire.layout",
    "kvwire.transport",
    "kvwire.config",
    "kvwire.machine",
    "kvwire.sidechannel",
    "kvwire.runtime",
    "kvwire",
)


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in package.rglob("*.py"):
            parts = list(path.relative_to(package.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> Iterator[str]:
    """The project modules ``module`` imports (``from pkg import sub`` names ``pkg.sub``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            resolved = _resolve(target)
            if resolved is not None and resolved != module:
                yield resolved


GRAPH = {module: set(_imports(module, path)) for module, path in MODULES.items()}


def _rules() -> dict[str, set[str]]:
    """Package -> the packages it may import, from the table between the doc's markers."""
    text = DOC.read_text()
    table = text.split("<!-- import-rules:start -->")[1].split("<!-- import-rules:end -->")[0]
    rules: dict[str, set[str]] = {}
    for line in table.splitlines()[3:]:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        packages = re.findall(r"`([\w.]+)`", cells[0])
        allowed = set(re.findall(r"`([\w.]+)`", cells[2]))
        if re.search(r"(^|, )core(,|$)", cells[2]):
            allowed |= set(CORE)
        for package in packages:
            rules[package] = allowed | {package}
    return rules


RULES = _rules()


def _owner(module: str) -> str:
    """The most specific row of the table that covers ``module``."""
    candidates = [p for p in RULES if module == p or module.startswith(p + ".")]
    if not candidates:
        raise AssertionError(f"{module} is in no row of {DOC.name}: add its package there")
    return max(candidates, key=len)


def _covers(allowed: set[str], target: str) -> bool:
    return any(target == p or target.startswith(p + ".") for p in allowed if p != "kvwire") or (
        "kvwire" in allowed and target == "kvwire"
    )


def test_the_rules_table_is_read() -> None:
    assert {"kvwire.machine", "kvwire_shm", "kvwire_conformance"} <= set(RULES)
    assert "kvwire.bench" not in RULES["kvwire.runtime"]


def test_every_import_is_allowed_by_the_architecture_table() -> None:
    broken = [
        f"{module} imports {target} ({_owner(module)} may not)"
        for module, targets in sorted(GRAPH.items())
        for target in sorted(targets)
        if _owner(target) != _owner(module) and not _covers(RULES[_owner(module)], target)
    ]
    assert broken == []


def test_no_import_cycles() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert cycles == []


@pytest.mark.parametrize("planted", ["kvwire.machine._core", "kvwire_shm.transport"])
def test_a_planted_violation_is_caught(planted: str) -> None:
    """The check can fail: an import of the CLI from the machine or an adapter is refused."""
    owner = _owner(planted)
    assert not _covers(RULES[owner], "kvwire.cli")
    assert not _covers(RULES[owner], "kvwire.bench.transport")


def _above_the_interface(targets: Iterable[str]) -> list[str]:
    """The kvwire modules among ``targets`` that are not the transport interface."""
    return sorted(
        target
        for target in targets
        if (target == "kvwire" or target.startswith("kvwire."))
        and not any(target == p or target.startswith(p + ".") for p in INTERFACE)
    )


def test_adapters_import_nothing_above_the_transport_interface() -> None:
    """No module under ``transports/*/kvwire_*/`` imports from kvwire anything but
    :data:`INTERFACE`, benchmark tooling included (it belongs in ``kvwire.bench``). Held
    here by name as well as by the table, and the table may not carve out a row for part
    of an adapter."""
    adapter_modules = [module for module in MODULES if module.split(".")[0] in ADAPTERS]
    assert {"kvwire_shm.transport", "kvwire_nixl.transport", "kvwire_ucx.transport"} <= set(
        adapter_modules
    )
    broken = {module: _above_the_interface(GRAPH[module]) for module in adapter_modules}
    assert {module: targets for module, targets in broken.items() if targets} == {}
    assert {_owner(module) for module in adapter_modules} == set(ADAPTERS)
    for adapter in ADAPTERS:
        assert RULES[adapter] == {*INTERFACE, adapter}


def test_an_adapter_importing_above_the_interface_is_caught(tmp_path: Path) -> None:
    """The check can fail: bench, framing and root imports planted in an adapter module, at
    module level or inside a function, are all named; the interface's are not."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import kvwire.errors\n"
        "from kvwire.layout.plan import coalesce\n"
        "from kvwire.transport import Transport\n"
        "from kvwire import wire\n"
        "def later():\n"
        "    from kvwire.framing import spawn\n"
        "    import kvwire.bench.report\n"
    )
    targets = set(_imports("kvwire_shm.planted", planted))
    assert _above_the_interface(targets) == ["kvwire.bench.report", "kvwire.framing", "kvwire.wire"]
