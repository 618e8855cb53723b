"""Pythonic NSA API (differentiable) and the composed ``native_sparse_attention`` layer. No math here."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..._core.autocast import autocast_dtype, autocast_off, cast_inputs
from ..._core.checks import (check_int, check_same_device, check_tensor, fail, require, require_not_none,
                             softmax_scale)
from ..._core.softmax_stats import STAT_LANES, stats_dtype
from ..._core.varlen import cumulative_from_cu_seqlens, lengths_from_cumulative
from .compress import compress_block_count
from .selected import SelectedSpec

INT_MAX = 2147483647
CAUSAL_2048 = None  # built lazily (module import stays cheap)


def _op():
    from . import op

    return op


def _prepared(ref_name: str, ref: Tensor, **others) -> tuple:
    """``(ref, *others)`` after checking that every tensor is on ``ref``'s device (never copied silently), the
    floating-point ones cast to the autocast dtype when ``torch.autocast`` is on there (as SDPA)."""
    check_same_device(ref_name, ref, **others)
    return cast_inputs(autocast_dtype(ref.device), ref, *others.values())


def _cumulative(name: str, cu_seqlens, actual, total: int) -> list[int]:
    """CANN cumulative lengths from ``cu_seqlens`` (leading 0) or ``actual`` (cumulative); one batch by default."""
    if cu_seqlens is not None:
        require(actual is None, name, "either cu_seqlens or actual lengths, not both", "both")
        return cumulative_from_cu_seqlens(name, cu_seqlens)
    if actual is None:
        return [total]
    return [int(v) for v in (actual.tolist() if isinstance(actual, Tensor) else actual)]


def nsa_compress(input: Tensor, weight: Tensor, *, block_size: int, stride: int, cu_seqlens=None,
                 actual_seq_len=None) -> Tensor:
    """NSA compression ``[T, N, D] -> [sum_b blocks_b, N, D]`` with learnable ``weight [block_size, N]``.

    Blocks of ``block_size`` tokens every ``stride`` tokens, per sequence (``cu_seqlens`` with a leading 0 or
    CANN cumulative ``actual_seq_len``); tails that do not fill a block are dropped. Differentiable in ``input``
    and ``weight``.
    """
    check_tensor("input", input, ndim=3)
    input, weight = _prepared("input", input, weight=weight)
    lens = _cumulative("cu_seqlens", cu_seqlens, actual_seq_len, input.shape[0])
    with autocast_off(input.device):
        return _op().nsa_compress(input, weight, block_size, stride, lens, 0)


class CompressAttentionResult(NamedTuple):
    out: Tensor
    topk_indices: Tensor
    softmax_max: Tensor
    softmax_sum: Tensor


def nsa_compress_attention(query: Tensor, key: Tensor, value: Tensor, *, compress_block_size: int,
                           compress_stride: int, select_block_size: int, select_block_count: int,
                           scale: float | None = None, atten_mask: Tensor | None = None,
                           topk_mask: Tensor | None = None, cu_seqlens_q=None, cu_seqlens_cmp=None,
                           actual_seq_qlen=None, actual_cmp_seq_kvlen=None) -> CompressAttentionResult:
    """Attention of ``query [T, N1, D]`` over compressed ``key/value [T_cmp, N2, D/Dv]`` plus top-k selection.

    ``atten_mask`` ``[maxSq, maxCmpSkv]`` (True = masked) and ``topk_mask`` ``[maxSq, maxSelSkv]`` (True = always
    selected) use their top-left slice per batch. Returns the output (differentiable in q, k, v), the int32
    ``topk_indices [T, N2, select_block_count]`` (block indices local to each batch) and the statistics.
    """
    check_tensor("query", query, ndim=3)
    check_tensor("key", key, ndim=3)
    query, key, value, atten_mask, topk_mask = _prepared("query", query, key=key, value=value, atten_mask=atten_mask,
                                                         topk_mask=topk_mask)
    qlen = _cumulative("cu_seqlens_q", cu_seqlens_q, actual_seq_qlen, query.shape[0])
    cmp = _cumulative("cu_seqlens_cmp", cu_seqlens_cmp, actual_cmp_seq_kvlen, key.shape[0])
    m = select_block_size // compress_stride if compress_stride > 0 else 1
    sel, acc = [], 0
    for n in lengths_from_cumulative("actual_cmp_seq_kvlen", cmp, key.shape[0]):
        acc += -(-n // max(m, 1))
        sel.append(acc)
    scale = softmax_scale(scale, query, query.shape[-1])
    with autocast_off(query.device):
        return CompressAttentionResult(*_op().nsa_compress_attention(
            query, key, value, topk_mask, atten_mask, float(scale), query.shape[1], compress_block_size,
            compress_stride, select_block_size, select_block_count, qlen, cmp, sel,
            1 if atten_mask is not None else 0))


def nsa_selected_attention(query: Tensor, key: Tensor, value: Tensor, topk_indices: Tensor, *,
                           select_block_size: int, causal: bool = True, scale: float | None = None,
                           cu_seqlens_q=None, cu_seqlens_k=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                           return_stats: bool = False):
    """Each query token attends to its selected KV blocks: ``topk_indices [T1, N2, count]`` (local to the batch).

    ``causal`` hides KV positions after the query's position within its sequence (the NPU's sparse_mode 2).
    Returns ``[T1, N1, Dv]`` (differentiable in q, k, v), or ``(out, softmax_max, softmax_sum)`` with
    ``return_stats``.
    """
    check_tensor("query", query, ndim=3)
    check_tensor("key", key, ndim=3)
    check_tensor("topk_indices", topk_indices, ndim=3)
    query, key, value, topk_indices = _prepared("query", query, key=key, value=value, topk_indices=topk_indices)
    qlen = _cumulative("cu_seqlens_q", cu_seqlens_q, actual_seq_qlen, query.shape[0])
    kvlen = _cumulative("cu_seqlens_k", cu_seqlens_k, actual_seq_kvlen, key.shape[0])
    scale = softmax_scale(scale, query, query.shape[-1])
    mask = torch.ones(1, 1, dtype=torch.bool, device=query.device) if causal else None
    with autocast_off(query.device):
        out, smax, ssum = _op().nsa_selected_attention(query, key, value, topk_indices, mask, float(scale),
                                                       query.shape[1], select_block_size, topk_indices.shape[-1],
                                                       qlen, kvlen, 2 if causal else 0)
    return (out, smax, ssum) if return_stats else out


def nsa_selected_attention_infer(query: Tensor, key_cache: Tensor, value_cache: Tensor, topk_indices: Tensor,
                                 block_table: Tensor, seq_lens, *, select_block_size: int,
                                 scale: float | None = None) -> Tensor:
    """Decoding: one new token per request (``query [B, N1, D]``) attends, per KV head, to the blocks of
    ``select_block_size`` keys named by ``topk_indices [B, N2, count]`` (in order up to the first ``-1``, each cut
    at the request's length), read from paged caches ``[blocks, page_size, N2, D/Dv]`` through ``block_table
    [B, maxBlocks]``; ``seq_lens`` are the per-request KV lengths. Returns ``[B, N1, Dv]`` (0 for a head that
    selects nothing)."""
    check_tensor("query", query, ndim=3)
    check_tensor("key_cache", key_cache, ndim=4)
    check_tensor("topk_indices", topk_indices, ndim=3)
    query, key_cache, value_cache, topk_indices, block_table = _prepared(
        "query", query, key_cache=key_cache, value_cache=value_cache, topk_indices=topk_indices,
        block_table=block_table)
    scale = softmax_scale(scale, query, query.shape[-1])
    lens = [int(v) for v in (seq_lens.tolist() if isinstance(seq_lens, Tensor) else seq_lens)]
    with autocast_off(query.device):
        return _op().nsa_selected_attention_infer(query, key_cache, value_cache, topk_indices, block_table,
                                                  float(scale), query.shape[1], key_cache.shape[2],
                                                  select_block_size, topk_indices.shape[-1], key_cache.shape[1],
                                                  lens)


def nsa_compress_attention_infer(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                                 cmp_seq_lens, *, compress_block_size: int, compress_stride: int,
                                 select_block_size: int, select_block_count: int, scale: float | None = None
                                 ) -> tuple[Tensor, Tensor]:
    """Decoding: one new token per request (``query [B, N1, D]``) attends to its compressed keys/values, read from
    paged caches ``[blocks, page_size, N2, D/Dv]`` through ``block_table`` (``cmp_seq_lens``: per-request
    compressed lengths), and picks the next step's selection blocks. Returns ``(out [B, N1, Dv], topk_indices
    [B, N2, select_block_count] int32)``; the first and the last two blocks are always chosen, first
    (:mod:`attnops.ops.nsa.decode`)."""
    check_tensor("query", query, ndim=3)
    check_tensor("key_cache", key_cache, ndim=4)
    query, key_cache, value_cache, block_table = _prepared("query", query, key_cache=key_cache,
                                                           value_cache=value_cache, block_table=block_table)
    scale = softmax_scale(scale, query, query.shape[-1])
    lens = [int(v) for v in (cmp_seq_lens.tolist() if isinstance(cmp_seq_lens, Tensor) else cmp_seq_lens)]
    with autocast_off(query.device):
        return _op().nsa_compress_attention_infer(query, key_cache, value_cache, block_table, float(scale),
                                                  query.shape[1], key_cache.shape[2], select_block_size,
                                                  select_block_count, key_cache.shape[1], compress_block_size,
                                                  compress_stride, lens)


def check_selected_backward_inputs(spec: SelectedSpec, query, grad, attention_out, softmax_max, softmax_sum):
    shape_out = (spec.total_q, spec.n1, spec.dv)
    for name, t in (("attention_out_grad", grad), ("attention_out", attention_out)):
        require_not_none(t, name)
        check_tensor(name, t, dtypes=(query.dtype,), shape=shape_out)
    for name, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        require_not_none(t, name)
        check_tensor(name, t, dtypes=(stats_dtype(query.dtype),), shape=(spec.total_q, spec.n1, STAT_LANES))


def _causal_compressed_mask(lengths: list[int], block: int, stride: int) -> Tensor:
    """``[maxS, maxCmp]``: compressed block c is visible to token i once complete (``c*stride + block - 1 <= i``)."""
    max_s = max([0, *lengths])
    max_c = max([0, *(compress_block_count(n, block, stride) for n in lengths)])
    ends = torch.arange(max_c) * stride + block - 1
    return ends.unsqueeze(0) > torch.arange(max_s).unsqueeze(1)


def _forced_blocks(lengths: list[int], select_block: int, local_blocks: int) -> Tensor:
    """``[maxS, maxSel]`` topk_mask: block 0 and the ``local_blocks`` blocks ending at the token's own block."""
    max_s = max([0, *lengths])
    n_sel = -(-max_s // select_block)
    own = (torch.arange(max_s) // select_block).unsqueeze(1)
    cols = torch.arange(n_sel).unsqueeze(0)
    return (cols == 0) | ((cols <= own) & (cols > own - local_blocks))


def native_sparse_attention(query: Tensor, key: Tensor, value: Tensor, gates: Tensor, compress_weight_k: Tensor,
                            compress_weight_v: Tensor, *, cu_seqlens=None, actual_seq_len=None,
                            compress_block_size: int = 32, compress_stride: int = 16, select_block_size: int = 64,
                            select_block_count: int = 16, window_size: int = 512, local_blocks: int = 2,
                            scale: float | None = None) -> Tensor:
    """Native Sparse Attention (DeepSeek, arXiv 2502.11089): causal self-attention as the gated sum of three branches.

    * compression: keys/values compressed by :func:`nsa_compress` with the learnable ``compress_weight_k/v``
      ``[compress_block_size, N2]``; queries attend to complete compressed blocks;
    * selection: the top ``select_block_count`` blocks of ``select_block_size`` tokens by importance (block 0 and
      the ``local_blocks`` most recent blocks forced), attended with :func:`nsa_selected_attention`;
    * sliding window: :func:`attnops.flash_attention` with a bottom-right band of ``window_size`` tokens.

    ``query [T, N1, D]``, ``key [T, N2, D]``, ``value [T, N2, Dv]`` packed (TND) with ``cu_seqlens`` (leading 0)
    or ``actual_seq_len`` (cumulative); every sequence length must be a multiple of ``select_block_size`` and at
    least ``select_block_size * select_block_count`` (the NPU kernel's constraint). ``gates [T, N1, 3]`` weight the
    compression, selection and window outputs. Returns ``[T, N1, Dv]``; gradients flow to q, k, v, both
    compression weights and the gates.
    """
    check_tensor("query", query, ndim=3)
    query, key, value, gates, compress_weight_k, compress_weight_v = _prepared(
        "query", query, key=key, value=value, gates=gates, compress_weight_k=compress_weight_k,
        compress_weight_v=compress_weight_v)
    t, n1 = query.shape[0], query.shape[1]
    check_tensor("gates", gates, shape=(t, n1, 3))
    with autocast_off(query.device):
        return _native_sparse_attention(query, key, value, gates, compress_weight_k, compress_weight_v, t,
                                        cu_seqlens, actual_seq_len, compress_block_size, compress_stride,
                                        select_block_size, select_block_count, window_size, local_blocks, scale)


def _native_sparse_attention(query, key, value, gates, compress_weight_k, compress_weight_v, t, cu_seqlens,
                             actual_seq_len, compress_block_size, compress_stride, select_block_size,
                             select_block_count, window_size, local_blocks, scale):
    """:func:`native_sparse_attention` on checked inputs of one device, autocast off."""
    from ..flash_attention import flash_attention

    window = check_int("window_size", window_size, lo=1)
    cum = _cumulative("cu_seqlens", cu_seqlens, actual_seq_len, t)
    lengths = lengths_from_cumulative("actual_seq_len", cum, t)
    k_cmp = nsa_compress(key, compress_weight_k, block_size=compress_block_size, stride=compress_stride,
                         actual_seq_len=cum)
    v_cmp = nsa_compress(value, compress_weight_v, block_size=compress_block_size, stride=compress_stride,
                         actual_seq_len=cum)
    cmp_cum, acc = [], 0
    for n in lengths:
        acc += compress_block_count(n, compress_block_size, compress_stride)
        cmp_cum.append(acc)
    if acc == 0:
        fail("actual_seq_len", f"at least one sequence of >= compress_block_size={compress_block_size} tokens",
             lengths)
    o_cmp, topk, _, _ = nsa_compress_attention(
        query, k_cmp, v_cmp, compress_block_size=compress_block_size, compress_stride=compress_stride,
        select_block_size=select_block_size, select_block_count=select_block_count, scale=scale,
        atten_mask=_causal_compressed_mask(lengths, compress_block_size, compress_stride).to(query.device),
        topk_mask=_forced_blocks(lengths, select_block_size, local_blocks).to(query.device), actual_seq_qlen=cum,
        actual_cmp_seq_kvlen=cmp_cum)
    o_slc = nsa_selected_attention(query, key, value, topk, select_block_size=select_block_size, causal=True,
                                   scale=scale, actual_seq_qlen=cum, actual_seq_kvlen=cum)
    band = torch.ones(2048, 2048, dtype=torch.bool, device=query.device).triu(1)
    o_win = flash_attention(query, key, value, layout="TND", actual_seq_qlen=cum, actual_seq_kvlen=cum,
                            atten_mask=band, sparse_mode=4, pre_tokens=window - 1, next_tokens=0, scale=scale)
    g = gates.to(o_win.dtype)
    return g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win
