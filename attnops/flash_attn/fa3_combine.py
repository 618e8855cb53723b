"""FlashAttention-3's split-KV helpers: ``flash_attn_combine`` (merge attention computed over key splits, from their
outputs and log-sum-exps) and ``get_scheduler_metadata`` (FA3's precomputed tile schedule, which attnops does not
need: its kernels schedule themselves)."""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.checks import check_int, check_tensor, require
from .errors import flash_attn_errors

__all__ = ["flash_attn_combine", "get_scheduler_metadata"]

_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@flash_attn_errors
def flash_attn_combine(out_partial: Tensor, lse_partial: Tensor, out: Tensor | None = None, out_dtype=None):
    """Combine attention over ``num_splits`` disjoint key sets: ``out_partial`` fp32
    ``[num_splits, B, S, H, Dv]`` (each split's normalised output), ``lse_partial`` fp32 ``[num_splits, B, S, H]``
    (each split's log-sum-exp). Returns ``(out [B, S, H, Dv], lse [B, S, H])`` with
    ``lse = log(sum_s exp(lse_s))`` and ``out = sum_s exp(lse_s - lse) * out_s``, in ``out_dtype`` (default fp32;
    fp16/bf16/fp32), written into ``out`` when given. A row whose splits are all ``-inf`` gets lse ``-inf`` and
    output 0. ``lse`` has FA3's strides (a ``[B, H, S]`` tensor transposed).

    Example::

        >>> out, lse = flash_attn_combine(torch.randn(3, 2, 5, 4, 8), torch.randn(3, 2, 5, 4))
        >>> out.shape, lse.shape
        (torch.Size([2, 5, 4, 8]), torch.Size([2, 5, 4]))
    """
    check_tensor("out_partial", out_partial, ndim=5, dtypes=(torch.float32,))
    check_tensor("lse_partial", lse_partial, shape=tuple(out_partial.shape[:4]), dtypes=(torch.float32,))
    require(lse_partial.device == out_partial.device, "lse_partial", f"a tensor on {out_partial.device}",
            lse_partial)
    dtype = out_partial.dtype if out_dtype is None else out_dtype
    require(dtype in _OUT_DTYPES, "out_dtype", "torch.float32, torch.float16 or torch.bfloat16", out_dtype)
    if out is not None:
        check_tensor("out", out, shape=tuple(out_partial.shape[1:]), dtypes=(dtype,))
    lse = torch.logsumexp(lse_partial, 0)
    scale = torch.exp(lse_partial - lse)
    scale = torch.where(torch.isfinite(scale), scale, 0.0)  # all splits -inf: nothing to add
    combined = (scale.unsqueeze(-1) * out_partial).sum(0).to(dtype)
    if out is not None:
        combined = out.copy_(combined)
    return combined, lse.transpose(1, 2).contiguous().transpose(1, 2)


@flash_attn_errors
def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                           cache_seqlens: Tensor, qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None,
                           cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
                           causal=False, window_size=(-1, -1), attention_chunk=0, has_softcap=False, num_splits=0,
                           pack_gqa=None, sm_margin=0) -> Tensor:
    """FA3's ``get_scheduler_metadata``: validates the problem description and returns the metadata to pass as
    ``flash_attn_with_kvcache(scheduler_metadata=...)``. attnops' kernels plan their own work, so the metadata is
    an empty int32 tensor on ``cache_seqlens``' device (reusable for every call)."""
    for name, value in (("batch_size", batch_size), ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k),
                        ("num_heads_q", num_heads_q), ("num_heads_kv", num_heads_kv), ("headdim", headdim)):
        check_int(name, value, lo=1 if name != "max_seqlen_q" and name != "max_seqlen_k" else 0)
    require(num_heads_q % num_heads_kv == 0, "num_heads_kv", f"a divisor of num_heads_q={num_heads_q}", num_heads_kv)
    check_tensor("cache_seqlens", cache_seqlens, shape=(batch_size,), dtypes=(torch.int32,))
    return torch.empty(0, dtype=torch.int32, device=cache_seqlens.device)
