"""The kernel family of the DSA Triton kernels and each kernel's one tile configuration (no autotuning: deterministic
tiles; 16-wide tiles in the interpreter).

GPU tiles: the indexer holds 64 query heads x ``BLOCK_N`` = 64 keys per product and a top-k vector of ``BLOCK_K``
(``sparse_count`` rounded up to a power of two); sparse attention holds ``BLOCK_H`` = 64 heads (one wgmma M tile)
against ``BLOCK_N`` gathered latent rows (32 for 16-bit caches: a 512-wide row tile is 32 KiB per stage; 16 for fp32).
"""
from __future__ import annotations

import torch

from ...._core.triton.launch import KernelFamily, Launch, pow2

INTERPRET_TILE = 16
INDEXER_KEYS = 64  # keys per indexer product on a GPU
MAX_HEAD_TILE = 64  # query heads per sparse-attention program on a GPU (the M of its products)
ATTENTION_KEYS = {1: 32, 2: 32, 4: 16}  # gathered rows per step on a GPU, by query dtype bytes (1: never)


def precision_flags(dtype: torch.dtype, interpret: bool) -> dict:
    """``UPCAST`` (fp32 math on loaded tiles: fp32 inputs, and always in the interpreter, which has no bf16) and the
    products' ``PRECISION``."""
    upcast = interpret or dtype == torch.float32
    return dict(UPCAST=upcast, PRECISION="ieee" if upcast else "tf32")


def head_tile(heads: int, interpret: bool) -> int:
    """``BLOCK_H`` of sparse attention: every head of the token up to ``MAX_HEAD_TILE`` (at least 16 rows)."""
    return pow2(heads) if interpret else min(pow2(heads), MAX_HEAD_TILE)


def topk_tile(count: int, interpret: bool) -> int:
    """``BLOCK_K`` of the indexer: ``count`` rounded up to a power of two, at least one key tile."""
    return pow2(count, INTERPRET_TILE if interpret else INDEXER_KEYS)


def _config(launch: Launch, named_args: dict, interpret: bool):
    import triton

    dtype = named_args["q_ptr"].dtype
    if launch.kernel == "indexer_topk_kernel":
        keys = INTERPRET_TILE if interpret else INDEXER_KEYS
        tiles = dict(BLOCK_N=keys, BLOCK_K=topk_tile(named_args["count"], interpret))
        return triton.Config(tiles, num_warps=4 if interpret else 8, num_stages=1 if interpret else 2)
    keys = INTERPRET_TILE if interpret else ATTENTION_KEYS[dtype.itemsize]
    return triton.Config(dict(BLOCK_N=keys), num_warps=4 if interpret else 8, num_stages=1 if interpret else 2)


KERNELS = KernelFamily("dsa", ("attnops.ops.dsa.triton.indexer", "attnops.ops.dsa.triton.sparse_attention"),
                       lambda launch, named_args, interpret: [_config(launch, named_args, interpret)])
