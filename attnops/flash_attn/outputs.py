"""flash-attn's extra outputs of ``return_attn_probs=True`` from attnops' forward results: the softmax LSE and
``S_dmask`` (the probabilities of :func:`attnops.ops.flash_attention.attention_probabilities` in flash-attn's
encoding)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._core.softmax_stats import FLT_LOWEST
from ..ops.flash_attention import FlashAttentionResult


def softmax_lse(result: FlashAttentionResult, varlen: bool) -> Tensor:
    """fp32 ``logsumexp`` of each row's scores: ``[B, H, Sq]``, or ``[H, T]`` for varlen (statistics in the "TND"
    softmax layout); ``+inf`` on rows without a kept key, as flash-attn writes."""
    lse = lse_from_stats(result.softmax_max[..., 0], result.softmax_sum[..., 0])
    return lse.t() if varlen else lse


def block_size_n(head_dim: int, is_dropout: bool) -> int:
    """The key-block width of :func:`s_dmask`'s encoding for ``head_dim`` (flash-attn 2's kernel on an A100)."""
    if head_dim <= 32:
        return 128
    if head_dim <= 64:
        return 64 if is_dropout else 128
    if 96 < head_dim <= 128:
        return 32 if is_dropout else 64
    return 64


def s_dmask(signed_probs: Tensor, block_n: int, dtype: torch.dtype) -> Tensor:
    """flash-attn's ``S_dmask`` from the probabilities ``[B, H, Sq, Sk]`` (negative where dropout dropped them):
    key block ``j`` (``block_n`` keys) holds ``P * exp(lse - m_j)``, ``m_j`` the row's score maximum over blocks
    ``j`` and after (the unnormalised ``exp(S - m)`` of a kernel walking the key blocks from the last), i.e. ``P``
    divided by the largest ``P`` of those blocks; the sign is kept (dropped: negative). In ``dtype``."""
    keys = signed_probs.shape[-1]
    blocks = F.pad(signed_probs.abs(), (0, -keys % block_n)).unflatten(-1, (-1, block_n))
    running_max = blocks.amax(-1).flip(-1).cummax(-1).values.flip(-1)
    scale = running_max.repeat_interleave(block_n, -1)[..., :keys]
    return torch.where(scale > 0, signed_probs / scale, signed_probs).to(dtype)


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
