"""``torch_npu.npu_block_sparse_attention`` and its backward: attention where query block ``i`` (``block_shape[0]``
rows) sees key block ``j`` (``block_shape[1]`` columns) of the same batch and head iff
``block_sparse_mask[b, n, i, j] != 0``; blocks count from each sequence's start. Run per sequence on FlashAttention
with the mask expanded to elements (a row that sees no block gives 0), in fp32 whatever ``inner_precise`` (which
only chooses the NPU's intermediate precision).

Layouts: BNSD (``[B, N, S, D]``, ``actual_seq_lengths`` per batch, every one ``S`` when given) or TND (``[T, N, D]``,
``actual_seq_lengths`` cumulative, required). GQA: query head ``n`` uses key head ``n // (N1 / N2)``. The forward
returns ``(attention_out, softmax_lse)`` with the fp32 natural-log ``softmax_lse`` ``[B, N, S, 1]`` / ``[T, N, 1]``
(computed whatever ``softmax_lse_flag``); the backward takes the forward's ``attention_out`` and ``softmax_lse``
as they are and returns ``(d_query, d_key, d_value)``."""
from __future__ import annotations

import itertools

import torch
from torch import Tensor

from .._core.checks import check_int, check_scale, check_tensor, int_list, require
from ._common import with_overloads

LAYOUTS = ("BNSD", "TND")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _cumulative(name: str, values, total: int) -> list[int]:
    """TND cumulative lengths: non-decreasing, from >= 0 to ``total``."""
    cum = int_list(name, values)
    require(cum is not None and len(cum) > 0 and cum[0] >= 0 and cum[-1] == total and
            all(a <= b for a, b in zip(cum, cum[1:])), name,
            f"non-decreasing cumulative lengths ending at T={total} (required with TND)", cum)
    return cum


def _sequences(query: Tensor, key: Tensor, layout: str, kv_layout: str, q_lens, kv_lens) -> list[tuple]:
    """``(query_rows, key_rows)`` of each sequence: (batch index, slice) pairs into BNSD (as ``[1, N, S, D]``) or
    TND (as rows of ``[T, N, D]``)."""
    if layout == "BNSD":
        for name, lens, s in (("actual_seq_lengths", q_lens, query.shape[2]),
                              ("actual_seq_lengths_kv", kv_lens, key.shape[2])):
            values = int_list(name, lens)
            require(values is None or values == [s] * query.shape[0], name, f"None or [{s}] * B (full sequences)",
                    values)
        return [((b, slice(None)), (b, slice(None))) for b in range(query.shape[0])]
    q_cum = _cumulative("actual_seq_lengths", q_lens, query.shape[0])
    kv_cum = _cumulative("actual_seq_lengths_kv", kv_lens, key.shape[0])
    require(len(kv_cum) == len(q_cum), "actual_seq_lengths_kv", f"{len(q_cum)} entries (as actual_seq_lengths)",
            kv_cum)
    bounds = [list(zip([0, *cum[:-1]], cum)) for cum in (q_cum, kv_cum)]
    return [((None, slice(*q)), (None, slice(*kv))) for q, kv in zip(*bounds)]


def _as_bnsd(x: Tensor, where: tuple) -> Tensor:
    b, rows = where
    return x[b:b + 1] if b is not None else x[rows].transpose(0, 1).unsqueeze(0)


