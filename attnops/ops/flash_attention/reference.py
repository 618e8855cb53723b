"""Pure-PyTorch FlashAttention forward and backward (the production CPU path).

Works one batch, one KV head (with its GQA group) and one chunk of query rows at a time, in fp32, and only over
the KV columns the mask band can keep, so extra memory is O(G * chunk * Skv) and masked tiles cost nothing.
The backward uses the softmax statistics and attention output it is given (never recomputes them).
"""
from __future__ import annotations

import torch

from ..._core.layouts import batch_tokens, tokens_view, with_head_dim
from ..._core.softmax_stats import FLT_LOWEST, FLT_MAX, new_stats, stats_block
from .problem import FAProblem

TILE_BYTES = 2 << 20  # fp32 score tile budget: keeps a tile in L2/L3 between the elementwise passes
MIN_ROWS = 16


def _row_chunk(group: int, skv: int) -> int:
    rows = TILE_BYTES // (4 * group * max(skv, 1))
    return max(MIN_ROWS, rows)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[S, N, D] (any dtype, any strides) -> contiguous fp32 [N, S, D]."""
    return x.transpose(0, 1).to(torch.float32).contiguous()


class _Tile:
    """Scores of one (batch, KV head, row chunk, column range) tile, masked, in fp32."""

    def __init__(self, p: FAProblem, b: int, n2: int, r0: int, r1: int, c0: int, c1: int):
        g = p.geom.group
        self.p, self.b, self.r0, self.r1, self.c0, self.c1 = p, b, r0, r1, c0, c1
        self.heads = slice(n2 * g, (n2 + 1) * g)

    def scores(self, q_scaled: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``scale*QK^T (+pse)`` with masked entries at -inf; q_scaled [G, r, D], k [c, D] -> [G, r, c]."""
        p = self.p
        s = torch.matmul(q_scaled, k.transpose(0, 1))
        if p.pse is not None:
            pse = p.pse.block(self.b, self.r0, self.r1, self.c0, self.c1, self.heads)
            s += pse * p.scale if p.pse.add_before_scale else pse
        masked = p.mask.masked_block(self.b, self.r0, self.r1, self.c0, self.c1, self.heads)
        if masked is not None:
            s.masked_fill_(masked, float("-inf"))
        return s

    def dropout_scale(self) -> torch.Tensor | None:
        """``keep / keep_prob`` as fp32 [G, r, c], or None without dropout."""
        d = self.p.dropout
        if d is None:
            return None
        seq = self.p.seq
        keep = d.keep_block(self.b, self.heads, seq.q_lens[self.b], seq.kv_lens[self.b],
                            self.r0, self.r1, self.c0, self.c1)
        return keep.to(torch.float32).mul_(1.0 / d.keep_prob)

    def pse_grad(self, ds: torch.Tensor, dpse: torch.Tensor | None) -> None:
        p = self.p
        if dpse is not None:
            g = ds * p.scale if p.pse.add_before_scale else ds
            p.pse.accumulate_grad(dpse, self.b, self.r0, self.r1, self.c0, self.c1, self.heads, g)


def _tiles(p: FAProblem, b: int):
    """Yield (n2, r0, r1, c0, c1) for the non-empty tiles of batch ``b``."""
    sq, skv = p.seq.q_lens[b], p.seq.kv_lens[b]
    if sq == 0 or skv == 0:
        return
    rows = _row_chunk(p.geom.group, skv)
    for n2 in range(p.geom.n2):
        for r0 in range(0, sq, rows):
            r1 = min(sq, r0 + rows)
            c0, c1 = p.mask.col_range(b, r0, r1, skv)
            if c0 < c1:
                yield n2, r0, r1, c0, c1


