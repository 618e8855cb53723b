"""The import graph of ``attnops/`` (docs/architecture.md): no circles, and imports only in the allowed directions.

The graph is read from the sources with :mod:`ast`: every ``import`` and ``from ... import`` counts, inside functions
and ``if TYPE_CHECKING:`` blocks too (a deferred import is still a dependency). Relative imports are resolved, and
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``. Importing ``a.b.c``
also runs the ``__init__`` of ``a`` and ``a.b``; those implicit edges are not drawn, so a package ``__init__`` may
re-export its submodules. The rule that keeps such packages free of circles: a module never imports its own
enclosing packages' ``__init__`` (``from . import name`` must name a sibling module, not something the ``__init__``
defines); the one exception is the top-level public API, ``attnops/__init__``, for the tools built on it.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "attnops"
SHARED = "common"  # ops/common: what several operators share, owned by none
DIALECTS = ("aclnn", "torch_npu", "flash_attn", "nn", "distributed", "msprobe", "check", "bench", "gpu")
LEAVES = ("attnops.testing",)  # may import only the standard library, torch and attnops._core


def _modules() -> dict[str, Path]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _owner(name: str) -> str:
    """The nearest module that exists for dotted ``name`` (``pkg.func`` -> ``pkg``)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _targets(module: str, node: ast.AST) -> list[str]:
    """The attnops modules ``node`` (an import statement inside ``module``) imports."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
            base = base[:len(base) - node.level + 1]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in MODULES else prefix for alias in node.names]
    return [_owner(name) for name in names if name.split(".")[0] == "attnops"]


def _graph() -> dict[str, set[str]]:
    graph = defaultdict(set)
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module].update(t for t in _targets(module, node) if t != module)
    return graph


GRAPH = _graph()


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
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


def _operator(module: str) -> str | None:
    """The operator folder of ``module`` (``attnops.ops.X...`` -> X), None outside ``attnops/ops``."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["attnops", "ops"] else None


def _edges():
    return sorted((source, target) for source, targets in GRAPH.items() for target in targets)


def test_the_graph_is_read():
    """Guards the checks below against an empty graph: known edges are found, deferred imports included."""
    assert "attnops.ops.common.problem" in GRAPH["attnops.ops.flash_attention.op"]
    assert "attnops.ops.flash_attention.op" in GRAPH["attnops.ops.flash_attention.api"]  # inside a function
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_circles():
    assert _circles(GRAPH) == []


def test_no_module_imports_its_own_package_init():
    """Except the top-level ``attnops``: its ``__init__`` is the public API, which the tools (``check``, ``bench``,
    ``msprobe``, the command line) are built on and imports none of them; operators may not import it (below)."""
    bad = [(s, t) for s, t in _edges() if MODULES[t].name == "__init__.py" and s.startswith(t + ".") and t != "attnops"]
    assert bad == []


def test_operators_import_no_other_operator():
    """An operator imports ``_core``, ``ops/common`` and itself; ``ops/common`` imports no operator."""
    bad = [(s, t) for s, t in _edges()
           if _operator(s) is not None and _operator(t) not in (None, SHARED, _operator(s))]
    assert bad == []


@pytest.mark.parametrize("dialect", DIALECTS)
def test_operators_import_no_dialect(dialect):
    bad = [(s, t) for s, t in _edges()
           if _operator(s) is not None and (t == f"attnops.{dialect}" or t.startswith(f"attnops.{dialect}."))]
    assert bad == []


def test_operators_do_not_import_the_public_package():
    """``attnops/__init__`` re-exports the operators: an operator importing it would import every operator."""
    assert [(s, t) for s, t in _edges() if _operator(s) is not None and t == "attnops"] == []


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaves_import_only_core(leaf):
    """``attnops.testing`` (the goldens) imports nothing it judges, nor any tool built on it."""
    bad = [(s, t) for s, t in _edges() if (s == leaf or s.startswith(leaf + "."))
           and not (t == leaf or t.startswith(leaf + ".") or t.startswith("attnops._core"))]
    assert bad == []
