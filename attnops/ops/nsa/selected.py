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
        check_tensor("atten_mask", atten_mask, ndim=2, dtypes=MASK_DTYPES)
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


LOG2E = 1.4426950408889634


class _Batch:
    """One batch in the compute dtype: queries per KV head, keys/values as ``[n_blocks, block, D]`` per KV head.

    Selected blocks are gathered whole with ``index_select`` (contiguous copies), scores are kept in base 2.
    """

    def __init__(self, spec: SelectedSpec, b: int, query, key, value, topk):
        acc = _acc(query.dtype)
        qs, sq = spec.seq.q_starts[b], spec.seq.q_lens[b]
        ks, skv = spec.seq.kv_starts[b], spec.seq.kv_lens[b]
        bs, nblk = spec.block_size, skv // spec.block_size
        self.q2 = (query[qs:qs + sq].to(acc) * (spec.scale * LOG2E)).view(sq, spec.n2, spec.group, spec.d)
        self.k = key[ks:ks + skv].to(acc).view(nblk, bs, spec.n2, spec.d).permute(2, 0, 1, 3).contiguous()
        self.v = value[ks:ks + skv].to(acc).view(nblk, bs, spec.n2, spec.dv).permute(2, 0, 1, 3).contiguous()
        self.idx = topk[qs:qs + sq].long()  # [Sq, N2, K]
        self.offsets = torch.arange(bs)
        self.spec, self.sq = spec, sq
        width = spec.block_count * bs * (spec.d + spec.dv + 2 * spec.group) * acc.itemsize
        self.chunk = max(1, GATHER_BYTES // max(width, 1))

    def tiles(self):
        """Yield ``(t0, t1, n2)`` work units: a chunk of query tokens and one KV head."""
        for t0 in range(0, self.sq, self.chunk):
            for n2 in range(self.spec.n2):
                yield t0, min(self.sq, t0 + self.chunk), n2

    def scores2(self, t0, t1, n2):
        """Base-2 scores ``[tc, G, L]`` (masked at -inf), block indices ``[tc*K]`` and gathered K/V."""
        tc, spec = t1 - t0, self.spec
        blocks = self.idx[t0:t1, n2].reshape(-1)
        ksel = self.k[n2].index_select(0, blocks).view(tc, -1, spec.d)
        vsel = self.v[n2].index_select(0, blocks).view(tc, -1, spec.dv)
        s = torch.bmm(self.q2[t0:t1, n2], ksel.transpose(1, 2))
        if spec.causal:
            pos = (self.idx[t0:t1, n2].unsqueeze(-1) * spec.block_size + self.offsets).view(tc, 1, -1)
            s.masked_fill_(pos > torch.arange(t0, t1).view(-1, 1, 1), float("-inf"))
        return s, blocks, ksel, vsel


def selected_forward(spec: SelectedSpec, query, key, value, topk):
    """``(attention_out [T1, N1, Dv], softmax_max [T1, N1, 8], softmax_sum [T1, N1, 8])``."""
    out = torch.zeros(spec.total_q, spec.n1, spec.dv, dtype=query.dtype)
    sdt = stats_dtype(query.dtype)
    smax = torch.full((spec.total_q, spec.n1, STAT_LANES), FLT_LOWEST, dtype=sdt)
    ssum = torch.full((spec.total_q, spec.n1, STAT_LANES), FLT_MAX, dtype=sdt)
    g = spec.group
    for b in range(spec.seq.batch):
        if spec.seq.q_lens[b] == 0:
            continue
        bt = _Batch(spec, b, query, key, value, topk)
        qs = spec.seq.q_starts[b]
        for t0, t1, n2 in bt.tiles():
            s, _, _, vsel = bt.scores2(t0, t1, n2)
            m = s.amax(-1, keepdim=True)
            valid = m > float("-inf")
            p = s.sub_(torch.where(valid, m, 0.0)).exp2_()
            l = p.sum(-1, keepdim=True)
            o = torch.bmm(p, vsel).div_(torch.where(valid, l, 1.0))  # [tc, G, Dv]
            rows, heads = slice(qs + t0, qs + t1), slice(n2 * g, (n2 + 1) * g)
            out[rows, heads] = o.to(out.dtype)
            smax[rows, heads] = torch.where(valid, m / LOG2E, FLT_LOWEST).to(sdt)
            ssum[rows, heads] = torch.where(valid, l, FLT_MAX).to(sdt)
    return out, smax, ssum


def selected_backward(spec: SelectedSpec, query, key, value, attention_out, attention_out_grad, softmax_max,
                      softmax_sum, topk):
    """``(dq, dk, dv)`` from the given forward output and statistics (never recomputed)."""
    acc = _acc(query.dtype)
    g, bs = spec.group, spec.block_size
    dq = torch.zeros(query.shape, dtype=acc)
    dk = torch.zeros(key.shape, dtype=acc)
    dv = torch.zeros(value.shape, dtype=acc)
    for b in range(spec.seq.batch):
        if spec.seq.q_lens[b] == 0:
            continue
        bt = _Batch(spec, b, query, key, value, topk)
        qs, ks, skv = spec.seq.q_starts[b], spec.seq.kv_starts[b], spec.seq.kv_lens[b]
        nblk = skv // bs
        m = softmax_max[qs:qs + bt.sq, :, :1].to(torch.float64)
        lse2 = torch.where(m > FLT_LOWEST, (m + softmax_sum[qs:qs + bt.sq, :, :1].to(torch.float64).log()) * LOG2E,
                           float("inf")).to(acc)  # [Sq, N1, 1]; P = exp2(s2 - lse2)
        do = attention_out_grad[qs:qs + bt.sq].to(acc)
        delta = (do * attention_out[qs:qs + bt.sq].to(acc)).sum(-1, keepdim=True)
        # blocks selected by many tokens sum many contributions: accumulate fp32 inputs in fp64
        kv_acc = torch.float64 if query.dtype in (torch.float32, torch.float64) else acc
        dk_blocks = torch.zeros(spec.n2, nblk, bs * spec.d, dtype=kv_acc)
        dv_blocks = torch.zeros(spec.n2, nblk, bs * spec.dv, dtype=kv_acc)
        for t0, t1, n2 in bt.tiles():
            tc, heads = t1 - t0, slice(n2 * g, (n2 + 1) * g)
            s, blocks, ksel, vsel = bt.scores2(t0, t1, n2)
            p = s.sub_(lse2[t0:t1, heads]).exp2_()  # [tc, G, L]
            do_c = do[t0:t1, heads]
            dp = torch.bmm(do_c, vsel.transpose(1, 2))
            dv_blocks[n2].index_add_(0, blocks, torch.bmm(p.transpose(1, 2), do_c).view(tc * spec.block_count, -1)
                                     .to(kv_acc))
            ds = p.mul_(dp.sub_(delta[t0:t1, heads]))
            dq[qs + t0:qs + t1, heads] = torch.bmm(ds, ksel).mul_(spec.scale)
            dk_blocks[n2].index_add_(0, blocks, torch.bmm(ds.transpose(1, 2), bt.q2[t0:t1, n2])
                                     .view(tc * spec.block_count, -1).to(kv_acc))
        dk[ks:ks + skv] = dk_blocks.view(spec.n2, skv, spec.d).transpose(0, 1).mul_(1.0 / LOG2E).to(acc)
        dv[ks:ks + skv] = dv_blocks.view(spec.n2, skv, spec.dv).transpose(0, 1).to(acc)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)
