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

import itertools

import torch
from torch import Tensor

from ..._core import staging
from ..._core.checks import Described, check_choice, check_int, check_same_device, check_tensor, fail, require
from ..._core.softmax_stats import FLT_LOWEST, FLT_MAX, SOFTMAX_LAYOUTS, STAT_LANES, stats_dtype

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


def _prefix_sums(actual_seq_qlen, out: Tensor) -> Tensor:
    """``actual_seq_qlen`` (int64 prefix sums ``[0, s0, s0+s1, ...]``) on the device of ``out`` ``[T, N, D]``: a CPU
    tensor is checked (free) and staged up once per distinct list; a device tensor is used unread (values not
    checked)."""
    check_tensor("actual_seq_qlen", actual_seq_qlen, ndim=1, dtypes=(torch.int64, torch.int32))
    require(actual_seq_qlen.shape[0] >= 2, "actual_seq_qlen", "prefix sums [0, s0, s0+s1, ...] (at least 2 entries)",
            actual_seq_qlen)
    if actual_seq_qlen.device.type != "cpu":
        check_same_device("prev_attn_out", out, actual_seq_qlen=actual_seq_qlen)
        return actual_seq_qlen.to(torch.int64)
    starts = [int(x) for x in actual_seq_qlen.tolist()]
    ok = starts[0] == 0 and all(b >= a for a, b in zip(starts, starts[1:]))
    require(ok and starts[-1] <= out.shape[0], "actual_seq_qlen",
            f"int64 prefix sums starting at 0 ([0, s0, s0+s1, ...]), non-decreasing, last <= T={out.shape[0]}",
            actual_seq_qlen)
    return _staged_prefix_sums(tuple(b - a for a, b in zip(starts, starts[1:])), out.device)


def _staged_prefix_sums(lens: tuple[int, ...], device: torch.device) -> Tensor:
    """``[0, l0, l0+l1, ...]`` of host lengths on ``device`` (uploaded once per distinct list)."""
    return staging.cached_upload(("attention_update.prefix_sums", lens), lambda: [0, *itertools.accumulate(lens)],
                                 torch.int64, device)


