"""The lightning indexer's training signal, CPU reference: KL(P || softmax(I)) per query token and its gradients
w.r.t. the indexer's query, key and weights (``npu_sparse_lightning_indexer_grad_kl_loss``).

For query row ``t`` with causal key limit ``L`` and the first ``n = min(K, L)`` entries ``j_r`` of its index row (up
to the first -1; unvalidated entries that are negative or not below ``L`` are masked out):
``P_r = mean_h exp(scale * (q_h . k_j + q_rope_h . k_rope_j) - softmax_max_h) / softmax_sum_h`` (the main attention's
head-averaged distribution over the selected keys), ``S_gr = q_index_g . k_index_j``,
``I_r = sum_g weights_g * relu(S_gr)``, ``Y = softmax(I)``; ``loss = sum_t sum_r P'(log P' - log Y')`` with both
clamped at 1e-8; ``dI = Y - P``, ``d_weights_g = sum_r dI_r relu(S_gr)``, ``dS_gr = dI_r weights_g [S_gr > 0]``
(rounded to the inputs' dtype), ``d_query_index_g = sum_r dS_gr k_index_j``, ``d_key_index_j += dS_gr q_index_g``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..._core.indices import entries_read
from .problem import Problem, compute_dtype, flat_key, flat_query, row_chunks

CLAMP = 1e-8


def indexer_kl_loss_grad(problem: Problem, query: Tensor, key: Tensor, query_index: Tensor, key_index: Tensor,
                         weights: Tensor, sparse_indices: Tensor, softmax_max: Tensor, softmax_sum: Tensor,
                         query_rope: Tensor | None, key_rope: Tensor | None, *, scale: float
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(d_query_index, d_key_index, d_weights, loss [1])`` (gradients in their inputs' shapes and dtypes; loss
    fp32, fp64 for fp64 inputs)."""
    dt = compute_dtype(query)
    lq = problem.layout_query
    q, qi, qr = flat_query(query, lq), flat_query(query_index, lq), _flat_or_none(query_rope, lq)
    k, ki, kr = flat_key(key), flat_key(key_index), None if key_rope is None else flat_key(key_rope)
    w = weights.reshape(qi.shape[0], qi.shape[1])
    idx = sparse_indices.reshape(q.shape[0], -1).to(torch.int64)
    row_max = softmax_max.reshape(q.shape[0], -1).to(dt)
    row_sum = softmax_sum.reshape(q.shape[0], -1).to(dt)
    d_qi = torch.zeros(qi.shape, dtype=dt)
    d_ki = torch.zeros(ki.shape, dtype=dt)
    d_w = torch.zeros(w.shape, dtype=dt)
    loss = torch.zeros((), dtype=dt)
    width = idx.shape[1] * (k.shape[1] + (0 if kr is None else kr.shape[1]) + ki.shape[1] + 2 * q.shape[1])
    for _, lo, hi in row_chunks(problem, 8 * width):
        limit = problem.rows.limit[lo:hi]
        mask = entries_read(idx[lo:hi], limit.clamp_max(idx.shape[1])) & (idx[lo:hi] >= 0)
        mask &= idx[lo:hi] < limit[:, None]
        flat = problem.keys.flat(problem.rows.batch[lo:hi, None], idx[lo:hi].masked_fill(~mask, 0))
        q_rope = None if qr is None else qr[lo:hi]
        target = _attention_distribution(q[lo:hi], k, q_rope, kr, flat, row_max[lo:hi], row_sum[lo:hi], scale,
                                         dt) * mask
        kib = ki[flat.reshape(-1)].to(dt).view(*flat.shape, -1)  # [C, K, Di]
        s = torch.bmm(qi[lo:hi].to(dt), kib.transpose(1, 2))  # [C, Ni, K]
        relu = s.clamp_min(0)
        wc = w[lo:hi].to(dt)
        logits = torch.bmm(wc[:, None, :], relu)[:, 0].masked_fill(~mask, float("-inf"))
        y = torch.softmax(logits, -1).nan_to_num(0.0) * mask
        p_c, y_c = target.clamp_min(CLAMP), y.clamp_min(CLAMP)
        loss += (mask * p_c * (p_c.log() - y_c.log())).sum()
        d_i = (y - target) * mask
        d_w[lo:hi] = torch.bmm(relu, d_i[:, :, None])[..., 0]
        d_s = (d_i[:, None, :] * wc[:, :, None] * (s > 0)).to(query_index.dtype).to(dt)
        d_qi[lo:hi] = torch.bmm(d_s, kib)
        d_ki.index_add_(0, flat.reshape(-1), torch.bmm(d_s.transpose(1, 2), qi[lo:hi].to(dt)).flatten(0, 1))
    return (d_qi.view(query_index.shape).to(query_index.dtype), d_ki.view(key_index.shape).to(key_index.dtype),
            d_w.view(weights.shape).to(weights.dtype), loss.reshape(1).to(torch.promote_types(dt, torch.float32)))


def _flat_or_none(x: Tensor | None, layout: str) -> Tensor | None:
    return None if x is None else flat_query(x, layout)


def _attention_distribution(q, k, qr, kr, flat, row_max, row_sum, scale, dt) -> Tensor:
    """``P [C, K]``: the main attention's probabilities of the selected keys, averaged over the query heads
    (``q``, ``qr``, ``flat`` and the statistics are the chunk's rows; ``k``, ``kr`` every key)."""
    index = flat.reshape(-1)
    kb = k[index].to(dt).view(*flat.shape, -1)
    s = torch.bmm(q.to(dt), kb.transpose(1, 2))
    if qr is not None:
        s += torch.bmm(qr.to(dt), kr[index].to(dt).view(*flat.shape, -1).transpose(1, 2))
    p = torch.exp(s * scale - row_max[..., None]) / row_sum.clamp_min(torch.finfo(dt).tiny)[..., None]
    return torch.where(row_sum[..., None] > 0, p, 0).mean(1)
