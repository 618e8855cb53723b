"""The lightning indexer v2's kernel in the shared AOT machinery (``attnops._core.triton``): the problems ``python -m
attnops aot`` compiles, from the launcher's own plan, at DeepSeek-V4's shapes (64 heads x 128, top-512 as in
DSV4-Flash and top-1024 as in Pro), fp16/bf16/fp32: BSND queries over BSND compressed keys (mask mode 0) and
vllm-ascend's decode step (TND queries over a paged cache, mask mode 3, ratio 4 with residuals)."""
from __future__ import annotations

import torch

from ...._core.triton.registry import register_aot
from .indexer_v2_family import KERNELS
from .indexer_v2_launch import IndexerV2Metadata, indexer_v2_plan

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HEADS, DIM, TOKENS, BLOCKS, PAGE, REQUESTS = 64, 128, 256, 8, 128, 2  # only the signature matters, not the sizes


def _launches(dtype: str, paged: bool, topk: int) -> list:
    t = DTYPES[dtype]
    lead = (REQUESTS,) if paged else (1, TOKENS)
    query, weights = torch.zeros(*lead, HEADS, DIM, dtype=t), torch.zeros(*lead, HEADS)
    lens = torch.zeros(REQUESTS, dtype=torch.int32)
    if paged:
        key = torch.zeros(BLOCKS, PAGE, 1, DIM, dtype=t)
        meta = IndexerV2Metadata(cu_seqlens_q=torch.arange(REQUESTS + 1, dtype=torch.int32), seqused_k=lens,
                                 cmp_residual_k=lens, block_table=torch.zeros(REQUESTS, 4, dtype=torch.int32))
    else:
        key, meta = torch.zeros(1, TOKENS, 1, DIM, dtype=t), IndexerV2Metadata()
    layouts = ("TND", "PA_BSND") if paged else ("BSND", "BSND")
    _, plan = indexer_v2_plan(query, key, weights, meta, topk, *layouts, 3 if paged else 0, 4 if paged else 1,
                              interpret=False)
    return [KERNELS.aot_launch(launch) for launch in plan]


for _dtype in DTYPES:
    for _topk in (512, 1024):
        register_aot("dsv4-indexer-v2", f"bsnd-top{_topk}-{_dtype}",
                     lambda dtype=_dtype, topk=_topk: _launches(dtype, False, topk))
        register_aot("dsv4-indexer-v2", f"paged-top{_topk}-{_dtype}",
                     lambda dtype=_dtype, topk=_topk: _launches(dtype, True, topk))
