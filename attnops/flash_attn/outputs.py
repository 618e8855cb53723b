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
    m, total = result.softmax_max[..., 0], result.softmax_sum[..., 0]
    lse = torch.where(m == FLT_LOWEST, torch.full_like(m, float("inf")), m + total.log())
    return lse.t() if varlen else lse
