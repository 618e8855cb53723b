"""Sparse flash attention, CPU reference (forward and backward): each query row attends to the key positions its
``sparse_indices`` row lists.

Row ``i`` with key limit ``L_i`` (:mod:`.problem`) reads the first ``c = min(K, ceil(L_i / sparse_block_size))``
entries of its index row, stopping at the first negative one; entry ``v`` covers positions
``[v * sbs, v * sbs + sbs)`` cut at ``L_i`` (a duplicate entry counts twice). Then, per query head ``h``:
``logit = scale * (q . k_j + q_rope . k_rope_j)``, ``m = max(logits[, sink])``, ``l = sum exp(logit - m)
[+ exp(sink - m)]``, ``out = sum_j exp(logit_j - m) / l * v_j``. Rows with no key give 0 (statistics ``(0, 0)``,
or ``(sink, 1)`` with sinks).

Memory is linear in the sequence: query rows go in chunks; each chunk gathers only its rows' selected key rows
``[C, K*sbs, D]`` (once for key and value when they are the same tensor, as MLA passes them).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .problem import Problem, compute_dtype, flat_key, flat_query, row_chunks


def selected_positions(indices: Tensor, limit: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """``(positions [C, K*block] int64, mask [C, K*block] bool)`` of index rows ``indices [C, K]`` under per-row
    key limits ``limit [C]``."""
    idx = indices.to(torch.int64)
    entry = torch.arange(idx.shape[1])
    count = torch.clamp((limit + block - 1) // block, max=idx.shape[1])
    live = (entry < count[:, None]) & ((idx < 0).cumsum(1) == 0)
    pos = (idx[:, :, None] * block + torch.arange(block)).flatten(1)
    mask = live.repeat_interleave(block, 1) & (pos < limit[:, None])
    return pos.masked_fill_(~mask, 0), mask


class _Gathered:
    """A chunk's inputs in the compute dtype: queries, the selected key (+ rope) and value rows, and the mask."""

    def __init__(self, problem: Problem, lo: int, hi: int, tensors: dict, block: int, dt: torch.dtype):
        rows = problem.rows
        self.pos, self.mask = selected_positions(tensors["indices"][lo:hi], rows.limit[lo:hi], block)
        self.flat = problem.keys.flat(rows.batch[lo:hi, None], self.pos)
        index = self.flat.reshape(-1)
        c, p = self.flat.shape

        def rows_of(x):
            return None if x is None else x.index_select(0, index).to(dt).view(c, p, -1)

        self.q = tensors["q"][lo:hi].to(dt)
        self.q_rope = None if tensors["q_rope"] is None else tensors["q_rope"][lo:hi].to(dt)
        self.k = rows_of(tensors["k"])
        self.k_rope = rows_of(tensors["k_rope"])
        self.v = self.k if tensors["v"] is tensors["k"] else rows_of(tensors["v"])

    def logits(self, scale: float) -> Tensor:
        """``[C, N1, P]`` scaled logits, ``-inf`` where the mask is off."""
        s = torch.bmm(self.q, self.k.transpose(1, 2))
        if self.q_rope is not None:
            s.baddbmm_(self.q_rope, self.k_rope.transpose(1, 2))
        return s.mul_(scale).masked_fill_(~self.mask[:, None, :], float("-inf"))


def _flat_inputs(problem: Problem, query, key, value, sparse_indices, query_rope, key_rope) -> dict:
    """The flat views the chunks read (``v`` is ``k`` itself when value and key are the same tensor)."""
    k = flat_key(key)
    same = value is key or (value.data_ptr() == key.data_ptr() and value.shape == key.shape
                            and value.stride() == key.stride())
    return {"q": flat_query(query, problem.layout_query), "k": k, "v": k if same else flat_key(value),
            "q_rope": None if query_rope is None else flat_query(query_rope, problem.layout_query),
            "k_rope": None if key_rope is None else flat_key(key_rope),
            "indices": sparse_indices.reshape(-1, sparse_indices.shape[-1])}


def _bytes_per_row(t: dict, heads: int, block: int) -> int:
    p = t["indices"].shape[1] * block
    widths = sum(t[n].shape[-1] for n in ("k", "k_rope") if t[n] is not None)
    widths += 0 if t["v"] is t["k"] else t["v"].shape[-1]
    return 8 * p * (widths + 3 * heads)


