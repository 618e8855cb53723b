"""``torch.ops.flash_attn_3``: FlashAttention-3's operators (``fwd``, ``bwd``, ``fwd_combine``,
``get_scheduler_metadata``) with FA3's schemas, on :mod:`attnops.flash_attn.fa3`. Registered by
:func:`register` (the shim calls it where FA3 is absent), never on import."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .._core.softmax_stats import FLT_LOWEST, FLT_MAX
from ..ops.flash_attention import flash_attention_backward
from . import fa3
from .fa3_segments import chunk_segments

__all__ = ["register"]

_SCHEMAS = {
    "fwd": "fwd(Tensor q, Tensor k, Tensor v, Tensor(k_new!)? k_new=None, Tensor(v_new!)? v_new=None, "
           "Tensor? q_v=None, Tensor(out!)? out=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
           "Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, Tensor? seqused_k=None, int? max_seqlen_q=None, "
           "int? max_seqlen_k=None, Tensor? page_table=None, Tensor? kv_batch_idx=None, Tensor? leftpad_k=None, "
           "Tensor? rotary_cos=None, Tensor? rotary_sin=None, Tensor? seqlens_rotary=None, Tensor? q_descale=None, "
           "Tensor? k_descale=None, Tensor? v_descale=None, float? softmax_scale=None, bool is_causal=False, "
           "int window_size_left=-1, int window_size_right=-1, int attention_chunk=0, float softcap=0., "
           "bool is_rotary_interleaved=False, Tensor? scheduler_metadata=None, int num_splits=0, "
           "bool? pack_gqa=None, int sm_margin=0) -> (Tensor(out!), Tensor, Tensor, Tensor)",
    "bwd": "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor(dq!)? dq=None, "
           "Tensor(dk!)? dk=None, Tensor(dv!)? dv=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
           "Tensor? seqused_q=None, Tensor? seqused_k=None, int? max_seqlen_q=None, int? max_seqlen_k=None, "
           "float? softmax_scale=None, bool is_causal=False, int window_size_left=-1, int window_size_right=-1, "
           "float softcap=0., bool deterministic=False, int sm_margin=0) "
           "-> (Tensor(dq!), Tensor(dk!), Tensor(dv!), Tensor, Tensor, Tensor, Tensor, Tensor)",
    "fwd_combine": "fwd_combine(Tensor out_partial, Tensor lse_partial, Tensor(out!)? out=None, "
                   "ScalarType? out_dtype=None) -> (Tensor(out!), Tensor)",
    "get_scheduler_metadata": "get_scheduler_metadata(int batch_size, int max_seqlen_q, int max_seqlen_k, "
                              "int num_heads, int num_heads_k, int headdim, int headdim_v, ScalarType qkv_dtype, "
                              "Tensor seqused_k, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
                              "Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, Tensor? leftpad_k=None, "
                              "int? page_size=None, int max_seqlen_k_new=0, bool is_causal=False, "
                              "int window_size_left=-1, int window_size_right=-1, int attention_chunk=0, "
                              "bool has_softcap=False, int num_splits=0, bool? pack_gqa=None, "
                              "int sm_margin=0) -> Tensor",
}
_library: torch.library.Library | None = None


def _into(target, value: Tensor) -> Tensor:
    """``value`` written into the caller's ``target`` (then returned), or ``value`` itself."""
    return value if target is None else target.copy_(value)


def _fwd(q, k, v, k_new=None, v_new=None, q_v=None, out=None, cu_seqlens_q=None, cu_seqlens_k=None,
         cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, page_table=None,
         kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None, seqlens_rotary=None, q_descale=None,
         k_descale=None, v_descale=None, softmax_scale=None, is_causal=False, window_size_left=-1,
         window_size_right=-1, attention_chunk=0, softcap=0.0, is_rotary_interleaved=False, scheduler_metadata=None,
         num_splits=0, pack_gqa=None, sm_margin=0):
    """A key cache (no ``cu_seqlens_k``, with new keys, a page table, cache indices or per-batch key lengths) runs
    ``flash_attn_with_kvcache`` (``seqused_k`` the cache lengths), packed keys the varlen function, else the dense
    one. The split-KV accumulators come back empty (attnops does not split)."""
    window = (window_size_left, window_size_right)
    common = dict(softmax_scale=softmax_scale, causal=is_causal, window_size=window, attention_chunk=attention_chunk,
                  softcap=softcap, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    cache = cu_seqlens_k is None and (cu_seqlens_q is not None or seqused_k is not None or k_new is not None
                                      or page_table is not None or kv_batch_idx is not None or leftpad_k is not None)
    if cache:
        result, lse = fa3.flash_attn_with_kvcache(
            q, k, v, k_new, v_new, q_v, rotary_cos, rotary_sin, seqused_k, kv_batch_idx, leftpad_k, page_table,
            cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, seqlens_rotary, rotary_interleaved=is_rotary_interleaved,
            return_softmax_lse=True, **common)
    elif cu_seqlens_k is not None:
        result, lse = fa3.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                 seqused_q, seqused_k, qv=q_v, return_attn_probs=True, **common)
    else:
        result, lse = fa3.flash_attn_func(q, k, v, qv=q_v, return_attn_probs=True, **common)
    empty = q.new_empty(0, dtype=torch.float32)
    return _into(out, result), lse, empty, empty.clone()


