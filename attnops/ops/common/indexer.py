"""What the lightning indexers (DeepSeek-V3.2's and V4's) share: the weighted ReLU score of a chunk of query rows
against key positions, built one key block at a time, and the per-row top-k in descending order with ties broken by
the smaller position."""
from __future__ import annotations

import torch
from torch import Tensor


def weighted_relu_scores(q: Tensor, w: Tensor, key_rows, keys: Tensor, span: int, block: int) -> Tensor:
    """``[C, span]`` scores ``sum_h w[c, h] * relu(q[c, h] . keys[key_rows(j)])`` of query rows ``q [C, N1, D]``
    (weights ``w [C, N1]``, both in the compute dtype) against positions ``j = 0..span-1``; ``key_rows(pos)`` maps a
    block of positions to rows of ``keys [M, D]``. The ReLU terms ``[C, N1, block]`` are built ``block`` keys at a
    time."""
    scores = torch.empty(q.shape[0], span, dtype=q.dtype, device=q.device)
    for j0 in range(0, span, block):
        pos = torch.arange(j0, min(span, j0 + block))
        kb = keys[key_rows(pos)].to(q.dtype)  # [P, D]
        relu = torch.matmul(q, kb.T).clamp_min_(0)  # [C, N1, P]
        scores[:, j0:j0 + pos.numel()] = torch.bmm(w[:, None, :], relu)[:, 0]
    return scores


def stable_top_k(scores: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """Per row the ``counts[r]`` largest scores, in descending order with ties broken by the smaller position; a NaN
    score ranks as ``+inf`` (as ``torch.topk`` puts NaN first). ``(positions [C, n], values [C, n])`` with
    ``n = max(counts)`` and ``-1`` / ``-inf`` past each row's count. Linear in the row length plus ``n log n``."""
    n = int(counts.max())
    rank_key = scores.nan_to_num(nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
    top, _ = torch.topk(rank_key, n, dim=1, sorted=True)
    boundary = top.gather(1, (counts - 1).clamp_min(0)[:, None])  # the smallest score that is kept
    above = rank_key > boundary
    tied = rank_key == boundary
    keep = above | (tied & (tied.cumsum(1) <= counts[:, None] - above.sum(1, keepdim=True)))
    keep &= (counts > 0)[:, None]
    rank = keep.cumsum(1) - 1  # kept positions in ascending order
    rows, cols = keep.nonzero(as_tuple=True)
    positions = torch.full((scores.shape[0], n), -1, dtype=torch.int64)
    positions[rows, rank[rows, cols]] = cols
    keys = torch.full((scores.shape[0], n), float("-inf"), dtype=scores.dtype)
    keys[rows, rank[rows, cols]] = rank_key[rows, cols]
    values = torch.full((scores.shape[0], n), float("-inf"), dtype=scores.dtype)
    values[rows, rank[rows, cols]] = scores[rows, cols]
    order = torch.sort(keys, dim=1, descending=True, stable=True).indices  # ascending positions break ties
    return positions.gather(1, order), values.gather(1, order)
