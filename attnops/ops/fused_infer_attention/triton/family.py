"""The one kernel family of the FIA Triton kernels (decode: ``split_kernel``, ``merge_kernel``; prefill:
``prefill_kernel``) and the tile configuration of each launch: one fixed configuration (no autotuning), 16-wide tiles
in Triton's interpreter; on the GPU the largest tiles that compile without spills on sm_80 and sm_90 with Triton 3.6
and 3.9 (``python -m attnops aot --filter fused_infer``)."""
from __future__ import annotations

import torch

from ...._core.triton.launch import KernelFamily, Launch
from .codes import KV_INT4

INTERPRET_TILE = 16  # Triton's interpreter: KV tiles and query row blocks (and decode chunk grains)
MIN_ROWS = 16  # tl.dot's least rows: decode's G x Sq rows and prefill's row blocks are padded to at least this


def precision_flags(query_dtype: torch.dtype, interpret: bool) -> dict:
    """``UPCAST`` (fp32 math on loaded tiles: fp32 queries, and always in the interpreter, which has no bf16) and the
    dots' ``PRECISION``."""
    upcast = interpret or query_dtype == torch.float32
    return dict(UPCAST=upcast, PRECISION="ieee" if upcast else "tf32")


def _decode_config(launch: Launch, named_args: dict, interpret: bool):
    """The split kernel: the widest KV tile that compiles without spills. 64 or more fp16/bf16 query rows (wgmma,
    8 warps, 2 stages): 64 tokens for 64 rows, 32 for 128 rows (16 with a pse or an explicit mask); with antiquant or
    head dims over 128, 16 tokens in 1 stage. Fewer rows: 16 tokens for int4 (unpacking doubles the live tile), 32
    for fp32 (1 stage), else 64, all with 8 warps (4 spill 2 words over a paged cache at D=64 on sm_90 with Triton
    3.6). The merge kernel: 4 warps (2 for Dv <= 64)."""
    import triton

    kw = launch.kwargs
    if launch.kernel == "merge_kernel":
        return triton.Config({}, num_warps=4 if kw["BLOCK_DV"] > 64 else 2, num_stages=1)
    if interpret:
        return triton.Config(dict(BLOCK_N=INTERPRET_TILE), num_warps=4, num_stages=1)
    wide = max(kw["BLOCK_D"], kw["BLOCK_DV"]) > 128
    plain = named_args["q_ptr"].dtype != torch.float32 and not (kw["K_QUANT"] or kw["V_QUANT"] or wide)
    if kw["BLOCK_R"] >= 64 and plain:  # wgmma: 64 x 64, 128 x 32 or (per-element features) 128 x 16 score tiles
        tokens = 64 if kw["BLOCK_R"] == 64 else 16 if kw["HAS_PSE"] or kw["HAS_EXPLICIT"] else 32
        return triton.Config(dict(BLOCK_N=tokens), num_warps=8, num_stages=2)
    if kw["BLOCK_R"] >= 64:
        return triton.Config(dict(BLOCK_N=16), num_warps=8, num_stages=1)
    if KV_INT4 in (kw["K_QUANT"], kw["V_QUANT"]):
        return triton.Config(dict(BLOCK_N=16), num_warps=8, num_stages=2)
    if named_args["q_ptr"].dtype == torch.float32:  # 2 stages spill 2 words (dense, D=128, Triton 3.9)
        return triton.Config(dict(BLOCK_N=32), num_warps=8, num_stages=1)
    return triton.Config(dict(BLOCK_N=64), num_warps=8, num_stages=2)


def _prefill_config(launch: Launch, named_args: dict, interpret: bool):
    """64 query rows x 64 keys for fp16/bf16, 64 x 32 with 8 warps when a pse, an explicit mask, antiquant, a paged
    cache or head dims over 128 add per-element work (64 x 16 for int4, whose unpacking doubles the live K/V tile);
    fp32 (FMA dots, twice the bytes): 32 x 32 with 8 warps, 32 x 16 with those features; 16 x 32 with 4 warps when no
    batch has more than 16 query rows (calls the decode kernels refuse)."""
    import triton

    if interpret:
        return triton.Config(dict(BLOCK_M=INTERPRET_TILE, BLOCK_N=INTERPRET_TILE), num_warps=4, num_stages=1)
    if launch.grid[0] <= MIN_ROWS:
        return triton.Config(dict(BLOCK_M=MIN_ROWS, BLOCK_N=32), num_warps=4, num_stages=2)
    kw = launch.kwargs
    heavy = kw["PSE"] or kw["HAS_EXPLICIT"] or kw["K_QUANT"] or kw["V_QUANT"] or kw["PAGED"] or \
        max(kw["BLOCK_D"], kw["BLOCK_DV"]) > 128
    if named_args["q_ptr"].dtype == torch.float32:
        return triton.Config(dict(BLOCK_M=32, BLOCK_N=16 if heavy else 32), num_warps=8, num_stages=1)
    if KV_INT4 in (kw["K_QUANT"], kw["V_QUANT"]):
        return triton.Config(dict(BLOCK_M=64, BLOCK_N=16), num_warps=8, num_stages=2)
    if heavy:
        return triton.Config(dict(BLOCK_M=64, BLOCK_N=32), num_warps=8, num_stages=2)
    return triton.Config(dict(BLOCK_M=64, BLOCK_N=64), num_warps=4, num_stages=3)


def _tile_configs(launch: Launch, named_args: dict, interpret: bool) -> list:
    config = _prefill_config if launch.kernel == "prefill_kernel" else _decode_config
    return [config(launch, named_args, interpret)]


KERNELS = KernelFamily("fused_infer_attention", ("attnops.ops.fused_infer_attention.triton.kernels",
                                                 "attnops.ops.fused_infer_attention.triton.prefill_kernels"),
                       _tile_configs)
