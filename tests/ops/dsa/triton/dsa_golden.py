"""Plain fp64 formulas of the DSA ops written from their definitions (one query row at a time), used only to judge
the kernels: the rows of every batch as ``(query rows, key rows)`` lists, whatever the layout."""
from __future__ import annotations

import torch


def causal_limit(q_len: int, kv_len: int, row: int, causal: bool) -> int:
    """Keys row ``row`` may see: ``kv_len`` (mode 0) or ``kv_len - q_len + row + 1`` (mode 3), at least 0."""
    return max(0, kv_len - q_len + row + 1) if causal else kv_len


def indexer_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``score[j] = sum_h w[h] relu(q[h] . k[j])`` in fp64 (``q [N1, D]``, ``k [S, D]``, ``w [N1]``)."""
    return (w.double()[:, None] * torch.relu(q.double() @ k.double().T)).sum(0)


def topk_row(scores: torch.Tensor, count: int) -> list[int]:
    """Positions of the ``count`` largest scores, descending, ties to the smaller position."""
    order = sorted(range(scores.numel()), key=lambda j: (-scores[j].item(), j))
    return order[:count]


def sparse_row(q, q_rope, k, k_rope, v, entries, scale, limit, sbs, sink=None):
    """Output ``[N1, Dv]`` and ``(max, sum)`` ``[N1]`` of one query row over the positions its ``entries`` name."""
    c = min(len(entries), -(-limit // sbs)) if limit > 0 else 0
    pos = []
    for e in entries[:c]:
        if e == -1:
            break
        pos += [p for p in range(e * sbs, e * sbs + sbs) if p < min(limit, k.shape[0])]
    heads = q.shape[0]
    if not pos:
        out = torch.zeros(heads, v.shape[-1], dtype=torch.float64)
        if sink is None:
            return out, torch.zeros(heads, dtype=torch.float64), torch.zeros(heads, dtype=torch.float64)
        return out, sink.double(), torch.ones(heads, dtype=torch.float64)
    idx = torch.tensor(pos)
    logit = q.double() @ k[idx].double().T
    if q_rope is not None:
        logit = logit + q_rope.double() @ k_rope[idx].double().T
    logit = logit * scale
    m = logit.max(1).values
    if sink is not None:
        m = torch.maximum(m, sink.double())
    p = torch.exp(logit - m[:, None])
    l = p.sum(1) + (torch.exp(sink.double() - m) if sink is not None else 0)
    return (p / l[:, None]) @ v[idx].double(), m, l
