"""Rotary position embedding of the nn layers (rotate-half convention, as in Llama / HF ``rotate_half``), in the
dtype of the angles (:func:`rotary_angles`)."""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.staging import device_constant
from ..ops.common.rotary import rotate_half


def rotary_angles(positions: Tensor, d: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` ``[T, 1, D]`` in ``dtype`` of the angles ``positions[t] * theta**(-2i/D)`` (fp32 angles),
    shared by every tensor rotated at these positions."""
    twice = (positions.to(torch.float32).unsqueeze(-1) * _inverse_frequencies(d, theta, positions.device)).unsqueeze(1)
    return twice.cos().to(dtype), twice.sin().to(dtype)


@device_constant(16)
def _inverse_frequencies(d: int, theta: float, device: torch.device) -> Tensor:
    """``theta**(-2i/D)`` twice (fp32 ``[D]``: each angle for both halves) on ``device``, made once per (D, theta,
    device); read only."""
    half = theta ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    return torch.cat([half, half])


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [T, N, D]`` (D even) by the angles of :func:`rotary_angles`."""
    return rotate_half(x, cos, sin)


def rotary_table(length: int, d: int, theta: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``[length, 2, D]`` in ``dtype``: the angles of :func:`rotary_angles` at positions ``0 .. length - 1``, row
    ``[cos, sin]`` with the sine's first half negated (:func:`attnops.ops.nsa.step.rotate_by_table`); shared by every layer that decodes
    with these sizes (made once per size; read only)."""
    return _table(length, d, theta, dtype, torch.device(device))


@device_constant(8)
def _table(length: int, d: int, theta: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    cos, sin = rotary_angles(torch.arange(length, device=device), d, theta, dtype)
    sign = torch.ones(d, dtype=dtype, device=device)
    sign[:d // 2] = -1
    return torch.cat([cos, sin * sign], 1)