def forward(p: FAProblem, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """Returns ``(attention_out, softmax_max, softmax_sum)`` in the problem's layouts."""
    g = p.geom
    out = torch.zeros(with_head_dim(query.shape, g.layout, g.n1, g.dv), dtype=query.dtype, device=query.device)
    smax, ssum = new_stats(p.seq, g.n1, p.total_q, query.device)
    qv, kv, vv = (tokens_view(t, g.layout, n) for t, n in ((query, g.n1), (key, g.n2), (value, g.n2)))
    ov = tokens_view(out, g.layout, g.n1)
    for b in range(p.seq.batch):
        sq = p.seq.q_lens[b]
        if sq == 0 or p.seq.kv_lens[b] == 0:
            continue
        q = _heads_first(batch_tokens(qv, p.seq, b)).mul_(p.scale)
        k = _heads_first(batch_tokens(kv, p.seq, b, kv=True))
        v = _heads_first(batch_tokens(vv, p.seq, b, kv=True))
        o = torch.zeros(g.n1, sq, g.dv)
        m_b = torch.full((g.n1, sq), FLT_LOWEST)
        l_b = torch.full((g.n1, sq), FLT_MAX)
        for n2, r0, r1, c0, c1 in _tiles(p, b):
            t = _Tile(p, b, n2, r0, r1, c0, c1)
            s = t.scores(q[t.heads, r0:r1], k[n2, c0:c1])
            m = s.amax(-1, keepdim=True)
            valid = m > float("-inf")
            s.sub_(torch.where(valid, m, 0.0)).exp_()
            l = s.sum(-1, keepdim=True)
            drop = t.dropout_scale()
            if drop is not None:
                s.mul_(drop)
            ot = torch.matmul(s, v[n2, c0:c1]).div_(torch.where(valid, l, 1.0))
            o[t.heads, r0:r1] = ot
            m_b[t.heads, r0:r1] = torch.where(valid, m, FLT_LOWEST).squeeze(-1)
            l_b[t.heads, r0:r1] = torch.where(valid, l, FLT_MAX).squeeze(-1)
        batch_tokens(ov, p.seq, b).copy_(o.transpose(0, 1))
        stats_block(smax, p.seq, b, p.softmax_layout).copy_(m_b.unsqueeze(-1).expand(-1, -1, 8))
        stats_block(ssum, p.seq, b, p.softmax_layout).copy_(l_b.unsqueeze(-1).expand(-1, -1, 8))
    return out, smax, ssum


def backward(p: FAProblem, query, key, value, dy, attention_in, softmax_max, softmax_sum):
    """Returns ``(dq, dk, dv, dpse)``; dpse is None unless a pse tensor of type 0/1 was given."""
    g = p.geom
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    dpse = None
    if p.pse is not None and p.pse.has_grad:
        dpse = torch.zeros(p.pse.tensor.shape, dtype=torch.float32, device=query.device)
    views = [tokens_view(t, g.layout, n) for t, n in
             ((query, g.n1), (key, g.n2), (value, g.n2), (dy, g.n1), (attention_in, g.n1),
              (dq, g.n1), (dk, g.n2), (dv, g.n2))]
    qv, kv, vv, dyv, ov, dqv, dkv, dvv = views
    for b in range(p.seq.batch):
        sq, skv = p.seq.q_lens[b], p.seq.kv_lens[b]
        if sq == 0 or skv == 0:
            continue
        q = _heads_first(batch_tokens(qv, p.seq, b)).mul_(p.scale)
        k = _heads_first(batch_tokens(kv, p.seq, b, kv=True))
        v = _heads_first(batch_tokens(vv, p.seq, b, kv=True))
        do = _heads_first(batch_tokens(dyv, p.seq, b))
        delta = (do * _heads_first(batch_tokens(ov, p.seq, b))).sum(-1, keepdim=True)  # [N1, Sq, 1]
        m_b = stats_block(softmax_max, p.seq, b, p.softmax_layout)[..., :1]
        l_b = stats_block(softmax_sum, p.seq, b, p.softmax_layout)[..., :1]
        dq_b = torch.zeros(g.n1, sq, g.d)
        dk_b = torch.zeros(g.n2, skv, g.d)
        dv_b = torch.zeros(g.n2, skv, g.dv)
        for n2, r0, r1, c0, c1 in _tiles(p, b):
            t = _Tile(p, b, n2, r0, r1, c0, c1)
            h = t.heads
            qt, dot = q[h, r0:r1], do[h, r0:r1]
            prob = t.scores(qt, k[n2, c0:c1]).sub_(m_b[h, r0:r1]).exp_().div_(l_b[h, r0:r1])
            dp = torch.matmul(dot, v[n2, c0:c1].transpose(0, 1))
            drop = t.dropout_scale()
            if drop is not None:
                dp.mul_(drop)
                dv_b[n2, c0:c1] += torch.tensordot(prob * drop, dot, dims=([0, 1], [0, 1]))
            else:
                dv_b[n2, c0:c1] += torch.tensordot(prob, dot, dims=([0, 1], [0, 1]))
            ds = prob.mul_(dp.sub_(delta[h, r0:r1]))
            dq_b[h, r0:r1] += torch.matmul(ds, k[n2, c0:c1])
            dk_b[n2, c0:c1] += torch.tensordot(ds, qt, dims=([0, 1], [0, 1]))
            t.pse_grad(ds, dpse)
        batch_tokens(dqv, p.seq, b).copy_(dq_b.mul_(p.scale).transpose(0, 1))
        batch_tokens(dkv, p.seq, b, kv=True).copy_(dk_b.transpose(0, 1))
        batch_tokens(dvv, p.seq, b, kv=True).copy_(dv_b.transpose(0, 1))
    if dpse is not None:
        dpse = dpse.to(p.pse.tensor.dtype)
    return dq, dk, dv, dpse
