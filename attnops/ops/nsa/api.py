"""Pythonic NSA API (differentiable) and the composed ``native_sparse_attention`` layer. No math here."""
from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from ..._core.autocast import autocast_dtype, autocast_off, cast_inputs
from ..._core.custom_ops import call
from ..._core.checks import Described, caller_names, check_same_device, check_tensor, require, softmax_scale
from ..common.npu_rounding import check_precision
from ..._core.staging import device_constant
from ..._core.varlen import cumulative_from_cu_seqlens, lengths_from_cumulative
from .decode import lengths_arg



def _op():
    from . import op

    return op


def _prepared(ref_name: str, ref: Tensor, **others) -> tuple:
    """``(ref, *others)`` after checking that every tensor is on ``ref``'s device (never copied silently), the
    floating-point ones cast to the autocast dtype when ``torch.autocast`` is on there (as SDPA)."""
    check_same_device(ref_name, ref, **others)
    return cast_inputs(autocast_dtype(ref.device), ref, *others.values())


@device_constant(16)
def _causal_flag(device: torch.device) -> Tensor:
    """The ``[1, 1]`` ``atten_mask`` that turns on the operator's causal rule (``sparse_mode=2``; never read), one
    per device."""
    return torch.ones(1, 1, dtype=torch.bool, device=device)


def _cumulative(name: str, cu_seqlens, actual, total: int) -> list[int]:
    """CANN cumulative lengths from ``cu_seqlens`` (leading 0) or ``actual`` (cumulative); one batch by default."""
    if cu_seqlens is not None:
        require(actual is None, name, "either cu_seqlens or actual lengths, not both", Described("both"))
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
        return call(_op().nsa_compress, input, weight, block_size, stride, lens, 0)


class CompressAttentionResult(NamedTuple):
    out: Tensor
    topk_indices: Tensor
    softmax_max: Tensor
    softmax_sum: Tensor


def nsa_compress_attention(query: Tensor, key: Tensor, value: Tensor, *, compress_block_size: int,
                           compress_stride: int, select_block_size: int, select_block_count: int,
                           scale: float | None = None, atten_mask: Tensor | None = None,
                           topk_mask: Tensor | None = None, causal: bool = False, local_blocks: int | None = None,
                           position_offset: int = 0, cu_seqlens_q=None, cu_seqlens_cmp=None, actual_seq_qlen=None,
                           actual_cmp_seq_kvlen=None, precision: Literal["exact", "npu"] = "exact"
                           ) -> CompressAttentionResult:
    """Attention of ``query [T, N1, D]`` over compressed ``key/value [T_cmp, N2, D/Dv]`` plus top-k selection.

    ``atten_mask`` ``[maxSq, maxCmpSkv]`` (True = masked) and ``topk_mask`` ``[maxSq, maxSelSkv]`` (True = always
    selected) use their top-left slice per batch. ``causal=True`` (instead of an ``atten_mask``) masks compressed key
    ``c`` for the token at position ``i`` of its sequence until its block is complete (``c * compress_stride +
    compress_block_size - 1 > i``), computed in the kernels: the mask of the NSA layer. ``local_blocks`` (instead of a
    ``topk_mask``) forces block 0 and the ``local_blocks`` selection blocks ending at the block of the token's
    position, also computed in the kernels: the layer's ``topk_mask``. ``position_offset`` (with either rule): every
    sequence's first query row is at that position (a chunk of new tokens after as many cached ones). Returns the output (differentiable in q, k,
    v), the int32 ``topk_indices [T, N2, select_block_count]`` (block indices local to each batch) and the
    statistics. ``precision="npu"``: the Ascend kernels' rounding of the attention (forward and backward) for
    fp16/bf16 inputs, on the reference (docs/precision.md); the importance scores and the selection stay exact.
    """
    check_precision(precision)
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
        return CompressAttentionResult(*call(
            _op().nsa_compress_attention, query, key, value, topk_mask, atten_mask, float(scale), query.shape[1],
            compress_block_size, compress_stride, select_block_size, select_block_count, qlen, cmp, sel,
            1 if atten_mask is not None else 0, bool(causal), -1 if local_blocks is None else int(local_blocks),
            position_offset, precision))


