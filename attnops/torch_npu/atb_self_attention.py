"""torch_npu's ATB SelfAttention entry points over packed (unpadded) key/value tensors, as vllm-ascend calls them
(its 310P path included): ``_npu_flash_attention_unpad`` and ``_npu_flash_attention_unpad_v2`` (no mask),
``_npu_flash_attention`` (an explicit mask) and ``_npu_flash_attention_v3`` (ATB's compressed causal mask).

Every sequence attends to itself only: query ``[T, num_heads, D]``, key ``[T, num_kv_heads, D]``, value
``[T, num_kv_heads, Dv]``, ``seq_len [B]`` per-sequence lengths. They run on FlashAttention (TND) and write the
caller's ``out [T, num_heads, Dv]``. ``seq_len`` on the host (ATB's way) is checked; on the device it becomes
``cu_seqlens`` there, unread.
"""
from __future__ import annotations

import itertools

import torch
from torch import Tensor

from .._core.checks import check_int, check_scale, check_tensor, require
from ._common import with_overloads
from .atb import _lengths, _write


def _packed_attention(query: Tensor, key: Tensor, value: Tensor, seq_len: Tensor, scale_value: float,
                      num_heads: int, num_kv_heads: int, out: Tensor, **masking) -> None:
    """Attention within each packed sequence (``masking``: FlashAttention's ``causal`` or ``atten_mask``)."""
    from ..ops.flash_attention import flash_attention

    check_tensor("query", query, ndim=3)
    check_tensor("key", key, ndim=3, dtypes=(query.dtype,), device=query.device)
    check_tensor("value", value, ndim=3, dtypes=(query.dtype,), device=query.device)
    num_heads = check_int("num_heads", num_heads, lo=1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, lo=1)
    require(query.shape[1] == num_heads, "query", f"[T, num_heads={num_heads}, D]", query)
    require(key.shape[1] == num_kv_heads, "key", f"[T, num_kv_heads={num_kv_heads}, D]", key)
    check_tensor("seq_len", seq_len, ndim=1)
    lens = _lengths("seq_len", seq_len, seq_len.shape[0], "per-sequence lengths")
    if isinstance(lens, Tensor):  # on the device: the cumulative lengths are formed there, unread
        cu_seqlens = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32)
        seqs = dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens)
    else:
        require(all(n >= 0 for n in lens) and sum(lens) == query.shape[0], "seq_len",
                f"non-negative per-sequence lengths summing to T={query.shape[0]}", lens)
        cumulative = list(itertools.accumulate(lens))
        seqs = dict(actual_seq_qlen=cumulative, actual_seq_kvlen=cumulative)
    result = flash_attention(query, key, value, layout="TND", scale=check_scale("scale_value", scale_value),
                             **seqs, **masking)
    _write(out, result)


def _npu_flash_attention_unpad(query: Tensor, key: Tensor, value: Tensor, seq_len: Tensor, scale_value: float,
                               num_heads: int, num_kv_heads: int, out: Tensor) -> None:
    """Full (unmasked) attention within each packed sequence (ATB PA_ENCODER without a mask): GQA, Dv <= D.
    Writes ``out [T, num_heads, Dv]``."""
    _packed_attention(query, key, value, seq_len, scale_value, num_heads, num_kv_heads, out)


def _npu_flash_attention_unpad_v2(query: Tensor, key: Tensor, value: Tensor, seq_len: Tensor, scale_value: float,
                                  num_heads: int, num_kv_heads: int, *, kernel_type: int | None = 0,
                                  out: Tensor) -> None:
    """:func:`_npu_flash_attention_unpad` with ATB's ``kernel_type`` 0 (KERNELTYPE_DEFAULT) or 2
    (KERNELTYPE_EXP_M8V2, a faster exponential on the NPU): the same attention here, computed in fp32."""
    require(kernel_type in (None, 0, 2), "kernel_type", "0 (KERNELTYPE_DEFAULT) or 2 (KERNELTYPE_EXP_M8V2)",
            kernel_type)
    _packed_attention(query, key, value, seq_len, scale_value, num_heads, num_kv_heads, out)


def _npu_flash_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, seq_len: Tensor,
                         scale_value: float, num_heads: int, num_kv_heads: int, out: Tensor) -> None:
    """Attention within each packed sequence under an explicit mask (ATB PA_ENCODER, MASK_TYPE_NORM): ``mask``
    ``[max_seq_len, max_seq_len]`` (or ``[1, max_seq_len, max_seq_len]``), each sequence using its top-left
    ``[S_b, S_b]`` corner; a non-zero entry masks (vllm-ascend's fp16 ``-inf`` and bf16 ``1`` alike). A fully
    masked row gives 0. Writes ``out [T, num_heads, Dv]``."""
    check_tensor("mask", mask, ndim=(2, 3), device=query.device)
    require(mask.dim() == 2 or mask.shape[0] == 1, "mask", "[max_seq_len, max_seq_len] or [1, max_seq_len, "
            "max_seq_len] (one mask for every sequence)", mask, "per-sequence masks are not supported")
    if isinstance(seq_len, Tensor) and seq_len.device.type == "cpu" and seq_len.numel():  # device: not read
        longest = int(seq_len.max())
        require(min(mask.shape[-2:]) >= longest, "mask", f"[max_seq_len, max_seq_len] with max_seq_len >= the "
                f"longest sequence ({longest})", mask)
    _packed_attention(query, key, value, seq_len, scale_value, num_heads, num_kv_heads, out,
                      atten_mask=mask.reshape(mask.shape[-2:]) != 0)


def _npu_flash_attention_v3(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, seq_len: Tensor,
                            scale_value: float, num_heads: int, num_kv_heads: int, *, mask_type: int | None = 3,
                            out: Tensor) -> None:
    """Causal attention within each packed sequence (ATB PA_ENCODER with ``mask_type`` 3, MASK_TYPE_NORM_COMPRESS,
    the only type accepted): ``mask`` is ATB's compressed causal mask (e.g. 128x128), its size is checked, its
    values are not read. Writes ``out [T, num_heads, Dv]``."""
    require(mask_type in (None, 3), "mask_type", "3 (MASK_TYPE_NORM_COMPRESS, the only type supported)", mask_type)
    check_tensor("mask", mask, ndim=(2, 3, 4), device=query.device)
    _packed_attention(query, key, value, seq_len, scale_value, num_heads, num_kv_heads, out, causal=True)


_npu_flash_attention_unpad = with_overloads(_npu_flash_attention_unpad)
_npu_flash_attention_unpad_v2 = with_overloads(_npu_flash_attention_unpad_v2)
_npu_flash_attention = with_overloads(_npu_flash_attention)
_npu_flash_attention_v3 = with_overloads(_npu_flash_attention_v3)
