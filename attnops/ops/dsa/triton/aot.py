"""The DSA kernels in the shared AOT machinery (``attnops._core.triton``): the problems ``python -m attnops aot``
compiles, from the launchers' own plans, at DeepSeek-V3.2's shapes, fp16/bf16 (and fp32 for the plain kernels):
the lightning indexer (64 heads x 128, top-2048) over BSND keys and a paged cache, sparse flash attention
(128 heads, latent 512 + rope 64, MLA: value = key) in training (BSND) and decode (two requests of one token over a
paged cache: rows split over programs, then merged) form, its backward (training), decode over the packed
int8 / fp8 cache, and the indexer KL loss (training: 128 heads of 512 + 64 against 64 index heads of 128)."""
from __future__ import annotations

import torch

from ...._core.triton.registry import register_aot
from . import backward, kl_launch, launch
from .family import KERNELS

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
HEADS, INDEX_HEADS, INDEX_DIM, LATENT, ROPE, TOPK = 128, 64, 128, 512, 64, 2048
TOKENS, BLOCKS, PAGE = 256, 8, 64  # only the signature matters, not the sizes
REQUESTS = 2  # decode: one token per request, few programs (the split rows and their merge)


def _paged(dtype: torch.dtype, width: int) -> torch.Tensor:
    return torch.zeros(BLOCKS, PAGE, 1, width, dtype=dtype)


def _geometry(paged: bool, query: torch.Tensor, key: torch.Tensor) -> launch.Geometry:
    if not paged:
        return launch.geometry(query, key, "BSND", "BSND", None, None, None)
    table = torch.arange(BLOCKS, dtype=torch.int32).reshape(2, BLOCKS // 2)
    lens = torch.tensor([PAGE * 3, PAGE * 4], dtype=torch.int32)
    return launch.geometry(query, key, "TND", "PA_BSND", torch.arange(1, REQUESTS + 1, dtype=torch.int32), lens,
                           table)


def _query(paged: bool, dtype: torch.dtype, heads: int, width: int) -> torch.Tensor:
    return torch.zeros(((REQUESTS,) if paged else (1, TOKENS)) + (heads, width), dtype=dtype)


def _indexer(dtype: str, paged: bool) -> list:
    t = DTYPES[dtype]
    query = _query(paged, t, INDEX_HEADS, INDEX_DIM)
    key = _paged(t, INDEX_DIM) if paged else torch.zeros(1, TOKENS, 1, INDEX_DIM, dtype=t)
    weights = torch.zeros(query.shape[:-1], dtype=torch.float32)
    _, plan = launch.indexer_plan(_geometry(paged, query, key), query, key, weights, TOPK, True, not paged,
                                  interpret=False)
    return [KERNELS.aot_launch(x) for x in plan]


def _attention(dtype: str, paged: bool, codes: torch.dtype | None) -> list:
    t = DTYPES[dtype]
    query, query_rope = _query(paged, t, HEADS, LATENT), _query(paged, t, HEADS, ROPE)
    lead = (BLOCKS, PAGE) if paged else (1, TOKENS)
    if codes is None:
        latent, rope = torch.zeros(*lead, 1, LATENT, dtype=t), torch.zeros(*lead, 1, ROPE, dtype=t)
        cache = launch.plain_cache(latent, latent, rope)
    else:
        latent = torch.zeros(*lead, 1, launch.PACKED_ROW, dtype=torch.int8).view(codes)
        cache = launch.packed_cache(latent, t)
    indices = torch.zeros(*query.shape[:-2], 1, TOPK, dtype=torch.int32)
    _, plan = launch.attention_plan(_geometry(paged, query, latent), query, query_rope, cache, indices,
                                    (LATENT + ROPE) ** -0.5, 1, True, not paged, None, interpret=False)
    return [KERNELS.aot_launch(x) for x in plan]


def _attention_backward(dtype: str) -> list:
    """Training (BSND): dQ, then dK/dV over the inverted lists and the reduction of the split lists."""
    t = DTYPES[dtype]
    query, query_rope = _query(False, t, HEADS, LATENT), _query(False, t, HEADS, ROPE)
    latent, rope = torch.zeros(1, TOKENS, 1, LATENT, dtype=t), torch.zeros(1, TOKENS, 1, ROPE, dtype=t)
    indices = torch.zeros(*query.shape[:-2], 1, TOPK, dtype=torch.int32)
    stats = torch.zeros(TOKENS * HEADS, dtype=torch.float32)
    _, plan, _ = backward.attention_backward_plan(_geometry(False, query, latent), query, query, query_rope,
                                                  launch.plain_cache(latent, latent, rope), indices, query, stats,
                                                  stats, (LATENT + ROPE) ** -0.5, 1, True, interpret=False)
    return [KERNELS.aot_launch(x) for x in plan]


def _kl_loss(dtype: str) -> list:
    """Training (BSND): the indexer KL loss's row kernel and loss sum, d_key_index over the inverted lists and the
    reduction of the split lists."""
    t = DTYPES[dtype]
    query, query_rope = _query(False, t, HEADS, LATENT), _query(False, t, HEADS, ROPE)
    latent, rope = torch.zeros(1, TOKENS, 1, LATENT, dtype=t), torch.zeros(1, TOKENS, 1, ROPE, dtype=t)
    query_index, key_index = _query(False, t, INDEX_HEADS, INDEX_DIM), torch.zeros(1, TOKENS, 1, INDEX_DIM, dtype=t)
    weights = torch.zeros(query_index.shape[:-1], dtype=torch.float32)
    indices = torch.zeros(*query.shape[:-2], 1, TOPK, dtype=torch.int32)
    stats = torch.zeros(1, 1, TOKENS, HEADS, dtype=torch.float32)
    _, plan, _ = kl_launch.kl_loss_plan(_geometry(False, query, latent), query, latent, query_index, key_index,
                                        weights, indices, stats, stats, query_rope, rope, (LATENT + ROPE) ** -0.5,
                                        interpret=False)
    return [KERNELS.aot_launch(x) for x in plan]


for _dtype in DTYPES:
    if _dtype != "fp32":
        for _codes, _name in ((torch.int8, "int8"), (torch.float8_e4m3fn, "fp8")):
            register_aot("dsa", f"sparse-attention-{_name}-cache-{_dtype}",
                         lambda dtype=_dtype, codes=_codes: _attention(dtype, True, codes))
    register_aot("dsa", f"indexer-bsnd-{_dtype}", lambda dtype=_dtype: _indexer(dtype, False))
    register_aot("dsa", f"indexer-paged-{_dtype}", lambda dtype=_dtype: _indexer(dtype, True))
    register_aot("dsa", f"sparse-attention-bsnd-{_dtype}", lambda dtype=_dtype: _attention(dtype, False, None))
    register_aot("dsa", f"sparse-attention-decode-{_dtype}", lambda dtype=_dtype: _attention(dtype, True, None))
    register_aot("dsa", f"sparse-attention-backward-bsnd-{_dtype}", lambda dtype=_dtype: _attention_backward(dtype))
    register_aot("dsa", f"kl-loss-bsnd-{_dtype}", lambda dtype=_dtype: _kl_loss(dtype))
