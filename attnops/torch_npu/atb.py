"""torch_npu's ATB PagedAttention entry points (attention over a paged KV cache), as vllm-ascend and sglang call them:
``_npu_paged_attention`` (one query token per sequence, graph mode) and its workspace query,
``_npu_paged_attention_mla`` (MLA decode, the value is the first ``mla_vheadsize`` columns of the key cache),
``_npu_paged_attention_splitfuse`` (several query tokens per sequence with an explicit per-token mask),
``_npu_paged_attention_splitfuse_v2`` and ``_npu_flash_attention_qlens`` (several query tokens per sequence,
causal, aligned to the end of the sequence).

They run on FusedInferAttention's paged path. Outputs are written into the caller's ``out`` tensor, as on the NPU.
Lengths given as lists or CPU tensors (ATB's host ``context_lens``/``seq_len``) are checked here; device tensors
go to the operators unread where the operator can take them (decode), and are refused where ATB reads them on
the host (the multi-token forms need them to lay the queries out).
"""
from __future__ import annotations

import itertools

import torch
from torch import Tensor

from .._core.checks import check_int, check_scale, check_tensor, int_list, require
from .._core.staging import cached_upload
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


_npu_paged_attention = with_overloads(_npu_paged_attention)
_npu_paged_attention_get_workspace = with_overloads(_npu_paged_attention_get_workspace)


def _host_lengths(name: str, lens, count: int | None = None) -> list[int]:
    """Non-negative per-sequence lengths that ATB reads on the host (a list or a CPU tensor)."""
    require(not (isinstance(lens, Tensor) and lens.device.type != "cpu"), name,
            "a CPU tensor or a list (ATB reads these lengths on the host)", lens)
    values = int_list(name, lens)
    require(values is not None and all(n >= 0 for n in values), name, "non-negative per-sequence lengths", lens)
    require(count is None or len(values) == count, name, f"one length per sequence ({count})", values)
    return values


def _heads(name: str, x: Tensor, heads: int, what: str) -> Tensor:
    """``x`` as ``[T, heads, D]``: ``[T, heads, D]`` as is, ``[T, heads*D]`` (sglang's form) unflattened."""
    check_tensor(name, x, ndim=(2, 3))
    if x.dim() == 2:
        require(x.shape[1] % heads == 0, name, f"[T, {what}*D] with {what}={heads}", x)
        return x.unflatten(1, (heads, x.shape[1] // heads))
    require(x.shape[1] == heads, name, f"[T, {what}={heads}, D]", x)
    return x


def _paged_prefill(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor, seq_len,
                   context_lens, num_kv_heads: int, num_heads: int, scale_value: float, out: Tensor,
                   token_mask: Tensor | None = None) -> None:
    """Several query tokens per sequence over a paged cache: query ``[T, N, D]`` (or ``[T, N*D]``) packs the
    ``seq_len[b]`` new tokens of each sequence; sequence ``b`` has ``context_lens[b]`` tokens in the cache (the new
    ones last). Causal, aligned to the end, unless ``token_mask`` ``[T, >= max(context_lens)]`` (non-zero = masked)
    gives each query token's row instead. Writes ``out`` (the query's form, with the value's head size)."""
    from ..ops.fused_infer_attention import fused_infer_attention

    num_heads = check_int("num_heads", num_heads, lo=1)
    num_kv_heads = check_int("num_kv_heads", num_kv_heads, lo=1)
    q = _heads("query", query, num_heads, "num_heads")
    check_tensor("key_cache", key_cache, ndim=(4, 5), device=query.device)
    check_tensor("value_cache", value_cache, ndim=(4, 5), device=query.device)
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32, torch.int64), device=query.device)
    q_lens = _host_lengths("seq_len", seq_len)
    kv_lens = _host_lengths("context_lens", context_lens, len(q_lens))
    require(sum(q_lens) == q.shape[0], "seq_len", f"per-sequence query lengths summing to T={q.shape[0]}", q_lens)
    for b, (n, c) in enumerate(zip(q_lens, kv_lens)):
        require(n <= c, f"seq_len[{b}]", f"at most context_lens[{b}]={c} (the new tokens are in the cache)", n)
    key, value = (_cache_for_fia(c, name, num_kv_heads) for c, name in ((key_cache, "key_cache"),
                                                                      (value_cache, "value_cache")))
    block_size = key.shape[1] if key.dim() == 3 else key.shape[3]
    common = dict(num_heads=num_heads, num_key_value_heads=num_kv_heads, block_size=block_size,
                  scale=check_scale("scale_value", scale_value), block_table=block_table.to(torch.int32),
                  actual_seq_lengths_kv=kv_lens)
    if token_mask is None:
        result = fused_infer_attention(q, key, value, layout="TND", causal=True,
                                       actual_seq_lengths=list(itertools.accumulate(q_lens)), **common)
    else:
        result = _masked_rows(fused_infer_attention, q, key, value, token_mask, q_lens, kv_lens,
                              block_table.shape[1] * block_size, common)
    _write(out, result.reshape(*query.shape[:-1], -1) if query.dim() == 2 else result)