def sparse_attention_forward(problem: Problem, query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor,
                             query_rope: Tensor | None, key_rope: Tensor | None, sinks: Tensor | None, scale: float,
                             block: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(out [R, N1, Dv] in query's dtype, softmax_max [R, N1], softmax_sum [R, N1])`` (statistics fp32, fp64 for
    fp64 inputs) over flat query rows ``R``; padding rows give zeros."""
    dt = compute_dtype(query)
    t = _flat_inputs(problem, query, key, value, sparse_indices, query_rope, key_rope)
    total, heads = t["q"].shape[:2]
    out = torch.zeros(total, heads, t["v"].shape[-1], dtype=dt)
    row_max = torch.zeros(total, heads, dtype=dt)
    row_sum = torch.zeros(total, heads, dtype=dt)
    sink = None if sinks is None else sinks.to(dt)
    for _, lo, hi in row_chunks(problem, _bytes_per_row(t, heads, block)):
        g = _Gathered(problem, lo, hi, t, block, dt)
        s = g.logits(scale)
        m = s.amax(-1)
        if sink is not None:
            m = torch.maximum(m, sink)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows with no key (and no sink)
        p = torch.exp(s - m[..., None])
        l = p.sum(-1)
        if sink is not None:
            l = l + torch.exp(sink - m)
        o = torch.bmm(p, g.v)
        out[lo:hi] = torch.where(l[..., None] > 0, o / l[..., None].clamp_min(torch.finfo(dt).tiny), 0)
        row_max[lo:hi], row_sum[lo:hi] = m, l
    return out.to(query.dtype), row_max, row_sum


def sparse_attention_backward(problem: Problem, grad: Tensor, query: Tensor, key: Tensor, value: Tensor,
                              sparse_indices: Tensor, query_rope: Tensor | None, key_rope: Tensor | None,
                              out: Tensor, softmax_max: Tensor, softmax_sum: Tensor, scale: float, block: int
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """``(dq, dk, dv, dq_rope, dk_rope)`` from the forward's flat statistics ``[R, N1]``; ``dk``/``dv`` hold the
    gradients of the key and value tensors as given (value's is zero when it is key itself: all of it is in
    ``dk``). Rope gradients are None without rope."""
    dt = compute_dtype(query)
    t = _flat_inputs(problem, query, key, value, sparse_indices, query_rope, key_rope)
    do = flat_query(grad, problem.layout_query)
    o = flat_query(out, problem.layout_query)
    dq = torch.zeros(t["q"].shape, dtype=dt)
    dk = torch.zeros(t["k"].shape, dtype=dt)
    dv = dk if t["v"] is t["k"] else torch.zeros(t["v"].shape, dtype=dt)
    dq_rope = None if t["q_rope"] is None else torch.zeros(t["q_rope"].shape, dtype=dt)
    dk_rope = None if t["k_rope"] is None else torch.zeros(t["k_rope"].shape, dtype=dt)
    heads = t["q"].shape[1]
    for _, lo, hi in row_chunks(problem, 2 * _bytes_per_row(t, heads, block)):
        g = _Gathered(problem, lo, hi, t, block, dt)
        l = softmax_sum[lo:hi].to(dt)
        p = torch.exp(g.logits(scale) - softmax_max[lo:hi].to(dt)[..., None]) / l.clamp_min(
            torch.finfo(dt).tiny)[..., None]
        p = torch.where(l[..., None] > 0, p, 0)
        gout = do[lo:hi].to(dt)
        delta = (gout * o[lo:hi].to(dt)).sum(-1, keepdim=True)
        ds = p * (torch.bmm(gout, g.v.transpose(1, 2)) - delta) * scale  # [C, N1, P]
        index = g.flat.reshape(-1)
        dq[lo:hi] = torch.bmm(ds, g.k)
        dk.index_add_(0, index, torch.bmm(ds.transpose(1, 2), g.q).flatten(0, 1))
        dv.index_add_(0, index, torch.bmm(p.transpose(1, 2), gout).flatten(0, 1))
        if dq_rope is not None:
            dq_rope[lo:hi] = torch.bmm(ds, g.k_rope)
            dk_rope.index_add_(0, index, torch.bmm(ds.transpose(1, 2), g.q_rope).flatten(0, 1))

    def shaped(x, like):
        return None if x is None else x.view(like.shape).to(like.dtype)

    dv_out = torch.zeros_like(value) if dv is dk else shaped(dv, value)
    return (shaped(dq, query), shaped(dk, key), dv_out, shaped(dq_rope, query_rope), shaped(dk_rope, key_rope))
