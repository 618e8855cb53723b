"""``flash_attn.layers.rotary``: rotary position embedding with flash-attn's functions, arguments and conventions.

``cos``/``sin`` are ``[seqlen_ro, rotary_dim / 2]``; the first ``rotary_dim`` values of each head are rotated, the
rest pass through. ``interleaved=False`` (GPT-NeoX) pairs dimension ``i`` with ``i + rotary_dim / 2``;
``interleaved=True`` (GPT-J) pairs ``2i`` with ``2i + 1``. Token ``s`` of sequence ``b`` is at position
``s + seqlen_offsets[b]``; a position at or past ``seqlen_ro`` is left unrotated, as flash-attn's kernel does.
Computed in fp32 (fp64 for fp64 inputs) and rounded once to ``x``'s dtype (:mod:`.ops.triton.rotary`);
differentiable, the in-place forms too, as flash-attn's autograd functions (also under ``torch.compile``).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..._core.checks import check_int, check_tensor, fail, require
from ...ops.common.rotary import rotate_half, rotate_interleaved
from ..ops.triton.rotary import check_cos_sin, positions, rotate

__all__ = ["RotaryEmbedding", "apply_rotary_emb", "apply_rotary_emb_func", "apply_rotary_emb_kv_",
           "apply_rotary_emb_qkv_", "apply_rotary_emb_torch"]


def apply_rotary_emb_torch(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """flash-attn's plain-PyTorch reference: ``x`` ``[B, S, H, D]`` rotated by ``cos``/``sin`` ``[S, rotary_dim / 2]``
    or ``[B, S, rotary_dim / 2]`` (one row per token, no offsets), computed in the dtype ``x``, ``cos`` and ``sin``
    promote to."""
    check_tensor("x", x, ndim=4)
    check_tensor("cos", cos, ndim=(2, 3))
    check_tensor("sin", sin, shape=tuple(cos.shape))
    rotary_dim = 2 * cos.shape[-1]
    require(rotary_dim <= x.shape[-1], "cos", f"[..., rotary_dim / 2] with rotary_dim <= headdim ({x.shape[-1]})", cos)
    convention = rotate_interleaved if interleaved else rotate_half
    rotated = convention(x[..., :rotary_dim], cos.unsqueeze(-2), sin.unsqueeze(-2), per_pair=True)
    return torch.cat([rotated, x[..., rotary_dim:]], -1)


def _rotate_into(out: Tensor, x: Tensor, parts, positions: Tensor, interleaved: bool,
                 conjugate: bool = False) -> Tensor:
    """``out`` with each part ``out[index]`` set to ``x[index]`` rotated by its tables (``parts``: ``((index, cos,
    sin), ...)``) at ``positions``; ``conjugate``: the inverse rotation."""
    for index, cos, sin in parts:
        out[index] = rotate(x[index], cos, -sin if conjugate else sin, positions, interleaved)
    return out


class _RotateParts(torch.autograd.Function):
    """:func:`_rotate_into` ``x`` itself when ``inplace``, else a copy: as in flash-attn's autograd functions, the
    write happens inside the function, so ``x`` may be a leaf that requires grad (the result is then a view of ``x``
    carrying the rotation's backward). Backward: the inverse rotation of the gradient's parts, in a new tensor."""

    @staticmethod
    def forward(ctx, x, parts, positions, interleaved, inplace):
        ctx.parts, ctx.interleaved = parts, interleaved
        ctx.save_for_backward(positions)
        return _rotate_into(x if inplace else x.clone(), x, parts, positions, interleaved)

    @staticmethod
    def backward(ctx, grad):
        (positions,) = ctx.saved_tensors
        return _rotate_into(grad.clone(), grad, ctx.parts, positions, ctx.interleaved, True), None, None, None, None


def _rotate_parts(x: Tensor, parts, positions: Tensor, interleaved: bool, inplace: bool) -> Tensor:
    """:class:`_RotateParts` where autograd records it; plain rotations otherwise (``inplace`` then returns ``x``
    itself)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _RotateParts.apply(x, tuple(parts), positions, interleaved, inplace)
    return _rotate_into(x if inplace else x.clone(), x, parts, positions, interleaved)


def apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False, inplace: bool = False,
                     seqlen_offsets: int | Tensor = 0, cu_seqlens: Tensor | None = None,
                     max_seqlen: int | None = None) -> Tensor:
    """flash-attn's ``apply_rotary_emb``: ``x`` ``[B, S, H, D]`` (or varlen ``[T, H, D]`` with ``cu_seqlens``
    ``[B + 1]``) rotated by ``cos``/``sin`` ``[seqlen_ro, rotary_dim / 2]`` at positions ``s + seqlen_offsets[b]``
    (``seqlen_offsets``: an int or an int32/int64 ``[B]`` tensor). ``inplace=True`` writes into ``x`` and returns
    it. ``max_seqlen`` is accepted for compatibility (the positions come from ``cu_seqlens``).

    Example::

        >>> angles = torch.rand(16, 4)
        >>> apply_rotary_emb(torch.randn(2, 16, 3, 8), angles.cos(), angles.sin()).shape
        torch.Size([2, 16, 3, 8])
    """
    check_tensor("x", x)
    check_cos_sin(x, cos, sin)
    return _rotate_parts(x, [(..., cos, sin)], positions(x, seqlen_offsets, cu_seqlens), interleaved, inplace)


