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

from ..common.indexer import stable_top_k, weighted_relu_scores
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
        batch = torch.tensor([b])
        scores = weighted_relu_scores(q[lo:hi].to(dt), w[lo:hi].to(dt), lambda pos: problem.keys.flat(batch, pos), k,
                                      span, KEY_BLOCK)
        allowed = torch.arange(span) < limit[:, None]
        addressable = problem.keys.addressable(batch, torch.arange(span))
        if addressable is not None:  # keys in blocks outside the cache (block table not validated) are skipped
            allowed &= addressable
        scores.masked_fill_(~allowed, float("-inf"))
        idx, val = stable_top_k(scores, allowed.sum(1).clamp_max(sparse_count))
        indices[lo:hi, :idx.shape[1]] = idx.to(torch.int32)
        values[lo:hi, :val.shape[1]] = val
    return indices, values.to(query.dtype) if return_value else query.new_empty((0,))