def _element_mask(block_mask: Tensor, b: int, block_shape: list[int], sq: int, skv: int) -> Tensor:
    """The FlashAttention ``atten_mask`` (True = masked) ``[1, N, sq, skv]`` of sequence ``b``."""
    bx, by = block_shape
    keep = block_mask[b, :, :-(-sq // bx), :-(-skv // by)].bool()
    return ~keep.repeat_interleave(bx, 1).repeat_interleave(by, 2)[:, :sq, :skv].unsqueeze(0)


def _checked(query, key, value, block_sparse_mask, block_shape, q_layout, kv_layout, num_key_value_heads,
             scale_value):
    """Validated ``(block_shape, scale)``: tensors, layouts and the mask's ``[B, N, blocks_q, blocks_kv]`` shape."""
    require(q_layout in LAYOUTS, "q_input_layout", "BNSD or TND", q_layout)
    require(kv_layout == q_layout, "kv_input_layout", f"{q_layout} (as q_input_layout)", kv_layout)
    rank = 4 if q_layout == "BNSD" else 3
    check_tensor("query", query, ndim=rank, dtypes=FLOAT_DTYPES)
    heads = check_int("num_key_value_heads", num_key_value_heads, lo=1)
    check_tensor("key", key, ndim=rank, dtypes=(query.dtype,), device=query.device)
    check_tensor("value", value, ndim=rank, dtypes=(query.dtype,), device=query.device)
    require(key.shape[1] == heads and query.shape[1] % heads == 0, "key",
            f"num_key_value_heads={heads} heads, dividing the query's", key)
    shape = int_list("block_shape", block_shape)
    require(shape is not None and len(shape) == 2 and min(shape) > 0, "block_shape", "[rows, columns] > 0", shape)
    check_tensor("block_sparse_mask", block_sparse_mask, ndim=4, device=query.device)
    return shape, check_scale("scale_value", scale_value) or query.shape[-1] ** -0.5


def _check_mask(mask: Tensor, seqs: list, shape: list[int], query: Tensor, key: Tensor) -> None:
    """``[B, N1, ceil(max Sq / block_shape[0]), ceil(max Skv / block_shape[1])]``."""
    def longest(x: Tensor, side: int) -> int:
        return max((x[at[1]].shape[0] if at[0] is None else x.shape[2] for at in (seq[side] for seq in seqs)),
                   default=0)

    blocks = (-(-longest(query, 0) // shape[0]), -(-longest(key, 1) // shape[1]))
    expected = (len(seqs), query.shape[1], *blocks)
    require(tuple(mask.shape) == expected, "block_sparse_mask",
            f"[B, N, ceil(Sq / block_shape[0]), ceil(Skv / block_shape[1])] = {list(expected)} for block_shape "
            f"{shape}", mask)


def _place(out: Tensor, where: tuple, part: Tensor) -> None:
    b, rows = where
    if b is not None:
        out[b:b + 1] = part
    else:
        out[rows] = part.squeeze(0).transpose(0, 1)


def npu_block_sparse_attention(query: Tensor, key: Tensor, value: Tensor, block_sparse_mask: Tensor, block_shape, *,
                               q_input_layout: str = "TND", kv_input_layout: str = "TND",
                               num_key_value_heads: int = 1, scale_value: float = 0.0, inner_precise: int = 1,
                               actual_seq_lengths=None, actual_seq_lengths_kv=None, softmax_lse_flag: int = 0):
    """``(attention_out, softmax_lse)`` (module docstring); ``scale_value`` 0 means ``1/sqrt(D)``."""
    from ..ops.flash_attention import flash_attention

    check_int("inner_precise", inner_precise, lo=0, hi=1)
    shape, scale = _checked(query, key, value, block_sparse_mask, block_shape, q_input_layout, kv_input_layout,
                            num_key_value_heads, scale_value)
    seqs = _sequences(query, key, q_input_layout, kv_input_layout, actual_seq_lengths, actual_seq_lengths_kv)
    _check_mask(block_sparse_mask, seqs, shape, query, key)
    out = query.new_zeros(*query.shape[:-1], value.shape[-1])
    lse = torch.zeros(*query.shape[:-1], 1, dtype=torch.float32, device=query.device)
    for b, (q_at, kv_at) in enumerate(seqs):
        q, k, v = _as_bnsd(query, q_at), _as_bnsd(key, kv_at), _as_bnsd(value, kv_at)
        res = flash_attention(q, k, v, scale=scale, return_stats=True,
                              atten_mask=_element_mask(block_sparse_mask, b, shape, q.shape[2], k.shape[2]))
        _place(out, q_at, res.out)
        _place(lse, q_at, (res.softmax_max[..., :1] + res.softmax_sum[..., :1].log()))
    return out, lse


def npu_block_sparse_attention_backward(d_out: Tensor, query: Tensor, key: Tensor, value: Tensor,
                                        attention_out: Tensor, softmax_lse: Tensor, block_sparse_mask: Tensor,
                                        block_shape, actual_seq_lengths, actual_seq_lengths_kv, q_input_layout: str,
                                        kv_input_layout: str, num_key_value_heads: int, scale_value: float):
    """``(d_query, d_key, d_value)`` from the forward's ``attention_out`` and ``softmax_lse`` (module docstring)."""
    from ..ops.flash_attention import flash_attention_backward

    shape, scale = _checked(query, key, value, block_sparse_mask, block_shape, q_input_layout, kv_input_layout,
                            num_key_value_heads, scale_value)
    out_shape = (*query.shape[:-1], value.shape[-1])
    check_tensor("d_out", d_out, shape=out_shape, dtypes=(query.dtype,), device=query.device)
    check_tensor("attention_out", attention_out, shape=out_shape, dtypes=(query.dtype,), device=query.device)
    check_tensor("softmax_lse", softmax_lse, shape=(*query.shape[:-1], 1), dtypes=(torch.float32,),
                 device=query.device)
    seqs = _sequences(query, key, q_input_layout, kv_input_layout, actual_seq_lengths, actual_seq_lengths_kv)
    _check_mask(block_sparse_mask, seqs, shape, query, key)
    grads = [torch.zeros_like(x) for x in (query, key, value)]
    for b, (q_at, kv_at) in enumerate(seqs):
        q, k, v = _as_bnsd(query, q_at), _as_bnsd(key, kv_at), _as_bnsd(value, kv_at)
        row_lse = _as_bnsd(softmax_lse, q_at).float().expand(*q.shape[:3], 8).contiguous()
        dq, dk, dv, _ = flash_attention_backward(
            _as_bnsd(d_out, q_at), q, k, v, _as_bnsd(attention_out, q_at), row_lse, torch.ones_like(row_lse),
            scale=scale, atten_mask=_element_mask(block_sparse_mask, b, shape, q.shape[2], k.shape[2]))
        for grad, part, at in zip(grads, (dq, dk, dv), (q_at, kv_at, kv_at)):
            _place(grad, at, part)
    return tuple(grads)


npu_block_sparse_attention = with_overloads(npu_block_sparse_attention)
npu_block_sparse_attention_backward = with_overloads(npu_block_sparse_attention_backward)
