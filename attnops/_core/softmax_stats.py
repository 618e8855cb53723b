"""Softmax statistics buffers (softmax_max / softmax_sum): fp32, each value replicated 8 times.

Layouts (``cann_semantics.md`` §4.2): dense ``[B, N1, Sq, 8]``; TND default: shape ``[T, N1, 8]`` whose memory is
per-batch ``[N1, Sq_b, 8]`` blocks (as the NPU writes it); TND ``softmax_layout="TND"``: true ``[T, N1, 8]``.
Rows not computed (fully masked, or tokens outside every batch) hold FLT_LOWEST / FLT_MAX.
"""
from __future__ import annotations

import torch

from .checks import check_tensor, require
from .varlen import SeqInfo

FLT_MAX = 3.4028234663852886e38
FLT_LOWEST = -FLT_MAX
STAT_LANES = 8
SOFTMAX_LAYOUTS = ("", "TND")


def stats_shape(seq: SeqInfo, n1: int, total_q: int) -> tuple[int, ...]:
    return (total_q, n1, STAT_LANES) if seq.packed else (seq.batch, n1, seq.max_q, STAT_LANES)


def stats_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """fp32, except fp64 for fp64 inputs (Pythonic API only, for gradcheck)."""
    return torch.float64 if input_dtype == torch.float64 else torch.float32


def stats_block(buf: torch.Tensor, seq: SeqInfo, b: int, softmax_layout: str) -> torch.Tensor:
    """View of batch ``b``'s statistics as ``[N1, Sq_b, 8]`` (writes go to ``buf``)."""
    if not seq.packed:
        return buf[b]
    start, sq = seq.q_starts[b], seq.q_lens[b]
    n1 = buf.shape[1]
    if softmax_layout == "TND":
        return buf[start:start + sq].permute(1, 0, 2)
    flat = buf.view(-1)
    return flat[start * n1 * STAT_LANES:(start + sq) * n1 * STAT_LANES].view(n1, sq, STAT_LANES)


def check_stats(name: str, x: torch.Tensor, seq: SeqInfo, n1: int, total_q: int, input_dtype: torch.dtype
                ) -> torch.Tensor:
    """Validate a given softmax_max/sum; returns it contiguous (blocked TND layouts need flat views)."""
    shape = stats_shape(seq, n1, total_q)
    check_tensor(name, x, dtypes=(stats_dtype(input_dtype),))
    require(tuple(x.shape) == shape, name, f"shape {list(shape)} (fp32, value replicated 8 times)", x)
    return x.contiguous()
