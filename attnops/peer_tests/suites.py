"""The peer suites the runner knows: which files of a checkout it runs and what it installs first."""
from __future__ import annotations

import contextlib
import dataclasses
import re
from pathlib import Path
from typing import Callable

from .cuda_on_cpu import DESCRIPTION as CUDA_MAPPING
from .cuda_on_cpu import CudaOnCpu
from .exclusions import EXCLUDED_FILES


@dataclasses.dataclass(frozen=True)
class Suite:
    """``files(root)``: the test files to run (paths relative to the checkout); ``installed(options)``: a context
    manager that makes the peer's imports load attnops' stand-ins for the session (``options``: the runner's
    ``--npu-soc`` and the like); ``notes``: what it applies and how it picks files (printed)."""
    name: str
    files: Callable[[Path], list[str]]
    installed: Callable[[dict], contextlib.AbstractContextManager]
    notes: tuple[str, ...]
    optional: bool = False  # a checkout without its files skips the suite instead of failing


FLASH_ATTN_FILES = ("tests/test_flash_attn.py", "tests/test_rotary.py", "tests/layers/test_rotary.py")
FA3_RULE = "FA3 files: hopper/test_*.py, less the excluded files"
OP_PLUGIN_TOPICS = re.compile(r"^test_(atb_.*|.*(attention|attn|cache|mla|nsa|sparse|lightning_indexer).*)\.py$")
OP_PLUGIN_RULE = ("op-plugin files: test/test_custom_ops/test_*.py named test_atb_* (ATB) or containing attention, "
                  "attn, cache, mla, nsa, sparse or lightning_indexer (DSA) in the name, less the excluded files")


def _without_excluded(names: list[str]) -> list[str]:
    return [name for name in names if name not in EXCLUDED_FILES]


def _flash_attn_files(root: Path) -> list[str]:
    return list(FLASH_ATTN_FILES)


def _fa3_files(root: Path) -> list[str]:
    return _without_excluded([f"hopper/{path.name}" for path in sorted((root / "hopper").glob("test_*.py"))])


@contextlib.contextmanager
def _flash_attn_installed(options: dict):
    from ..flash_attn import install
    install(force=True)
    with CudaOnCpu():
        yield


def _op_plugin_files(root: Path) -> list[str]:
    return _without_excluded([f"test/test_custom_ops/{path.name}"
                              for path in sorted((root / "test" / "test_custom_ops").glob("test_*.py"))
                              if OP_PLUGIN_TOPICS.match(path.name)])


@contextlib.contextmanager
def _op_plugin_installed(options: dict):
    """attnops.torch_npu as torch_npu on the CPU, reporting the SoC ``options["npu_soc"]`` (None: ATTNOPS_NPU_SOC,
    else the default) to SupportedDevices."""
    from .. import torch_npu
    from ..torch_npu import soc
    torch_npu.install("cpu")
    soc.configure(options.get("npu_soc"))
    yield


_FLASH_ATTN_NOTE = ("flash_attn, flash_attn.* and flash_attn_interface import attnops.flash_attn "
                    "(flash_attn_interface: its FA3 API attnops.flash_attn.fa3), forced, even where the real packages "
                    "are importable")
SUITES = {
    "flash-attn": Suite("flash-attn", _flash_attn_files, _flash_attn_installed, (_FLASH_ATTN_NOTE, CUDA_MAPPING)),
    "fa3": Suite("fa3", _fa3_files, _flash_attn_installed, (FA3_RULE, _FLASH_ATTN_NOTE, CUDA_MAPPING), True),
    "op-plugin": Suite("op-plugin", _op_plugin_files, _op_plugin_installed,
                       (OP_PLUGIN_RULE, "torch_npu imports attnops.torch_npu, 'npu' devices map to the CPU; the SoC "
                        "reported to SupportedDevices: --npu-soc, else $ATTNOPS_NPU_SOC, else Ascend910B1")),
}
