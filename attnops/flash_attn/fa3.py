"""FlashAttention-3's Python names (the ``flash_attn_interface`` module of its ``hopper`` package) on attnops.

They differ from flash-attn 2's: no dropout and no ALiBi, ``return_attn_probs=True`` returns ``(out, softmax_lse)``
(no probabilities), the qkv-packed form also takes ``[B, S, H + 2 * H_k, D]`` with ``num_heads_q``, and FA3 adds
``qv``, ``attention_chunk``, ``seqused_q/k`` and a value head dim larger than the query's. The FP8 descales are
refused; ``num_splits``, ``pack_gqa`` and ``sm_margin`` (scheduling knobs) are accepted and change nothing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .._core.checks import check_int, check_tensor, require
from .errors import flash_attn_errors
from .fa3_combine import flash_attn_combine, get_scheduler_metadata
from .fa3_segments import chunk_segments
from .flash_attn_interface import attention
from .kvcache import packed_rows, padded_queries, with_kvcache

__all__ = ["flash_attn_combine", "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_with_kvcache", "get_scheduler_metadata"]


def _refuse_unsupported(**options) -> None:
    """Raise for FA3 options attnops does not implement (each must keep its default: None or 0)."""
    for name, value in options.items():
        require(value is None or (not isinstance(value, Tensor) and value == 0), name,
                "its default (not supported by attnops)", value)


def window_pair(window_size) -> tuple[int, int]:
    """``window_size`` as a tuple of two ints: FA3 also takes a 2-element int tensor (its C++ reads both)."""
    ok = isinstance(window_size, (tuple, list, Tensor)) and len(window_size) == 2
    ok = ok and all(isinstance(w, int) or (isinstance(w, Tensor) and w.numel() == 1 and not w.is_floating_point())
                    for w in window_size)
    require(ok, "window_size", "a pair (left, right) of ints, -1 for an unbounded side", window_size)
    return tuple(int(w) for w in window_size)


def _fold_head_dims(q: Tensor, k: Tensor, v: Tensor, qv) -> tuple[Tensor, Tensor]:
    """Query and key whose scores are FA3's: with ``qv`` (``[.., H, Dv]``) ``q.k + qv.v`` as one product of
    ``[q, qv]`` and ``[k, v]``; a value head dim larger than the query's by zero columns (the core takes
    ``Dv <= D``; zeros add nothing to the scores, and their gradients are sliced off)."""
    if qv is not None:
        check_tensor("qv", qv, shape=(*q.shape[:-1], v.shape[-1]), dtypes=(q.dtype,))
        return torch.cat([q, qv], -1), torch.cat([k, v], -1)
    pad = v.shape[-1] - q.shape[-1]
    if pad > 0 and k.shape[-1] == q.shape[-1]:
        return F.pad(q, (0, pad)), F.pad(k, (0, pad))
    return q, k


def _fa3(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs, qv=None,
         attention_chunk=0, seqused_q=None, seqused_k=None, **varlen):
    """FA3's attention on the core (``varlen``: the ``cu_seqlens_q/k`` and ``max_seqlen_q/k`` of a packed call)."""
    check_tensor("q", q, ndim=3 if varlen else 4)
    check_tensor("v", v, ndim=q.dim())
    chunk = check_int("attention_chunk", attention_chunk, lo=0)
    if softmax_scale is None:
        softmax_scale = (q.shape[-1] + (0 if qv is None else v.shape[-1])) ** -0.5
    q, k = _fold_head_dims(q, k, v, qv)
    options = dict(dropout_p=0.0, softmax_scale=softmax_scale, causal=causal, window_size=window_pair(window_size),
                   softcap=softcap, alibi_slopes=None, deterministic=deterministic, return_attn_probs=True)
    if not chunk and seqused_q is None and seqused_k is None:
        out, lse, _ = attention(q, k, v, **options, **varlen)
    elif varlen:
        require(varlen["max_seqlen_k"] is not None, "max_seqlen_k", "an int bound on the key lengths", None)
        cu_q, cu_k = chunk_segments(varlen["cu_seqlens_q"], varlen["cu_seqlens_k"], seqused_q, seqused_k, chunk,
                                    varlen["max_seqlen_k"])
        out, lse, _ = attention(q, k, v, **options, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                max_seqlen_q=varlen["max_seqlen_q"], max_seqlen_k=varlen["max_seqlen_k"])
    else:  # dense with attention_chunk: the batches as packed sequences of equal lengths
        (batch, sq), sk = q.shape[:2], k.shape[1]
        steps = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
        cu_q, cu_k = chunk_segments(steps * sq, steps * sk, None, None, chunk, sk)
        out, lse, _ = attention(*(x.flatten(0, 1) for x in (q, k, v)), **options, cu_seqlens_q=cu_q,
                                cu_seqlens_k=cu_k, max_seqlen_q=sq, max_seqlen_k=sk)
        out, lse = out.unflatten(0, (batch, sq)), lse.unflatten(1, (batch, sq)).transpose(0, 1)
    return (out, lse) if return_attn_probs else out


