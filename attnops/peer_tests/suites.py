"""The peer suites the runner knows: which files of a checkout it runs and what it installs first."""
from __future__ import annotations

import contextlib
import dataclasses
import re
from pathlib import Path
from typing import Callable

from .cuda_on_cpu import DESCRIPTION as CUDA_MAPPING
from .cuda_on_cpu import CudaOnCpu


@dataclasses.dataclass(frozen=True)
class Suite:
    """``files(root)``: the test files to run; ``installed()``: a context manager that makes the peer's imports
    load attnops' stand-ins for the session; ``notes``: what it applies (printed)."""
    name: str
    files: Callable[[Path], list[Path]]
    installed: Callable[[], contextlib.AbstractContextManager]
    notes: tuple[str, ...]


FLASH_ATTN_FILES = ("tests/test_flash_attn.py", "tests/test_rotary.py", "tests/layers/test_rotary.py")


def _flash_attn_files(root: Path) -> list[Path]:
    return [root / name for name in FLASH_ATTN_FILES]


@contextlib.contextmanager
def _flash_attn_installed():
    from ..flash_attn import install
    install(force=True)
    with CudaOnCpu():
        yield


def _op_plugin_files(root: Path) -> list[Path]:
    """``test/test_custom_ops/test_*.py`` files that call at least one operator attnops' torch_npu provides."""
    from .. import torch_npu
    provided = set(torch_npu.__all__)
    calls = re.compile(r"torch_npu\.(\w+)\(")
    return [path for path in sorted((root / "test" / "test_custom_ops").glob("test_*.py"))
            if provided.intersection(calls.findall(path.read_text(errors="replace")))]


@contextlib.contextmanager
def _op_plugin_installed():
    from .. import torch_npu
    torch_npu.install("cpu")
    yield


SUITES = {
    "flash-attn": Suite("flash-attn", _flash_attn_files, _flash_attn_installed,
                        ("flash_attn, flash_attn.* and flash_attn_interface import attnops.flash_attn "
                         "(forced, even where the real package is importable)", CUDA_MAPPING)),
    "op-plugin": Suite("op-plugin", _op_plugin_files, _op_plugin_installed,
                       ("torch_npu imports attnops.torch_npu, 'npu' devices map to the CPU",)),
}
