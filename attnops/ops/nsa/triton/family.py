"""The one kernel family of every NSA Triton kernel (selected attention, compression, compressed-attention scores,
top-k, decode) and the tile configuration of each kernel: one fixed configuration per kernel (no autotuning: the plans
size their grids and buffers with the same tiles), 16-wide tiles in the interpreter.

The GPU configurations come from the compiler's figures (``python -m attnops aot --filter nsa``, Triton 3.6 and
3.9): no register spills on sm_80/sm_90 for fp16/bf16/fp32 and head dims 128 and 192/128.
"""
from __future__ import annotations

import torch

from ...._core.triton.launch import KernelFamily, Launch, fold_grid, pow2

MAX_GRID = 65535  # CUDA's limit on a grid's second and third extents
INTERPRET_TILE = 16
MAX_KEY_TILE = {2: 64, 4: 32}  # keys of a selected block per step on a GPU, by operand bytes
COMPRESSION_ROWS = 32  # compressed rows (tokens for the input gradient) per compression program on a GPU
SCORE_BLOCK_K = 16  # selection blocks per score program (the score grid's third extent counts such tiles)
MAX_TOPK_TILE = 2048  # block scores the top-k kernel holds per step on a GPU
# importance_kernel on a GPU, by operand bytes: (BLOCK_M, BLOCK_N, warps); fp32 above D=128 takes
# WIDE_FP32_IMPORTANCE_WARPS (8 warps spill 2 words there, 4 with an explicit mask)
IMPORTANCE_TILES = {2: (64, 32, 8), 4: (16, 16, 8)}
WIDE_FP32_IMPORTANCE_WARPS = 2
# compress_dx_kernel in fp32 above D=128 (8 warps spill 2 words on sm_80 with Triton 3.9); the selected forward takes
# 4 warps at 16 bits and D <= 128 like the rest (8 spilled 2 words on sm_90 with Triton 3.9 at D=128)
WIDE_FP32_DX_WARPS = 4
# selected dK/dV on a GPU: (entry, query head) rows per step by operand bytes (the N of its [BLOCK_N x BLOCK_R]
# products: 64 spills at D >= 128; with a split head dim (D=192) 16, as 32 spills on sm_80); list chunks:
# attnops.ops.common.inverted_lists.list_chunk
DKDV_ROWS = {2: 32, 4: 16}
SPLIT_DKDV_ROWS = 16
SELECTED = ("selected_fwd_kernel", "selected_dq_kernel", "selected_dkdv_kernel", "selected_dkdv_reduce_kernel")
DECODE = ("selected_decode_kernel", "compress_decode_kernel", "compress_decode_score_kernel")
MERGE = "decode_merge_kernel"
STEP = "decode_step_kernel"
STEP_HEADS = 16  # heads per step of the decoding-step preparation (a [16, D] tile of each operand)
STEP_MASK_COLUMNS = 128  # mask columns per step of the decoding-step preparation
COMPRESS = ("compress_fwd_kernel", "compress_dx_kernel", "compress_dw_kernel")


def pair_grid(rows: int, batch: int, heads: int) -> tuple[tuple[int, int, int], int, dict]:
    """``(grid, bh_fold, constexprs)`` of a kernel over ``rows`` of a batch x (batch, head) pairs, the pairs folded
    into axes 1 and 2 past ``bh_fold = MAX_GRID`` (:func:`~attnops._core.triton.launch.fold_grid`; a constant
    argument, so the kernels are not specialised on it)."""
    grid, constexprs = fold_grid(rows, batch * heads, MAX_GRID)
    return grid, MAX_GRID, constexprs


def importance_tiles(dtype: torch.dtype, interpret: bool) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, warps)`` of ``importance_kernel``: ``IMPORTANCE_TILES`` by operand bytes on a GPU."""
    return (INTERPRET_TILE, INTERPRET_TILE, 4) if interpret else IMPORTANCE_TILES[dtype.itemsize]


def key_tile(block_size: int, dtype: torch.dtype, interpret: bool) -> int:
    """``BLOCK_N`` of the selected-attention kernels: keys of a selected block per step."""
    return min(pow2(block_size), INTERPRET_TILE if interpret else MAX_KEY_TILE[dtype.itemsize])


def head_tiles(d: int) -> tuple[int, int, bool]:
    """``(BLOCK_D, BLOCK_DT, SPLIT_D)`` of selected dK/dV: a head dim between 128 and 256 that is not a power of two
    is two tiles, 128 columns and the rest (D=192: 128 + 64, not a 256-wide tile with 64 padding columns in the
    accumulator, which spills); else one tile (``BLOCK_DT`` unused)."""
    if 128 < d < pow2(d):
        return 128, pow2(d - 128), True
    return pow2(d), 16, False


def row_tile(interpret: bool) -> int:
    """``BLOCK_R`` of the compression kernels: compressed rows (tokens) per program."""
    return INTERPRET_TILE if interpret else COMPRESSION_ROWS


def precision_flags(dtype: torch.dtype, interpret: bool) -> dict:
    """``UPCAST`` (fp32 math on loaded tiles: fp32 inputs, and always in the interpreter, which has no bf16) and the
    dots' ``PRECISION``."""
    upcast = interpret or dtype == torch.float32
    return dict(UPCAST=upcast, PRECISION="ieee" if upcast else "tf32")


