"""The paged-KV-cache kernels in the shared AOT machinery (``python -m attnops aot``): the write and read launches of
the launchers' own plans for 1-, 2- and 4-byte elements (int8, fp16/bf16, fp32) in ND and NZ caches, with rows of 8
KV heads of 128 (1024 elements) and an MLA latent row of 512 + 64 (576 elements: a partly masked tile)."""
from __future__ import annotations

import torch

from ..._core.triton.registry import register_aot
from .launch import KERNELS, gather_plan, scatter_plan

DTYPES = {"int8": torch.int8, "fp16": torch.float16, "fp32": torch.float32}
WIDTHS = (1024, 576)
NZ_CHUNK_BYTES = 32  # an NZ chunk holds 32 bytes: 16 fp16 / 32 int8 / 8 fp32 elements


def _problem(dtype: str, width: int, nz: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A 16-block cache of 128-token blocks as the kernels see it, and 4 token rows."""
    t = DTYPES[dtype]
    x = NZ_CHUNK_BYTES // torch.empty(0, dtype=t).element_size() if nz else width
    return torch.zeros(16, width // x, 128, x, dtype=t), torch.zeros(4, width, dtype=t)


def _write(dtype: str, width: int, nz: bool) -> list:
    cache, rows = _problem(dtype, width, nz)
    slots = torch.arange(4, dtype=torch.int32)
    return [KERNELS.aot_launch(launch) for launch in scatter_plan(slots, rows, cache, rows, cache)]


def _read(dtype: str, width: int, nz: bool) -> list:
    """Both forms of the lengths (per sequence with offsets; cumulative without)."""
    cache, rows = _problem(dtype, width, nz)
    table, lens, offsets = torch.zeros(2, 4, dtype=torch.int32), torch.tensor([1, 3]), torch.zeros(2, dtype=torch.int32)
    plans = (gather_plan(lens, False, offsets, table, 16, rows, cache, rows, cache)
             + gather_plan(torch.tensor([0, 1, 4]), True, None, table, 16, rows, cache, rows, cache))
    return [KERNELS.aot_launch(launch) for launch in plans]


for _dtype in DTYPES:
    for _width in WIDTHS:
        for _layout in ("nd", "nz"):
            for _name, _case in (("write", _write), ("read", _read)):
                register_aot("torch_npu", f"kv-cache-{_name}-{_dtype}-{_layout}-w{_width}",
                             lambda case=_case, dtype=_dtype, width=_width, nz=_layout == "nz": case(dtype, width, nz))
