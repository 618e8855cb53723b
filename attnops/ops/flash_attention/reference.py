"""Pure-PyTorch FlashAttention forward and backward (the production CPU path).

Works one batch, one KV head (with its GQA group) and one chunk of query rows at a time, in fp32, and only over
the KV columns the mask band can keep, so extra memory is O(G * chunk * Skv) and masked tiles cost nothing.
Exponentials use ``exp2((s - max) * log2(e))`` because ``exp2`` is several times faster than ``exp`` on the CPU;
the row max is subtracted first (exactly, in natural units) so the backward rebuilds P from the stored fp32
statistics without cancellation error. Tiles live in preallocated workspaces (no allocation per tile). The backward uses
the softmax statistics and attention output it is given; it never recomputes them.
"""
from __future__ import annotations

import math

import torch

from ..._core.layouts import batch_tokens, tokens_view, with_head_dim
from ..._core.softmax_stats import FLT_LOWEST, FLT_MAX, new_stats, stats_block
from .problem import FAProblem

LOG2E = math.log2(math.e)
TILE_BYTES = 8 << 20  # fp32 score tile budget: big enough for efficient GEMMs, small enough for the L3 cache
MIN_ROWS = 16


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp16/bf16/fp32 inputs; fp64 inputs (Pythonic API, gradcheck) compute in fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _heads_first(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """[S, N, D] (any dtype, any strides) -> a new contiguous [N, S, D] in the compute dtype, times ``scale``."""
    out = torch.empty((x.shape[1], x.shape[0], x.shape[2]), dtype=compute_dtype(x.dtype), device=x.device)
    out.copy_(x.transpose(0, 1))
    return out.mul_(scale) if scale != 1.0 else out


class _Workspace:
    """Reusable fp32 tile buffers of ``G * rows * skv`` elements."""

    def __init__(self, group: int, skv_max: int, count: int, dtype: torch.dtype, rows: int | None = None):
        self.rows = rows or max(MIN_ROWS, TILE_BYTES // (dtype.itemsize * group * max(skv_max, 1)))
        self._bufs = [torch.empty(group * self.rows * max(skv_max, 1), dtype=dtype) for _ in range(count)]

    def tile(self, i: int, shape: tuple[int, int, int]) -> torch.Tensor:
        return self._bufs[i][:shape[0] * shape[1] * shape[2]].view(shape)


class _Tile:
    """One (batch, KV head, row chunk, column range) tile of the score matrix."""

    def __init__(self, p: FAProblem, b: int, n2: int, r0: int, r1: int, c0: int, c1: int):
        g = p.geom.group
        self.p, self.b, self.n2, self.r0, self.r1, self.c0, self.c1 = p, b, n2, r0, r1, c0, c1
        self.heads = slice(n2 * g, (n2 + 1) * g)
        self.shape = (g, r1 - r0, c1 - c0)

    def scores(self, qs: torch.Tensor, k: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``scale*QK^T + pse`` (pse_type 1: ``scale*(QK^T + pse)``) with masked entries at -inf, into ``out``.

        ``qs`` is the batch's query times ``scale`` ([N1, Sq, D]); ``k`` is [N2, Skv, D]; ``out`` is [G, r, c].
        """
        p = self.p
        s = torch.matmul(qs[self.heads, self.r0:self.r1], k[self.n2, self.c0:self.c1].transpose(0, 1), out=out)
        if p.pse is not None:
            pse = p.pse.block(self.b, self.r0, self.r1, self.c0, self.c1, self.heads, s.dtype)
            s.add_(pse, alpha=p.scale if p.pse.add_before_scale else 1.0)
        return p.mask.fill_masked_(s, self.b, self.r0, self.r1, self.c0, self.c1, self.heads)

    def dropout_scale(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``keep / keep_prob`` as [G, r, c] in ``dtype``, or None without dropout."""
        d = self.p.dropout
        if d is None:
            return None
        seq = self.p.seq
        keep = d.keep_block(self.b, self.heads, seq.q_lens[self.b], seq.kv_lens[self.b],
                            self.r0, self.r1, self.c0, self.c1)
        return keep.to(dtype).mul_(1.0 / d.keep_prob)

    def add_pse_grad(self, ds: torch.Tensor, dpse: torch.Tensor | None) -> None:
        p = self.p
        if dpse is not None:
            g = ds * p.scale if p.pse.add_before_scale else ds
            p.pse.accumulate_grad(dpse, self.b, self.r0, self.r1, self.c0, self.c1, self.heads, g)


def _tiles(p: FAProblem, b: int, rows: int):
    """Yield the non-empty tiles of batch ``b`` (KV head by KV head, ``rows`` query rows at a time)."""
    sq, skv = p.seq.q_lens[b], p.seq.kv_lens[b]
    for n2 in range(p.geom.n2):
        for r0 in range(0, sq, rows):
            r1 = min(sq, r0 + rows)
            c0, c1 = p.mask.col_range(b, r0, r1, skv)
            if c0 < c1:
                yield _Tile(p, b, n2, r0, r1, c0, c1)


def _active_batches(p: FAProblem):
    return [b for b in range(p.seq.batch) if p.seq.q_lens[b] > 0 and p.seq.kv_lens[b] > 0]


def forward(p: FAProblem, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """Returns ``(attention_out, softmax_max, softmax_sum)`` in the problem's layouts."""
    g = p.geom
    out = torch.zeros(with_head_dim(query.shape, g.layout, g.n1, g.dv), dtype=query.dtype, device=query.device)
    acc = compute_dtype(query.dtype)
    smax, ssum = new_stats(p.seq, g.n1, p.total_q, query.device, query.dtype)
    qv, kv, vv = (tokens_view(t, g.layout, n) for t, n in ((query, g.n1), (key, g.n2), (value, g.n2)))
    ov = tokens_view(out, g.layout, g.n1)
    ws = _Workspace(g.group, p.seq.max_kv, 1, acc)
    for b in _active_batches(p):
        sq = p.seq.q_lens[b]
        qs = _heads_first(batch_tokens(qv, p.seq, b), p.scale)
        k = _heads_first(batch_tokens(kv, p.seq, b, kv=True))
        v = _heads_first(batch_tokens(vv, p.seq, b, kv=True))
        o = torch.zeros(g.n1, sq, g.dv, dtype=acc)
        m_b = torch.full((g.n1, sq, 1), FLT_LOWEST, dtype=acc)
        l_b = torch.full((g.n1, sq, 1), FLT_MAX, dtype=acc)
        for t in _tiles(p, b, ws.rows):
            h, r0, r1 = t.heads, t.r0, t.r1
            s = t.scores(qs, k, ws.tile(0, t.shape))
            m = s.amax(-1, keepdim=True)
            valid = m > float("-inf")
            s.sub_(torch.where(valid, m, 0.0)).mul_(LOG2E).exp2_()
            l = s.sum(-1, keepdim=True)
            drop = t.dropout_scale(acc)
            if drop is not None:
                s.mul_(drop)
            o[h, r0:r1] = torch.matmul(s, v[t.n2, t.c0:t.c1]).div_(torch.where(valid, l, 1.0))
            m_b[h, r0:r1] = torch.where(valid, m, FLT_LOWEST)
            l_b[h, r0:r1] = torch.where(valid, l, FLT_MAX)
        batch_tokens(ov, p.seq, b).copy_(o.transpose(0, 1))
        stats_block(smax, p.seq, b, p.softmax_layout).copy_(m_b.expand(-1, -1, 8))
        stats_block(ssum, p.seq, b, p.softmax_layout).copy_(l_b.expand(-1, -1, 8))
    return out, smax, ssum


def _probabilities_(s: torch.Tensor, m: torch.Tensor, log2_l: torch.Tensor) -> torch.Tensor:
    """In place: ``P = exp(s - max) / sum`` as ``exp2((s - max) * log2(e) - log2(sum))`` from given statistics.

    Invalid rows (max = FLT_LOWEST, all scores -inf) give P = 0.
    """
    return s.sub_(m).mul_(LOG2E).sub_(log2_l).exp2_()


def _row_stats(softmax_max, softmax_sum, seq, b, layout, acc):
    """Batch ``b``'s given (max, log2(sum)) as ``[N1, Sq, 1]`` in the compute dtype."""
    m = stats_block(softmax_max, seq, b, layout)[..., :1].to(acc)
    return m, stats_block(softmax_sum, seq, b, layout)[..., :1].to(acc).log2()


def probability_tiles(p: FAProblem, b: int, query, key, softmax_max, softmax_sum):
    """Yield ``(tile, P)`` for batch ``b``: the normalized probabilities ``[G, r, c]`` of each tile, rebuilt from the
    given statistics (used by NSA's importance scores). ``P`` lives in a reused workspace: consume it at once."""
    g = p.geom
    if p.seq.q_lens[b] == 0 or p.seq.kv_lens[b] == 0:
        return
    acc = compute_dtype(query.dtype)
    qs = _heads_first(batch_tokens(tokens_view(query, g.layout, g.n1), p.seq, b), p.scale)
    k = _heads_first(batch_tokens(tokens_view(key, g.layout, g.n2), p.seq, b, kv=True))
    m, log2_l = _row_stats(softmax_max, softmax_sum, p.seq, b, p.softmax_layout, acc)
    ws = _Workspace(g.group, p.seq.max_kv, 1, acc)
    for t in _tiles(p, b, ws.rows):
        rows = (t.heads, slice(t.r0, t.r1))
        yield t, _probabilities_(t.scores(qs, k, ws.tile(0, t.shape)), m[rows], log2_l[rows])


def _dp_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of ``dP - D``: fp64 for fp32/fp64 inputs.

    ``D = rowsum(dy * attention_in)`` does not share dP's rounding errors (autograd's ``sum(P * dP)`` would), so
    for a dominant key ``dP - D`` cancels to a small number and fp32 rounding of both terms would be the whole
    error of dq/dk. fp16/bf16 inputs are far coarser than fp32 products, so they keep fp32.
    """
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def _sum_over_group(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``sum_g x[g]^T @ y[g]`` ([c, d]): one GEMM per head, then the short sum over the group (fewer fp32 terms
    per accumulation than one GEMM over G*r rows)."""
    return torch.bmm(x.transpose(1, 2), y).sum(0) if x.shape[0] > 1 else x[0].transpose(0, 1) @ y[0]


def backward(p: FAProblem, query, key, value, dy, attention_in, softmax_max, softmax_sum):
    """Returns ``(dq, dk, dv, dpse)``; dpse is None unless a pse tensor of type 0/1 was given."""
    g = p.geom
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    dpse = None
    if p.pse is not None and p.pse.has_grad:
        dpse = torch.zeros(p.pse.tensor.shape, dtype=compute_dtype(query.dtype), device=query.device)
    qv, kv, vv, dyv, ov, dqv, dkv, dvv = (
        tokens_view(t, g.layout, n) for t, n in ((query, g.n1), (key, g.n2), (value, g.n2), (dy, g.n1),
                                                  (attention_in, g.n1), (dq, g.n1), (dk, g.n2), (dv, g.n2)))
    acc, dp_dtype = compute_dtype(query.dtype), _dp_dtype(query.dtype)
    ws = _Workspace(g.group, p.seq.max_kv, 1, acc)
    ws_dp = _Workspace(g.group, p.seq.max_kv, 1, dp_dtype, rows=ws.rows)
    for b in _active_batches(p):
        sq, skv = p.seq.q_lens[b], p.seq.kv_lens[b]
        qs = _heads_first(batch_tokens(qv, p.seq, b), p.scale)
        k = _heads_first(batch_tokens(kv, p.seq, b, kv=True))
        v = _heads_first(batch_tokens(vv, p.seq, b, kv=True))
        do = _heads_first(batch_tokens(dyv, p.seq, b))
        do_p, v_p = do.to(dp_dtype), v.to(dp_dtype)
        delta = torch.linalg.vecdot(do_p, _heads_first(batch_tokens(ov, p.seq, b)).to(dp_dtype)).unsqueeze(-1)
        m_b, log2_l = _row_stats(softmax_max, softmax_sum, p.seq, b, p.softmax_layout, acc)
        dq_b = torch.zeros(g.n1, sq, g.d, dtype=acc)
        dk_b = torch.zeros(g.n2, skv, g.d, dtype=acc)
        dv_b = torch.zeros(g.n2, skv, g.dv, dtype=acc)
        for t in _tiles(p, b, ws.rows):
            h, r0, r1, n2, cols = t.heads, t.r0, t.r1, t.n2, slice(t.c0, t.c1)
            dot = do[h, r0:r1]
            prob = _probabilities_(t.scores(qs, k, ws.tile(0, t.shape)), m_b[h, r0:r1], log2_l[h, r0:r1])
            dp = torch.matmul(do_p[h, r0:r1], v_p[n2, cols].transpose(0, 1), out=ws_dp.tile(0, t.shape))
            drop = t.dropout_scale(acc)
            if drop is not None:
                dp.mul_(drop)
            dv_b[n2, cols] += _sum_over_group(prob if drop is None else prob * drop, dot)
            ds = prob.mul_(dp.sub_(delta[h, r0:r1]))
            dq_b[h, r0:r1] += torch.matmul(ds, k[n2, cols])
            dk_b[n2, cols] += _sum_over_group(ds, qs[h, r0:r1])
            t.add_pse_grad(ds, dpse)
        batch_tokens(dqv, p.seq, b).copy_(dq_b.mul_(p.scale).transpose(0, 1))
        batch_tokens(dkv, p.seq, b, kv=True).copy_(dk_b.transpose(0, 1))
        batch_tokens(dvv, p.seq, b, kv=True).copy_(dv_b.transpose(0, 1))
    if dpse is not None:
        dpse = dpse.to(p.pse.tensor.dtype)
    return dq, dk, dv, dpse
