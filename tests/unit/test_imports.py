"""The layers of docs/architecture.md hold: no module of src/dynprobe imports, even only for type
checking or inside a function, a module that imports it back (directly or through others)."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "src"


def modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package by its __init__.py)."""
    found = {}
    for path in sorted((SOURCE / "dynprobe").rglob("*.py")):
        parts = path.relative_to(SOURCE).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports anywhere in its file: `from A import B` is module A.B
    when there is one, else A (the package imports itself absolutely: a relative import fails
    the test). The package itself (dynprobe/__init__.py, the API's lazy names) is left out: it
    imports what it exports, and nothing imports it for anything else."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}:{node.lineno}: a relative import"
            base = node.module or ""
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
    return {module for module in found if module in known and module not in ("dynprobe", name)}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_the_import_graph_finds_a_cycle_it_is_given() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_module_imports_one_that_imports_it_back() -> None:
    known = modules()
    assert len(known) > 50 and "dynprobe.core.session" in known
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert "dynprobe.core.session" in graph["dynprobe.cli.common"]  # (what an edge looks like)
    assert cycles(graph) == []
