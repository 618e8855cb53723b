"""Rotary position embedding (rotate-half convention, as in Llama / HF ``rotate_half``)."""
from __future__ import annotations

import torch
from torch import Tensor


def apply_rotary(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotate ``x [T, N, D]`` (D even) by the angles ``positions[t] * theta**(-2i/D)``."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [T, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1).unsqueeze(1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).unsqueeze(1).to(x.dtype)
    half = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-half[1], half[0]], -1) * sin
