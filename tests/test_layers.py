"""The import graph keeps the layers of ARCHITECTURE.md: no import from a lower layer to a
higher one, connector and server never import each other, and no import cycle between modules.

Every import counts: module level, inside functions, and under ``TYPE_CHECKING``. The graph
is read with :mod:`ast`, so nothing is imported to check it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("testbed", "connector", "server")

LAYERS: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    # (layer, rank, module prefixes): longest prefix wins; a module may import its own rank
    # and lower ranks only. Every module of the three packages has a layer of its own: none
    # falls to a catch-all (test_every_module_is_ranked).
    ("core", 0, ("testbed.core",)),
    ("models", 1, ("testbed.models",)),
    ("connector", 2, ("connector",)),
    ("server", 2, ("server",)),
    ("workloads", 3, ("testbed.workloads",)),
    ("fleet", 4, ("testbed.fleet",)),
    ("spec", 5, ("testbed.spec",)),
    ("analysis", 6, ("testbed.analysis",)),
    ("engine", 7, ("testbed.engine",)),
    ("run", 8, ("testbed.run",)),
    ("sweep", 9, ("testbed.sweep",)),
    ("report", 10, ("testbed.report",)),
    ("commands", 11, ("testbed.commands",)),
    ("bench", 12, ("testbed.bench",)),
    ("chaos", 12, ("testbed.chaos",)),
    ("cli", 13, ("testbed.cli",)),
)
PEERS_APART = ({"connector", "server"}, {"bench", "chaos"})
"""Pairs of layers of one rank that must not import each other."""
KNOWN_CYCLES: list[set[str]] = []


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    path: Path
    line: int

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def layer(module: str) -> tuple[str, int]:
    if module == "testbed":  # the package itself: import-light, part of the install boundary
        return "core", 0
    matches = [
        (name, rank, prefix)
        for name, rank, prefixes in LAYERS
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    if not matches:
        return "unranked", -1
    best = max(matches, key=lambda item: len(item[2]))
    return best[0], best[1]


def _targets(
    node: ast.Import | ast.ImportFrom, module: str, path: Path, known: dict[str, Path]
) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([node.module] if node.module else [])])
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        yield submodule if submodule in known else base


def edges() -> list[Edge]:
    known = modules()
    found: list[Edge] = []
    for module, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _targets(node, module, path, known):
                while target not in known and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in known and target != module:
                    found.append(Edge(module, target, path, node.lineno))
    return found


def layering_violations(graph: list[Edge]) -> list[str]:
    bad: list[str] = []
    for edge in graph:
        (source_layer, source_rank), (target_layer, target_rank) = (
            layer(edge.source),
            layer(edge.target),
        )
        apart = source_layer != target_layer and {source_layer, target_layer} in PEERS_APART
        if target_rank > source_rank or apart:
            bad.append(
                f"{edge.where()}: {edge.source} ({source_layer}) imports "
                f"{edge.target} ({target_layer})"
            )
    return list(dict.fromkeys(bad))


def cycles(graph: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each with its edges."""
    out: dict[str, list[Edge]] = {}
    for edge in graph:
        out.setdefault(edge.source, []).append(edge)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for edge in out.get(node, []):
            if edge.target not in index:
                visit(edge.target)
                low[node] = min(low[node], low[edge.target])
            elif edge.target in on_stack:
                low[node] = min(low[node], index[edge.target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(out):
        if node not in index:
            visit(node)
    return [
        sorted(
            {
                f"{e.where()}: {e.source} imports {e.target}"
                for e in graph
                if e.source in c and e.target in c
            }
        )
        for c in components
    ]


def _members(cycle: list[str]) -> set[str]:
    return {line.split(": ", 1)[1].split(" imports ")[0] for line in cycle}


def test_known_cycles_still_exist() -> None:
    """A cycle broken is taken off :data:`KNOWN_CYCLES`, so none can come back unnoticed."""
    found = [_members(c) for c in cycles(edges())]
    assert all(known in found for known in KNOWN_CYCLES), found


def test_every_module_has_a_layer_and_the_graph_is_read() -> None:
    graph = edges()
    assert {e.source for e in graph} >= {"connector.vllm_connector", "server.service"}
    assert any(e.target == "testbed.core.protocol" for e in graph)


def test_every_module_is_ranked() -> None:
    """No module sits outside the layers (a loose module in ``testbed/`` has no rank)."""
    unranked = sorted(name for name in modules() if layer(name)[0] == "unranked")
    assert not unranked, "modules without a layer (ARCHITECTURE.md): " + ", ".join(unranked)


def test_no_import_from_a_lower_layer_to_a_higher_one() -> None:
    bad = layering_violations(edges())
    assert not bad, "imports against the layers (ARCHITECTURE.md):\n" + "\n".join(bad)


def test_no_import_cycle() -> None:
    found = [c for c in cycles(edges()) if _members(c) not in KNOWN_CYCLES]
    assert not found, "import cycles:\n" + "\n\n".join("\n".join(c) for c in found)
