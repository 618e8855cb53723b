"""FlashAttention-3's Python names (the ``flash_attn_interface`` module of its ``hopper`` package) on attnops.

They differ from flash-attn 2's: no dropout and no ALiBi, ``return_attn_probs=True`` returns ``(out, softmax_lse)``
(no probabilities), the qkv-packed form also takes ``[B, S, H + 2 * H_k, D]`` with ``num_heads_q``. The FP8
descales, ``qv``, ``attention_chunk`` and ``seqused_q/k`` are refused; ``num_splits``, ``pack_gqa`` and
``sm_margin`` (scheduling knobs) are accepted and change nothing.
"""
from __future__ import annotations

from torch import Tensor

from .._core.checks import check_tensor, require
from .flash_attn_interface import attention
from .kvcache import packed_rows, padded_queries, with_kvcache

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]


def _refuse_unsupported(**options) -> None:
    """Raise for FA3 options attnops does not implement (each must keep its default: None or 0)."""
    for name, value in options.items():
        require(value is None or (not isinstance(value, Tensor) and value == 0), name,
                "its default (not supported by attnops)", value)


def _fa3(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs, **varlen):
    out = attention(q, k, v, dropout_p=0.0, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                    softcap=softcap, alibi_slopes=None, deterministic=deterministic,
                    return_attn_probs=return_attn_probs, **varlen)
    return out[:2] if return_attn_probs else out


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                    pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """FA3 ``flash_attn_func``: ``q`` ``[B, Sq, H, D]``, ``k``/``v`` ``[B, Sk, H_k, D]``; returns ``out``, or
    ``(out, softmax_lse [B, H, Sq])`` with ``return_attn_probs``."""
    _refuse_unsupported(qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                        attention_chunk=attention_chunk)
    return _fa3(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    """FA3 ``flash_attn_varlen_func``: ``[T, H, D]`` tensors with int32 ``cu_seqlens_q/k``; returns ``out``, or
    ``(out, softmax_lse [H, T_q])`` with ``return_attn_probs``."""
    _refuse_unsupported(seqused_q=seqused_q, seqused_k=seqused_k, qv=qv, q_descale=q_descale, k_descale=k_descale,
                        v_descale=v_descale, attention_chunk=attention_chunk)
    return _fa3(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs,
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k)


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None,
                              v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                              deterministic=False, num_heads_q=None, sm_margin=0, return_attn_probs=False):
    """FA3 ``flash_attn_qkvpacked_func``: ``qkv`` ``[B, S, 3, H, D]``, or ``[B, S, H + 2 * H_k, D]`` with the
    query heads first (``num_heads_q``: H, default a third of the heads)."""
    _refuse_unsupported(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                        attention_chunk=attention_chunk)
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
    return _fa3(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False):
    """FA3 ``flash_attn_with_kvcache``: flash-attn 2's (:func:`attnops.flash_attn.flash_attn_with_kvcache`) with
    ``page_table`` for ``block_table``, and varlen queries: ``q`` ``[T, H, D]`` with int32 ``cu_seqlens_q``
    ``[B + 1]`` and ``max_seqlen_q``, each batch's rows aligned to the bottom right of its own keys (its new
    ``k``/``v`` then ``[B, S_new, H_k, D]``). ``scheduler_metadata``, ``num_splits``, ``pack_gqa`` and ``sm_margin``
    are accepted and change nothing; ``qv``, the FP8 descales, ``cu_seqlens_k_new``, ``rotary_seqlens`` and
    ``attention_chunk`` are refused. Returns ``out``, or ``(out, softmax_lse)``: ``[B, H, Sq]``, varlen
    ``[H, T]``."""
    _refuse_unsupported(qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                        cu_seqlens_k_new=cu_seqlens_k_new, rotary_seqlens=rotary_seqlens,
                        attention_chunk=attention_chunk)
    varlen = cu_seqlens_q is not None
    require(varlen or max_seqlen_q is None, "max_seqlen_q", "None without cu_seqlens_q", max_seqlen_q)
    padded, q_lens = padded_queries(q, cu_seqlens_q, max_seqlen_q) if varlen else (q, None)
    out, lse = with_kvcache(padded, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                            cache_leftpad, page_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                            None, num_splits, True, q_lens)
    if varlen:
        out, lse = packed_rows(out, cu_seqlens_q, q.shape[0]), packed_rows(lse.transpose(1, 2), cu_seqlens_q,
                                                                           q.shape[0]).t()
    return (out, lse) if return_softmax_lse else out
