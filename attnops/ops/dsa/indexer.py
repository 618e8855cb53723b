"""Lightning indexer, CPU reference: ``score[i, j] = sum_h weights[i, h] * relu(query[i, h] . key[j])`` over the
keys row ``i`` may use, and the top ``sparse_count`` positions per row in descending score order (ties: the
smaller position first), ``-1`` past the row's ``min(sparse_count, allowed keys)`` (a key in a block outside the
cache, left by an unvalidated block table, is not allowed).

Memory stays linear in the sequence: query rows are taken in chunks, each chunk's scores ``[chunk, Lk]`` are
built over key blocks (the per-head ReLU terms ``[chunk, N1, block]`` never cover all keys at once), and no
``[S1, S2]`` matrix is ever held. Scores accumulate in fp32 (fp64 for fp64 inputs).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .problem import Problem, compute_dtype, flat_key, flat_query, row_chunks

KEY_BLOCK = 4096


def lightning_indexer_forward(problem: Problem, query: Tensor, key: Tensor, weights: Tensor, sparse_count: int,
                              return_value: bool) -> tuple[Tensor, Tensor]:
    """``(sparse_indices [R, K] int32, sparse_values [R, K] in query's dtype, or [0])`` for flat query rows ``R``."""
    dt = compute_dtype(query)
    q = flat_query(query, problem.layout_query)
    w = weights.reshape(q.shape[0], q.shape[1])
    k = flat_key(key)
    rows = problem.rows
    indices = torch.full((q.shape[0], sparse_count), -1, dtype=torch.int32)
    values = torch.full((q.shape[0], sparse_count), float("-inf"), dtype=dt)
    width = int(rows.limit.max()) if q.shape[0] else 0
    for b, lo, hi in row_chunks(problem, 8 * (width + q.shape[1] * min(width, KEY_BLOCK))):
        limit = rows.limit[lo:hi]
        span = int(limit.max())
        if span == 0:
            continue
        scores = _chunk_scores(problem, q[lo:hi].to(dt), w[lo:hi].to(dt), k, b, span)
        allowed = torch.arange(span) < limit[:, None]
        addressable = problem.keys.addressable(torch.tensor([b]), torch.arange(span))
        if addressable is not None:  # keys in blocks outside the cache (block table not validated) are skipped
            allowed &= addressable
        scores.masked_fill_(~allowed, float("-inf"))
        idx, val = _top_k(scores, allowed.sum(1).clamp_max(sparse_count))
        indices[lo:hi, :idx.shape[1]] = idx.to(torch.int32)
        values[lo:hi, :val.shape[1]] = val
    return indices, values.to(query.dtype) if return_value else query.new_empty((0,))


def _chunk_scores(problem: Problem, q: Tensor, w: Tensor, k: Tensor, batch: int, span: int) -> Tensor:
    """Weighted ReLU scores ``[C, span]`` of a chunk of batch ``batch``'s rows against its key positions
    ``0..span-1``, one key block at a time."""
    scores = torch.empty(q.shape[0], span, dtype=q.dtype)
    b = torch.tensor([batch])
    for j0 in range(0, span, KEY_BLOCK):
        pos = torch.arange(j0, min(span, j0 + KEY_BLOCK))
        kb = k[problem.keys.flat(b, pos)].to(q.dtype)  # [P, D]
        relu = torch.matmul(q, kb.T).clamp_min_(0)  # [C, N1, P]
        scores[:, j0:j0 + pos.numel()] = torch.bmm(w[:, None, :], relu)[:, 0]
    return scores


def _top_k(scores: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """Per row the ``counts[r]`` largest finite scores, in descending order with ties broken by the smaller
    position; ``(positions [C, n], values [C, n])`` with ``n = max(counts)`` and ``-1`` / ``-inf`` past each row's
    count. Linear in the row length plus ``n log n``."""
    n = int(counts.max())
    if n == 0:
        return scores.new_empty((scores.shape[0], 0), dtype=torch.int64), scores[:, :0]
    top, _ = torch.topk(scores, n, dim=1, sorted=True)
    boundary = top.gather(1, (counts - 1).clamp_min(0)[:, None])  # the smallest score that is kept
    above = scores > boundary
    tied = scores == boundary
    keep = above | (tied & (tied.cumsum(1) <= counts[:, None] - above.sum(1, keepdim=True)))
    keep &= (counts > 0)[:, None]
    rank = keep.cumsum(1) - 1  # kept positions in ascending order
    rows, cols = keep.nonzero(as_tuple=True)
    positions = torch.full((scores.shape[0], n), -1, dtype=torch.int64)
    positions[rows, rank[rows, cols]] = cols
    values = torch.full((scores.shape[0], n), float("-inf"), dtype=scores.dtype)
    values[rows, rank[rows, cols]] = scores[rows, cols]
    order = torch.sort(values, dim=1, descending=True, stable=True).indices  # ascending positions break ties
    return positions.gather(1, order), values.gather(1, order)
