"""The paged-KV-cache write in the shared AOT machinery (``python -m attnops aot``): the launch of the launcher's own
plan for 1-, 2- and 4-byte elements (int8, fp16/bf16, fp32) into ND and NZ caches, with rows of 8 KV heads of 128
(1024 elements) and an MLA latent row of 512 + 64 (576 elements: a partly masked tile)."""
from __future__ import annotations

import torch

from ..._core.triton.registry import register_aot
from .launch import KERNELS, scatter_plan

DTYPES = {"int8": torch.int8, "fp16": torch.float16, "fp32": torch.float32}
WIDTHS = (1024, 576)
NZ_CHUNK_BYTES = 32  # an NZ chunk holds 32 bytes: 16 fp16 / 32 int8 / 8 fp32 elements


def _scatter(dtype: str, width: int, nz: bool) -> list:
    """The launch writing 4 tokens into a 16-block cache of 128-token blocks."""
    t = DTYPES[dtype]
    x = NZ_CHUNK_BYTES // torch.empty(0, dtype=t).element_size() if nz else width
    cache = torch.zeros(16, width // x, 128, x, dtype=t)
    rows = torch.zeros(4, width, dtype=t)
    slots = torch.arange(4, dtype=torch.int32)
    return [KERNELS.aot_launch(launch) for launch in scatter_plan(slots, rows, cache, rows, cache)]


for _dtype in DTYPES:
    for _width in WIDTHS:
        for _layout in ("nd", "nz"):
            register_aot("torch_npu", f"kv-cache-write-{_dtype}-{_layout}-w{_width}",
                         lambda dtype=_dtype, width=_width, nz=_layout == "nz": _scatter(dtype, width, nz))
