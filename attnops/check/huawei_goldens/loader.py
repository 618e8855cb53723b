"""Import Huawei's DeepSeek-V4 CPU golden modules, unmodified, from a checkout of ops-transformer.

The modules import torch_npu and ``cann_ops_transformer.ops`` at module level: attnops' torch_npu shim provides both
(:func:`attnops.torch_npu.install`), so the operator they would call on the NPU is attnops'. A few names are imported
at module level but never used by the CPU goldens (``torchair``, Huawei's graph compiler, which is not on PyPI;
``torch_npu.testing.testcase``; the ``torch.npu.config.allow_internal_format`` switch): where they are absent, a
stand-in without behaviour is present for the import only, and the report names them. Nothing inside a golden
module is replaced.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import sys
import types
import unittest
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

# operator -> the golden module's path inside an ops-transformer checkout
GOLDEN_FILES = {
    "sparse_flash_mla": "attention/sparse_flash_mla/tests/pytest/sparse_flash_mla_golden.py",
    "compressor": "attention/compressor/tests/pytest/compressor_golden.py",
    "lightning_indexer_v2": "attention/lightning_indexer_v2/tests/pytest/lightning_indexer_v2_golden.py",
}
CHECKED_COMMIT = "25fb6b92"  # the ops-transformer commit these goldens were checked at (docs/dsv4.md)


@dataclass
class Goldens:
    """The imported golden modules by operator, and why any could not be imported."""

    modules: dict[str, types.ModuleType]
    errors: dict[str, str]
    stand_ins: list[str]


def _absent(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


@contextlib.contextmanager
def _import_only_names() -> Iterator[list[str]]:
    """Stand-ins for the goldens' unused imports that are absent (an empty ``torchair``, ``torch_npu.testing.testcase``
    with unittest's ``TestCase`` / ``main``, ``torch.npu.config``), present while the goldens are imported; yields
    their names."""
    added_modules = []
    if _absent("torchair"):
        sys.modules["torchair"] = types.ModuleType("torchair", "absent: imported but unused by the CPU goldens")
        added_modules.append("torchair")
    testing = sys.modules["torch_npu"].__dict__.get("testing")
    if testing is None:
        testcase = types.ModuleType("torch_npu.testing.testcase", "absent: imported but unused by the CPU goldens")
        testcase.TestCase, testcase.run_tests = unittest.TestCase, unittest.main
        sys.modules["torch_npu.testing"] = types.ModuleType("torch_npu.testing")
        sys.modules["torch_npu.testing.testcase"] = testcase
        added_modules += ["torch_npu.testing", "torch_npu.testing.testcase"]
    added_config = not hasattr(torch.npu, "config")
    if added_config:
        torch.npu.config = types.SimpleNamespace(allow_internal_format=False)
    used = [n for n in added_modules if n != "torch_npu.testing"] + (["torch.npu.config"] if added_config else [])
    try:
        yield used
    finally:
        for name in added_modules:
            sys.modules.pop(name, None)
        if added_config:
            del torch.npu.config


def _import(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    with contextlib.redirect_stdout(io.StringIO()):
        spec.loader.exec_module(module)
    return module


def load(checkout: str | Path) -> Goldens:
    """Import the golden modules found under ``checkout`` (errors name the file and the reason)."""
    from ... import torch_npu

    root = Path(checkout)
    if not root.is_dir():
        raise FileNotFoundError(f"--ops-transformer: expected a checkout of ops-transformer, got {str(root)!r} "
                                "(not a directory)")
    errors = {op: f"{rel} not found under {root}" for op, rel in GOLDEN_FILES.items() if not (root / rel).is_file()}
    if len(errors) == len(GOLDEN_FILES):
        return Goldens({}, errors, [])
    if not torch_npu.install():
        raise RuntimeError("the real torch_npu is installed: the goldens would call Huawei's NPU operators, not "
                           "attnops'; run this check where torch_npu is absent")
    modules = {}
    with _import_only_names() as stand_ins:
        for op, rel in GOLDEN_FILES.items():
            if op in errors:
                continue
            try:
                modules[op] = _import(root / rel, f"huawei_{op}_golden")
            except Exception as e:  # report any import failure of a foreign module, with its reason
                errors[op] = f"importing {rel} failed: {type(e).__name__}: {e}"
    return Goldens(modules, errors, stand_ins)
