"""The kernel family of the DeepSeek-V4 lightning indexer and its one tile configuration (no autotuning:
deterministic tiles; 16-wide tiles in the interpreter). On a GPU a program holds its token's heads (up to 64) x
``BLOCK_N`` keys per product (64 for 16-bit inputs: one wgmma tile; 16 for fp32) and a top-k vector of ``BLOCK_K`` =
``topk`` rounded up to a power of two, with 8 warps and 2 stages (the DSA indexer's figures: no spills on sm_90)."""
from __future__ import annotations

from ...._core.triton.launch import KernelFamily, Launch, pow2

INTERPRET_TILE = 16
INDEXER_KEYS = {2: 64, 4: 16}  # keys per product on a GPU, by input bytes


def _config(launch: Launch, named_args: dict, interpret: bool):
    import triton

    keys = INTERPRET_TILE if interpret else INDEXER_KEYS[named_args["q_ptr"].dtype.itemsize]
    tiles = dict(BLOCK_N=keys, BLOCK_K=pow2(named_args["count"], keys))
    return triton.Config(tiles, num_warps=4 if interpret else 8, num_stages=1 if interpret else 2)


KERNELS = KernelFamily("dsv4-indexer-v2", ("attnops.ops.dsv4.triton.indexer_v2_kernel",),
                       lambda launch, named_args, interpret: [_config(launch, named_args, interpret)])
