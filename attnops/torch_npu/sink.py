"""torch_npu's attention sink (``sink`` of ``npu_fusion_attention(_v2)`` and their grads), on top of the core.

The sink is one fp32 logit per head, compared with the scaled scores, that enters only the softmax denominator
(torch_npu_api.md §1.2: ``softmax(cat([scale*QK^T, sink]))[..., :-1]``). From the core's row max ``m``, row sum
``l`` and output ``o`` (softmax over the keys only):

    m' = max(m, sink)                               (CANN: "m = max(sink, max(S))")
    l' = l * exp(m - m') + exp(sink - m')
    o' = o * l * exp(m - m') / l'

``softmax_max``/``softmax_sum`` are returned as ``m'``/``l'``, the statistics of the softmax actually computed, so
the grad, which rebuilds ``P = exp(S - max) / sum`` from the given statistics, gives dq/dk/dv/dpse unchanged and
only adds ``dsink[n] = -sum_rows exp(sink - m') / l' * rowsum(dy * o')``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.checks import check_tensor, require
from .._core.layouts import tokens_view
from .._core.softmax_stats import FLT_LOWEST, STAT_LANES
from ..ops.attention_update import blocked_to_tnd, tnd_to_blocked


def check_sink(sink: Tensor, head_num: int) -> None:
    check_tensor("sink", sink, dtypes=(torch.float32,))
    require(tuple(sink.shape) == (head_num,), "sink", f"fp32 shape [head_num] = [{head_num}]", sink)


class _Rows:
    """Per-row statistics in token order (``[B, S, N]`` dense, ``[T, N]`` TND) and back to the op's layout."""

    def __init__(self, layout: str, softmax_layout: str, q_lens: list[int] | None):
        self.layout, self.blocked, self.q_lens = layout, layout == "TND" and softmax_layout == "", q_lens

    def rows(self, stats: Tensor) -> Tensor:
        if self.layout != "TND":
            return stats[..., 0].transpose(1, 2)
        return (blocked_to_tnd(stats, self.q_lens) if self.blocked else stats)[..., 0]

    def stats(self, rows: Tensor) -> Tensor:
        x = rows if self.layout == "TND" else rows.transpose(1, 2)
        x = x.unsqueeze(-1).expand(*x.shape, STAT_LANES).contiguous()
        return tnd_to_blocked(x, self.q_lens) if self.blocked else x


def apply_sink(out: Tensor, softmax_max: Tensor, softmax_sum: Tensor, sink: Tensor, *, layout: str,
               softmax_layout: str, q_lens: list[int] | None, head_num: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(o', m', l')`` from the core's forward results (see the module docstring)."""
    r = _Rows(layout, softmax_layout, q_lens)
    m, l = r.rows(softmax_max).double(), r.rows(softmax_sum).double()
    s = sink.double()
    m2 = torch.maximum(m, s)
    kept = l * torch.exp(m - m2)  # 0 for rows without keys (m = FLT_LOWEST)
    l2 = kept + torch.exp(s - m2)
    o = out.to(torch.float64, copy=True)
    tokens_view(o, layout, head_num).mul_((kept / l2).unsqueeze(-1))
    return o.to(out.dtype), r.stats(m2.to(softmax_max.dtype)), r.stats(l2.to(softmax_sum.dtype))


def sink_grad(dy: Tensor, attention_in: Tensor, softmax_max: Tensor, softmax_sum: Tensor, sink: Tensor, *,
              layout: str, softmax_layout: str, q_lens: list[int] | None, head_num: int) -> Tensor:
    """``dsink [N]`` (fp32) from the statistics :func:`apply_sink` returned and the op's output."""
    r = _Rows(layout, softmax_layout, q_lens)
    m, l = r.rows(softmax_max).double(), r.rows(softmax_sum).double()
    delta = (tokens_view(dy, layout, head_num).double() * tokens_view(attention_in, layout, head_num).double()).sum(-1)
    p_sink = torch.where(m == FLT_LOWEST, torch.zeros_like(m), torch.exp(sink.double() - m) / l)
    return -(p_sink * delta).reshape(-1, head_num).sum(0).to(torch.float32)
