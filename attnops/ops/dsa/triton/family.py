"""The kernel family of the DSA Triton kernels and each kernel's one tile configuration (no autotuning: deterministic
tiles; 16-wide tiles in the interpreter).

GPU tiles: the indexer holds 64 query heads x ``BLOCK_N`` = 64 keys per product and a top-k vector of ``BLOCK_K``
(``sparse_count`` rounded up to a power of two); sparse attention holds ``BLOCK_H`` = 64 heads (one wgmma M tile)
x ``BLOCK_DV`` = 256 output columns against ``BLOCK_N`` gathered latent rows (``ATTENTION_KEYS``); the indexer KL
loss holds one query row's heads against ``KL_KEYS`` gathered entries.
"""
from __future__ import annotations

import torch

from ...._core.triton.launch import KernelFamily, Launch, pow2

INTERPRET_TILE = 16
VALUE_TILE = 256  # output (latent) columns per sparse-attention program on a GPU
INTERPRET_VALUE_TILE = 32
SPLIT_PROGRAMS, SPLIT_POSITIONS = 264, 256
INTERPRET_SPLIT_PROGRAMS, INTERPRET_SPLIT_POSITIONS = 8, 8
INDEXER_KEYS, FP32_INDEXER_KEYS = 64, 16  # keys per indexer product on a GPU (16-bit inputs, fp32)
# warps per indexer program (16-bit inputs, fp32): fp32 products run on the CUDA cores with the query tile in
# registers; at 8 warps its paged form spills 4 words on sm_90 (Triton 3.9), at 16 none there
INDEXER_WARPS, FP32_INDEXER_WARPS = 8, 16
MAX_HEAD_TILE = 64  # query heads per sparse-attention program on a GPU (the M of its products)
# gathered rows per sparse-attention step on a GPU: 32 for a dense 16-bit cache, 16 through a block table (3 stages
# from a plain 16-bit cache, 1 for fp32), for a quantized cache (dequantization registers) and for fp32; the
# compiler's figures (python -m attnops aot --filter dsa): no spills that way
WIDE_ATTENTION_KEYS = 32
ATTENTION_KEYS = 16
# the backward on a GPU: dQ holds BACKWARD_HEADS heads x the whole latent (its fp32 accumulator) against
# BACKWARD_DQ_KEYS gathered rows; dK/dV holds BACKWARD_KEYS rows of a block (also in the interpreter: the grid counts
# them) against BACKWARD_ROWS (pair, query head) rows per step
BACKWARD_HEADS = 64
DQ_TILE, INTERPRET_DQ_TILE = 256, 16  # dQ columns per program (the interpreter's tests split the latent too)
DK_TILE, INTERPRET_DK_TILE = 256, 16  # dK/dV columns per program
BACKWARD_CHUNK = 64  # columns per step of the dK/dV kernel's score and dO V^T sums on a GPU
BACKWARD_DQ_KEYS = 16
BACKWARD_KEYS = 16
BACKWARD_ROWS = 64
BACKWARD = ("sparse_attention_dq_kernel", "sparse_attention_dkdv_kernel", "sparse_attention_dkdv_reduce_kernel")
# the indexer KL loss on a GPU: the row kernel gathers KL_KEYS entries per step (every query head x KL_CHUNK latent
# columns of the main attention's scores at a time), the key kernel KL_PAIR_ROWS (pair, index head) rows per step
KL_LOSS = ("indexer_kl_loss_kernel", "indexer_kl_loss_dk_kernel", "indexer_kl_loss_sum_kernel")
KL_KEYS, KL_CHUNK, KL_PAIR_ROWS = 16, 64, 64


def precision_flags(dtype: torch.dtype, interpret: bool) -> dict:
    """``UPCAST`` (fp32 math on loaded tiles: fp32 inputs, and always in the interpreter, which has no bf16) and the
    products' ``PRECISION``."""
    upcast = interpret or dtype == torch.float32
    return dict(UPCAST=upcast, PRECISION="ieee" if upcast else "tf32")


