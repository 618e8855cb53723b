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

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func"]


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
