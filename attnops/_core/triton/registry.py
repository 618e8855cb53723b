"""The AOT cases of every operator's Triton kernels: an operator registers named problems, each a function that
returns the problem's :class:`~attnops._core.triton.aot.KernelLaunch` call sites (built from its launchers' own
plans). ``python -m attnops aot`` imports :data:`PROVIDERS` and compiles every registered case."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

# modules that register their operator's AOT cases when imported
PROVIDERS = ("attnops.ops.common.triton.aot", "attnops.ops.fused_infer_attention.triton.aot",
             "attnops.ops.nsa.triton.aot", "attnops.ops.dsa.triton.aot", "attnops.torch_npu.triton.aot",
             "attnops.ops.dsv4.triton.compressor_aot", "attnops.ops.dsv4.triton.indexer_v2_aot",
             "attnops.ops.dsv4.triton.sparse_flash_mla_aot")


@dataclass(frozen=True)
class AotCase:
    operator: str
    name: str
    launches: Callable[[], list]  # -> list[KernelLaunch]


AOT_CASES: dict[str, AotCase] = {}


def register_aot(operator: str, name: str, launches: Callable[[], list]) -> AotCase:
    key = f"{operator}/{name}"
    if key in AOT_CASES:
        raise ValueError(f"AOT case {key!r} is already registered")
    AOT_CASES[key] = AotCase(operator, name, launches)
    return AOT_CASES[key]


def all_aot_cases() -> dict[str, AotCase]:
    """Every registered case, after importing the :data:`PROVIDERS`."""
    for module in PROVIDERS:
        importlib.import_module(module)
    return AOT_CASES
