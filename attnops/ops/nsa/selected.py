"""NSA selected attention (NsaSelectedAttention / NsaSelectedAttentionGrad), pure PyTorch.

Each query token attends to ``selected_block_count`` blocks of ``selected_block_size`` keys of its own batch,
chosen per KV head by ``topk_indices [T1, N2, count]`` (block indices local to the batch; duplicates are kept).
Causal (``sparse_mode=2`` with an ``atten_mask`` present): local KV position ``p`` is visible to local query row
``s1`` iff ``p <= s1`` (``DECISIONS.md``), in forward and backward. Statistics are true ``[T1, N1, 8]``.
The CPU path gathers the selected keys per chunk of tokens, so its cost scales with the selected tokens, not
with the sequence; dk/dv are scatter-added with ``index_add_`` in a fixed order (deterministic).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._core.checks import check_int, check_tensor, fail, require
from ..._core.masks import MASK_DTYPES
from ..._core.softmax_stats import FLT_LOWEST, FLT_MAX, STAT_LANES, stats_dtype
from ..._core.varlen import SeqInfo, lengths_from_cumulative, seq_info_varlen
from .compress import NSA_DTYPES

GATHER_BYTES = 32 << 20  # budget for the gathered keys/values and scores of one chunk of tokens


@dataclass(frozen=True)
class SelectedSpec:
    seq: SeqInfo
    n1: int
    n2: int
    d: int
    dv: int
    block_size: int
    block_count: int
    causal: bool
    scale: float
    total_q: int

    @property
    def group(self) -> int:
        return self.n1 // self.n2


def build_selected_spec(query, key, value, topk_indices, *, scale_value: float, head_num: int,
                        select_block_size: int, select_block_count: int, atten_mask=None, actual_seq_qlen=None,
                        actual_seq_kvlen=None, sparse_mode: int = 2, layout: str = "TND") -> SelectedSpec:
    """Validate a selected-attention call (forward or backward inputs)."""
    require(layout == "TND", "input_layout", "'TND'", layout)
    check_tensor("query", query, ndim=3, dtypes=NSA_DTYPES)
    for name, t in (("key", key), ("value", value)):
        check_tensor(name, t, ndim=3)
        if t.dtype != query.dtype:
            fail(name, f"dtype {query.dtype} (same as query)", t)
    t1, n1, d = query.shape
    t2, n2, dk = key.shape
    require(head_num == n1, "head_num", f"the N of query ({n1})", head_num)
    require(value.shape[0] == t2 and value.shape[1] == n2, "value", f"[T2={t2}, N2={n2}, Dv] like key", value)
    require(n2 > 0 and n1 % n2 == 0, "key", f"a number of heads N2 dividing N1={n1}", key)
    require(dk == d, "key", f"head dim {d} like query", key)
    bs = check_int("select_block_size", select_block_size, lo=1)
    count = check_int("select_block_count", select_block_count, lo=1)
    check_tensor("topk_indices", topk_indices, dtypes=(torch.int32, torch.int64), shape=(t1, n2, count))
    require(sparse_mode in (0, 2), "sparse_mode", "0 or 2", sparse_mode)
    if atten_mask is not None:
        check_tensor("atten_mask", atten_mask, dtypes=MASK_DTYPES)
    require(actual_seq_qlen is not None and actual_seq_kvlen is not None, "actual_seq_qlen",
            "cumulative actual_seq_qlen and actual_seq_kvlen (layout TND)", actual_seq_qlen)
    q_lens = lengths_from_cumulative("actual_seq_qlen", actual_seq_qlen, t1)
    kv_lens = lengths_from_cumulative("actual_seq_kvlen", actual_seq_kvlen, t2)
    seq = seq_info_varlen(q_lens, kv_lens)
    for b, (sq, skv) in enumerate(zip(q_lens, kv_lens)):
        if sq == 0:
            continue
        require(skv >= bs * count and skv % bs == 0, "actual_seq_kvlen",
                f"every batch's KV length to be >= select_block_size*select_block_count = {bs * count} and a "
                f"multiple of select_block_size={bs}", f"Skv={skv} in batch {b}")
    _check_indices(topk_indices, seq, bs)
    return SelectedSpec(seq, n1, n2, d, value.shape[2], bs, count, sparse_mode == 2 and atten_mask is not None,
                        float(scale_value), t1)


def _check_indices(topk: torch.Tensor, seq: SeqInfo, bs: int) -> None:
    for b in range(seq.batch):
        sq, start = seq.q_lens[b], seq.q_starts[b]
        if sq == 0:
            continue
        idx = topk[start:start + sq]
        limit = seq.kv_lens[b] // bs
        bad = (idx < 0) | (idx >= limit)
        if bool(bad.any()):
            where = bad.nonzero()[0].tolist()
            fail("topk_indices", f"block indices in [0, {limit}) for batch {b} (local to the batch)",
                 f"{int(idx[tuple(where)])} at [{start + where[0]}, {where[1]}, {where[2]}]")


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


class _Batch:
    """One batch's tensors in the compute dtype and its selected KV positions."""

    def __init__(self, spec: SelectedSpec, b: int, query, key, value, topk):
        acc = _acc(query.dtype)
        qs, sq = spec.seq.q_starts[b], spec.seq.q_lens[b]
        ks, skv = spec.seq.kv_starts[b], spec.seq.kv_lens[b]
        self.q = query[qs:qs + sq].to(acc).view(sq, spec.n2, spec.group, spec.d)
        self.k = key[ks:ks + skv].to(acc)
        self.v = value[ks:ks + skv].to(acc)
        offsets = torch.arange(spec.block_size)
        self.pos = (topk[qs:qs + sq].long().unsqueeze(-1) * spec.block_size + offsets).flatten(2)  # [Sq, N2, L]
        self.heads = torch.arange(spec.n2).view(1, -1, 1)
        self.spec, self.sq = spec, sq
        width = self.pos.shape[-1] * max(spec.d, spec.dv, spec.group) * spec.n2 * acc.itemsize
        self.chunk = max(1, GATHER_BYTES // max(width, 1))

    def chunks(self):
        for t0 in range(0, self.sq, self.chunk):
            yield t0, min(self.sq, t0 + self.chunk)

    def scores(self, t0, t1):
        """Scaled masked scores [tc, N2, G, L] and the gathered keys/values of tokens t0:t1."""
        pos = self.pos[t0:t1]
        ksel, vsel = self.k[pos, self.heads], self.v[pos, self.heads]  # [tc, N2, L, D]
        s = torch.matmul(self.q[t0:t1], ksel.transpose(-1, -2)).mul_(self.spec.scale)
        if self.spec.causal:
            rows = torch.arange(t0, t1).view(-1, 1, 1, 1)
            s.masked_fill_(pos.unsqueeze(2) > rows, float("-inf"))
        return s, pos, ksel, vsel


def selected_forward(spec: SelectedSpec, query, key, value, topk):
    """``(attention_out [T1, N1, Dv], softmax_max [T1, N1, 8], softmax_sum [T1, N1, 8])``."""
    acc = _acc(query.dtype)
    out = torch.zeros(spec.total_q, spec.n1, spec.dv, dtype=query.dtype)
    sdt = stats_dtype(query.dtype)
    smax = torch.full((spec.total_q, spec.n1, STAT_LANES), FLT_LOWEST, dtype=sdt)
    ssum = torch.full((spec.total_q, spec.n1, STAT_LANES), FLT_MAX, dtype=sdt)
    for b in range(spec.seq.batch):
        if spec.seq.q_lens[b] == 0:
            continue
        bt = _Batch(spec, b, query, key, value, topk)
        qs = spec.seq.q_starts[b]
        for t0, t1 in bt.chunks():
            s, _, _, vsel = bt.scores(t0, t1)
            m = s.amax(-1, keepdim=True)
            valid = m > float("-inf")
            p = s.sub_(torch.where(valid, m, 0.0)).exp_()
            l = p.sum(-1, keepdim=True)
            o = torch.matmul(p, vsel).div_(torch.where(valid, l, 1.0))  # [tc, N2, G, Dv]
            out[qs + t0:qs + t1] = o.reshape(t1 - t0, spec.n1, spec.dv).to(out.dtype)
            smax[qs + t0:qs + t1] = torch.where(valid, m, FLT_LOWEST).reshape(t1 - t0, spec.n1, 1).to(sdt)
            ssum[qs + t0:qs + t1] = torch.where(valid, l, FLT_MAX).reshape(t1 - t0, spec.n1, 1).to(sdt)
    return out, smax, ssum


def selected_backward(spec: SelectedSpec, query, key, value, attention_out, attention_out_grad, softmax_max,
                      softmax_sum, topk):
    """``(dq, dk, dv)`` from the given forward output and statistics (never recomputed)."""
    acc = _acc(query.dtype)
    dq = torch.zeros(query.shape, dtype=acc)
    dk = torch.zeros(key.shape, dtype=acc)
    dv = torch.zeros(value.shape, dtype=acc)
    for b in range(spec.seq.batch):
        if spec.seq.q_lens[b] == 0:
            continue
        bt = _Batch(spec, b, query, key, value, topk)
        qs, ks, skv = spec.seq.q_starts[b], spec.seq.kv_starts[b], spec.seq.kv_lens[b]
        shape = (bt.sq, spec.n2, spec.group, 1)
        m = softmax_max[qs:qs + bt.sq, :, :1].to(acc).reshape(shape)
        lse = torch.where(m > FLT_LOWEST, m + softmax_sum[qs:qs + bt.sq, :, :1].to(acc).reshape(shape).log(),
                          float("inf"))
        do = attention_out_grad[qs:qs + bt.sq].to(acc).view(bt.sq, spec.n2, spec.group, spec.dv)
        delta = (do * attention_out[qs:qs + bt.sq].to(acc).view_as(do)).sum(-1, keepdim=True)
        dk_b = dk[ks:ks + skv].view(skv * spec.n2, spec.d)
        dv_b = dv[ks:ks + skv].view(skv * spec.n2, spec.dv)
        for t0, t1 in bt.chunks():
            s, pos, ksel, vsel = bt.scores(t0, t1)
            p = s.sub_(lse[t0:t1]).exp_()  # [tc, N2, G, L]
            do_c = do[t0:t1]
            dp = torch.matmul(do_c, vsel.transpose(-1, -2))
            flat = (pos * spec.n2 + bt.heads).reshape(-1)
            dv_b.index_add_(0, flat, torch.matmul(p.transpose(-1, -2), do_c).reshape(-1, spec.dv))
            ds = p.mul_(dp.sub_(delta[t0:t1]))
            dq[qs + t0:qs + t1] = torch.matmul(ds, ksel).reshape(t1 - t0, spec.n1, spec.d).mul_(spec.scale)
            dk_b.index_add_(0, flat, torch.matmul(ds.transpose(-1, -2), bt.q[t0:t1]).reshape(-1, spec.d)
                            .mul_(spec.scale))
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)