def nsa_selected_attention(query: Tensor, key: Tensor, value: Tensor, topk_indices: Tensor, *,
                           select_block_size: int, causal: bool = True, scale: float | None = None,
                           cu_seqlens_q=None, cu_seqlens_k=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                           return_stats: bool = False, precision: Literal["exact", "npu"] = "exact"):
    """Each query token attends to its selected KV blocks: ``topk_indices [T1, N2, count]`` (local to the batch).

    ``causal`` hides KV positions after the query's position within its sequence (the NPU's sparse_mode 2).
    Returns ``[T1, N1, Dv]`` (differentiable in q, k, v), or ``(out, softmax_max, softmax_sum)`` with
    ``return_stats``. ``precision="npu"``: the Ascend kernels' rounding for fp16/bf16 inputs (P and dS to the
    input dtype before their products, outputs ties away from zero), on the reference (docs/precision.md).
    """
    check_precision(precision)
    check_tensor("query", query, ndim=3)
    check_tensor("key", key, ndim=3)
    check_tensor("topk_indices", topk_indices, ndim=3)
    query, key, value, topk_indices = _prepared("query", query, key=key, value=value, topk_indices=topk_indices)
    qlen = _cumulative("cu_seqlens_q", cu_seqlens_q, actual_seq_qlen, query.shape[0])
    kvlen = _cumulative("cu_seqlens_k", cu_seqlens_k, actual_seq_kvlen, key.shape[0])
    scale = softmax_scale(scale, query, query.shape[-1])
    mask = _causal_flag(query.device) if causal else None
    with autocast_off(query.device):
        out, smax, ssum = call(_op().nsa_selected_attention, query, key, value, topk_indices, mask, float(scale),
                               query.shape[1], select_block_size, topk_indices.shape[-1], qlen, kvlen,
                               2 if causal else 0, precision)
    return (out, smax, ssum) if return_stats else out


_INFER_NAMES = dict(key="key_cache", value="value_cache")  # the decode operators' names of the caches


def nsa_selected_attention_infer(query: Tensor, key_cache: Tensor, value_cache: Tensor, topk_indices: Tensor,
                                 block_table: Tensor, seq_lens, *, select_block_size: int,
                                 scale: float | None = None, precision: Literal["exact", "npu"] = "exact") -> Tensor:
    """Decoding: one new token per request (``query [B, N1, D]``) attends, per KV head, to the blocks of
    ``select_block_size`` keys named by ``topk_indices [B, N2, count]`` (in order up to the first ``-1``, each cut
    at the request's length), read from paged caches ``[blocks, page_size, N2, D/Dv]`` through ``block_table
    [B, maxBlocks]``; ``seq_lens`` are the per-request KV lengths (a list, or a tensor: one on the query's GPU is read
    by the kernels only, never on the host, so a CUDA graph can capture the call). Returns ``[B, N1, Dv]`` (0 for a
    head that selects nothing). ``precision="npu"``: P rounded to the input dtype before P V and the output cast
    ties away from zero, on the reference (docs/precision.md)."""
    check_precision(precision)
    check_tensor("query", query, ndim=3)
    check_tensor("key_cache", key_cache, ndim=4)
    check_tensor("topk_indices", topk_indices, ndim=3)
    query, key_cache, value_cache, topk_indices, block_table = _prepared(
        "query", query, key_cache=key_cache, value_cache=value_cache, topk_indices=topk_indices,
        block_table=block_table)
    scale = softmax_scale(scale, query, query.shape[-1])
    lens, lens_tensor = lengths_arg("seq_lens", seq_lens)
    with autocast_off(query.device), caller_names(**_INFER_NAMES, actual_seq_kvlen="seq_lens"):
        return call(_op().nsa_selected_attention_infer, query, key_cache, value_cache, topk_indices, block_table,
                    float(scale), query.shape[1], key_cache.shape[2], select_block_size, topk_indices.shape[-1],
                    key_cache.shape[1], lens, lens_tensor, precision)


def nsa_compress_attention_infer(query: Tensor, key_cache: Tensor, value_cache: Tensor, block_table: Tensor,
                                 cmp_seq_lens, *, compress_block_size: int, compress_stride: int,
                                 select_block_size: int, select_block_count: int, scale: float | None = None,
                                 precision: Literal["exact", "npu"] = "exact") -> tuple[Tensor, Tensor]:
    """Decoding: one new token per request (``query [B, N1, D]``) attends to its compressed keys/values, read from
    paged caches ``[blocks, page_size, N2, D/Dv]`` through ``block_table`` (``cmp_seq_lens``: per-request
    compressed lengths, a list or a tensor as ``seq_lens`` of :func:`nsa_selected_attention_infer`), and picks the
    next step's selection blocks. Returns ``(out [B, N1, Dv], topk_indices
    [B, N2, select_block_count] int32)``; the first and the last two blocks are always chosen, first
    (:mod:`attnops.ops.nsa.decode`). ``precision="npu"``: as :func:`nsa_selected_attention_infer` (the selection
    stays exact)."""
    check_precision(precision)
    check_tensor("query", query, ndim=3)
    check_tensor("key_cache", key_cache, ndim=4)
    query, key_cache, value_cache, block_table = _prepared("query", query, key_cache=key_cache,
                                                           value_cache=value_cache, block_table=block_table)
    scale = softmax_scale(scale, query, query.shape[-1])
    lens, lens_tensor = lengths_arg("cmp_seq_lens", cmp_seq_lens)
    with autocast_off(query.device), caller_names(**_INFER_NAMES, actual_cmp_seq_kvlen="cmp_seq_lens"):
        return call(_op().nsa_compress_attention_infer, query, key_cache, value_cache, block_table, float(scale),
                    query.shape[1], key_cache.shape[2], select_block_size, select_block_count, key_cache.shape[1],
                    compress_block_size, compress_stride, lens, lens_tensor, precision)