def head_tile(heads: int, dtype: torch.dtype, interpret: bool) -> int:
    """``BLOCK_H`` of sparse attention: every head of the token up to ``MAX_HEAD_TILE`` (half of it for fp32, whose
    query tile would not fit in sm_80's shared memory), at least 16 rows."""
    if interpret:
        return pow2(heads)
    return min(pow2(heads), MAX_HEAD_TILE // (dtype.itemsize // 2))


def backward_head_tile(heads: int, dtype: torch.dtype, interpret: bool) -> int:
    """``BLOCK_H`` of the dQ kernel: every head of the token up to ``BACKWARD_HEADS`` (half of it for fp32)."""
    if interpret:
        return pow2(heads)
    return min(pow2(heads), BACKWARD_HEADS // (dtype.itemsize // 2))


def dq_tile(d: int, interpret: bool) -> int:
    """``BLOCK_DQ`` of the dQ kernel: latent columns of dQ per program (``DQ_TILE`` on a GPU)."""
    return min(pow2(d), INTERPRET_DQ_TILE if interpret else DQ_TILE)


def dk_tile(width: int, dtype: torch.dtype, interpret: bool) -> int:
    """``BLOCK_DK`` of the dK/dV kernel: key (and value) gradient columns per program (``DK_TILE`` on a GPU, half
    of it for fp32)."""
    return min(pow2(width), INTERPRET_DK_TILE if interpret else DK_TILE // (dtype.itemsize // 2))


def value_tile(dv: int, interpret: bool) -> int:
    """``BLOCK_DV`` of sparse attention: output columns per program (``VALUE_TILE`` on a GPU, 32 in the interpreter,
    so that its tests cover both the one-tile and the split form)."""
    return min(pow2(dv), INTERPRET_VALUE_TILE if interpret else VALUE_TILE)


def split_count(programs: int, positions: int, interpret: bool) -> int:
    """Splits of each row's entries (decode): enough programs for ``SPLIT_PROGRAMS`` (two waves of an H100's 132 SMs;
    8 in the interpreter, so that its decode tests split), at least ``SPLIT_POSITIONS`` positions each; 1
    when the rows alone fill the GPU."""
    target, least = (INTERPRET_SPLIT_PROGRAMS, INTERPRET_SPLIT_POSITIONS) if interpret else (SPLIT_PROGRAMS,
                                                                                               SPLIT_POSITIONS)
    if programs >= target:
        return 1
    return max(1, min(-(-target // programs), positions // least))


def topk_tile(count: int, interpret: bool) -> int:
    """``BLOCK_K`` of the indexer: ``count`` rounded up to a power of two, at least one key tile."""
    return pow2(count, INTERPRET_TILE if interpret else INDEXER_KEYS)


def _config(launch: Launch, named_args: dict, interpret: bool):
    import triton

    if launch.kernel == "sparse_attention_merge_kernel":  # a [64, 256] fp32 accumulator: 8 warps, no spills
        return triton.Config({}, num_warps=4 if interpret else 8, num_stages=1)
    if launch.kernel in BACKWARD:
        return _backward_config(launch, named_args, interpret)
    if launch.kernel in KL_LOSS:
        return _kl_loss_config(launch, named_args, interpret)
    dtype = named_args["q_ptr"].dtype
    if interpret:
        tiles = dict(BLOCK_N=INTERPRET_TILE)
        if launch.kernel == "indexer_topk_kernel":
            tiles["BLOCK_K"] = topk_tile(named_args["count"], interpret)
        return triton.Config(tiles, num_warps=4, num_stages=1)
    if launch.kernel == "indexer_topk_kernel":
        keys = INDEXER_KEYS if dtype.itemsize == 2 else FP32_INDEXER_KEYS
        tiles = dict(BLOCK_N=keys, BLOCK_K=topk_tile(named_args["count"], interpret))
        return triton.Config(tiles, num_warps=INDEXER_WARPS if dtype.itemsize == 2 else FP32_INDEXER_WARPS,
                             num_stages=2)
    paged = launch.kwargs["KV_MODE"] == 2
    dense = not paged and not launch.kwargs["QUANT"] and dtype.itemsize == 2
    if dtype.itemsize == 4:
        stages = 1 if paged else 2
    else:
        stages = 3 if paged and not launch.kwargs["QUANT"] else 2
    return triton.Config(dict(BLOCK_N=WIDE_ATTENTION_KEYS if dense else ATTENTION_KEYS), num_warps=8,
                         num_stages=stages)


def _backward_config(launch: Launch, named_args: dict, interpret: bool):
    import triton

    if launch.kernel == "sparse_attention_dkdv_reduce_kernel":
        return triton.Config({}, num_warps=4, num_stages=1)
    if launch.kernel == "sparse_attention_dkdv_kernel":
        if interpret:
            return triton.Config(dict(BLOCK_M=INTERPRET_TILE, BLOCK_C=INTERPRET_TILE), num_warps=4, num_stages=1)
        wide = named_args["q_ptr"].dtype.itemsize // 2  # fp32: half the rows and chunk columns
        return triton.Config(dict(BLOCK_M=BACKWARD_ROWS // wide, BLOCK_C=BACKWARD_CHUNK // wide), num_warps=8,
                             num_stages=2)
    if interpret:
        return triton.Config(dict(BLOCK_N=INTERPRET_TILE, BLOCK_C=INTERPRET_TILE), num_warps=4, num_stages=1)
    wide = named_args["q_ptr"].dtype.itemsize // 2
    return triton.Config(dict(BLOCK_N=BACKWARD_DQ_KEYS, BLOCK_C=BACKWARD_CHUNK // wide), num_warps=8, num_stages=2)


def _kl_loss_config(launch: Launch, named_args: dict, interpret: bool):
    import triton

    if launch.kernel == "indexer_kl_loss_sum_kernel":
        return triton.Config({}, num_warps=4, num_stages=1)
    if launch.kernel == "indexer_kl_loss_dk_kernel":
        return triton.Config(dict(BLOCK_M=INTERPRET_TILE if interpret else KL_PAIR_ROWS), num_warps=4, num_stages=1)
    if interpret:
        return triton.Config(dict(BLOCK_N=INTERPRET_TILE, BLOCK_C=INTERPRET_TILE), num_warps=4, num_stages=1)
    wide = named_args["q_ptr"].dtype.itemsize // 2  # fp32: half the chunk columns
    return triton.Config(dict(BLOCK_N=KL_KEYS, BLOCK_C=KL_CHUNK // wide), num_warps=8, num_stages=1)


KERNELS = KernelFamily("dsa", ("attnops.ops.dsa.triton.indexer", "attnops.ops.dsa.triton.sparse_attention",
                               "attnops.ops.dsa.triton.sparse_attention_bwd", "attnops.ops.dsa.triton.kl_loss"),
                       lambda launch, named_args, interpret: [_config(launch, named_args, interpret)])
