"""NSA selected attention (NsaSelectedAttention / NsaSelectedAttentionGrad), pure PyTorch.

Each query token attends to ``selected_block_count`` blocks of ``selected_block_size`` keys of its own batch,
chosen per KV head by ``topk_indices [T1, N2, count]`` (block indices local to the batch; duplicates are kept).
Causal: local KV position ``p`` is visible to local query row ``s1`` iff ``p <= s1``; as on the NPU, the forward
masks iff ``sparse_mode=2`` with an ``atten_mask`` present, the grad iff ``sparse_mode=2`` (mask or not).
Statistics are true ``[T1, N1, 8]``.
The CPU path works block by block: the (token, slot) pairs that selected KV block ``j`` are grouped (a stable
sort), their query rows gathered (sliced where they are a run of consecutive tokens), and one GEMM against the
contiguous block computes all their scores. So the cost scales with the selected tokens, not with the sequence,
the GEMMs are large, and dk/dv of a block come from one GEMM (no scatter); per-token results (row max, sums, dq)
are scatter-added in a fixed order (deterministic). The GEMMs stay on ``torch.matmul``: their row counts follow the
selection, so oneDNN (:mod:`attnops._core.gemm`) would build a new primitive (0.5-2 ms) for most of them. Token
chunks (forward) and groups of them (backward) run side by side on single-threaded workers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..._core.checks import Described, check_int, check_scale, check_tensor, fail, require
from ..._core.indices import check_index_rows, validation_enabled
from ..._core.masks import MASK_DTYPES
from ..common.npu_rounding import NpuRounding, cast_round, npu_rounding, store
from ..._core.parallel import fill_, run_jobs
from ..._core.softmax_stats import FLT_LOWEST, FLT_MAX, STAT_LANES, stats_dtype
from ..._core.varlen import SeqInfo, lengths_from_cumulative, seq_info_varlen
from .compress import NSA_DTYPES
from .memo import memoized

SCORE_BYTES = 64 << 20  # budget for the scores of one chunk of query tokens (all their selected blocks)
KV_GRAD_GROUPS = 4  # backward: groups of token chunks run side by side, each with its own dk/dv partial
SEGMENT_PAIRS = 2048  # at most this many (token, slot) pairs per GEMM


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
    rounding: NpuRounding | None = None  # precision="npu": the kernels' rounding (None: exact)

    @property
    def group(self) -> int:
        return self.n1 // self.n2


def build_selected_spec(query, key, value, topk_indices, *, scale_value: float, head_num: int,
                        select_block_size: int, select_block_count: int, atten_mask=None, actual_seq_qlen=None,
                        actual_seq_kvlen=None, sparse_mode: int = 2, layout: str = "TND",
                        grad: bool = False, precision: str = "exact") -> SelectedSpec:
    """Validate a selected-attention call: forward inputs, or with ``grad`` the grad's (causal whenever
    ``sparse_mode == 2``, without an ``atten_mask`` too, like NsaSelectedAttentionGrad). The spec is remembered per
    configuration (:mod:`.memo`); the indices of CPU tensors are checked on every call."""
    spec = memoized(_build_selected_spec, query, key, value, topk_indices, atten_mask, scale_value=scale_value,
                    head_num=head_num, select_block_size=select_block_size, select_block_count=select_block_count,
                    actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode,
                    layout=layout, grad=grad)
    if validation_enabled(topk_indices.device):  # unvalidated indices outside the blocks select nothing
        _check_indices(topk_indices, spec.seq, spec.block_size)
    rounding = npu_rounding(precision, query.dtype)
    return spec if rounding is None else dataclasses.replace(spec, rounding=rounding)


def _build_selected_spec(query, key, value, topk_indices, atten_mask, *, scale_value, head_num, select_block_size,
                         select_block_count, actual_seq_qlen, actual_seq_kvlen, sparse_mode, layout,
                         grad) -> SelectedSpec:
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
                f"multiple of select_block_size={bs}", Described(f"Skv={skv} in batch {b}"))
    causal = sparse_mode == 2 and (grad or atten_mask is not None)
    return SelectedSpec(seq, n1, n2, d, value.shape[2], bs, count, causal, check_scale("scale_value", scale_value), t1)


def _check_indices(topk: torch.Tensor, seq: SeqInfo, bs: int) -> None:
    """Every index of a batch's tokens names one of its whole blocks (no padding value); one vectorized pass."""
    topk = topk.detach().cpu()
    batch = torch.full((topk.shape[0],), -1, dtype=torch.int64)
    for b, (start, sq) in enumerate(zip(seq.q_starts, seq.q_lens)):
        batch[start:start + sq] = b
    blocks = torch.tensor([*(n // bs for n in seq.kv_lens), 0], dtype=torch.int64)[batch]  # -1: the 0 at the end
    read = (batch >= 0).view(-1, 1, 1).expand(topk.shape)
    check_index_rows("topk_indices", topk, read, blocks.view(-1, 1), what=f"the batch's whole blocks of {bs} keys",
                     padding=False)


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _sum_acc(dtype):
    """Accumulator of block gradients summed over many tokens: fp64 for fp32/fp64 inputs."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def _dp_dtype(dtype):
    """dtype of ``dP - D``: fp64, in which the products of fp16/bf16/fp32 values are exact (and short sums of
    fp16/bf16 ones too), so a row with one visible key gives ``dP - D = 0`` (fp16/bf16: exactly; fp32: to fp64
    rounding) as ``D = rowsum(dy * attention_out)`` with ``attention_out`` equal to that key's value; in fp32 the two
    sums would differ by their fp32 rounding, which the scale and the key multiply into dq and dk."""
    return torch.float64


LOG2E = 1.4426950408889634


class _Segment:
    """(token, slot) pairs of one token chunk that selected KV block ``block``: ``pairs`` index ``t*K + k``.

    ``tokens`` (chunk-local, non-decreasing: the pairs are sorted) address the rows of per-token tensors; where they
    are a run of consecutive tokens (a block every token of a stretch selected, such as its own or the first one)
    rows are taken and accumulated as slices instead of gathered and scattered."""

    def __init__(self, block: int, pairs: torch.Tensor, count: int):
        self.block, self.pairs, self.tokens = block, pairs, pairs // count
        first = int(self.tokens[0])
        self.run = (first, first + len(pairs)) if bool((self.tokens.diff() == 1).all()) else None

    def take(self, x: torch.Tensor, base: int = 0) -> torch.Tensor:
        """The segment's rows of ``x`` (whose row ``base`` is the chunk's first token): a view for a run."""
        if self.run is not None:
            return x[base + self.run[0]:base + self.run[1]]
        return x[self.tokens + base if base else self.tokens]

    def add_to(self, x: torch.Tensor, y: torch.Tensor, base: int = 0, alpha: float = 1.0) -> None:
        """``x[rows] += alpha * y`` row by row in pair order (deterministic)."""
        if self.run is not None:
            x[base + self.run[0]:base + self.run[1]].add_(y, alpha=alpha)
        else:
            x.index_add_(0, self.tokens + base if base else self.tokens, y, alpha=alpha)

    def max_into(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """``x[rows] = max(x[rows], y)`` for chunk-local rows of ``x`` ``[tokens, G]``."""
        if self.run is not None:
            rows = x[self.run[0]:self.run[1]]
            torch.maximum(rows, y, out=rows)
        else:
            x.scatter_reduce_(0, self.tokens.unsqueeze(1).expand_as(y), y, "amax")


class _Batch:
    """One batch and one KV head in the compute dtype; keys/values as contiguous ``[n_blocks, block, D]``."""

    def __init__(self, spec: SelectedSpec, b: int, n2: int, query, key, value, topk):
        acc = _acc(query.dtype)
        qs, sq = spec.seq.q_starts[b], spec.seq.q_lens[b]
        ks, skv = spec.seq.kv_starts[b], spec.seq.kv_lens[b]
        bs, g = spec.block_size, spec.group
        self.heads = slice(n2 * g, (n2 + 1) * g)
        # dense copies whatever the inputs' strides: the products then sum in one order for any layout of the inputs
        dense = dict(dtype=acc, memory_format=torch.contiguous_format)
        self.q = query[qs:qs + sq, self.heads].to(**dense).mul(spec.scale)  # [Sq, G, D], scaled
        self.k = key[ks:ks + skv, n2].to(**dense).view(skv // bs, bs, spec.d)
        self.v = value[ks:ks + skv, n2].to(**dense).view(skv // bs, bs, spec.dv)
        idx = topk[qs:qs + sq, n2].long()  # [Sq, K]
        n_blocks = skv // bs
        # indices outside the batch's blocks (only unvalidated ones, from another device) select nothing: they go to
        # the extra bucket n_blocks, which no segment reads (as the kernels skip them)
        self.idx = idx.masked_fill((idx < 0) | (idx >= n_blocks), n_blocks)
        self.spec, self.sq, self.q_start = spec, sq, qs
        self.chunk = max(1, SCORE_BYTES // (spec.block_count * g * bs * acc.itemsize))

    def chunks(self):
        for t0 in range(0, self.sq, self.chunk):
            yield t0, min(self.sq, t0 + self.chunk)

    def segments(self, t0: int, t1: int):
        """Group the chunk's (token, slot) pairs by selected block (stable: a fixed order, deterministic)."""
        count = self.spec.block_count
        flat = self.idx[t0:t1].reshape(-1)
        order = torch.argsort(flat, stable=True)
        sizes = torch.bincount(flat, minlength=self.k.shape[0] + 1).tolist()[:self.k.shape[0]]
        start = 0
        for block, size in enumerate(sizes):
            for s0 in range(start, start + size, SEGMENT_PAIRS):
                yield _Segment(block, order[s0:min(start + size, s0 + SEGMENT_PAIRS)], count)
            start += size

    def scores(self, seg: _Segment, t0: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``scale * q k^T`` of the segment's pairs against its block (``[n, G, bs]``, causal entries at -inf) and
        the scaled query rows ``[n, G, D]``."""
        spec = self.spec
        qj = seg.take(self.q, t0)
        s = torch.matmul(qj, self.k[seg.block].transpose(0, 1))
        if spec.causal:  # only the leading pairs whose token lies before the block's last key see masked keys
            first = seg.block * spec.block_size
            cut = int(torch.searchsorted(seg.tokens, first + spec.block_size - 1 - t0))
            if cut:
                rows = t0 + seg.tokens[:cut]
                pos = torch.arange(first, first + spec.block_size)
                s[:cut].masked_fill_((pos.unsqueeze(0) > rows.unsqueeze(1)).unsqueeze(1), float("-inf"))
        return s, qj


def selected_forward(spec: SelectedSpec, query, key, value, topk):
    """``(attention_out [T1, N1, Dv], softmax_max [T1, N1, 8], softmax_sum [T1, N1, 8])``.

    Token chunks of a (batch, KV head) are independent: they run side by side (:mod:`attnops._core.parallel`)."""
    out = torch.empty(spec.total_q, spec.n1, spec.dv, dtype=query.dtype)
    sdt = stats_dtype(query.dtype)
    smax, ssum = (torch.empty((spec.total_q, spec.n1, STAT_LANES), dtype=sdt) for _ in range(2))
    fill_([(out, 0.0), (smax, FLT_LOWEST), (ssum, FLT_MAX)], query.device)  # on the workers: see parallel.py
    for b in range(spec.seq.batch):
        for n2 in range(spec.n2 if spec.seq.q_lens[b] else 0):
            bt = _Batch(spec, b, n2, query, key, value, topk)
            run_jobs(lambda span: _forward_chunk(bt, *span, out, smax, ssum), list(bt.chunks()), query.device)
    return out, smax, ssum


def _forward_chunk(bt: _Batch, t0: int, t1: int, out, smax, ssum) -> None:
    """The forward of tokens ``[t0, t1)`` of ``bt``: scores of every selected block, their softmax over each
    token's ``count * block`` keys (row max first), ``P V`` summed per token."""
    spec, acc, sdt = bt.spec, bt.q.dtype, smax.dtype
    g, tc = spec.group, t1 - t0
    segments = list(bt.segments(t0, t1))
    scores = [bt.scores(seg, t0)[0] for seg in segments]  # [n, G, bs] per segment
    m = torch.full((tc, g), float("-inf"), dtype=acc)
    for seg, s in zip(segments, scores):
        seg.max_into(m, s.amax(-1))
    valid = m != float("-inf")  # a NaN max (non-finite inputs) stays: the row comes out NaN
    unkept = None if bool(valid.all()) else ~valid & _sees_keys(bt, segments, t0, tc)  # every visible score -inf
    shift = torch.where(valid, m, 0.0)
    l = torch.zeros(tc, g, dtype=acc)
    o = torch.zeros(tc, g, spec.dv, dtype=acc)
    for seg, s in zip(segments, scores):
        p = s.sub_(seg.take(shift).unsqueeze(-1)).mul_(LOG2E).exp2_()
        seg.add_to(l, p.sum(-1))
        seg.add_to(o, torch.matmul(p if spec.rounding is None else spec.rounding.grid_(p), bt.v[seg.block]))
    if unkept is not None:  # the formula's 0 / 0: sum NaN (max -inf), output NaN
        l.masked_fill_(unkept, float("nan"))
        valid |= unkept
    o.div_(torch.where(valid, l, 1.0).unsqueeze(-1))
    rows = slice(bt.q_start + t0, bt.q_start + t1)
    store(spec.rounding, out[rows, bt.heads], o)
    smax[rows, bt.heads] = torch.where(valid, m, FLT_LOWEST).unsqueeze(-1).to(sdt)
    ssum[rows, bt.heads] = torch.where(valid, l, FLT_MAX).unsqueeze(-1).to(sdt)


def _sees_keys(bt: _Batch, segments: list, t0: int, tc: int) -> torch.Tensor:
    """``[tc, 1]``: whether each token of the chunk sees a key of its selected blocks (causal: a block that starts
    at or before it)."""
    counts = torch.zeros(tc)
    for seg in segments:
        tokens = seg.take(torch.arange(tc))
        seen = tokens + t0 >= seg.block * bt.spec.block_size if bt.spec.causal else torch.ones_like(tokens, dtype=bool)
        seg.add_to(counts, seen.float())
    return (counts > 0).unsqueeze(-1)


def selected_backward(spec: SelectedSpec, query, key, value, attention_out, attention_out_grad, softmax_max,
                      softmax_sum, topk):
    """``(dq, dk, dv)`` from the given forward output and statistics (never recomputed).

    The token chunks of a (batch, KV head) form ``KV_GRAD_GROUPS`` contiguous groups that run side by side; each
    writes its own dq rows and sums dk/dv into a partial over the blocks its tokens selected; the partials are
    added in group order, so the result does not depend on the thread count."""
    acc, kv_acc = _acc(query.dtype), _sum_acc(query.dtype)
    bs = spec.block_size
    dq = torch.empty(query.shape, dtype=acc)
    dk = torch.empty(key.shape, dtype=kv_acc)
    dv = torch.empty(value.shape, dtype=kv_acc)
    fill_([(dq, 0.0), (dk, 0.0), (dv, 0.0)], query.device)  # on the workers: see parallel.py
    for b in range(spec.seq.batch):
        qs, sq = spec.seq.q_starts[b], spec.seq.q_lens[b]
        ks, skv = spec.seq.kv_starts[b], spec.seq.kv_lens[b]
        for n2 in range(spec.n2 if sq else 0):
            bt = _Batch(spec, b, n2, query, key, value, topk)
            h = bt.heads
            grads = _BlockGrads(bt, softmax_max[qs:qs + sq, h, 0].to(acc), softmax_sum[qs:qs + sq, h, 0].to(acc).log2(),
                                attention_out_grad[qs:qs + sq, h], attention_out[qs:qs + sq, h],
                                _dp_dtype(query.dtype), dq[qs:qs + sq, h], kv_acc)
            chunks = list(bt.chunks())
            n = min(KV_GRAD_GROUPS, len(chunks))
            groups = [chunks[i * len(chunks) // n:(i + 1) * len(chunks) // n] for i in range(n)]
            partials = [None] * n
            run_jobs(lambda i: partials.__setitem__(i, grads.run(groups[i])), range(n), query.device)
            dk_b = dk[ks:ks + skv, n2].view(skv // bs, bs, spec.d)
            dv_b = dv[ks:ks + skv, n2].view(skv // bs, bs, spec.dv)
            for lo, pk, pv in partials:
                dk_b[lo:lo + pk.shape[0]] += pk
                dv_b[lo:lo + pv.shape[0]] += pv
    if spec.rounding is not None:  # the NPU's CAST_ROUND of the gradients
        return tuple(cast_round(g, x.dtype) for g, x in ((dq, query), (dk, key), (dv, value)))
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


@dataclass
class _BlockGrads:
    """The backward of one (batch, KV head): per group of token chunks, dq rows in place and dk/dv partials."""

    bt: _Batch
    m: torch.Tensor  # [Sq, G] given row max
    log2_l: torch.Tensor  # [Sq, G] log2 of the given row sum
    do: torch.Tensor  # [Sq, G, Dv] attention_out_grad (a view of the input)
    out: torch.Tensor  # [Sq, G, Dv] attention_out (a view of the input)
    dp_dtype: torch.dtype  # the dtype of dP - D
    dq: torch.Tensor  # [Sq, G, D] (a view of the result: each chunk's rows are written by one job)
    kv_acc: torch.dtype

    def run(self, chunks: list[tuple[int, int]]) -> tuple[int, torch.Tensor, torch.Tensor]:
        """``(first block, dk partial, dv partial)`` of the tokens of ``chunks`` (contiguous)."""
        bt, spec = self.bt, self.bt.spec
        bs, dp_dt, acc = spec.block_size, self.dp_dtype, self.dq.dtype
        picked = bt.idx[chunks[0][0]:chunks[-1][1]]
        picked = picked[picked < bt.k.shape[0]]  # the selectable blocks (out-of-range ones select nothing)
        lo, hi = (int(picked.min()), int(picked.max()) + 1) if picked.numel() else (0, 0)
        pk = torch.zeros(hi - lo, bs, spec.d, dtype=self.kv_acc)
        pv = torch.zeros(hi - lo, bs, spec.dv, dtype=self.kv_acc)
        v_dp = bt.v.to(dp_dt)
        rounding = spec.rounding  # the NPU rounds P (for dV) and dS (for dQ, dK) to the input dtype
        for t0, t1 in chunks:
            do = self.do[t0:t1].to(acc, memory_format=torch.contiguous_format)
            do_dp = do.to(dp_dt)
            delta = torch.linalg.vecdot(do_dp, self.out[t0:t1].to(dp_dt))  # D = rowsum(dy * attention_out)
            for seg in bt.segments(t0, t1):
                s, qj = bt.scores(seg, t0)
                p = s.sub_(seg.take(self.m, t0).unsqueeze(-1)).mul_(LOG2E)
                p = p.sub_(seg.take(self.log2_l, t0).unsqueeze(-1)).exp2_()
                do_j = seg.take(do)
                dp = torch.matmul(seg.take(do_dp), v_dp[seg.block].transpose(0, 1))
                p_v = p if rounding is None else rounding.grid(p)
                pv[seg.block - lo] += (p_v.reshape(-1, bs).transpose(0, 1) @ do_j.reshape(-1, spec.dv)).to(self.kv_acc)
                ds = p.mul_(dp.sub_(seg.take(delta).unsqueeze(-1)).to(p.dtype))
                ds = ds if rounding is None else rounding.grid_(ds)
                pk[seg.block - lo] += (ds.reshape(-1, bs).transpose(0, 1) @ qj.reshape(-1, spec.d)).to(self.kv_acc)
                seg.add_to(self.dq, torch.matmul(ds, bt.k[seg.block]), t0, alpha=spec.scale)
        return lo, pk, pv
