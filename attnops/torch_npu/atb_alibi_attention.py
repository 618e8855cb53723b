"""torch_npu's ATB attention entry points with ATB's mask types, ALiBi included:
``torch_npu.atb._npu_flash_attention_v2`` (packed sequences attending to themselves, PA_ENCODER),
``torch_npu.atb._npu_flash_attention_prefix_v2`` (packed query tokens at the end of sequences held in a paged
cache, PREFIX_ENCODER) and ``torch_npu.atb._npu_paged_attention_v2`` (decode over a paged cache, with an optional
additive ALiBi mask).

ATB's ``mask_type``: 1 MASK_TYPE_NORM (``mask``: a non-zero entry masks, as :func:`_npu_flash_attention`),
2 MASK_TYPE_ALIBI (``mask``: an additive ``[B, N, S, S]``, ``[N, S, S]`` or ``[S, S]`` bias, each sequence using its
top-left ``[S_b, S_b]`` corner, added to the scaled scores), 3 MASK_TYPE_NORM_COMPRESS (causal; the compressed mask's
values are not read), 4 MASK_TYPE_ALIBI_COMPRESS and 5 MASK_TYPE_ALIBI_COMPRESS_SQRT (causal plus the bias
``slopes[h] * (i - j)``, resp. ``slopes[h] * sqrt(i - j)``, for query position ``i`` and key position ``j <= i``,
``slopes`` fp32 ``[num_heads]``, ATB's negated slopes; the compressed mask that encodes the same is not read).
Positions are aligned bottom-right when a sequence has more keys than queries (the prefix form).
"""
from __future__ import annotations

import itertools

import torch
from torch import Tensor

from .._core.checks import check_int, check_scale, check_tensor, int_list, require
from ._common import with_overloads
from .atb import _npu_paged_attention, _write
from .kv_cache import gather_sequences

MASK_NORM, MASK_ALIBI, MASK_NORM_COMPRESS, MASK_ALIBI_COMPRESS, MASK_ALIBI_COMPRESS_SQRT = 1, 2, 3, 4, 5
_MASK_TYPES = "1 (NORM), 2 (ALIBI), 3 (NORM_COMPRESS), 4 (ALIBI_COMPRESS) or 5 (ALIBI_COMPRESS_SQRT)"


