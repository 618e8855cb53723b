"""torch_npu's ATB attention entry points that vllm-ascend calls: ``_npu_paged_attention`` (decode over a paged cache,
graph mode), its workspace query, and ``_npu_flash_attention_unpad`` (packed encoder attention).

They run on attnops' core: paged decode on FusedInferAttention, the unpadded encoder on FlashAttention (TND).
Outputs are written into the caller's ``out`` tensor, as on the NPU. Lengths given as lists or CPU tensors (ATB's
host ``seq_len``/``context_lens``) are checked here; device tensors go to the operators unread.
"""
from __future__ import annotations

import itertools

import torch
from torch import Tensor

from .._core.checks import check_int, check_scale, check_tensor, int_list, require
from ._common import with_overloads


def _cache_for_fia(cache: Tensor, name: str, kv_heads: int) -> Tensor:
    """A paged cache as FusedInferAttention reads it: ND ``[nb, bs, N2, D]`` -> ``[nb, bs, N2*D]``; NZ
    ``[nb, N2*D/x, bs, x]`` -> ``[nb, N2, D/x, bs, x]`` (views; ND when dim 2 equals ``num_kv_heads``)."""
    if cache.dim() == 4 and cache.shape[2] == kv_heads:
        return cache.flatten(2)
    if cache.dim() == 5:
        return cache
    nb, chunks, bs, x = cache.shape
    require(chunks % kv_heads == 0, name, f"an ND [num_blocks, block_size, num_kv_heads={kv_heads}, D] or NZ "
            f"[num_blocks, num_kv_heads*D/x, block_size, x] cache", cache)
    return cache.view(nb, kv_heads, chunks // kv_heads, bs, x)


def _lengths(name: str, lens, count: int, expected: str):
    """Per-sequence lengths as the operators take them: a host list (given as a list or a CPU tensor: read, which
    is free), or a device tensor passed on unread (its values are the kernels' to use, not checked here)."""
    if isinstance(lens, Tensor) and lens.device.type != "cpu":
        check_tensor(name, lens, ndim=1, dtypes=(torch.int32, torch.int64))
        require(lens.shape[0] == count, name, f"{expected} ({count})", lens)
        return lens
    values = int_list(name, lens)
    require(len(values) == count, name, f"{expected} ({count})", values)
    return values


def _paged_decode(query: Tensor, key_cache: Tensor, value_cache: Tensor, num_kv_heads: int, num_heads: int,
                  scale_value: float, block_table: Tensor, context_lens: Tensor) -> Tensor:
    from ..ops.fused_infer_attention import fused_infer_attention

    check_tensor("query", query, ndim=3)
    num_heads = check_int("num_heads", num_heads, lo=1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, lo=1)
    require(query.shape[1] == num_heads, "query", f"[num_tokens, num_heads={num_heads}, head_size]", query)
    check_tensor("key_cache", key_cache, ndim=(4, 5), device=query.device)
    check_tensor("value_cache", value_cache, ndim=(4, 5), device=query.device)
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32, torch.int64))
    lens = _lengths("context_lens", context_lens, query.shape[0], "one length per query token")
    key = _cache_for_fia(key_cache, "key_cache", num_kv_heads)
    value = _cache_for_fia(value_cache, "value_cache", num_kv_heads)
    block_size = key.shape[1] if key.dim() == 3 else key.shape[3]
    out = fused_infer_attention(query.unsqueeze(1), key, value, layout="BSND", num_heads=num_heads,
                                num_key_value_heads=num_kv_heads, scale=check_scale("scale_value", scale_value),
                                block_table=block_table.to(torch.int32), block_size=block_size,
                                actual_seq_lengths_kv=lens)
    return out.squeeze(1)


def _write(out: Tensor, result: Tensor) -> None:
    check_tensor("out", out, shape=tuple(result.shape), dtypes=(result.dtype,), device=result.device)
    out.copy_(result)


def _npu_paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, num_kv_heads: int, num_heads: int,
                         scale_value: float, block_table: Tensor, context_lens: Tensor, out: Tensor, *,
                         workspace: Tensor | None = None) -> None:
    """Decode attention over a paged cache: query token ``i`` (``query [num_tokens, num_heads, D]``) attends to the
    first ``context_lens[i]`` tokens of its sequence, read through ``block_table[i]`` from ``key_cache``/``value_cache``
    ``[num_blocks, block_size, num_kv_heads, D]`` (or NZ). Writes ``out [num_tokens, num_heads, Dv]``; ``workspace``
    is accepted and unused (no device workspace is needed). ``context_lens`` on the host (ATB's way) is checked;
    on the device it is passed to the kernels unread."""
    del workspace
    _write(out, _paged_decode(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
                              context_lens))


def _npu_paged_attention_get_workspace(query: Tensor, key_cache: Tensor, value_cache: Tensor, num_kv_heads: int,
                                       num_heads: int, scale_value: float, block_table: Tensor, context_lens: Tensor,
                                       out: Tensor) -> Tensor:
    """The workspace :func:`_npu_paged_attention` needs: an empty uint8 tensor (attnops needs none)."""
    del key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table, context_lens, out
    return torch.empty(0, dtype=torch.uint8, device=query.device)


def _npu_flash_attention_unpad(query: Tensor, key: Tensor, value: Tensor, seq_len: Tensor, scale_value: float,
                               num_heads: int, num_kv_heads: int, out: Tensor) -> None:
    """Full (unmasked) attention within each packed sequence: ``query [T, num_heads, D]``, ``key [T, num_kv_heads,
    D]``, ``value [T, num_kv_heads, Dv]``, ``seq_len [B]`` per-sequence lengths (host: checked to sum to T;
    device: made cumulative there and passed unread as ``cu_seqlens``). Writes ``out [T, num_heads, Dv]``."""
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
    result = flash_attention(query, key, value, layout="TND", scale=check_scale("scale_value", scale_value), **seqs)
    _write(out, result)


_npu_paged_attention = with_overloads(_npu_paged_attention)
_npu_paged_attention_get_workspace = with_overloads(_npu_paged_attention_get_workspace)
_npu_flash_attention_unpad = with_overloads(_npu_flash_attention_unpad)
