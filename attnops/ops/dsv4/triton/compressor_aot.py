"""The compressor's kernels in the shared AOT machinery (``attnops._core.triton``): the problems ``python -m attnops
aot`` compiles, from the launcher's own plan, at DeepSeek-V4's shapes (hidden size 4096; only the signature matters,
not the sizes), fp16/bf16/fp32: C4A (D=512, ``coff`` 2, ratio 4), C4Li (the indexer's keys: D=128, ``coff`` 2,
ratio 4), C128A (D=512, ``coff`` 1, ratio 128), packed tokens of two requests over a paged state, and C4A in
vllm-ascend's form (RMSNorm + interleaved RoPE of the last 64 columns)."""
from __future__ import annotations

import torch

from ...._core.triton.registry import register_aot
from .compressor_family import KERNELS
from .compressor_launch import CompressorMetadata, Post, compressor_plan

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
SHAPES = {"c4a": (512, 2, 4), "c4li": (128, 2, 4), "c128a": (512, 1, 128)}  # D, coff, ratio
HIDDEN, TOKENS, BLOCKS, BLOCK_SIZE, ROPE = 4096, 256, 16, 128, 64


def _launches(dtype: str, shape: str, post: bool) -> list:
    t = DTYPES[dtype]
    dim, coff, ratio = SHAPES[shape]
    x = torch.zeros(TOKENS, HIDDEN, dtype=t)
    wkv, wgate = (torch.zeros(coff * dim, HIDDEN, dtype=t) for _ in range(2))
    state = torch.zeros(BLOCKS, BLOCK_SIZE, 2 * coff * dim)
    lens = torch.zeros(2, dtype=torch.int32)
    meta = CompressorMetadata(torch.tensor([0, 128, TOKENS], dtype=torch.int32), None, lens,
                              torch.arange(BLOCKS, dtype=torch.int32).reshape(2, -1))
    rows = min(TOKENS, TOKENS // ratio + 2)
    extra = Post(torch.zeros(dim), torch.zeros(rows, ROPE), torch.zeros(rows, ROPE), ROPE) if post else Post()
    _, plan = compressor_plan(x, wkv, wgate, state, torch.zeros(ratio, coff * dim), meta, extra, (rows, dim), ratio,
                              coff, 1, interpret=False)
    return [KERNELS.aot_launch(launch) for launch in plan]


for _dtype in DTYPES:
    for _shape in SHAPES:
        register_aot("dsv4-compressor", f"{_shape}-{_dtype}", lambda dtype=_dtype, shape=_shape: _launches(
            dtype, shape, False))
    register_aot("dsv4-compressor", f"c4a-norm-rope-{_dtype}", lambda dtype=_dtype: _launches(dtype, "c4a", True))
