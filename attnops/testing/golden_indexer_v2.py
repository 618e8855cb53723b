"""Dense golden of the DeepSeek-V4 lightning indexer v2, written straight from the spec: one batch, the full score
matrix over its compressed keys, a sorted list per query row.

Independent of :mod:`attnops.ops`.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def allowed(lq: int, lk: int, i: int, *, mask_mode: int, cmp_ratio: int = 1, residual: int = 0) -> int:
    """How many leading compressed keys query row ``i`` may use: all ``lk`` (mode 0), or those whose block of
    ``cmp_ratio`` uncompressed positions ends at or before the row's position ``lk * r + residual - lq + i``."""
    if mask_mode == 0:
        return lk
    p = lk * cmp_ratio + residual - lq + i
    return max(0, min(lk, (p + 1) // cmp_ratio))


def scores(q: Tensor, k: Tensor, w: Tensor, dtype=torch.float64) -> Tensor:
    """``[Lq, Lk]``: ``sum_h w[i, h] * relu(q[i, h] . k[j])`` (q ``[Lq, N, D]``, k ``[Lk, D]``, w ``[Lq, N]``)."""
    s = torch.einsum("ihd,jd->ihj", q.to(dtype), k.to(dtype)).clamp_min(0)
    return torch.einsum("ih,ihj->ij", w.to(dtype), s)


def _rank(score: float) -> float:
    """A score's rank key: NaN ranks as ``+inf`` (NaN first, as ``torch.topk`` orders it)."""
    return math.inf if math.isnan(score) else score


def lightning_indexer_v2(q: Tensor, k: Tensor, w: Tensor, topk: int, *, mask_mode: int, cmp_ratio: int = 1,
                         residual: int = 0, offset: list[int] | None = None
                         ) -> tuple[list[list[int]], list[list[float]]]:
    """One batch: per query row the ``topk`` best allowed keys (descending score, NaN as ``+inf``, ties to the lower
    index, plus ``offset[i]``), then ``-1``; and their scores, then ``-inf``."""
    s = scores(q, k, w)
    indices, values = [], []
    for i in range(q.shape[0]):
        a = allowed(q.shape[0], k.shape[0], i, mask_mode=mask_mode, cmp_ratio=cmp_ratio, residual=residual)
        order = sorted(range(a), key=lambda j: (-_rank(float(s[i, j])), j))[:topk]
        pad = topk - len(order)
        indices.append([j + (offset[i] if offset else 0) for j in order] + [-1] * pad)
        values.append([float(s[i, j]) for j in order] + [float("-inf")] * pad)
    return indices, values