apply_rotary_emb_func = apply_rotary_emb  # flash-attn's alias


def apply_rotary_emb_qkv_(qkv: Tensor, cos: Tensor, sin: Tensor, cos_k: Tensor | None = None,
                          sin_k: Tensor | None = None, interleaved: bool = False, seqlen_offsets: int | Tensor = 0,
                          num_heads_q: int | None = None) -> Tensor:
    """Rotate q and k of a packed ``qkv`` in place and return it: ``[B, S, 3, H, D]``, or with ``num_heads_q``
    ``[B, S, H_q + 2 H_k, D]`` (GQA, q heads first). ``cos_k``/``sin_k`` (default ``cos``/``sin``) rotate k."""
    check_tensor("qkv", qkv, ndim=(4, 5))
    cos_k, sin_k = (cos, sin) if cos_k is None else (cos_k, sin_k)
    if qkv.dim() == 5:
        require(qkv.shape[2] == 3 and num_heads_q is None, "qkv", "[B, S, 3, H, D] (num_heads_q None)", qkv)
        q_index, k_index = (slice(None), slice(None), 0), (slice(None), slice(None), 1)
    else:
        require(num_heads_q is not None, "num_heads_q", "the number of q heads for a [B, S, H_q + 2 H_k, D] qkv",
                None)
        h_k = (qkv.shape[2] - check_int("num_heads_q", num_heads_q, lo=1)) // 2
        require(h_k >= 1 and num_heads_q + 2 * h_k == qkv.shape[2], "qkv",
                f"[B, S, num_heads_q + 2 * H_k, D] with num_heads_q={num_heads_q}", qkv)
        q_index = (slice(None), slice(None), slice(0, num_heads_q))
        k_index = (slice(None), slice(None), slice(num_heads_q, num_heads_q + h_k))
    q = qkv[q_index]
    check_cos_sin(q, cos, sin)
    check_cos_sin(q, cos_k, sin_k, "cos_k", "sin_k")
    return _rotate_parts(qkv, [(q_index, cos, sin), (k_index, cos_k, sin_k)], positions(q, seqlen_offsets, None),
                         interleaved, True)


def apply_rotary_emb_kv_(kv: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False,
                         seqlen_offsets: int | Tensor = 0) -> Tensor:
    """Rotate k of a packed ``kv`` ``[B, S, 2, H, D]`` in place and return ``kv``."""
    check_tensor("kv", kv, ndim=5)
    require(kv.shape[2] == 2, "kv", "[B, S, 2, H, D]", kv)
    k_index = (slice(None), slice(None), 0)
    check_cos_sin(kv[k_index], cos, sin)
    return _rotate_parts(kv, [(k_index, cos, sin)], positions(kv[k_index], seqlen_offsets, None), interleaved, True)


