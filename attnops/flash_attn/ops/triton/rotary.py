"""``flash_attn.ops.triton.rotary``: flash-attn's functional rotary embedding, :func:`apply_rotary` (no autograd;
:mod:`attnops.flash_attn.layers.rotary` builds the differentiable functions on it), in plain PyTorch on any device.

``cos``/``sin`` are ``[seqlen_ro, rotary_dim / 2]``; the first ``rotary_dim`` values of each head are rotated, the
rest pass through. ``interleaved=False`` (GPT-NeoX) pairs dimension ``i`` with ``i + rotary_dim / 2``;
``interleaved=True`` (GPT-J) pairs ``2i`` with ``2i + 1``. Token ``s`` of sequence ``b`` is at position
``s + seqlen_offsets[b]``; a position at or past ``seqlen_ro`` is left unrotated, as flash-attn's kernel does.
Computed in fp32 (fp64 for fp64 inputs) and rounded once to ``x``'s dtype.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...._core.checks import check_int, check_tensor, require
from ....ops.common.rotary import compute_dtype, rotate_half, rotate_interleaved

__all__ = ["apply_rotary"]


def positions(x: Tensor, seqlen_offsets, cu_seqlens: Tensor | None) -> Tensor:
    """int64 positions of ``x``'s tokens: ``[B, S]`` (dense) or ``[T]`` (varlen), computed on x's device."""
    if cu_seqlens is None:
        check_tensor("x", x, ndim=4)
        pos = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        return pos + (_offsets(seqlen_offsets, x.shape[0], x.device).unsqueeze(1))
    check_tensor("x", x, ndim=3)
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32, torch.int64))
    tokens = torch.arange(x.shape[0], device=x.device)
    cu = cu_seqlens.to(device=x.device, dtype=torch.int64)
    batch = torch.searchsorted(cu[1:], tokens, right=True).clamp_(max=max(cu.shape[0] - 2, 0))
    return tokens - cu[batch] + _offsets(seqlen_offsets, cu.shape[0] - 1, x.device)[batch]


def _offsets(seqlen_offsets, batch: int, device: torch.device) -> Tensor:
    """``seqlen_offsets`` (an int or a ``[B]`` integer tensor) as int64 ``[B]`` on ``device``."""
    if isinstance(seqlen_offsets, Tensor):
        check_tensor("seqlen_offsets", seqlen_offsets, shape=(batch,), dtypes=(torch.int32, torch.int64))
        return seqlen_offsets.to(device=device, dtype=torch.int64)
    return torch.full((batch,), check_int("seqlen_offsets", seqlen_offsets, lo=0), dtype=torch.int64,
                      device=device)


def check_cos_sin(x: Tensor, cos: Tensor, sin: Tensor, cos_name: str = "cos", sin_name: str = "sin") -> int:
    """Validate ``cos``/``sin`` ``[seqlen_ro, rotary_dim / 2]`` against ``x``; returns ``rotary_dim``."""
    check_tensor(cos_name, cos, ndim=2)
    check_tensor(sin_name, sin, shape=tuple(cos.shape))
    rotary_dim = 2 * cos.shape[1]
    require(rotary_dim <= x.shape[-1], cos_name, f"[seqlen_ro, rotary_dim / 2] with rotary_dim <= headdim "
            f"({x.shape[-1]})", cos)
    require(cos.device == x.device and sin.device == x.device, cos_name, f"{cos_name}/{sin_name} on {x.device} "
            "(the device of x)", cos)
    return rotary_dim


def rotate(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """``x [..., H, D]`` rotated at ``positions`` (x's leading dims) by the tables ``cos``/``sin``
    ``[seqlen_ro, rotary_dim / 2]``; positions past the table are left as they are. A new tensor."""
    rotary_dim = 2 * cos.shape[1]
    inside = (positions < cos.shape[0]).unsqueeze(-1).unsqueeze(-1)
    index = positions.clamp(max=cos.shape[0] - 1)
    compute = compute_dtype(x)
    c = torch.where(inside, cos[index].to(compute).unsqueeze(-2), 1.0)
    s = torch.where(inside, sin[index].to(compute).unsqueeze(-2), 0.0)
    convention = rotate_interleaved if interleaved else rotate_half
    rotated = convention(x[..., :rotary_dim].to(compute), c, s, per_pair=True)
    return torch.cat([rotated.to(x.dtype), x[..., rotary_dim:]], -1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, seqlen_offsets: int | Tensor = 0,
                 cu_seqlens: Tensor | None = None, max_seqlen: int | None = None, interleaved: bool = False,
                 inplace: bool = False, conjugate: bool = False) -> Tensor:
    """``x`` ``[B, S, H, D]`` (or varlen ``[T, H, D]`` with ``cu_seqlens`` ``[B + 1]``) rotated by ``cos``/``sin``
    at positions ``s + seqlen_offsets[b]`` (an int or an int32/int64 ``[B]`` tensor); ``conjugate`` rotates the
    other way (the backward). ``inplace=True`` writes into ``x`` and returns it. ``max_seqlen`` is accepted for
    compatibility (the positions come from ``cu_seqlens``)."""
    check_tensor("x", x)
    check_cos_sin(x, cos, sin)
    out = rotate(x, cos, -sin if conjugate else sin, positions(x, seqlen_offsets, cu_seqlens), interleaved)
    return x.copy_(out) if inplace else out
