"""The runnable CPU examples in the FIA docstrings (DESIGN.md: every public docstring has one) run as written."""
from __future__ import annotations

import doctest

import pytest
import torch

import attnops


@pytest.mark.parametrize("obj", ["fused_infer_attention", "PagedKVCache"])
def test_fia_docstring_examples_run(obj):
    target = getattr(attnops, obj)
    finder = doctest.DocTestFinder(recurse=False)
    tests = finder.find(target, obj, globs={"torch": torch, "attnops": attnops,
                                             "PagedKVCache": attnops.PagedKVCache})
    assert tests and tests[0].examples, f"{obj} has no docstring example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for t in tests:
        runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples of {obj} failed"
