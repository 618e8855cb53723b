"""Merging partial attention results through their softmax statistics (context parallelism, chunked prefill).

Two forms, exactly as torch_npu (``torch_npu_api.md`` §9):

* :func:`ring_attention_update` (``npu_ring_attention_update``): max/sum statistics, fp32, 8 lanes.
  ``m = max(m1, m2)``, ``s = s1*e^(m1-m) + s2*e^(m2-m)``, ``o = o1*e^(m1-m)*s1/s + o2*e^(m2-m)*s2/s``.
* :func:`attention_update` (``npu_attention_update``): K partial outputs with their log-sum-exp,
  ``lse = logsumexp_i(lse_i)``, ``O = sum_i O_i * e^(lse_i - lse)``.

Rows that attended to nothing carry the invalid-row statistics (FLT_LOWEST / FLT_MAX for max/sum, ``+inf`` lse for
FIA) and contribute nothing; a row invalid in every input stays invalid (output 0). Arithmetic runs in the
statistics' dtype (fp32; fp64 for fp64 outputs), the output is cast back to the input's dtype.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.checks import check_choice, check_int, check_tensor, fail, require
from .._core.softmax_stats import FLT_LOWEST, FLT_MAX, SOFTMAX_LAYOUTS, STAT_LANES, stats_block, stats_dtype
from .._core.varlen import seq_info_varlen

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
RING_LAYOUTS = ("SBH", "TND")

__all__ = ["ring_attention_update", "attention_update", "merge_softmax_stats", "blocked_to_tnd", "tnd_to_blocked"]


def merge_softmax_stats(prev_out: Tensor, prev_max: Tensor, prev_sum: Tensor, cur_out: Tensor, cur_max: Tensor,
                        cur_sum: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Merge two partial results whose rows are aligned: outputs ``[..., D]``, statistics ``[..., L]``.

    Statistics are combined lane by lane; the output uses lane 0. Returns ``(out, max, sum)`` in the statistics'
    dtype (no validation: the public functions and the ring driver call it on checked tensors).
    """
    dtype = prev_max.dtype
    merged_max = torch.maximum(prev_max, cur_max)
    prev_w = torch.where(prev_max > FLT_LOWEST, prev_sum, 0.0) * torch.exp(prev_max - merged_max)
    cur_w = torch.where(cur_max > FLT_LOWEST, cur_sum, 0.0) * torch.exp(cur_max - merged_max)
    merged_sum = prev_w + cur_w
    valid = merged_sum > 0
    denom = torch.where(valid, merged_sum, 1.0)
    out = (prev_out.to(dtype) * (prev_w / denom)[..., :1] + cur_out.to(dtype) * (cur_w / denom)[..., :1])
    merged_max = torch.where(valid, merged_max, FLT_LOWEST)
    merged_sum = torch.where(valid, merged_sum, FLT_MAX)
    return out, merged_max, merged_sum


def _check_pair(prev: Tensor, cur: Tensor, prev_name: str, cur_name: str, dtypes) -> None:
    check_tensor(prev_name, prev, dtypes=dtypes)
    check_tensor(cur_name, cur, dtypes=(prev.dtype,))
    require(cur.shape == prev.shape, cur_name, f"shape {list(prev.shape)} like {prev_name}", cur)


def _seq_lens_from_prefix_sums(actual_seq_qlen, total: int) -> list[int]:
    check_tensor("actual_seq_qlen", actual_seq_qlen, ndim=1, dtypes=(torch.int64, torch.int32))
    starts = [int(x) for x in actual_seq_qlen.tolist()]
    ok = len(starts) >= 2 and starts[0] == 0 and all(b >= a for a, b in zip(starts, starts[1:]))
    require(ok and starts[-1] <= total, "actual_seq_qlen",
            f"int64 prefix sums starting at 0 ([0, s0, s0+s1, ...]), non-decreasing, last <= T={total}",
            actual_seq_qlen)
    return [b - a for a, b in zip(starts, starts[1:])]