def _heads_view(x: Tensor, name: str, heads: int) -> Tensor:
    """``[T, heads, D]`` from ``[T, heads, D]`` or ``[T, heads*D]``."""
    check_tensor(name, x, ndim=(2, 3))
    if x.dim() == 3:
        require(x.shape[1] == heads, name, f"[T, {heads}, D] or [T, {heads}*D]", x)
        return x
    require(x.shape[1] % heads == 0, name, f"[T, {heads}*D] (a multiple of {heads} columns)", x)
    return x.view(x.shape[0], heads, x.shape[1] // heads)


def _compressed_masking(mask_type: int, slopes: Tensor | None, num_heads: int) -> dict:
    """FlashAttention's arguments for the causal mask types (3, 4, 5): causal, plus ALiBi slopes for 4 and 5
    (FlashAttention's ``-slope * dist`` bias, hence the negation of ATB's slopes)."""
    if mask_type == MASK_NORM_COMPRESS:
        return dict(causal=True)
    check_tensor("slopes", slopes, shape=(num_heads,), dtypes=(torch.float32,))
    return dict(causal=True, pse=-slopes, pse_type=2 if mask_type == MASK_ALIBI_COMPRESS else 3,
                pse_bottom_right=True)


def _alibi_bias_attention(q: Tensor, k: Tensor, v: Tensor, lens: list[int], mask: Tensor, scale: float) -> Tensor:
    """MASK_TYPE_ALIBI: each sequence on its own, with its corner of the additive ``mask`` as the pse."""
    from ..ops.flash_attention import flash_attention

    check_tensor("mask", mask, ndim=(2, 3, 4), device=q.device)
    longest = max(lens, default=0)
    require(min(mask.shape[-2:]) >= longest, "mask", f"[..., S, S] with S >= the longest sequence ({longest})", mask)
    require(mask.dim() < 4 or mask.shape[0] in (1, len(lens)), "mask", f"[1 or {len(lens)}, N, S, S]", mask)
    outs = []
    for b, (start, n) in enumerate(zip(itertools.accumulate([0, *lens]), lens)):
        bias = mask[b if mask.dim() == 4 and mask.shape[0] > 1 else 0] if mask.dim() == 4 else mask
        bias = bias[..., :n, :n].reshape(1, -1, n, n).expand(1, q.shape[1], n, n).to(q.dtype)
        rows = slice(start, start + n)
        outs.append(flash_attention(q[rows].unsqueeze(0), k[rows].unsqueeze(0), v[rows].unsqueeze(0), layout="BSND",
                                    scale=scale, pse=bias, pse_type=0).squeeze(0))
    return torch.cat(outs) if outs else q.new_empty(0, q.shape[1], v.shape[2])


def _npu_flash_attention_v2(query: Tensor, key: Tensor, value: Tensor, seq_len, *, mask: Tensor | None = None,
                            slopes: Tensor | None = None, kernel_type: int = 0, mask_type: int = 2,
                            scale_value: float = 1, num_heads: int = 0, num_kv_heads: int = 0,
                            out: Tensor) -> Tensor:
    """Attention within each packed sequence (``seq_len [B]`` host lengths) under ATB's ``mask_type`` (module
    docstring): query ``[T, num_heads, D]`` or ``[T, num_heads*D]``, key ``[T, num_kv_heads(*)D]``, value
    ``[T, num_kv_heads(*)Dv]``; writes ``out`` (``[T, num_heads, Dv]`` or ``[T, num_heads*Dv]``) and returns it.
    ``kernel_type`` (0 default, 1 high precision) changes nothing: the softmax is computed in fp32."""
    from ..ops.flash_attention import flash_attention

    num_heads = check_int("num_heads", num_heads, lo=1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, lo=1)
    check_int("kernel_type", kernel_type, lo=0, hi=1)
    require(mask_type in range(1, 6), "mask_type", _MASK_TYPES, mask_type)
    q = _heads_view(query, "query", num_heads)
    k = _heads_view(key, "key", num_kv_heads)
    v = _heads_view(value, "value", num_kv_heads)
    check_tensor("out", out, device=q.device)
    lens = int_list("seq_len", seq_len)
    require(all(n >= 0 for n in lens) and sum(lens) == q.shape[0], "seq_len",
            f"non-negative per-sequence lengths summing to T={q.shape[0]}", lens)
    scale = check_scale("scale_value", scale_value)
    if mask_type == MASK_ALIBI:
        result = _alibi_bias_attention(q, k, v, lens, mask, scale)
    else:
        if mask_type == MASK_NORM:
            check_tensor("mask", mask, ndim=(2, 3), device=q.device)
            masking = dict(atten_mask=mask.reshape(mask.shape[-2:]) != 0)
        else:
            masking = _compressed_masking(mask_type, slopes, num_heads)
        cumulative = list(itertools.accumulate(lens))
        result = flash_attention(q, k, v, layout="TND", scale=scale, actual_seq_qlen=cumulative,
                                 actual_seq_kvlen=cumulative, **masking)
    _write(out, result.reshape(out.shape) if result.numel() == out.numel() else result)
    return out


def _npu_flash_attention_prefix_v2(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                                   mask: Tensor, seq_len, context_lens, *, slopes: Tensor | None = None,
                                   kernel_type: int = 1, mask_type: int = 3, num_kv_heads: int = 0,
                                   num_heads: int = 0, scale_value: float = 1, out: Tensor) -> Tensor:
    """Prefix attention: sequence ``b``'s ``seq_len[b]`` query tokens (packed ``query [T, num_heads, D]``) are the
    last of its ``context_lens[b]`` tokens, read through ``block_table[b]`` from the paged caches
    ``[num_blocks, block_size, num_kv_heads(*)D]``; causal (bottom-right), ``mask_type`` 3, 4 or 5 (module
    docstring). Writes ``out [T, num_heads, Dv]`` and returns it."""
    from ..ops.flash_attention import flash_attention

    num_heads = check_int("num_heads", num_heads, lo=1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, lo=1)
    check_int("kernel_type", kernel_type, lo=0, hi=1)
    require(mask_type in (MASK_NORM_COMPRESS, MASK_ALIBI_COMPRESS, MASK_ALIBI_COMPRESS_SQRT), "mask_type",
            "3 (NORM_COMPRESS), 4 (ALIBI_COMPRESS) or 5 (ALIBI_COMPRESS_SQRT)", mask_type)
    q = _heads_view(query, "query", num_heads)
    q_lens, kv_lens = int_list("seq_len", seq_len), int_list("context_lens", context_lens)
    require(len(kv_lens) == len(q_lens) and all(0 <= a <= b for a, b in zip(q_lens, kv_lens)), "context_lens",
            f"{len(q_lens)} lengths, each at least its seq_len", kv_lens)
    require(sum(q_lens) == q.shape[0], "seq_len", f"lengths summing to T={q.shape[0]}", q_lens)
    caches = []
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_tensor(name, cache, ndim=(3, 4), device=q.device)
        caches.append(cache if cache.dim() == 4 else cache.view(*cache.shape[:2], num_kv_heads, -1))
    k, v = gather_sequences(*caches, block_table, kv_lens)
    result = flash_attention(q, k, v, layout="TND", scale=check_scale("scale_value", scale_value),
                             actual_seq_qlen=list(itertools.accumulate(q_lens)),
                             actual_seq_kvlen=list(itertools.accumulate(kv_lens)),
                             **_compressed_masking(mask_type, slopes, num_heads))
    _write(out, result.reshape(out.shape) if result.numel() == out.numel() else result)
    return out


_npu_flash_attention_v2 = with_overloads(_npu_flash_attention_v2, out=_npu_flash_attention_v2)
_npu_flash_attention_prefix_v2 = with_overloads(_npu_flash_attention_prefix_v2, out=_npu_flash_attention_prefix_v2)


PAGED_MASK_NONE, PAGED_MASK_ALIBI = 0, 2


def _npu_paged_attention_v2(query: Tensor, key_cache: Tensor, block_table: Tensor, context_lens, *,
                            value_cache: Tensor | None = None, mask: Tensor | None = None, num_kv_heads: int = 0,
                            num_heads: int = 0, scale_value: float = 1.0, mask_type: int = 0,
                            workspace: Tensor | None = None, out: Tensor) -> Tensor:
    """Decode over a paged cache, as :func:`_npu_paged_attention` (query token ``i`` attends to the first
    ``context_lens[i]`` tokens of its sequence): ``mask_type`` 0 (no mask) or 2 (MASK_TYPE_ALIBI: ``mask``
    ``[num_tokens, num_heads, 1, >= max context]`` or ``[num_tokens, num_heads, >= max context]``, its first
    ``context_lens[i]`` columns added to token ``i``'s scaled scores). Writes ``out [num_tokens, num_heads, Dv]`` and
    returns it; ``workspace`` is accepted and unused."""
    from ..ops.flash_attention import flash_attention

    require(mask_type in (PAGED_MASK_NONE, PAGED_MASK_ALIBI), "mask_type", "0 (UNDEFINED) or 2 (MASK_TYPE_ALIBI)",
            mask_type)
    require(value_cache is not None, "value_cache", "a value cache (the key-only MLA form is not supported)",
            value_cache)
    if mask_type == PAGED_MASK_NONE:
        lens = context_lens if isinstance(context_lens, Tensor) else torch.tensor(int_list("context_lens",
                                                                                       context_lens))
        _npu_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table, lens,
                             out)
        return out
    num_heads = check_int("num_heads", num_heads, lo=1)
    check_int("num_kv_heads", num_kv_heads, lo=1)
    check_tensor("query", query, ndim=3, shape=(None, num_heads, None))
    lens = int_list("context_lens", context_lens)
    require(len(lens) == query.shape[0], "context_lens", f"one length per query token ({query.shape[0]})", lens)
    check_tensor("mask", mask, ndim=(3, 4), device=query.device)
    require(mask.shape[0] == query.shape[0] and mask.shape[1] == num_heads and mask.shape[-1] >= max(lens, default=0),
            "mask", f"[num_tokens={query.shape[0]}, num_heads={num_heads}, (1,) >= {max(lens, default=0)}]", mask)
    keys, values = gather_sequences(key_cache, value_cache, block_table, lens)
    scale = check_scale("scale_value", scale_value)
    outs = []
    for i, (start, n) in enumerate(zip(itertools.accumulate([0, *lens]), lens)):
        bias = mask[i].reshape(1, num_heads, 1, -1)[..., :n].to(query.dtype)
        rows = slice(start, start + n)
        outs.append(flash_attention(query[i:i + 1].unsqueeze(0), keys[rows].unsqueeze(0), values[rows].unsqueeze(0),
                                    layout="BSND", scale=scale, pse=bias, pse_type=0).squeeze(0))
    _write(out, torch.cat(outs))
    return out


def _npu_paged_attention_v2_get_workspace(query: Tensor, key_cache: Tensor, block_table: Tensor, context_lens, *,
                                          value_cache: Tensor | None = None, mask: Tensor | None = None,
                                          num_kv_heads: int = 0, num_heads: int = 0, scale_value: float = 1.0,
                                          mask_type: int = 0, out: Tensor) -> Tensor:
    """The workspace :func:`_npu_paged_attention_v2` needs: an empty uint8 tensor (attnops needs none)."""
    check_tensor("query", query)
    return torch.empty(0, dtype=torch.uint8, device=query.device)


_npu_paged_attention_v2 = with_overloads(_npu_paged_attention_v2, out=_npu_paged_attention_v2)
_npu_paged_attention_v2_get_workspace = with_overloads(_npu_paged_attention_v2_get_workspace)