def _masked_rows(fia, q: Tensor, key: Tensor, value: Tensor, token_mask: Tensor, q_lens: list[int],
                 kv_lens: list[int], capacity: int, common: dict) -> Tensor:
    """FusedInferAttention with one mask row per query token: the tokens padded to ``[B, maxSq, N, D]`` (BSND) with
    a ``[B, 1, maxSq, capacity]`` mask whose rows are the tokens' rows (columns past the given ones masked)."""
    check_tensor("mask", token_mask, ndim=2, device=q.device)
    require(token_mask.shape[0] == q.shape[0] and token_mask.shape[1] >= max(kv_lens, default=0), "mask",
            f"[num_tokens={q.shape[0]}, max_seq_len >= {max(kv_lens, default=0)}] (one row per query token)",
            token_mask)
    batch, longest = len(q_lens), max(q_lens, default=0)
    rows = cached_upload(("atb_token_rows", tuple(q_lens)),
                         lambda: [b * longest + i for b, n in enumerate(q_lens) for i in range(n)], torch.long,
                         q.device)
    padded = q.new_zeros(batch * longest, *q.shape[1:]).index_copy_(0, rows, q)
    cols = min(token_mask.shape[1], capacity)
    mask = torch.ones(batch * longest, capacity, dtype=torch.bool, device=q.device)
    mask[:, :cols].index_copy_(0, rows, token_mask[:, :cols] != 0)
    out = fia(padded.unflatten(0, (batch, longest)), key, value, layout="BSND", actual_seq_lengths=q_lens,
              atten_mask=mask.view(batch, 1, longest, capacity), **common)
    return out.flatten(0, 1).index_select(0, rows)


def _npu_flash_attention_qlens(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                               mask: Tensor, seq_len: Tensor, context_lens: Tensor, num_kv_heads: int,
                               num_heads: int, scale_value: float, out: Tensor) -> None:
    """Prefill over a paged cache that already holds each sequence's prefix and new tokens (sglang's default prefill,
    vllm-ascend's prefix-cache hit): query ``[T, num_heads, D]`` or ``[T, num_heads*D]`` packs ``seq_len[b]`` new
    tokens per sequence; ``context_lens[b]`` tokens of sequence ``b`` are in ``key_cache``/``value_cache``
    ``[num_blocks, block_size, num_kv_heads, D]`` (or NZ) through ``block_table [B, max_blocks]``; causal, aligned
    to the end of each sequence. ``mask`` is ATB's compressed causal mask (e.g. 128x128): its size is checked, its
    values are not read (as the NPU does with a compressed mask). Lengths on the host. Writes ``out``."""
    check_tensor("mask", mask, ndim=(2, 3, 4), device=query.device)
    _paged_prefill(query, key_cache, value_cache, block_table, seq_len, context_lens, num_kv_heads, num_heads,
                   scale_value, out)


def _npu_paged_attention_splitfuse(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                                   context_lens: Tensor, mask: Tensor, seq_len: Tensor, num_kv_heads: int,
                                   num_heads: int, scale_value: float, out: Tensor) -> None:
    """Chunked prefill / parallel decoding over a paged cache (ATB CALC_TYPE_SPEC, MASK_TYPE_SPEC): as
    :func:`_npu_flash_attention_qlens`, but ``mask [num_tokens, max_seq_len]`` gives each query token's own row over
    its sequence's cached tokens (non-zero = masked: vllm-ascend's fp16 ``-inf`` and bf16 ``1`` alike). Writes
    ``out [T, num_heads, Dv]``."""
    _paged_prefill(query, key_cache, value_cache, block_table, seq_len, context_lens, num_kv_heads, num_heads,
                   scale_value, out, token_mask=mask)


def _npu_paged_attention_splitfuse_v2(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                                      context_lens: Tensor, mask: Tensor, seq_len: Tensor, num_kv_heads: int,
                                      num_heads: int, scale_value: float, *, mask_type: int | None = 5,
                                      out: Tensor) -> None:
    """:func:`_npu_paged_attention_splitfuse` with ATB's compressed causal mask (``mask_type`` 5,
    MASK_TYPE_NORM_COMPRESS, the only one accepted): causal, aligned to the end of each sequence, as
    :func:`_npu_flash_attention_qlens`; the mask's values are not read."""
    require(mask_type in (None, 5), "mask_type", "5 (MASK_TYPE_NORM_COMPRESS, the only type supported)", mask_type)
    _npu_flash_attention_qlens(query, key_cache, value_cache, block_table, mask, seq_len, context_lens, num_kv_heads,
                               num_heads, scale_value, out)


def _npu_paged_attention_mla(query: Tensor, key_cache: Tensor, num_kv_heads: int, num_heads: int,
                             scale_value: float, block_table: Tensor, context_lens: Tensor, mla_vheadsize: int,
                             out: Tensor) -> None:
    """MLA decode over one combined latent cache: query ``[num_tokens, num_heads, D]`` (e.g. 512 + 64 rope),
    ``key_cache [num_blocks, block_size, num_kv_heads, D]``; the value is the key cache's first ``mla_vheadsize``
    columns. Writes ``out [num_tokens, num_heads, mla_vheadsize]``; lengths and checks as
    :func:`_npu_paged_attention`."""
    check_tensor("key_cache", key_cache, ndim=4, device=query.device)
    vhead = check_int("mla_vheadsize", mla_vheadsize, lo=1, hi=key_cache.shape[-1])
    _write(out, _paged_decode(query, key_cache, key_cache[..., :vhead], num_kv_heads, num_heads, scale_value,
                              block_table, context_lens))


_npu_flash_attention_qlens = with_overloads(_npu_flash_attention_qlens)
_npu_paged_attention_splitfuse = with_overloads(_npu_paged_attention_splitfuse)
_npu_paged_attention_splitfuse_v2 = with_overloads(_npu_paged_attention_splitfuse_v2)
_npu_paged_attention_mla = with_overloads(_npu_paged_attention_mla)