def _stats(lse: Tensor, varlen: bool) -> tuple[Tensor, Tensor]:
    """The core's softmax statistics ``(max, sum)`` equal to a log-sum-exp (``max = lse``, ``sum = 1``; rows without a
    key, lse ``+inf``, the core's FLT_LOWEST / FLT_MAX), 8 wide: ``[B, H, Sq, 8]``, varlen ``[T, H, 8]``."""
    lse = lse.float().t() if varlen else lse.float()
    empty_row = torch.isinf(lse) & (lse > 0)
    smax = torch.where(empty_row, FLT_LOWEST, lse)
    ssum = torch.where(empty_row, FLT_MAX, 1.0)
    return (x.unsqueeze(-1).expand(*x.shape, 8).contiguous() for x in (smax, ssum))


def _bwd(dout, q, k, v, out, softmax_lse, dq=None, dk=None, dv=None, cu_seqlens_q=None, cu_seqlens_k=None,
         seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None, is_causal=False,
         window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=False, sm_margin=0):
    """Gradients from the given ``out`` and ``softmax_lse`` on attnops' backward; also ``softmax_d = rowsum(dout *
    out)`` and the log2 LSE (``softmax_lse * log2(e)``), fp32 in the LSE's layout; the accumulators come back
    empty."""
    varlen = cu_seqlens_q is not None
    d = q.shape[-1]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    pad = max(v.shape[-1] - d, 0)
    qp, kp = (F.pad(x, (0, pad)) for x in (q, k)) if pad else (q, k)
    options = dict(layout="BSND", causal=is_causal, window_size=(window_size_left, window_size_right), scale=scale,
                   softcap=softcap)
    if varlen:
        cu_q, cu_k = cu_seqlens_q, cu_seqlens_k
        if seqused_q is not None or seqused_k is not None:
            cu_q, cu_k = chunk_segments(cu_q, cu_k, seqused_q, seqused_k, 0, max_seqlen_k)
        options.update(layout="TND", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen_q,
                       max_seqlen_k=max_seqlen_k, softmax_layout="TND")
    smax, ssum = _stats(softmax_lse, varlen)
    grads = flash_attention_backward(dout, qp, kp, v, out, smax, ssum, **options)[:3]
    grads = [g[..., :x.shape[-1]] for g, x in zip(grads, (q, k, v))]
    softmax_d = (dout.float() * out.float()).sum(-1)
    softmax_d = softmax_d.t() if varlen else softmax_d.transpose(1, 2)
    empty = q.new_empty(0, dtype=torch.float32)
    return (*(_into(t, g) for t, g in zip((dq, dk, dv), grads)), softmax_d.contiguous(),
            softmax_lse * math.log2(math.e), empty, empty.clone(), empty.clone())


def _fwd_combine(out_partial, lse_partial, out=None, out_dtype=None):
    return fa3.flash_attn_combine(out_partial, lse_partial, out, out_dtype)


def _get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim, headdim_v,
                            qkv_dtype, seqused_k, *schedule):
    """FA3's operator form of :func:`attnops.flash_attn.fa3.get_scheduler_metadata` (the ``schedule`` options only
    tune FA3's own tile schedule)."""
    return fa3.get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads, num_heads_k, headdim,
                                      seqused_k, qkv_dtype, headdim_v)


_IMPLS = {"fwd": _fwd, "bwd": _bwd, "fwd_combine": _fwd_combine, "get_scheduler_metadata": _get_scheduler_metadata}


def _defined(name: str) -> bool:
    try:
        getattr(torch.ops.flash_attn_3, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def register() -> bool:
    """Define ``torch.ops.flash_attn_3.{fwd, bwd, fwd_combine, get_scheduler_metadata}`` on attnops, unless an
    operator of that namespace already exists (the real FA3, or an earlier call). Returns whether they were defined.
    They run eagerly on any device (no autograd: as FA3's, ``bwd`` is called by hand)."""
    global _library
    if _library is not None or any(_defined(name) for name in _SCHEMAS):
        return False
    _library = torch.library.Library("flash_attn_3", "FRAGMENT")
    for name, schema in _SCHEMAS.items():
        _library.define(schema)
        _library.impl(name, _IMPLS[name], "CompositeExplicitAutograd")
    return True
