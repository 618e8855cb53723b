"""The attention probabilities of a FlashAttention forward, rebuilt from its results (flash-attn's ``S_dmask``)."""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..common.problem import build_problem
from ..common.reference import probability_tiles
from .api import FlashAttentionResult
from .options import Options


@torch.no_grad()
def attention_probabilities(query: Tensor, key: Tensor, value: Tensor, result: FlashAttentionResult,
                            dtype: torch.dtype | None = None, **options) -> Tensor:
    """``[B, N, max Sq, max Skv]`` in ``dtype`` (default: the query's): the normalised attention probabilities of
    the :func:`flash_attention` forward that gave ``result`` (called with these keyword ``options``), negated where
    dropout dropped them; 0 where masked and past each sequence's lengths. Rebuilt densely by the CPU reference from
    the forward's statistics and Philox seed (a testing aid: quadratic memory, and device lengths are read on the
    host)."""
    resolved = dataclasses.replace(Options(**options), seed=result.seed, offset=result.offset)
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        if isinstance(getattr(resolved, name), Tensor):
            resolved = dataclasses.replace(resolved, **{name: getattr(resolved, name).tolist()})
    args = resolved.op_args(query, key)
    del args["backend"], args["precision"]  # op-level choices, not the problem's
    p = build_problem(query, key, value, **args)
    seq = p.seq
    dtype = query.dtype if dtype is None else dtype
    out = torch.zeros((seq.batch, p.geom.n1, seq.max_q, seq.max_kv), dtype=dtype, device=query.device)
    for b in range(seq.batch):
        for tile, probs in probability_tiles(p, b, query, key, result.softmax_max, result.softmax_sum):
            keep = tile.dropout_scale(torch.empty_like(probs))
            signed = probs if keep is None else torch.where(keep > 0, probs, -probs)
            out[b, tile.heads, tile.r0:tile.r1, tile.c0:tile.c1] = signed.to(dtype)
    return out
