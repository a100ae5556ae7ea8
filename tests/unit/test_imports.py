"""hftk's import graph, read statically (every ``import`` in a module, function-level ones included): no
cycles, and each package imports only the packages below it in :data:`LAYERS` (the order docs/ARCHITECTURE.md
states), so no strategy reaches into an engine and no leaf into what uses it."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "hftk"

# hftk's packages, bottom first: each may import its own modules and those of the packages before it. The
# package root (``hftk``: the version) is below them all; ``hftk.cli`` (the command, which dispatches by name)
# above them all, and ``hftk.reference`` (the documentation's reference, rendered from the command table) above it.
TOP = ("hftk.cli", "hftk.reference")
LAYERS = ("core", "config", "comm", "telemetry", "data", "checkpoint", "models", "plan", "strategies", "launch",
          "publish", "engine", "run", "bench")


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


def layer(module: str) -> int:
    """Where ``module`` sits in :data:`LAYERS` (the root below all, then :data:`TOP` above all)."""
    if module == "hftk":
        return -1
    if module in TOP:
        return len(LAYERS) + TOP.index(module)
    return LAYERS.index(module.split(".")[1])


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{name} -> {target}" for name, targets in graph.items() for target in targets
                  if layer(target) > layer(name))


def test_the_walker_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "hftk.core.errors" in graph["hftk.config.strategy_table"]  # a module-level import
    assert "hftk.run.preprocess" in graph["hftk.run.prepare"]  # a function-level one
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_hftk_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles in hftk/: " + "; ".join(" <-> ".join(c) for c in found)


def test_every_package_is_a_layer_and_hftk_has_no_loose_module():
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    loose = {f"hftk.{path.stem}" for path in ROOT.glob("*.py")} - {"hftk.__init__", *TOP}
    assert packages == set(LAYERS) and not loose, (packages ^ set(LAYERS), loose)


def test_each_package_imports_only_the_packages_below_it():
    found = upward_imports(import_graph())
    assert not found, "upward imports (order: " + " < ".join(LAYERS) + "): " + ", ".join(found)


def test_an_upward_import_is_caught(tmp_path):
    """The check above can fail: a strategy that imports the engine, a leaf that imports a strategy."""
    graph = import_graph()
    graph["hftk.strategies.ddp"] = graph["hftk.strategies.ddp"] | {"hftk.engine.trainer"}
    graph["hftk.core.errors"] = graph["hftk.core.errors"] | {"hftk.strategies.fsdp"}
    assert upward_imports(graph) == ["hftk.core.errors -> hftk.strategies.fsdp",
                                     "hftk.strategies.ddp -> hftk.engine.trainer"]


def test_the_tables_everything_reads_are_leaves():
    """The strategy table, the parallel dimensions, the plan types, the agent store and the error type import
    nothing beside the error type."""
    graph = import_graph()
    assert graph["hftk.core.agent_store"] == set()
    assert graph["hftk.models.activations"] == set()
    assert graph["hftk.core.errors"] == {"hftk.core.agent_store"}
    assert graph["hftk.plan.types"] == {"hftk.models.activations"}
    assert graph["hftk.strategies.parallel_dims"] == graph["hftk.config.strategy_table"] == {"hftk.core.errors"}
