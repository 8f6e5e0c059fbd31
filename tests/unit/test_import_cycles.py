"""No run-time import cycle in the product code (every module under ``saga``).

The graph: one node per module of the installed package (``saga/`` with the folders it
links to), one arrow per import statement that runs, at module level or inside a
function; an import under ``if TYPE_CHECKING:`` never runs and is left out. An arrow
goes to the most specific module named: ``from saga.streams import _codec`` points at
``saga.streams._codec``, ``from saga.streams import Step`` at the package
``saga.streams`` (its ``__init__`` runs, and with it everything that re-exports).
Modules loaded by name (``importlib.import_module("...")``) are not followed.

A cycle makes the result of an import depend on which module was imported first (one
of them sees the other half-initialised), and a function-local import that closes a
cycle only hides it until someone moves it to the top. The failure prints every cycle
found, one strongly connected group at a time, with one concrete loop through it.
"""

from __future__ import annotations

import ast
import os
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._infra import ROOT

pytestmark = pytest.mark.unit

PACKAGE = "saga"


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (symlinked folders followed)."""
    found: dict[str, Path] = {}
    base = ROOT / PACKAGE
    for folder, dirs, files in os.walk(base, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        parts = Path(folder).relative_to(ROOT).parts
        if "__init__.py" not in files:
            dirs[:] = []  # not a package (static files, schemas): nothing importable below
            continue
        for name in files:
            if not name.endswith(".py"):
                continue
            stem = name.removesuffix(".py")
            dotted = ".".join(parts if stem == "__init__" else (*parts, stem))
            found[dotted] = Path(folder, name)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _run_time_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree`` except those under ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)  # the else branch does run
            continue
        stack.extend(ast.iter_child_nodes(node))


def _arrows(
    module: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules: set[str]
) -> set[str]:
    """The modules ``node`` points at, relative imports resolved."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if node.level:
        parts = module.split(".")
        base = ".".join(parts[: len(parts) - node.level + (1 if is_package else 0)])
        source = f"{base}.{node.module}" if node.module else base
    else:
        source = node.module or ""
    # `from pkg import sub` imports the submodule; `from pkg import name` runs pkg's
    # __init__ only.
    return {
        f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
        for alias in node.names
    }


def import_graph() -> dict[str, set[str]]:
    """Module -> the product modules it imports at run time."""
    modules = _modules()
    names = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        arrows: set[str] = set()
        for node in _run_time_imports(tree):
            arrows |= _arrows(name, is_package, node, names)
        graph[name] = {target for target in arrows if target in names and target != name}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the groups of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return sorted(groups)


def one_loop(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A shortest import loop through the group's first module, ending where it starts."""
    start = group[0]
    members = set(group)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node] & members):
            if child == start:
                loop = [node]
                while loop[-1] != start:
                    loop.append(came_from[loop[-1]])
                return [start, *reversed(loop[:-1]), start]
            if child not in came_from:
                came_from[child] = node
                queue.append(child)
    raise AssertionError(f"no loop through {start} in {group}")


def describe(graph: dict[str, set[str]], groups: list[list[str]]) -> str:
    lines = [f"{len(groups)} group(s) of product modules import each other at run time:"]
    for group in groups:
        lines.append(f"- {len(group)} modules: {', '.join(group)}")
        lines.append("  for example: " + " -> ".join(one_loop(graph, group)))
    return "\n".join(lines)


def test_the_graph_sees_the_package() -> None:
    graph = import_graph()
    assert "saga.coordinator._client" in graph
    assert "saga.participants.sql._adapter" in graph
    assert "saga.streams._codec" in graph["saga.streams"]
    # A function-local import is an arrow (cli imports the duration parser in a function)...
    assert "saga.streams._duration" in graph["saga.coordinator.cli"]
    # ...one under `if TYPE_CHECKING:` is not (the package names its adapters for mypy only).
    assert "saga.participants.sql._adapter" not in graph["saga.participants"]


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    groups = strongly_connected(graph)
    assert groups == [["a", "b", "c"]]
    assert one_loop(graph, groups[0]) == ["a", "b", "c", "a"]


def test_type_checking_imports_are_not_arrows() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import saga.x\nelse:\n    import saga.y\n"
        "def f():\n    import saga.z\n"
    )
    names = {alias.name for node in _run_time_imports(tree) for alias in node.names}
    assert names == {"TYPE_CHECKING", "saga.y", "saga.z"}


def test_no_run_time_import_cycle_in_the_product() -> None:
    graph = import_graph()
    groups = strongly_connected(graph)
    assert not groups, describe(graph, groups)
