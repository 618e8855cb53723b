"""Interleaved RoPE (DeepSeek's pair rotation) with a de-interleaved output, and RMSNorm, in fp32 (fp64 for fp64).

``out = cat(x_even, x_odd) * cos + cat(-x_odd, x_even) * sin`` (:func:`~attnops.ops.common.rotary.rotate_deinterleaved`):
the result keeps the evens-then-odds order (keys and queries are stored in the same order, so ``q . k`` is
unchanged).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..common.rotary import rotate_deinterleaved


def work_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def interleave_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x [..., Dr]`` rotated by ``cos``/``sin`` (broadcasting against ``x``), in the work dtype."""
    dt = work_dtype(x)
    return rotate_deinterleaved(x.to(dt), cos.to(dt), sin.to(dt))


def rms_norm(x: Tensor, gamma: Tensor, eps: float) -> Tensor:
    """``gamma * x / sqrt(mean(x^2) + eps)`` over the last dim, in the work dtype."""
    dt = work_dtype(x)
    x = x.to(dt)
    return gamma.to(dt) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