@flash_attn_errors
def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                    pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """FA3 ``flash_attn_func``: ``q`` ``[B, Sq, H, D]``, ``k`` ``[B, Sk, H_k, D]``, ``v`` ``[B, Sk, H_k, Dv]`` (any
    ``Dv``); ``qv`` ``[B, Sq, H, Dv]`` adds ``qv . v`` to the scores (default scale then ``(D + Dv) ** -0.5``);
    ``attention_chunk`` > 0 lets row ``i`` see only the keys of its chunk ``[p - p % C, p - p % C + C)``,
    ``p = i + Sk - Sq``, on top of ``causal``/``window_size``. Returns ``out`` ``[B, Sq, H, Dv]``, or
    ``(out, softmax_lse [B, H, Sq])`` with ``return_attn_probs``."""
    _refuse_unsupported(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    return _fa3(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs, qv=qv,
                attention_chunk=attention_chunk)


@flash_attn_errors
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """FA3 ``flash_attn_varlen_func``: ``[T, H, D]`` tensors with int32 ``cu_seqlens_q/k``; ``seqused_q/k``
    (int32 ``[B]``) use only the first tokens of each segment (the other query rows give 0 and lse ``+inf``, the
    other keys are not seen), masks aligned to the used lengths. ``qv`` and ``attention_chunk`` as in
    :func:`flash_attn_func`. Returns ``out``, or ``(out, softmax_lse [H, T_q])`` with ``return_attn_probs``."""
    _refuse_unsupported(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    return _fa3(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs, qv=qv,
                attention_chunk=attention_chunk, seqused_q=seqused_q, seqused_k=seqused_k, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


@flash_attn_errors
def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None,
                              v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                              deterministic=False, num_heads_q=None, sm_margin=0, return_attn_probs=False):
    """FA3 ``flash_attn_qkvpacked_func``: ``qkv`` ``[B, S, 3, H, D]``, or ``[B, S, H + 2 * H_k, D]`` with the
    query heads first (``num_heads_q``: H, default a third of the heads)."""
    _refuse_unsupported(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    check_tensor("qkv", qkv, ndim=(4, 5))
    if qkv.dim() == 5:
        require(qkv.shape[2] == 3, "qkv", "[B, S, 3, H, D]", qkv)
        q, k, v = qkv.unbind(2)
    else:
        heads = qkv.shape[2]
        hq = heads // 3 if num_heads_q is None else num_heads_q
        require(isinstance(hq, int) and 0 < hq < heads and (heads - hq) % 2 == 0, "num_heads_q",
                f"the query heads of qkv's {heads} (the rest split evenly into keys and values)", num_heads_q)
        hk = (heads - hq) // 2
        q, k, v = qkv.split([hq, hk, hk], dim=2)
    return _fa3(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs,
                attention_chunk=attention_chunk)


def _page_table_rows(page_table, cache_batch_idx, batch: int):
    """``page_table[cache_batch_idx]``: with a paged cache FA3 reads batch ``b``'s pages from row
    ``cache_batch_idx[b]`` of the table (CPU indices are checked)."""
    check_tensor("page_table", page_table, ndim=2)
    check_tensor("cache_batch_idx", cache_batch_idx, shape=(batch,), dtypes=(torch.int32, torch.int64))
    if cache_batch_idx.device.type == "cpu" and not torch.compiler.is_compiling():
        require(bool(((cache_batch_idx >= 0) & (cache_batch_idx < page_table.shape[0])).all()), "cache_batch_idx",
                f"rows of page_table in [0, {page_table.shape[0]})", cache_batch_idx.tolist())
    return page_table.index_select(0, cache_batch_idx.long())


@flash_attn_errors
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False):
    """FA3 ``flash_attn_with_kvcache``: flash-attn 2's (:func:`attnops.flash_attn.flash_attn_with_kvcache`) with
    ``page_table`` for ``block_table``; varlen queries: ``q`` ``[T, H, D]`` with int32 ``cu_seqlens_q`` ``[B + 1]``
    and ``max_seqlen_q``, each batch's rows aligned to the bottom right of its own keys; packed new keys: ``k``/``v``
    ``[T_new, H_k, D]`` with int32 ``cu_seqlens_k_new`` ``[B + 1]``; ``rotary_seqlens`` (int32 ``[B]``): the rotary
    position of each batch's first new token (default ``cache_seqlens``); ``attention_chunk`` as in
    :func:`flash_attn_func`, counted from ``cache_leftpad``. ``scheduler_metadata`` (see
    :func:`get_scheduler_metadata`), ``num_splits``, ``pack_gqa`` and ``sm_margin`` are accepted and change nothing;
    ``qv`` ``[B, Sq, H, Dv]`` (varlen ``[T, H, Dv]``) adds ``qv . v`` to the scores (default scale
    ``(D + Dv) ** -0.5``; the cache is copied as ``[k, v]`` for it); the FP8 descales are refused. Returns ``out``, or ``(out, softmax_lse)``: ``[B, H, Sq]``, varlen
    ``[H, T]``."""
    _refuse_unsupported(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    varlen = cu_seqlens_q is not None
    require(varlen or max_seqlen_q is None, "max_seqlen_q", "None without cu_seqlens_q", max_seqlen_q)
    padded, q_lens = padded_queries(q, cu_seqlens_q, max_seqlen_q) if varlen else (q, None)
    if varlen and qv is not None:
        check_tensor("qv", qv, shape=(q.shape[0], q.shape[1], None))
        qv = padded_queries(qv, cu_seqlens_q, max_seqlen_q)[0]
    if page_table is not None and cache_batch_idx is not None:  # FA3: the batches' rows of the page table
        page_table, cache_batch_idx = _page_table_rows(page_table, cache_batch_idx, padded.shape[0]), None
    out, lse = with_kvcache(padded, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                            cache_leftpad, page_table, softmax_scale, causal, window_pair(window_size), softcap,
                            rotary_interleaved, None, num_splits, True, q_lens, cu_seqlens_k_new, rotary_seqlens,
                            attention_chunk, qv)
    if varlen:
        out, lse = packed_rows(out, cu_seqlens_q, q.shape[0]), packed_rows(lse.transpose(1, 2), cu_seqlens_q,
                                                                           q.shape[0]).t()
    return (out, lse) if return_softmax_lse else out