class RotaryEmbedding(nn.Module):
    """flash-attn's ``RotaryEmbedding(dim, base=10000.0, interleaved=False, scale_base=None, pos_idx_in_fp32=True,
    device=None)``: rotates q and k of a packed ``qkv`` ``[B, S, 3, H, D]`` (or ``[B, S, H_q + 2 H_k, D]`` with
    ``num_heads_q``), or q ``[B, S, H, D]`` and a packed ``kv`` ``[B, S, 2, H, D]``, in place, at positions
    ``s + seqlen_offset``. Angles ``position * base**(-2i/dim)``; ``scale_base`` adds XPos scaling (k gets the
    reciprocal scale). The cos/sin tables are cached and grown as longer sequences arrive.
    """

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False, scale_base: float | None = None,
                 pos_idx_in_fp32: bool = True, device=None):
        super().__init__()
        self.dim = check_int("dim", dim, lo=2)
        require(dim % 2 == 0, "dim", "an even rotary dimension", dim)
        self.base, self.interleaved, self.scale_base, self.pos_idx_in_fp32 = float(base), interleaved, scale_base, \
            pos_idx_in_fp32
        half = torch.arange(0, dim, 2, device=device, dtype=torch.float32)
        self.register_buffer("inv_freq", self._inverse_frequencies(device), persistent=False)
        self.register_buffer("scale", None if scale_base is None else (half + 0.4 * dim) / (1.4 * dim),
                             persistent=False)
        self._cos_cached = self._sin_cached = self._cos_k_cached = self._sin_k_cached = None

    def _inverse_frequencies(self, device) -> Tensor:
        """fp32 ``base**(-2i/dim)``."""
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim))

    def _update_cos_sin_cache(self, seqlen: int, device: torch.device, dtype: torch.dtype) -> None:
        cached = self._cos_cached
        if (cached is not None and cached.shape[0] >= seqlen and cached.device == device
                and cached.dtype == dtype and not (self.training and cached.is_inference())):
            return
        length = max(seqlen, 1)
        if self.pos_idx_in_fp32:
            t = torch.arange(length, device=device, dtype=torch.float32)  # an fp16 copy of inv_freq is recomputed
            inv_freq = (self.inv_freq.to(device) if self.inv_freq.dtype == torch.float32
                        else self._inverse_frequencies(device))
        else:
            t = torch.arange(length, device=device, dtype=self.inv_freq.dtype)
            inv_freq = self.inv_freq.to(device)
        freqs = torch.outer(t, inv_freq)
        cos, sin = torch.cos(freqs), torch.sin(freqs)
        if self.scale is None:
            self._cos_cached, self._sin_cached = cos.to(dtype), sin.to(dtype)
            self._cos_k_cached = self._sin_k_cached = None
            return
        power = (torch.arange(length, dtype=self.scale.dtype, device=device) - length // 2) / self.scale_base
        scale = self.scale.to(device) ** power.unsqueeze(1)
        self._cos_cached, self._sin_cached = (cos * scale).to(dtype), (sin * scale).to(dtype)
        self._cos_k_cached, self._sin_k_cached = (cos / scale).to(dtype), (sin / scale).to(dtype)

    def forward(self, qkv: Tensor, kv: Tensor | None = None, seqlen_offset: int | Tensor = 0,
                max_seqlen: int | None = None, num_heads_q: int | None = None):
        """Rotate in place; returns ``qkv``, or ``(q, kv)`` when ``kv`` is given. With a tensor ``seqlen_offset``
        ``[B]``, ``max_seqlen`` (required) bounds ``S + seqlen_offset`` for the cos/sin tables."""
        seqlen = qkv.shape[1]
        if isinstance(seqlen_offset, Tensor):
            if max_seqlen is None:
                fail("max_seqlen", "an int bounding seqlen + seqlen_offset when seqlen_offset is a tensor", None)
            length = max_seqlen
        else:
            length = seqlen + check_int("seqlen_offset", seqlen_offset, lo=0)
        self._update_cos_sin_cache(length, qkv.device, qkv.dtype)
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached, self._cos_k_cached,
                                         self._sin_k_cached, self.interleaved, seqlen_offset, num_heads_q)
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached, self.interleaved, True, seqlen_offset)
        cos_k = self._cos_cached if self._cos_k_cached is None else self._cos_k_cached
        sin_k = self._sin_cached if self._sin_k_cached is None else self._sin_k_cached
        return q, apply_rotary_emb_kv_(kv, cos_k, sin_k, self.interleaved, seqlen_offset)

