"""Dense golden of flash-attn's ``flash_attn_with_kvcache`` and of its rotary embedding, written from flash-attn's
documented semantics (the ``flash_attn_with_kvcache`` and ``apply_rotary_emb`` docstrings). It imports nothing from
``attnops``: an independent judge.

Everything is computed in the ``dtype`` argument: float64 for the golden, the inputs' dtype for the "plain PyTorch
in low precision" baseline of the tolerance rule (``attnops.testing.compare``). Rotation uses complex numbers
(a pair ``(x1, x2)`` is ``x1 + i x2`` times ``cos + i sin``), a different formulation from the implementation's.
One loop over the batches:

1. The batch's cache row (``cache_batch_idx``) or its pages (``block_table``) as a dense ``[capacity, H_k, D]``
   copy; the new ``k`` (rotated at ``cache_seqlens + s``) and ``v`` written at ``cache_seqlens + s``.
2. Valid keys ``[cache_leftpad, L)`` with ``L = cache_seqlens + S_new``; query ``i`` keeps key ``j`` iff
   ``i + L - Sq - left <= j <= i + L - Sq + right`` (-1 unbounded, ``right = 0`` when causal).
3. ``S = scale * q k^T - slope * |i + L - Sq - j|``; masked scores ``-inf``; ``out = softmax(S) v``; rows that keep
   nothing give 0 and lse ``+inf``.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["rotary_golden", "kvcache_golden", "KVCacheGolden"]


def rotary_golden(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool, dtype) -> Tensor:
    """``x [..., H, D]`` rotated at integer ``positions`` (x's leading dims), computed in ``dtype``; positions at or
    past ``len(cos)`` are not rotated."""
    rd = 2 * cos.shape[1]
    y = x.to(dtype).clone()
    head = y[..., :rd]
    pairs = head.unflatten(-1, (rd // 2, 2)) if interleaved else head.unflatten(-1, (2, rd // 2)).transpose(-1, -2)
    complex_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    z = torch.complex(pairs[..., 0].to(torch.float64), pairs[..., 1].to(torch.float64)).to(complex_dtype)
    ok = positions < cos.shape[0]
    p = torch.where(ok, positions, torch.zeros_like(positions))
    c = torch.where(ok.unsqueeze(-1), cos.to(dtype)[p], torch.ones((), dtype=dtype))
    s = torch.where(ok.unsqueeze(-1), sin.to(dtype)[p], torch.zeros((), dtype=dtype))
    w = torch.complex(c.to(torch.float64), s.to(torch.float64)).to(complex_dtype).unsqueeze(-2)
    r = z * w
    r = torch.stack([r.real, r.imag], -1).to(dtype)
    head.copy_(r.flatten(-2) if interleaved else r.transpose(-1, -2).flatten(-2))
    return y


class KVCacheGolden:
    """``out [B, Sq, H, Dv]``, ``lse [B, H, Sq]`` and the caches after the call (``k_cache``, ``v_cache``)."""

    def __init__(self, out: Tensor, lse: Tensor, k_cache: Tensor, v_cache: Tensor):
        self.out, self.lse, self.k_cache, self.v_cache = out, lse, k_cache, v_cache


def kvcache_golden(q, k_cache, v_cache, k=None, v=None, *, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                   cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                   window_size=(-1, -1), rotary_interleaved=True, alibi_slopes=None,
                   dtype=torch.float64) -> KVCacheGolden:
    """The call's results, computed in ``dtype`` (the inputs are left unchanged)."""
    b_count, sq, h, d = q.shape
    h_k = k_cache.shape[2]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    left, right = window_size[0], 0 if causal else window_size[1]
    k_cache_after, v_cache_after = k_cache.clone(), v_cache.clone()
    page = k_cache.shape[1]
    capacity = page * block_table.shape[1] if block_table is not None else page
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((b_count,), cache_seqlens)
    new = 0 if k is None else k.shape[1]
    outs, lses = [], []
    for b in range(b_count):
        start = capacity if cache_seqlens is None else int(cache_seqlens[b])
        if block_table is not None:
            slots = [(int(block_table[b, t // page]), t % page) for t in range(capacity)]
        else:
            row = b if cache_batch_idx is None else int(cache_batch_idx[b])
            slots = [(row, t) for t in range(capacity)]
        if k is not None:
            pos = torch.arange(start, start + new)
            kb = k[b] if rotary_cos is None else rotary_golden(k[b], rotary_cos, rotary_sin, pos, rotary_interleaved,
                                                              dtype).to(k.dtype)
            for s in range(new):
                blk, off = slots[start + s]
                k_cache_after[blk, off] = kb[s]
                v_cache_after[blk, off] = v[b, s]
        keys = torch.stack([k_cache_after[blk, off] for blk, off in slots]).to(dtype)  # [capacity, H_k, D]
        values = torch.stack([v_cache_after[blk, off] for blk, off in slots]).to(dtype)
        qb = q[b]
        if rotary_cos is not None:
            local = causal or tuple(window_size) != (-1, -1)
            q_pos = torch.arange(start, start + sq) if local else torch.full((sq,), start)
            qb = rotary_golden(qb, rotary_cos, rotary_sin, q_pos, rotary_interleaved, dtype).to(q.dtype)
        length = start + new
        lo = 0 if cache_leftpad is None else int(cache_leftpad[b])
        slopes = None if alibi_slopes is None else alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
        out_b, lse_b = _attend(qb.to(dtype), keys, values, scale, length, lo, left, right, slopes, h // h_k, dtype)
        outs.append(out_b)
        lses.append(lse_b)
    return KVCacheGolden(torch.stack(outs), torch.stack(lses), k_cache_after, v_cache_after)


def _attend(q: Tensor, keys: Tensor, values: Tensor, scale: float, length: int, lo: int, left: int, right: int,
            slopes, group: int, dtype):
    """One batch: ``q [Sq, H, D]`` over ``keys/values [capacity, H_k, *]``; ``(out [Sq, H, Dv], lse [H, Sq])``."""
    sq, h, _ = q.shape
    keys = keys.repeat_interleave(group, 1)
    values = values.repeat_interleave(group, 1)
    scores = torch.einsum("ihd,jhd->hij", q, keys) * scale
    i = torch.arange(sq).view(sq, 1)
    j = torch.arange(keys.shape[0]).view(1, -1)
    diag = i + length - sq
    keep = (j >= lo) & (j < length) & (j <= diag + right if right >= 0 else True) & (
        j >= diag - left if left >= 0 else True)
    if slopes is not None:
        scores = scores - slopes.to(dtype).view(h, 1, 1) * (diag - j).abs().to(dtype)
    scores = scores.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(scores, -1)
    empty = ~keep.any(-1).expand(h, sq)
    probs = torch.softmax(scores, -1).masked_fill(empty.unsqueeze(-1), 0.0)
    out = torch.einsum("hij,jhd->ihd", probs, values)
    return out, torch.where(empty, torch.full_like(lse, math.inf), lse)
