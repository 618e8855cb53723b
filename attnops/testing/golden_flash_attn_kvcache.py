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
3. ``S = cap(scale * q k^T) - slope * |i + L - Sq - j|`` (``cap(x) = softcap * tanh(x / softcap)`` when
   ``softcap`` > 0); masked scores ``-inf``; ``out = softmax(S) v``; rows that keep
   nothing give 0 and lse ``+inf``.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["CAPACITY", "PAGE", "BLOCKS", "KVCacheGolden", "kvcache_golden", "kvcache_inputs", "rotary_golden"]

CAPACITY, PAGE, BLOCKS = 24, 8, 10  # tokens a sequence can hold; paged inputs: page size, pages in the cache


def _randn(*shape, dtype=torch.float32, seed=0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def kvcache_inputs(*, seed=0, dtype=torch.float32, b=2, sq=1, h=4, h_k=2, d=16, new=1, paged=False, rotary=None,
                   rotary_dim=None, batch_idx=False, leftpad=False, causal=False, window=(-1, -1), alibi=None,
                   seqlens="tensor", softcap=0.0) -> dict:
    """Random inputs of one call: a dict of ``flash_attn_with_kvcache``'s arguments. Contiguous caches are
    ``[b + 1, CAPACITY, h_k, d]``; paged ones ``BLOCKS`` pages of ``PAGE`` tokens, ``CAPACITY / PAGE`` per sequence
    in a random order. ``seqlens``: "tensor" (random int32 lengths), "int" or None."""
    g = torch.Generator().manual_seed(seed)
    rows = BLOCKS if paged else b + 1
    slots = PAGE if paged else CAPACITY
    kw = dict(q=_randn(b, sq, h, d, dtype=dtype, seed=seed),
              k_cache=_randn(rows, slots, h_k, d, dtype=dtype, seed=seed + 1),
              v_cache=_randn(rows, slots, h_k, d, dtype=dtype, seed=seed + 2), causal=causal, window_size=window,
              softcap=softcap)
    if new:
        kw.update(k=_randn(b, new, h_k, d, dtype=dtype, seed=seed + 3),
                  v=_randn(b, new, h_k, d, dtype=dtype, seed=seed + 4))
    if seqlens == "tensor":
        kw["cache_seqlens"] = torch.randint(1, CAPACITY - max(new, sq) + 1, (b,), generator=g, dtype=torch.int32)
    elif seqlens == "int":
        kw["cache_seqlens"] = CAPACITY - max(new, sq) - 3
    if paged:
        kw["block_table"] = torch.randperm(BLOCKS, generator=g)[:b * CAPACITY // PAGE].view(b, -1).to(torch.int32)
    if batch_idx:
        kw["cache_batch_idx"] = torch.randperm(rows, generator=g)[:b].to(torch.int32)
    if leftpad:
        kw["cache_leftpad"] = torch.stack([torch.randint(0, int(n) + 1, (), generator=g)
                                           for n in kw["cache_seqlens"]]).to(torch.int32)
    if rotary is not None:
        angles = torch.rand(CAPACITY, (rotary_dim or d) // 2, generator=g, dtype=torch.float64) * 2 * math.pi
        kw.update(rotary_cos=angles.cos().to(dtype), rotary_sin=angles.sin().to(dtype),
                  rotary_interleaved=rotary == "interleaved")
    if alibi == "heads":
        kw["alibi_slopes"] = torch.rand(h, generator=g) * 0.3
    elif alibi == "batch":
        kw["alibi_slopes"] = torch.rand(b, h, generator=g) * 0.3
    return kw




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
                   window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
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
        out_b, lse_b = _attend(qb.to(dtype), keys, values, scale, softcap, length, lo, left, right, slopes, h // h_k,
                               dtype)
        outs.append(out_b)
        lses.append(lse_b)
    return KVCacheGolden(torch.stack(outs), torch.stack(lses), k_cache_after, v_cache_after)


def _attend(q: Tensor, keys: Tensor, values: Tensor, scale: float, softcap: float, length: int, lo: int, left: int,
            right: int, slopes, group: int, dtype):
    """One batch: ``q [Sq, H, D]`` over ``keys/values [capacity, H_k, *]``; ``(out [Sq, H, Dv], lse [H, Sq])``."""
    sq, h, _ = q.shape
    keys = keys.repeat_interleave(group, 1)
    values = values.repeat_interleave(group, 1)
    scores = torch.einsum("ihd,jhd->hij", q, keys) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
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
