"""hftk's import graph, read statically (every ``import`` in a module, function-level ones
included): no cycles, and no strategy reaches into an engine (the engines load strategies)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "hftk"


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the hftk modules it imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
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
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_walker_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "hftk.errors" in graph["hftk.strategies"]  # a module-level import
    assert "hftk.strategies" in graph["hftk.run"] or any(
        t.startswith("hftk.strategies") for t in graph["hftk.run"])
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_hftk_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles in hftk/: " + "; ".join(" <-> ".join(c) for c in found)


def test_strategies_never_import_the_engine():
    upward = sorted(f"{name} -> {target}" for name, targets in import_graph().items()
                    if name.startswith("hftk.strategies")
                    for target in targets if target == "hftk.engine" or target.startswith("hftk.engine."))
    assert not upward, "strategies import the engine: " + ", ".join(upward)


def test_the_tables_everything_reads_are_leaves():
    """The model-family and strategy tables, the parallel dimensions, the plan types, the agent store and the
    error type import nothing above them."""
    graph = import_graph()
    assert graph["hftk.families"] == graph["hftk.agent_store"] == graph["hftk.activations"] == set()
    assert graph["hftk.errors"] == {"hftk.agent_store"} and graph["hftk.plan_types"] == {"hftk.activations"}
    assert graph["hftk.parallel_dims"] == {"hftk.errors"} and graph["hftk.strategies"] == {"hftk.errors"}
