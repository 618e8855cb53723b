"""Every docstring example (``>>>``) in the attnops package runs as written, on the CPU; as in the user guide, an
example may use ``torch`` and ``attnops`` without importing them."""
from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest
import torch

import attnops

PACKAGE = Path(attnops.__file__).parent


def _modules_with_examples() -> list[str]:
    """The dotted names of attnops' modules whose source holds a ``>>>`` example (read, not imported)."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ">>>" in path.read_text(encoding="utf-8"):
            parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_the_package_has_examples():
    assert len(_modules_with_examples()) >= 10


@pytest.mark.parametrize("name", _modules_with_examples())
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, extraglobs={"torch": torch, "attnops": attnops}, optionflags=doctest.ELLIPSIS,
                             report=True)
    assert result.attempted > 0, f"{name} holds '>>>' but doctest finds no example in its docstrings"
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples of {name} failed"
