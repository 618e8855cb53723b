"""Lightning indexer v2, CPU reference: ``score[t, j] = sum_h weights[t, h] * relu(query[t, h] . key[j])`` over the
compressed keys row ``t`` may use (:mod:`.indexer_v2_problem`), and the ``topk`` best per row: descending score,
ties to the lower index, then ``-1`` / ``-inf``; ``output_idx_offset`` is added to every valid index.

Memory stays linear in the sequence: query rows are taken in chunks, each chunk's scores ``[chunk, keys]`` are built
one key block at a time (the per-head ReLU terms ``[chunk, N1, block]`` never cover all keys at once), so no
``[S1, S2]`` matrix is ever held. Scores accumulate in fp32 (fp64 for fp64 inputs).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..common.indexer import stable_top_k, weighted_relu_scores
from .indexer_v2_problem import IndexerV2Problem

KEY_BLOCK = 4096
CHUNK_BYTES = 1 << 26


def compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def lightning_indexer_v2_forward(problem: IndexerV2Problem, query: Tensor, key: Tensor, weights: Tensor, topk: int,
                                 output_idx_offset: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(sparse_indices [R, topk] int32, sparse_values [R, topk])`` for the flat query rows ``R``; values in fp32
    (fp64 for fp64 inputs)."""
    dt = compute_dtype(query)
    q = query.reshape(-1, *query.shape[-2:])
    w = weights.reshape(q.shape[:2])
    k = key.reshape(-1, key.shape[-1])
    indices = torch.full((q.shape[0], topk), -1, dtype=torch.int32)
    values = torch.full((q.shape[0], topk), float("-inf"), dtype=dt)
    limit = problem.row_limit
    offset = None if output_idx_offset is None else output_idx_offset.reshape(-1).to(torch.int64)
    per_row = 8 * (int(limit.max()) if limit.numel() else 0) + 4 * q.shape[1] * KEY_BLOCK
    step = max(1, CHUNK_BYTES // per_row)
    for b, (start, count) in enumerate(problem.spans):
        for lo in range(start, start + count, step):
            hi = min(start + count, lo + step)
            span = int(limit[lo:hi].max())
            if span == 0:
                continue
            scores = weighted_relu_scores(q[lo:hi].to(dt), w[lo:hi].to(dt),
                                          lambda pos, b=b: problem.key_rows(b, pos), k, span, KEY_BLOCK)
            scores.masked_fill_(torch.arange(span) >= limit[lo:hi, None], float("-inf"))
            idx, val = stable_top_k(scores, limit[lo:hi].clamp_max(topk))
            if offset is not None:
                idx = torch.where(idx >= 0, idx + offset[lo:hi, None], idx)
            indices[lo:hi, :idx.shape[1]] = idx.to(torch.int32)
            values[lo:hi, :val.shape[1]] = val
    return indices, values