def _tnd_stats_views(stats: Tensor, lens: list[int]) -> list[tuple[Tensor, slice]]:
    """Per-batch ``[Sq_b, N, 8]`` views of blocked TND statistics with their token ranges (tail: token-major)."""
    seq = seq_info_varlen(lens, lens)
    views = [(stats_block(stats, seq, b, "").permute(1, 0, 2), slice(seq.q_starts[b], seq.q_starts[b] + n))
             for b, n in enumerate(lens)]
    used = sum(lens)
    tail = stats.view(-1)[used * stats.shape[1] * STAT_LANES:].view(-1, stats.shape[1], STAT_LANES)
    return views + [(tail, slice(used, stats.shape[0]))]


def blocked_to_tnd(stats: Tensor, lens: list[int]) -> Tensor:
    """FlashAttention's default per-batch blocked TND statistics -> true ``[T, N, 8]`` (``lens``: per-batch Sq_b)."""
    stats = stats.detach()
    out = torch.empty_like(stats)
    for view, rows in _tnd_stats_views(stats, lens):
        out[rows] = view
    return out


def tnd_to_blocked(stats: Tensor, lens: list[int]) -> Tensor:
    """True ``[T, N, 8]`` statistics -> FlashAttention's default per-batch blocked memory (inverse of the above)."""
    stats = stats.detach()
    out = torch.empty_like(stats)
    for view, rows in _tnd_stats_views(out, lens):
        view.copy_(stats[rows])
    return out


