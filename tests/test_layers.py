"""The package's layers (docs/architecture.md): no import cycle, no import against the order,
except the known debts below, which must each still exist (so the list only shrinks).
Imports are read with ast, function-level ones included; nothing is imported."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = {"tests", "benchmarks", "models", "docs", "build", ".venv", ".git"}
# lowest first; a module in none of them is a tool (layer 5)
LAYERS = [("ember.ir", "ember.errors", "ember.log", "ember.limits", "ember.config"), ("ember.importer",),
          ("ember.ops",), ("ember.simplifier",), ("ember.runtime",)]
KNOWN_UPWARD: set[tuple[str, str]] = set()
KNOWN_CYCLES: list[set[str]] = []


def _modules() -> dict[str, str]:
    found = {}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP and not d.startswith(".")]
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                if rel[:2] == ["batch", "ray_api"]:  # pyproject maps it to ember.ray
                    rel = ["ray"] + rel[2:]
                found[".".join(["ember"] + rel)] = os.path.join(folder, name)
    return found


def _imports(path: str, module: str, known: set[str]) -> set[str]:
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            # `from ember.ops import conv` imports a module; `from ember.ir import Graph`, ir
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:  # a name inside a module: that module
                name = name.rpartition(".")[0]
            if name and name != module and name != "ember":
                targets.add(name)
    return targets


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, m, set(modules)) for m, p in modules.items()}


def _layer(module: str) -> int:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return len(LAYERS)


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_no_import_cycles_but_the_known():
    cycles = _cycles(_graph())
    assert [c for c in cycles if c not in KNOWN_CYCLES] == []
    assert [c for c in KNOWN_CYCLES if c not in cycles] == [], \
        "a known cycle is gone: take it out of KNOWN_CYCLES and docs/architecture.md"


def test_imports_follow_the_layers():
    upward = {(a, b) for a, targets in _graph().items() for b in targets
              if _layer(b) > _layer(a)}
    assert sorted(upward - KNOWN_UPWARD) == []
    assert sorted(KNOWN_UPWARD - upward) == [], \
        "a known upward import is gone: take it out of KNOWN_UPWARD and docs/architecture.md"


def test_the_checker_sees_cycles_and_upward_imports():
    """The reader itself: a made-up graph with a cycle and an upward edge."""
    graph = {"ember.ir": {"ember.runtime.session"}, "ember.runtime.session": {"ember.ir"},
             "ember.ops.conv": set()}
    assert _cycles(graph) == [{"ember.ir", "ember.runtime.session"}]
    assert _layer("ember.runtime.session") > _layer("ember.ir")
    assert _layer("ember.golden") == len(LAYERS)
