"""The kernel family of ``sparse_flash_mla``'s forward kernels, their one tile configuration each (no autotuning:
deterministic tiles; 16-wide tiles in the interpreter), the decode split and why a call cannot run on them.

GPU tiles (sm_90, no spills; ``python -m attnops aot --filter dsv4/``): ``BLOCK_H`` = 64 query heads (one wgmma M
tile; 32 for fp32) x ``BLOCK_DV`` = 256 output columns (a 512-wide head is two programs; 128 in the decode split)
against ``BLOCK_N`` key rows of the whole head width: 32 when both key stores are contiguous 16-bit rows, else 16
(gathers through a block table, fp32). Pure Python: no Triton import until a configuration is built.
"""
from __future__ import annotations

import torch

from ...._core.triton.launch import KernelFamily, Launch, pow2
from ...._core.triton.support import kernel_input_reason

MAX_HEAD_DIM = 512  # the head width one program holds
INTERPRET_TILE = 16
MAX_HEAD_TILE = 64  # query heads per program on a GPU (the M of its products)
VALUE_TILE, SPLIT_VALUE_TILE = 256, 128  # output columns per program on a GPU (prefill, decode split)
INTERPRET_VALUE_TILE = 32  # the interpreter's split the columns at D > 32
WIDE_KEYS, KEYS = 32, 16
SPLIT_PROGRAMS, SPLIT_KEYS = 264, 256  # decode: two waves of an H100's 132 SMs, at least 256 keys per split
INTERPRET_SPLIT_PROGRAMS, INTERPRET_SPLIT_KEYS = 8, 16


def forward_reason(q: torch.Tensor) -> str | None:
    """Why the forward kernels cannot serve a validated call with query ``q`` (None when they can)."""
    reason = kernel_input_reason(q)
    if reason is not None:
        return reason
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head dims up to {MAX_HEAD_DIM} (got D={q.shape[-1]})"
    return None


def head_tile(heads: int, dtype: torch.dtype, interpret: bool) -> int:
    """``BLOCK_H``: every head of the token up to ``MAX_HEAD_TILE`` (half for fp32; 16 in the interpreter, so that its
    tests cover several head tiles), at least 16 rows."""
    if interpret:
        return INTERPRET_TILE
    return min(pow2(heads), MAX_HEAD_TILE // (dtype.itemsize // 2))


def value_tile(dim: int, split: bool, interpret: bool) -> int:
    """``BLOCK_DV``: output columns per program (half of them in the decode split, whose paged gathers hold more
    registers: 256 spill there)."""
    if interpret:
        return min(pow2(dim), INTERPRET_VALUE_TILE)
    return min(pow2(dim), SPLIT_VALUE_TILE if split else VALUE_TILE)


def split_count(programs: int, keys: int, interpret: bool) -> int:
    """Chunks of each row's key stream (at most ``keys`` long): enough programs for the target (8 in the
    interpreter, so that its decode tests split), each chunk at least the least keys; 1 when the rows alone fill
    the GPU."""
    target, least = ((INTERPRET_SPLIT_PROGRAMS, INTERPRET_SPLIT_KEYS) if interpret
                     else (SPLIT_PROGRAMS, SPLIT_KEYS))
    if programs >= target:
        return 1
    return max(1, min(-(-target // programs), -(-keys // least)))


def _config(launch: Launch, named_args: dict, interpret: bool):
    import triton

    if launch.kernel == "sparse_flash_mla_combine_kernel":
        return triton.Config({}, num_warps=4 if interpret else 8, num_stages=1)
    if interpret:
        return triton.Config(dict(BLOCK_N=INTERPRET_TILE), num_warps=4, num_stages=1)
    wide = named_args["q_ptr"].dtype.itemsize == 2
    paged = launch.kwargs["ORI_PAGED"] or launch.kwargs["CMP_PAGED"]
    stages = 1 if paged and not wide and launch.kernel == "sparse_flash_mla_kernel" else 2  # fp32 256-column gathers
    return triton.Config(dict(BLOCK_N=WIDE_KEYS if wide and not paged else KEYS), num_warps=8, num_stages=stages)


KERNELS = KernelFamily("dsv4-sparse-flash-mla", ("attnops.ops.dsv4.triton.sparse_flash_mla_kernels",),
                       lambda launch, named_args, interpret: [_config(launch, named_args, interpret)])