def ring_attention_update(prev_attn_out: Tensor, prev_softmax_max: Tensor, prev_softmax_sum: Tensor,
                          cur_attn_out: Tensor, cur_softmax_max: Tensor, cur_softmax_sum: Tensor, *,
                          actual_seq_qlen: Tensor | None = None, input_layout: str = "SBH",
                          input_softmax_layout: str = "") -> tuple[Tensor, Tensor, Tensor]:
    """``npu_ring_attention_update``: merge two partial attention results over disjoint keys.

    ``input_layout`` "SBH": outputs ``[S, B, H]`` with statistics ``[B, N, S, 8]``; "TND": outputs ``[T, N, D]``
    with statistics ``[T, N, 8]``, either in FlashAttention's default per-batch blocked memory
    (``input_softmax_layout=""``, needs ``actual_seq_qlen``: int64 prefix sums starting at 0, unlike FA's
    cumulative lists) or true TND (``input_softmax_layout="TND"``). Statistics are fp32 (fp64 for fp64 outputs).
    Returns ``(attn_out, softmax_max, softmax_sum)`` in the input layouts; ``attn_out`` has the input dtype.
    """
    layout = check_choice("input_layout", input_layout.upper() if isinstance(input_layout, str) else input_layout,
                          RING_LAYOUTS)
    check_choice("input_softmax_layout", input_softmax_layout, SOFTMAX_LAYOUTS)
    _check_pair(prev_attn_out, cur_attn_out, "prev_attn_out", "cur_attn_out", OUT_DTYPES)
    sdt = (stats_dtype(prev_attn_out.dtype),)
    _check_pair(prev_softmax_max, cur_softmax_max, "prev_softmax_max", "cur_softmax_max", sdt)
    _check_pair(prev_softmax_sum, cur_softmax_sum, "prev_softmax_sum", "cur_softmax_sum", sdt)
    require(prev_softmax_sum.shape == prev_softmax_max.shape, "prev_softmax_sum",
            f"shape {list(prev_softmax_max.shape)} like prev_softmax_max", prev_softmax_sum)
    require(prev_attn_out.dim() == 3, "prev_attn_out", f"a 3-D tensor ({layout})", prev_attn_out)
    o1, o2, m1, s1, m2, s2 = (prev_attn_out, cur_attn_out, prev_softmax_max, prev_softmax_sum, cur_softmax_max,
                              cur_softmax_sum)
    if layout == "SBH":
        s, b, h = o1.shape
        require(m1.dim() == 4 and m1.shape[0] == b and m1.shape[2] == s and m1.shape[3] == STAT_LANES
                and m1.shape[1] > 0 and h % m1.shape[1] == 0, "prev_softmax_max",
                f"shape [B={b}, N, S={s}, 8] with N dividing H={h}", m1)
        n = m1.shape[1]
        as_bnsd = [o.view(s, b, n, h // n).permute(1, 2, 0, 3) for o in (o1, o2)]
        out, smax, ssum = merge_softmax_stats(as_bnsd[0], m1, s1, as_bnsd[1], m2, s2)
        return out.permute(2, 0, 1, 3).reshape(s, b, h).to(o1.dtype), smax, ssum
    t, n, _ = o1.shape
    require(tuple(m1.shape) == (t, n, STAT_LANES), "prev_softmax_max", f"shape [T={t}, N={n}, 8]", m1)
    if input_softmax_layout == "TND":
        out, smax, ssum = merge_softmax_stats(o1, m1, s1, o2, m2, s2)
        return out.to(o1.dtype), smax, ssum
    if actual_seq_qlen is None:
        fail("actual_seq_qlen", "int64 prefix sums [0, s0, s0+s1, ...] for TND with the blocked softmax layout",
             None)
    lens = _seq_lens_from_prefix_sums(actual_seq_qlen, t)
    m1, s1, m2, s2 = (blocked_to_tnd(x.contiguous(), lens) for x in (m1, s1, m2, s2))
    out, smax, ssum = merge_softmax_stats(o1, m1, s1, o2, m2, s2)
    return out.to(o1.dtype), tnd_to_blocked(smax, lens), tnd_to_blocked(ssum, lens)


def attention_update(lse: list[Tensor], local_out: list[Tensor], update_type: int = 0) -> tuple[Tensor, Tensor]:
    """``npu_attention_update``: merge K partial outputs ``local_out[i]`` ``[B*S*N, D]`` by their fp32 lse ``[B*S*N]``.

    Returns ``(out, lse_out)``: ``out`` in the partial outputs' dtype, ``lse_out`` the merged fp32 lse. torch_npu
    defines ``lse_out`` only for ``update_type=1``; it is computed for both types. Non-finite lse entries (FIA's
    ``+inf`` for rows that attended to nothing) contribute nothing; a row with none finite gives 0 and lse ``+inf``.
    """
    check_int("update_type", update_type, lo=0, hi=1)
    for name, value in (("lse", lse), ("local_out", local_out)):
        require(isinstance(value, (list, tuple)) and len(value) > 0, name, "a non-empty list of tensors", value)
    require(len(local_out) == len(lse), "local_out", f"{len(lse)} tensors (one per lse)", f"{len(local_out)}")
    check_tensor("local_out[0]", local_out[0], ndim=2, dtypes=OUT_DTYPES)
    rows = local_out[0].shape[0]
    lse_dtype = stats_dtype(local_out[0].dtype)
    for i, (x, o) in enumerate(zip(lse, local_out)):
        check_tensor(f"lse[{i}]", x, shape=(rows,), dtypes=(lse_dtype,))
        check_tensor(f"local_out[{i}]", o, shape=tuple(local_out[0].shape), dtypes=(local_out[0].dtype,))
    stacked = torch.stack(list(lse))
    finite = torch.isfinite(stacked)
    lse_max = torch.where(finite, stacked, float("-inf")).amax(0)
    any_valid = finite.any(0)
    lse_max = torch.where(any_valid, lse_max, 0.0)
    weights = torch.where(finite, torch.exp(stacked - lse_max), 0.0)
    total = weights.sum(0)
    merged = torch.where(any_valid, lse_max + torch.log(torch.where(any_valid, total, 1.0)), float("inf"))
    weights = weights / torch.where(any_valid, total, 1.0)
    out = sum(o.to(lse_dtype) * w.unsqueeze(-1) for o, w in zip(local_out, weights))
    return out.to(local_out[0].dtype), merged
