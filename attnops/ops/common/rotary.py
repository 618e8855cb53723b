"""Rotary position embedding (RoPE) in its three conventions, one function each.

``cos``/``sin`` broadcast against ``x``: one angle per element, laid out as the output, or with ``per_pair=True``
one angle per rotated pair (``[..., D/2]``, flash-attn's tables). Every function computes the rotation in the dtype
that ``x``, ``cos`` and ``sin`` promote to, with no cast of its own: the caller picks the precision (the operators
pass operands in :func:`compute_dtype`, fp32 or fp64, and round the result once).

- :func:`rotate_half` (GPT-NeoX / Llama, HF ``rotate_half``): element ``i`` pairs with ``i + D/2``.
- :func:`rotate_interleaved` (GPT-J): element ``2i`` pairs with ``2i + 1``; the output stays interleaved.
- :func:`rotate_deinterleaved` (DeepSeek MLA): pairs ``2i, 2i + 1`` of ``x``; the output is the evens then the odds
  (keys and queries share the order, so ``q . k`` is the interleaved rotation's).
"""
from __future__ import annotations

import torch
from torch import Tensor


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the operators rotate in: fp32, fp64 for fp64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def _rotate_pairs(x1: Tensor, x2: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The pairs ``(x1, x2)`` rotated by one angle each."""
    return x1 * cos - x2 * sin, x1 * sin + x2 * cos


def rotate_half(x: Tensor, cos: Tensor, sin: Tensor, *, per_pair: bool = False) -> Tensor:
    """``x [..., D]`` (D even) rotated with element ``i`` paired to ``i + D/2``."""
    half = x.shape[-1] // 2
    if per_pair:
        return torch.cat(_rotate_pairs(x[..., :half], x[..., half:], cos, sin), -1)
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def rotate_interleaved(x: Tensor, cos: Tensor, sin: Tensor, *, per_pair: bool = False) -> Tensor:
    """``x [..., D]`` (D even) rotated with element ``2i`` paired to ``2i + 1``, in the interleaved order."""
    if per_pair:
        return torch.stack(_rotate_pairs(x[..., 0::2], x[..., 1::2], cos, sin), -1).flatten(-2)
    pairs = x.unflatten(-1, (-1, 2))
    return x * cos + torch.stack([-pairs[..., 1], pairs[..., 0]], -1).flatten(-2) * sin


def rotate_deinterleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x [..., D]`` (D even) rotated with element ``2i`` paired to ``2i + 1``, output as the evens then the odds
    (``cos``/``sin`` in that order too)."""
    return rotate_half(torch.cat([x[..., 0::2], x[..., 1::2]], -1), cos, sin)
