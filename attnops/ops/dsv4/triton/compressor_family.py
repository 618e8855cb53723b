"""The kernel family of the DeepSeek-V4 compressor and each kernel's one tile configuration (no autotuning:
deterministic tiles; 16-wide tiles in the interpreter). The launcher sizes its grids with the same tiles.

GPU tiles: the projection is a ``[BLOCK_T tokens, BLOCK_C columns]`` GEMM tile over ``BLOCK_K`` of the hidden size
(64 x 128 x 64 for 16-bit inputs, wgmma on sm_90; 64 x 64 x 32 for fp32), 4 warps, 3 stages; the pool holds
``BLOCK_R`` window positions x the whole row (D up to 1024) per step, 4 warps; the state save ``BLOCK_C`` columns.
"""
from __future__ import annotations

import torch

from ...._core.triton.launch import KernelFamily, Launch

INTERPRET_TILE = 16
PROJECT_TILES = {2: (64, 128, 64), 4: (64, 64, 32)}  # (BLOCK_T, BLOCK_C, BLOCK_K) on a GPU, by input bytes
POOL_ROWS = 4  # window positions per pool step on a GPU
SAVE_COLUMNS = 256


def project_tiles(dtype: torch.dtype, interpret: bool) -> tuple[int, int, int]:
    return (INTERPRET_TILE,) * 3 if interpret else PROJECT_TILES[dtype.itemsize]


def save_tile(interpret: bool) -> int:
    return INTERPRET_TILE if interpret else SAVE_COLUMNS


def _config(launch: Launch, named_args: dict, interpret: bool):
    import triton

    if launch.kernel == "compressor_project_kernel":
        t, c, k = project_tiles(named_args["x_ptr"].dtype, interpret)
        return triton.Config(dict(BLOCK_T=t, BLOCK_C=c, BLOCK_K=k), num_warps=4,
                             num_stages=1 if interpret else 3)
    if launch.kernel == "compressor_pool_kernel":
        return triton.Config(dict(BLOCK_R=4 if interpret else POOL_ROWS), num_warps=4, num_stages=1)
    return triton.Config(dict(BLOCK_C=save_tile(interpret)), num_warps=4, num_stages=1)


KERNELS = KernelFamily("dsv4-compressor", ("attnops.ops.dsv4.triton.compressor_kernel",),
                       lambda launch, named_args, interpret: [_config(launch, named_args, interpret)])
