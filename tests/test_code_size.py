"""Small modules (docs/architecture.md): no Python file in ``attnops/`` over 600 lines, no function over 120."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "attnops"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 120
SOURCES = sorted(ROOT.rglob("*.py"))


def _long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """``(name, lines)`` of the functions (methods and nested functions too) in ``source`` longer than ``limit``."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= limit]


def test_the_sources_are_read():
    assert len(SOURCES) > 100
    long = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    assert _long_functions(long, MAX_FUNCTION_LINES) == [("f", MAX_FUNCTION_LINES + 1)]
    assert _long_functions(long, MAX_FUNCTION_LINES + 1) == []


def test_no_file_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in SOURCES if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}


def test_no_function_over_120_lines():
    long = {f"{p.relative_to(ROOT)}:{name}": n for p in SOURCES
            for name, n in _long_functions(p.read_text(), MAX_FUNCTION_LINES)}
    assert long == {}
