"""flash-attn's softmax LSE from attnops' forward results (``return_attn_probs=True``; the dropout-encoded
probabilities ``S_dmask`` are :func:`attnops.ops.flash_attention.attention_probabilities`)."""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.softmax_stats import FLT_LOWEST
from ..ops.flash_attention import FlashAttentionResult


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


def _lse_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _lse_backward(ctx, grad):
    """``d lse / d max = 1`` and ``d lse / d sum = 1 / sum`` on rows with a kept key, 0 elsewhere."""
    softmax_max, softmax_sum = ctx.saved_tensors
    kept = softmax_max != FLT_LOWEST
    return torch.where(kept, grad, 0), torch.where(kept, grad / softmax_sum, 0)


lse_from_stats.register_autograd(_lse_backward, setup_context=_lse_setup)