def _batch_of(prefix: Tensor, position: Tensor, scale: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(inside, start, length, batch)`` of ``position`` among the ranges ``[prefix[b], prefix[b+1]) * scale``:
    whether it falls in one, that batch's first token and length (clamped so no index leaves its range)."""
    batches = prefix.shape[0] - 1
    batch = torch.searchsorted(prefix[1:] * scale, position, right=True)
    inside = batch < batches
    batch = batch.clamp(max=batches - 1)
    start = prefix[batch]
    return inside, start, prefix[batch + 1] - start, batch


def _blocked_rows(prefix: Tensor, tokens: int, heads: int) -> Tensor:
    """For each true-TND row ``t * heads + n``, the row of the blocked memory holding it: batch ``b``'s rows are
    head-major ``[N, Sq_b]`` from ``prefix[b] * N``; rows past the last batch are token-major, where they are."""
    t = torch.arange(tokens, device=prefix.device)
    n = torch.arange(heads, device=prefix.device)
    inside, start, length, _ = _batch_of(prefix, t, 1)
    rows = torch.where(inside[:, None], (start * heads + t - start)[:, None] + n[None, :] * length[:, None],
                       t[:, None] * heads + n[None, :])
    return rows.flatten().clamp(0, max(tokens * heads - 1, 0))


def _tnd_rows(prefix: Tensor, tokens: int, heads: int) -> Tensor:
    """For each row ``r`` of the blocked memory, the true-TND row ``t * heads + n`` it holds (inverse of
    :func:`_blocked_rows`)."""
    r = torch.arange(tokens * heads, device=prefix.device)
    inside, start, length, _ = _batch_of(prefix, r, heads)
    local = r - start * heads
    length = length.clamp(min=1)
    rows = torch.where(inside, (start + local % length) * heads + local.div(length, rounding_mode="floor"), r)
    return rows.clamp(0, max(tokens * heads - 1, 0))


def _permuted(stats: Tensor, rows: Tensor) -> Tensor:
    """``stats`` ``[T, N, L]`` with row ``i`` of the result = row ``rows[i]`` of ``stats`` (rows of ``L`` lanes)."""
    stats = stats.detach().contiguous()
    return stats.view(-1, stats.shape[-1]).index_select(0, rows).view(stats.shape)


def blocked_to_tnd(stats: Tensor, lens: list[int] | Tensor) -> Tensor:
    """FlashAttention's default per-batch blocked TND statistics -> true ``[T, N, 8]``. ``lens``: the per-batch
    Sq_b (host list), or their prefix sums ``[0, s0, s0+s1, ...]`` as an int64 tensor on ``stats``' device."""
    prefix = lens if isinstance(lens, Tensor) else _staged_prefix_sums(tuple(lens), stats.device)
    return _permuted(stats, _blocked_rows(prefix, stats.shape[0], stats.shape[1]))


def tnd_to_blocked(stats: Tensor, lens: list[int] | Tensor) -> Tensor:
    """True ``[T, N, 8]`` statistics -> FlashAttention's default per-batch blocked memory (inverse of the above)."""
    prefix = lens if isinstance(lens, Tensor) else _staged_prefix_sums(tuple(lens), stats.device)
    return _permuted(stats, _tnd_rows(prefix, stats.shape[0], stats.shape[1]))


def ring_attention_update(prev_attn_out: Tensor, prev_softmax_max: Tensor, prev_softmax_sum: Tensor,
                          cur_attn_out: Tensor, cur_softmax_max: Tensor, cur_softmax_sum: Tensor, *,
                          actual_seq_qlen: Tensor | None = None, input_layout: str = "SBH",
                          input_softmax_layout: str = "") -> tuple[Tensor, Tensor, Tensor]:
    """``npu_ring_attention_update``: merge two partial attention results over disjoint keys.

    ``input_layout`` "SBH": outputs ``[S, B, H]`` with statistics ``[B, N, S, 8]``; "TND": outputs ``[T, N, D]``
    with statistics ``[T, N, 8]``, either in FlashAttention's default per-batch blocked memory
    (``input_softmax_layout=""``, needs ``actual_seq_qlen``: int64 prefix sums starting at 0, unlike FA's
    cumulative lists) or true TND (``input_softmax_layout="TND"``). Statistics are fp32 (fp64 for fp64 outputs).
    ``actual_seq_qlen`` on the CPU is checked; on the device it is used there unread (values not checked; every
    index it yields is clamped into the tensors).
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
    check_same_device("prev_attn_out", prev_attn_out, cur_attn_out=cur_attn_out, prev_softmax_max=prev_softmax_max,
                      prev_softmax_sum=prev_softmax_sum, cur_softmax_max=cur_softmax_max,
                      cur_softmax_sum=cur_softmax_sum)
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
    prefix = _prefix_sums(actual_seq_qlen, o1)
    to_tnd, to_blocked = _blocked_rows(prefix, t, n), _tnd_rows(prefix, t, n)
    m1, s1, m2, s2 = (_permuted(x, to_tnd) for x in (m1, s1, m2, s2))
    out, smax, ssum = merge_softmax_stats(o1, m1, s1, o2, m2, s2)
    return out.to(o1.dtype), _permuted(smax, to_blocked), _permuted(ssum, to_blocked)


def attention_update(lse: list[Tensor], local_out: list[Tensor], update_type: int = 0) -> tuple[Tensor, Tensor]:
    """``npu_attention_update``: merge K partial outputs ``local_out[i]`` ``[B*S*N, D]`` by their fp32 lse ``[B*S*N]``.

    Returns ``(out, lse_out)``: ``out`` in the partial outputs' dtype, ``lse_out`` the merged fp32 lse. torch_npu
    defines ``lse_out`` only for ``update_type=1``; it is computed for both types. Non-finite lse entries (FIA's
    ``+inf`` for rows that attended to nothing) contribute nothing; a row with none finite gives 0 and lse ``+inf``.
    """
    check_int("update_type", update_type, lo=0, hi=1)
    for name, value in (("lse", lse), ("local_out", local_out)):
        require(isinstance(value, (list, tuple)) and len(value) > 0, name, "a non-empty list of tensors", value)
    require(len(local_out) == len(lse), "local_out", f"{len(lse)} tensors (one per lse)",
            Described(f"{len(local_out)}"))
    check_tensor("local_out[0]", local_out[0], ndim=2, dtypes=OUT_DTYPES)
    rows = local_out[0].shape[0]
    lse_dtype = stats_dtype(local_out[0].dtype)
    for i, (x, o) in enumerate(zip(lse, local_out)):
        check_tensor(f"lse[{i}]", x, shape=(rows,), dtypes=(lse_dtype,))
        check_tensor(f"local_out[{i}]", o, shape=tuple(local_out[0].shape), dtypes=(local_out[0].dtype,))
        check_same_device("local_out[0]", local_out[0], **{f"lse[{i}]": x, f"local_out[{i}]": o})
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
