"""flash-attn's extra outputs from attnops' forward results: the softmax LSE and the dropout-encoded probabilities
(``S_dmask``) that ``return_attn_probs=True`` returns."""
from __future__ import annotations

import inspect

import torch
from torch import Tensor

from .._core.softmax_stats import FLT_LOWEST
from ..ops.flash_attention import FlashAttentionResult, flash_attention
from ..ops.flash_attention.api import _OPTIONS, _op_args
from ..ops.common.problem import build_problem
from ..ops.common.reference import probability_tiles

_DEFAULTS = {name: param.default for name, param in inspect.signature(flash_attention).parameters.items()
             if name in _OPTIONS}  # every option of the forward, for rebuilding its problem


def softmax_lse(result: FlashAttentionResult, varlen: bool) -> Tensor:
    """fp32 ``logsumexp`` of each row's scores: ``[B, H, Sq]``, or ``[H, T]`` for varlen (statistics in the "TND"
    softmax layout); ``+inf`` on rows without a kept key, as flash-attn writes."""
    lse = lse_from_stats(result.softmax_max[..., 0], result.softmax_sum[..., 0])
    return lse.t() if varlen else lse


@torch.library.custom_op("attnops::flash_attn_lse_from_stats", mutates_args=())
def lse_from_stats(softmax_max: Tensor, softmax_sum: Tensor) -> Tensor:
    """``max + log(sum)``, ``+inf`` where ``max`` is FLT_LOWEST (no kept key). A custom op so that a compiled
    caller gets the eager bits: Inductor would generate its own ``log``, which may differ in the last bit."""
    return torch.where(softmax_max == FLT_LOWEST, torch.full_like(softmax_max, float("inf")),
                       softmax_max + softmax_sum.log())


@lse_from_stats.register_fake
def _(softmax_max, softmax_sum):
    return torch.empty_like(softmax_max)


@torch.no_grad()
def dropout_probs(query: Tensor, key: Tensor, value: Tensor, result: FlashAttentionResult, options: dict) -> Tensor:
    """``S_dmask`` ``[B, H, max Sq, max Skv]`` in the query's dtype: the normalised attention probabilities of the
    forward that gave ``result`` (called with ``options``), negated where dropout dropped them; 0 where masked and
    past each sequence's lengths. Rebuilt densely by the CPU reference from the forward's statistics and Philox
    seed (a testing aid, as in flash-attn: quadratic memory, and device lengths are read on the host)."""
    options = {**_DEFAULTS, **options, "seed": result.seed, "offset": result.offset}
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        if isinstance(options.get(name), Tensor):
            options[name] = options[name].tolist()
    args = _op_args(query, key, **options)
    del args["backend"], args["precision"]  # op-level choices, not the problem's
    p = build_problem(query, key, value, **args)
    seq = p.seq
    out = torch.zeros((seq.batch, p.geom.n1, seq.max_q, seq.max_kv), dtype=query.dtype, device=query.device)
    for b in range(seq.batch):
        for tile, probs in probability_tiles(p, b, query, key, result.softmax_max, result.softmax_sum):
            keep = tile.dropout_scale(torch.empty_like(probs))
            signed = probs if keep is None else torch.where(keep > 0, probs, -probs)
            out[b, tile.heads, tile.r0:tile.r1, tile.c0:tile.c1] = signed.to(query.dtype)
    return out