def _training_config(launch: Launch, named_args: dict, interpret: bool):
    """Selected attention and compression: 4 warps (8 at head dims > 128 and for fp32, but ``WIDE_FP32_DX_WARPS`` for
    the compression's input gradient at head dims > 128 in fp32), 2 stages; the selected forward and dQ, whose one
    loop over (slot, key tile) the compiler pipelines, 3 (the keys and values of step ``i + 2`` load while step ``i``
    computes; fp32: 1, which never spills)."""
    import triton

    dtype = launch.args[0].dtype
    fp32 = dtype == torch.float32
    if launch.kernel in SELECTED:
        tiles = {"BLOCK_N": key_tile(named_args["block_size"], dtype, interpret)}
    elif launch.kernel in COMPRESS:
        tiles = {"BLOCK_R": row_tile(interpret)}
    else:
        tiles = {}
    wide = max(launch.kwargs.get("BLOCK_D", 0), launch.kwargs.get("BLOCK_DV", 0)) > 128
    warps = 8 if wide or fp32 else 4
    if launch.kernel == "compress_dx_kernel" and wide and fp32:
        warps = WIDE_FP32_DX_WARPS
    if interpret:
        stages = 1
    elif launch.kernel in ("selected_fwd_kernel", "selected_dq_kernel"):
        stages = 1 if fp32 else 3
    else:
        stages = 2
    return triton.Config(tiles, num_warps=warps, num_stages=stages)


def _dkdv_config(launch: Launch, named_args: dict, interpret: bool):
    """Selected dK/dV: ``BLOCK_N`` keys (:func:`key_tile`) x ``BLOCK_R`` rows per step (``DKDV_ROWS``;
    ``SPLIT_DKDV_ROWS`` with a split head dim), 8 warps, 2 stages (3 with a split head dim: fewer registers)."""
    import triton

    dtype = named_args["q_ptr"].dtype
    split = launch.kwargs["SPLIT_D"]
    rows = min(DKDV_ROWS[dtype.itemsize], SPLIT_DKDV_ROWS) if split else DKDV_ROWS[dtype.itemsize]
    tiles = dict(BLOCK_N=key_tile(named_args["block_size"], dtype, interpret),
                 BLOCK_R=INTERPRET_TILE if interpret else rows)
    if interpret:
        return triton.Config(tiles, num_warps=4, num_stages=1)
    return triton.Config(tiles, num_warps=8, num_stages=3 if split else 2)


def _decode_config(launch: Launch, named_args: dict, interpret: bool):
    """Decode: ``BLOCK_N`` keys per step (64; 32 at head dims > 128; 16 for fp32), 4 warps, 2 stages."""
    import triton

    fp32 = named_args["q_ptr"].element_size() == 4
    wide = launch.kwargs["BLOCK_D"] > 128
    tiles = dict(BLOCK_N=INTERPRET_TILE if interpret else 16 if fp32 else 32 if wide else 64)
    if launch.kernel == "compress_decode_score_kernel":
        tiles["BLOCK_K"] = SCORE_BLOCK_K
    return triton.Config(tiles, num_warps=4, num_stages=2)


def _plain_config():
    import triton

    return triton.Config({}, num_warps=4, num_stages=1)


def _importance_config(launch: Launch, named_args: dict, interpret: bool):
    """Compressed-attention scores: :func:`importance_tiles` (the plan sizes its grid with them), 1 stage."""
    import triton

    if interpret:
        return triton.Config(dict(BLOCK_M=INTERPRET_TILE, BLOCK_N=INTERPRET_TILE, BLOCK_K=SCORE_BLOCK_K))
    dtype = named_args["q_ptr"].dtype
    m, n, warps = importance_tiles(dtype, interpret)
    if dtype.itemsize == 4 and launch.kwargs["BLOCK_D"] > 128:
        warps = WIDE_FP32_IMPORTANCE_WARPS
    return triton.Config(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=SCORE_BLOCK_K), num_warps=warps, num_stages=1)


def _topk_config(launch: Launch, named_args: dict, interpret: bool):
    """Top-k: ``BLOCK_W`` scores per step (the whole row up to ``MAX_TOPK_TILE``), 4 warps, 1 stage."""
    import triton

    tile = INTERPRET_TILE if interpret else min(pow2(named_args["width"]), MAX_TOPK_TILE)
    return triton.Config(dict(BLOCK_W=tile), num_warps=4, num_stages=1)


def _tile_configs(launch: Launch, named_args: dict, interpret: bool) -> list:
    """The one configuration of ``launch``."""
    if launch.kernel == STEP:  # elementwise over [STEP_HEADS, D] tiles: 4 warps, no pipelining
        import triton

        return [triton.Config(dict(BLOCK_H=STEP_HEADS, BLOCK_C=STEP_MASK_COLUMNS), num_warps=4, num_stages=1)]
    if launch.kernel == "topk_kernel":
        return [_topk_config(launch, named_args, interpret)]
    if launch.kernel == "importance_kernel":
        return [_importance_config(launch, named_args, interpret)]
    if launch.kernel in DECODE:
        return [_decode_config(launch, named_args, interpret)]
    if launch.kernel == MERGE:  # a few loads and stores per (request, KV head): no tiles, no pipelining
        return [_plain_config()]
    if launch.kernel == "selected_dkdv_kernel":
        return [_dkdv_config(launch, named_args, interpret)]
    return [_training_config(launch, named_args, interpret)]


KERNELS = KernelFamily("nsa", ("attnops.ops.nsa.triton.selected", "attnops.ops.nsa.triton.compress",
                               "attnops.ops.nsa.triton.compress_attention", "attnops.ops.nsa.triton.decode",
                               "attnops.ops.nsa.triton.topk", "attnops.ops.nsa.triton.step"), _tile_configs)
