"""``sparse_flash_mla``'s forward kernels in the shared AOT machinery (``attnops._core.triton``): the problems
``python -m attnops aot`` compiles, from the launcher's own plan, at DeepSeek-V4's shapes (64 query heads, one
shared 512-wide KV head, the 128-token window, fp16/bf16/fp32): prefill with CSA (ratio 4, top-512 index rows) over
BSND keys, with HCA (ratio 128) over TND keys and with CSA over paged caches (a chunked prefill), and decode (two
requests of one token over paged caches: each row split over programs, then combined) in both modes."""
from __future__ import annotations

import torch

from ...._core.triton.registry import register_aot
from ..validate import Args
from . import sparse_flash_mla_launch as launch
from .sparse_flash_mla_family import KERNELS

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HEADS, DIM, TOPK = 64, 512, 512
TOKENS, BLOCKS, PAGE, REQUESTS = 256, 8, 64, 2  # only the signature matters, not the sizes
I32 = torch.int32


def _prefill(dtype: str, sparse: bool) -> list:
    t = DTYPES[dtype]
    ratio = 4 if sparse else 128
    if sparse:
        q, ori = torch.zeros(1, TOKENS, HEADS, DIM, dtype=t), torch.zeros(1, TOKENS, 1, DIM, dtype=t)
        lengths = dict(cmp_kv=torch.zeros(1, TOKENS // ratio, 1, DIM, dtype=t),
                       cmp_sparse_indices=torch.zeros(1, TOKENS, 1, TOPK, dtype=I32))
    else:
        q, ori = torch.zeros(TOKENS, HEADS, DIM, dtype=t), torch.zeros(TOKENS, 1, DIM, dtype=t)
        cu = torch.tensor([0, TOKENS], dtype=I32)
        lengths = dict(cmp_kv=torch.zeros(TOKENS // ratio, 1, DIM, dtype=t), cu_seqlens_q=cu, cu_seqlens_ori_kv=cu,
                       cu_seqlens_cmp_kv=torch.tensor([0, TOKENS // ratio], dtype=I32), layout_q="TND",
                       layout_kv="TND")
    return _plan(Args(q, ori, **lengths, sinks=torch.zeros(HEADS), scale=DIM ** -0.5, cmp_ratio=ratio))


def _paged(dtype: str, sparse: bool, tokens: int) -> list:
    """``tokens`` query tokens of two requests over paged caches: a chunked prefill, or decode (one token each)."""
    t = DTYPES[dtype]
    cache = torch.zeros(BLOCKS, PAGE, 1, DIM, dtype=t)
    table = torch.arange(BLOCKS, dtype=I32).reshape(REQUESTS, BLOCKS // REQUESTS)
    indices = dict(cmp_sparse_indices=torch.zeros(tokens, 1, TOPK, dtype=I32)) if sparse else {}
    return _plan(Args(torch.zeros(tokens, HEADS, DIM, dtype=t), cache, cmp_kv=cache, ori_block_table=table,
                      cmp_block_table=table, cu_seqlens_q=torch.tensor([0, tokens // 2, tokens], dtype=I32),
                      seqused_ori_kv=torch.full((REQUESTS,), PAGE * 3, dtype=I32), sinks=torch.zeros(HEADS),
                      scale=DIM ** -0.5, cmp_ratio=4 if sparse else 128, layout_q="TND", layout_kv="PA_BBND",
                      **indices))


def _plan(a: Args) -> list:
    _, plan = launch.forward_plan(a, interpret=False)
    return [KERNELS.aot_launch(x) for x in plan]


for _dtype in DTYPES:
    for _mode, _sparse in (("csa", True), ("hca", False)):
        register_aot("dsv4", f"sparse-flash-mla-prefill-{_mode}-{_dtype}",
                     lambda dtype=_dtype, sparse=_sparse: _prefill(dtype, sparse))
        register_aot("dsv4", f"sparse-flash-mla-decode-{_mode}-{_dtype}",
                     lambda dtype=_dtype, sparse=_sparse: _paged(dtype, sparse, REQUESTS))
    register_aot("dsv4", f"sparse-flash-mla-paged-prefill-csa-{_dtype}",
                 lambda dtype=_dtype: _paged(dtype, True, TOKENS))
