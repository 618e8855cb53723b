"""Sparse flash attention, CPU reference (forward and backward): each query row attends to the key positions its
``sparse_indices`` row lists.

Row ``i`` with key limit ``L_i`` (:mod:`.problem`) reads the first ``c = min(K, ceil(L_i / sparse_block_size))``
entries of its index row, stopping at the first -1; entry ``v`` covers positions
``[v * sbs, v * sbs + sbs)`` cut at ``L_i`` (a duplicate entry counts twice). Unvalidated bad values are masked
out: a negative entry other than -1 (the row goes on), a position past ``L_i``, a block outside the paged cache.
Then, per query head ``h``:
``logit = scale * (q . k_j + q_rope . k_rope_j)``, ``m = max(logits[, sink])``, ``l = sum exp(logit - m)
[+ exp(sink - m)]``, ``out = sum_j exp(logit_j - m) / l * v_j``. Rows with no key give 0 (statistics ``(0, 0)``,
or ``(sink, 1)`` with sinks).

Memory is linear in the sequence: query rows go in chunks; each chunk gathers only its rows' selected key rows
``[C, K*sbs, D]`` (once for key and value when they are the same tensor, as MLA passes them).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..._core.indices import entries_read
from ..._core.workspace import Buffers
from .problem import Problem, compute_dtype, flat_key, flat_query, row_chunks


def selected_positions(indices: Tensor, limit: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """``(positions [C, K*block] int64, mask [C, K*block] bool)`` of index rows ``indices [C, K]`` under per-row
    key limits ``limit [C]`` (masked positions point at 0): the entries read (:func:`entries_read`), less the
    positions that are negative or not below the limit (masked out)."""
    idx = indices.to(torch.int64)
    live = entries_read(idx, torch.clamp((limit + block - 1) // block, max=idx.shape[1]))
    if block > 1:
        idx = (idx[:, :, None] * block + torch.arange(block)).flatten(1)
        live = live.repeat_interleave(block, 1)
    mask = live & (idx >= 0) & (idx < limit[:, None])
    return (idx if bool(mask.all()) else idx.masked_fill(~mask, 0)), mask


class _Gathered:
    """A chunk's inputs in the compute dtype: queries ``qk [C, N1, D + Dr]`` (nope | rope), the selected key rows
    ``kk [C, P, D + Dr]``, value rows ``v [C, P, Dv]`` (a view of ``kk`` when value is key) and the mask. With
    ``buffers`` the gathered rows and the logits go to reused workspaces (fresh tens-of-MB tensors per chunk cost
    page faults that can exceed the gather itself)."""

    def __init__(self, problem: Problem, lo: int, hi: int, t: dict, block: int, dt: torch.dtype,
                 buffers: Buffers | None = None):
        rows = problem.rows
        pos, self.mask = selected_positions(t["indices"][lo:hi], rows.limit[lo:hi], block)
        self.flat = problem.keys.flat(rows.batch[lo:hi, None], pos)
        addressable = problem.keys.addressable(rows.batch[lo:hi, None], pos)
        if addressable is not None:
            self.mask &= addressable
        self.buffers = buffers
        index = self.flat.reshape(-1)
        c, p = self.flat.shape

        def rows_of(x, name):
            if buffers is None or x.dtype != dt:
                return x.index_select(0, index).to(dt).view(c, p, -1)
            return torch.index_select(x, 0, index, out=buffers.get(name, c * p, x.shape[-1])).view(c, p, -1)

        q = t["q"][lo:hi].to(dt)
        self.qk = q if t["q_rope"] is None else torch.cat([q, t["q_rope"][lo:hi].to(dt)], -1)
        if t["kk"] is not None or t["k_rope"] is None:
            self.kk = rows_of(t["k"] if t["kk"] is None else t["kk"], "kk")
        else:
            self.kk = torch.cat([rows_of(t["k"], "k"), rows_of(t["k_rope"], "k_rope")], -1)
        self.v = self.kk[..., :t["v"].shape[-1]] if t["v"] is t["k"] else rows_of(t["v"], "v")
        if not bool(self.mask.all()):  # padding slots gather key 0: a NaN there must not reach P V or dS K (0 * NaN)
            self.kk.masked_fill_(~self.mask[..., None], 0.0)
            if self.v.data_ptr() != self.kk.data_ptr():
                self.v.masked_fill_(~self.mask[..., None], 0.0)

    def logits(self, scale: float) -> Tensor:
        """``[C, N1, P]`` scaled logits, ``-inf`` where the mask is off."""
        qk, kk = self.qk * scale, self.kk.transpose(1, 2)
        if self.buffers is None:
            s = torch.bmm(qk, kk)
        else:
            s = torch.bmm(qk, kk, out=self.buffers.get("logits", qk.shape[0], qk.shape[1], kk.shape[2]))
        if not bool(self.mask.all()):
            s.masked_fill_(~self.mask[:, None, :], float("-inf"))
        return s


def _flat_inputs(problem: Problem, query, key, value, sparse_indices, query_rope, key_rope, dt) -> dict:
    """The flat views the chunks read (``v`` is ``k`` itself when value and key are the same tensor). ``kk``: key
    and rope concatenated once, in the compute dtype, when the key store is no larger than what the chunks gather
    (one gather per chunk); a larger store (a big paged cache, few queries) is gathered part by part."""
    k = flat_key(key)
    same = value is key or (value.data_ptr() == key.data_ptr() and value.shape == key.shape
                            and value.stride() == key.stride())
    indices = sparse_indices.reshape(-1, sparse_indices.shape[-1])
    k_rope = None if key_rope is None else flat_key(key_rope)
    joint = k_rope is not None and k.shape[0] <= indices.numel()
    return {"q": flat_query(query, problem.layout_query), "k": k, "v": k if same else flat_key(value),
            "q_rope": None if query_rope is None else flat_query(query_rope, problem.layout_query),
            "k_rope": k_rope, "kk": torch.cat([k.to(dt), k_rope.to(dt)], -1) if joint else None,
            "indices": indices}


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
    t = _flat_inputs(problem, query, key, value, sparse_indices, query_rope, key_rope, dt)
    total, heads = t["q"].shape[:2]
    out = torch.zeros(total, heads, t["v"].shape[-1], dtype=dt)
    row_max = torch.zeros(total, heads, dtype=dt)
    row_sum = torch.zeros(total, heads, dtype=dt)
    sink = None if sinks is None else sinks.to(dt)
    buffers = Buffers.acquire(dt, "cpu")
    for _, lo, hi in row_chunks(problem, _bytes_per_row(t, heads, block)):
        g = _Gathered(problem, lo, hi, t, block, dt, buffers)
        p = g.logits(scale)
        m = p.amax(-1)
        if sink is not None:
            m = torch.maximum(m, sink)
        unkept = m == float("-inf")  # no key (and no sink), or keys that all score -inf; +inf and NaN stay NaN
        m.masked_fill_(unkept, 0)
        p.sub_(m[..., None]).exp_()  # in place: the logits become the unnormalized probabilities
        l = p.sum(-1)
        if sink is not None:
            l += torch.exp(sink - m)
        if bool(unkept.any()):  # rows that see keys (or a sink) scoring -inf only: the formula's 0 / 0
            seen = unkept & (g.mask.any(-1, keepdim=True) if sink is None else True)
            m.masked_fill_(seen, float("-inf"))
            l.masked_fill_(seen, float("nan"))
        torch.bmm(p, g.v, out=out[lo:hi]).div_(l.clamp_min(torch.finfo(dt).tiny)[..., None])  # empty rows: 0/tiny
        row_max[lo:hi], row_sum[lo:hi] = m, l
    buffers.release()
    return out.to(query.dtype), row_max, row_sum


def sparse_attention_backward(problem: Problem, grad: Tensor, query: Tensor, key: Tensor, value: Tensor,
                              sparse_indices: Tensor, query_rope: Tensor | None, key_rope: Tensor | None,
                              out: Tensor, softmax_max: Tensor, softmax_sum: Tensor, scale: float, block: int
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """``(dq, dk, dv, dq_rope, dk_rope)`` from the forward's flat statistics ``[R, N1]``; ``dk``/``dv`` hold the
    gradients of the key and value tensors as given (value's is zero when it is key itself: all of it is in
    ``dk``). Rope gradients are None without rope."""
    dt = compute_dtype(query)
    t = _flat_inputs(problem, query, key, value, sparse_indices, query_rope, key_rope, dt)
    do = flat_query(grad, problem.layout_query)
    o = flat_query(out, problem.layout_query)
    d, dr = t["q"].shape[-1], 0 if t["q_rope"] is None else t["q_rope"].shape[-1]
    dqk = torch.zeros(*t["q"].shape[:2], d + dr, dtype=dt)
    dkk = torch.zeros(t["k"].shape[0], d + dr, dtype=dt)  # key | key_rope (| value, when value is key)
    dv = None if t["v"] is t["k"] else torch.zeros(t["v"].shape, dtype=dt)
    heads = t["q"].shape[1]
    for _, lo, hi in row_chunks(problem, 2 * _bytes_per_row(t, heads, block)):
        g = _Gathered(problem, lo, hi, t, block, dt)
        l = softmax_sum[lo:hi].to(dt)
        p = g.logits(scale).sub_(softmax_max[lo:hi].to(dt)[..., None]).exp_()
        p.div_(l.clamp_min(torch.finfo(dt).tiny)[..., None])  # rows without keys: all-zero p
        gout = do[lo:hi].to(dt)
        delta = (gout * o[lo:hi].to(dt)).sum(-1, keepdim=True)
        ds = p * (torch.bmm(gout, g.v.transpose(1, 2)) - delta) * scale  # [C, N1, P]
        padding = None if bool(g.mask.all()) else ~g.mask[..., None]  # [C, P, 1]
        if padding is not None:  # a NaN row (non-finite inputs) has NaN at its padding slots, which point at key 0
            p.masked_fill_(padding.transpose(1, 2), 0.0)
            ds.masked_fill_(padding.transpose(1, 2), 0.0)
        index = g.flat.reshape(-1)
        dqk[lo:hi] = torch.bmm(ds, g.kk)
        dk_rows, pv = torch.bmm(ds.transpose(1, 2), g.qk), torch.bmm(p.transpose(1, 2), gout)  # [C, P, *]
        if padding is not None:  # and a non-finite query or output gradient: 0 * NaN there
            dk_rows.masked_fill_(padding, 0.0)
            pv.masked_fill_(padding, 0.0)
        dkk.index_add_(0, index, dk_rows.flatten(0, 1))
        pv = pv.flatten(0, 1)
        if dv is None:
            dkk[:, :pv.shape[-1]].index_add_(0, index, pv)
        else:
            dv.index_add_(0, index, pv)

    def shaped(x, like):  # own memory: the parts of dqk / dkk must not alias each other
        return None if like is None else x.contiguous().reshape(like.shape).to(like.dtype)

    return (shaped(dqk[..., :d], query), shaped(dkk[:, :d], key),
            torch.zeros_like(value) if dv is None else shaped(dv, value), shaped(dqk[..., d:], query_rope),
            shaped(dkk[:, d:], key_rope))
