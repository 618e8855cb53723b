"""Pure-PyTorch FlashAttention backward (the production CPU path), on :mod:`.reference_tiles`' tiles: see
:mod:`.reference` for how the work is cut and why results do not depend on the thread count."""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch

from ..._core.layouts import batch_tokens, tokens_view
from ..._core.parallel import fill_, run_jobs
from ..._core.softmax_stats import stats_block
from ..._core.workspace import Buffers
from . import reference_tiles as tiling
from .fused_softmax import fused_softmax, grad_, probabilities_
from .npu_rounding import store
from .problem import FAProblem
from .reference_tiles import (LOG2E, active_batches, carve, col_blocks, compute_dtype, deal, has_tile_extras,
                              head_scores, row_chunks, stage_kv)
from .tile_products import operand_dtype, tile_products


def _peaked_rows(l_b: torch.Tensor, acc: torch.dtype, input_dtype: torch.dtype) -> list[list[int]] | None:
    """Per query head, the (sorted) rows whose ``dP - D`` must be formed in fp64, or None when none ever is.

    ``dP_ij - D_i = dy_i . (v_j - o_i)`` cancels when one key dominates the row (``o_i ~ v_j``, ``P_ij ~ 1``); then
    fp32 rounding of ``dP`` and ``D`` (each ~eps*|dy||v|) would be the whole error of dq/dk, while autograd's
    ``sum(P * dP)`` cancels the same rounding. With ``p = max_j P_ij`` the cancellation magnifies the rounding
    about ``1 / (1 - p)`` times, and ``p = 1 / softmax_sum``: rows with ``softmax_sum < PEAKED_SUM`` (p > 1/4,
    magnification > 4/3) get ``dP - D`` in fp64; the others keep the fp32 GEMM (random data of a long sequence has
    such rows only among its first few dozen causal rows). Only for fp32 inputs: fp16/bf16 inputs are far coarser
    than fp32 products, and fp64
    inputs compute in fp64 anyway.
    """
    if acc != torch.float32 or input_dtype != torch.float32:
        return None
    peaked = (l_b[..., 0] < tiling.PEAKED_SUM)
    if not bool(peaked.any()):
        return None
    return [torch.nonzero(row).flatten().tolist() for row in peaked]


def _has_unit_rows(p: FAProblem, l_b: torch.Tensor, acc: torch.dtype) -> bool:
    """Whether some row's ``softmax_sum`` is 1 in an fp32 computation without NPU rounding: there an entry with
    ``P == 1`` gets ``dS = 0`` exactly. Its exact value, ``-sum_j P_j dP_j`` over the row's other keys, is 0 for a
    row with one key and below fp32 resolution otherwise, where the rounding of ``dP - D`` would be all of ``dS``.
    Not in fp64 (the golden: its rounding is far below the other keys' terms) nor under ``precision="npu"`` (the
    NPU forms ``dP - D`` as computed)."""
    return acc == torch.float32 and p.rounding is None and bool((l_b == 1).any())


@dataclass
class _BackwardBatch:
    """One batch's operands, heads first, and its gradient accumulators (which may alias the outputs)."""

    b: int
    q: torch.Tensor  # [N1, Sq, D] (views of the inputs)
    do: torch.Tensor  # [N1, Sq, Dv]
    k: torch.Tensor  # [N2, Skv, D]
    v: torch.Tensor  # [N2, Skv, Dv]
    m: torch.Tensor  # [N1, Sq, 1] given row max
    neg_log2_l: torch.Tensor  # [N1, Sq, 1] -log2(given row sum)
    o: torch.Tensor  # [N1, Sq, Dv] attention_in (a view of the input)
    peaked: list[list[int]] | None  # rows whose dP - D is formed in fp64 (per head)
    unit_rows: bool  # some row's softmax_sum is 1: an entry may have P == 1 (see _backward_kv_head)
    finite_stats: bool  # every row's statistics are finite (else rows with NaN/inf inputs: see masked_entries)
    delta64: torch.Tensor | None  # [N1, Sq, 1] fp64 D of those rows
    dq: torch.Tensor  # [N1, Sq, D]
    dk: torch.Tensor  # [N2, Skv, D]
    dv: torch.Tensor  # [N2, Skv, Dv]
    dk_out: torch.Tensor  # [N2, Skv, D] (views of the outputs; the same as dk/dv where those are the outputs)
    dv_out: torch.Tensor  # [N2, Skv, Dv]
    groups: list  # lists of row chunks (r0, r1, column blocks) whose dK/dV are summed apart


def backward(p: FAProblem, query, key, value, dy, attention_in, softmax_max, softmax_sum):
    """Returns ``(dq, dk, dv, dpse)``; dpse is None unless a pse tensor of type 0/1 was given.

    Jobs of (batch, KV head) pairs run side by side on single-threaded workers (:mod:`attnops._core.parallel`;
    see :func:`_backward_jobs`); every dQ row and every dK/dV partial has one writer and partials are added in a
    fixed order, so the result does not depend on the thread count. Tiles are one
    query head x a row chunk x at most ``COL_BLOCK`` columns of the band. Per tile, from the given statistics:
    ``P = exp2((S - max) * log2(e) - log2(sum))``, ``dV += P^T dy``, ``dS = P * (dy V^T - D)`` with
    ``D = rowsum(dy * attention_in)`` (see :func:`_peaked_rows` for the rows done in fp64; where ``P == 1``, a row
    with one key, ``dS = 0`` exactly, as ``P * (dP - rowsum(P * dP))`` gives), ``dQ += scale * dS K``,
    ``dK += dS^T (scale*Q)``.
    """
    g = p.geom
    dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)  # zeroed by the workers
    dpse = None
    if p.pse is not None and p.pse.has_grad:
        dpse = torch.empty(p.pse.tensor.shape, dtype=compute_dtype(query.dtype), device=query.device)
    qv, kv, vv, dyv, ov, dqv, dkv, dvv = (
        tokens_view(t, g.layout, n) for t, n in ((query, g.n1), (key, g.n2), (value, g.n2), (dy, g.n1),
                                                  (attention_in, g.n1), (dq, g.n1), (dk, g.n2), (dv, g.n2)))
    acc = compute_dtype(query.dtype)
    direct = dq.dtype == acc  # accumulate in the (zeroed) outputs themselves
    active = active_batches(p)
    buf = Buffers.acquire(operand_dtype(query.dtype, query.device), query.device)
    k_all, v_all = stage_kv(p, buf, active, query.device, kv, vv)
    staged = None if direct else _accumulators(p, active, acc, query.device)
    batches = []
    for i, b in enumerate(active):
        sq, skv = p.seq.q_lens[b], p.seq.kv_lens[b]
        do = batch_tokens(dyv, p.seq, b).transpose(0, 1)
        o = batch_tokens(ov, p.seq, b).transpose(0, 1)  # its rows are widened where a chunk reads them
        l_b = stats_block(softmax_sum, p.seq, b, p.softmax_layout)[..., :1].to(acc)
        peaked = _peaked_rows(l_b, acc, query.dtype)
        dk_out, dv_out = (batch_tokens(t, p.seq, b, kv=True).transpose(0, 1) for t in (dkv, dvv))
        if direct:
            dq_b, dk_b, dv_b = batch_tokens(dqv, p.seq, b).transpose(0, 1), dk_out, dv_out
        else:
            dq_b, dk_b, dv_b = staged[i]
        # tiles of at most COL_BLOCK columns: the backward needs no whole rows (the statistics are given), and
        # smaller tiles keep its two score-sized buffers in the caches
        chunks = [(r0, r1, col_blocks(p, b, r0, r1, c0, c1, band, tiling.COL_BLOCK))
                  for r0, r1, c0, c1, band in row_chunks(p, b, tiling.TILE_BYTES // acc.itemsize, tiling.MAX_ROWS,
                                                         tiling.COL_BLOCK)]
        # dK/dV of a group of chunks (all G heads) are summed apart, then added once: fp32 chains of about
        # sqrt(chunks * G) additions instead of chunks * G
        per_group = max(1, math.isqrt(len(chunks) * g.group) // g.group)
        m_b = stats_block(softmax_max, p.seq, b, p.softmax_layout)[..., :1].to(acc).contiguous()
        neg_log2_l = l_b.log2().neg_().contiguous()
        batches.append(_BackwardBatch(
            b, batch_tokens(qv, p.seq, b).transpose(0, 1), do, k_all[i], v_all[i], m_b, neg_log2_l, o, peaked,
            _has_unit_rows(p, l_b, acc), bool(torch.isfinite(m_b).all() and torch.isfinite(neg_log2_l).all()),
            _peaked_delta(peaked, do, o), dq_b, dk_b, dv_b, dk_out, dv_out,
            [chunks[j:j + per_group] for j in range(0, len(chunks), per_group)]))
    jobs, partials = _backward_jobs(batches, g.n2, dpse)
    # outputs that are not the accumulators are written whole by _backward_finish where the batches cover them
    covered = sum(p.seq.q_lens[b] for b in active) == p.total_q and sum(p.seq.kv_lens[b] for b in active) == p.total_kv
    accumulators = [] if not direct and covered else [dq, dk, dv]
    # (without partials each dK/dV row has one writer, which stores it: see _store_or_add)
    accumulators += [t for bb in batches if not direct for t in ((bb.dq, bb.dk, bb.dv) if partials else (bb.dq,))]
    fill_([(t, 0.0) for t in accumulators + [t for _, _, dk_part, dv_part in partials for t in (dk_part, dv_part)]
           + ([] if dpse is None else [dpse])], query.device)
    run_jobs(lambda job: [_backward_kv_head(p, *task, dpse, acc) for task in job], jobs, query.device)
    run_jobs(lambda job: _backward_finish(p, *job, partials, None if direct else dqv), [
        (bb, n2) for bb in batches for n2 in range(g.n2)], query.device)
    buf.release()
    Buffers.acquire(acc, query.device).release()  # the accumulators' workspace, when it is large
    if dpse is not None:
        dpse = dpse.to(p.pse.tensor.dtype)
    return dq, dk, dv, dpse


def _accumulators(p: FAProblem, active: list[int], acc: torch.dtype, device) -> list[list[torch.Tensor]]:
    """The dQ, dK and dV accumulators (``[N1, Sq, D]``, ``[N2, Skv, D]``, ``[N2, Skv, Dv]`` in ``acc``) of each
    active batch where they are not the outputs: views of one workspace of the calling thread kept between calls
    (tens of MB allocated afresh would be faulted in again at every call, about a tenth of a bf16 backward)."""
    g = p.geom
    shapes = [shape for b in active for shape in ((g.n1, p.seq.q_lens[b], g.d), (g.n2, p.seq.kv_lens[b], g.d),
                                                   (g.n2, p.seq.kv_lens[b], g.dv))]
    views = carve(Buffers.acquire(acc, device).get("grad_acc", sum(math.prod(s) for s in shapes)), shapes)
    return [views[i:i + 3] for i in range(0, len(views), 3)]


def _backward_finish(p: FAProblem, bb: _BackwardBatch, n2: int, partials: list, dq_out) -> None:
    """KV head ``n2`` of batch ``bb`` after the tile jobs: its dK/dV partials added in their fixed order (the result
    does not depend on the thread count), and, when the accumulators are not the outputs (``dq_out``: the dq token
    view), dQ of its query heads (and dK/dV of the head, where partials were added) copied out in the output
    dtype."""
    for pb, h, dk_part, dv_part in partials:
        if pb is bb and h == n2:
            bb.dk[n2] += dk_part
            bb.dv[n2] += dv_part
    if dq_out is not None:
        heads = slice(n2 * p.geom.group, (n2 + 1) * p.geom.group)
        store(p.rounding, batch_tokens(dq_out, p.seq, bb.b)[:, heads], bb.dq[heads].transpose(0, 1))
        if partials:
            store(p.rounding, bb.dk_out[n2], bb.dk[n2])
            store(p.rounding, bb.dv_out[n2], bb.dv[n2])


def _peaked_delta(peaked: list[list[int]] | None, do: torch.Tensor, o: torch.Tensor) -> torch.Tensor | None:
    """fp64 ``D`` of the peaked rows (the other rows never read theirs), or None."""
    if peaked is None:
        return None
    delta64 = torch.zeros(*do.shape[:2], 1, dtype=torch.float64, device=do.device)
    for h, rows in enumerate(peaked):
        if rows:
            idx = torch.tensor(rows, dtype=torch.long, device=do.device)
            delta64[h, idx] = torch.linalg.vecdot(do[h, idx].to(torch.float64),
                                                  o[h, idx].to(torch.float64)).unsqueeze(-1)
    return delta64


def _backward_jobs(batches: list[_BackwardBatch], n2: int, dpse):
    """The backward's jobs (lists of ``(batch, KV head, chunk groups, dK target, dV target, sole writer)`` tasks)
    and the dK/dV partials to add afterwards as ``(batch, KV head, dK, dV)``.

    One job per (batch, KV head) writes its dK/dV rows into the outputs, their only writer; a pse gradient shared by the batches (batch dim 1)
    makes one job per KV head walk every batch. With fewer than ``MIN_JOBS`` (batch, KV head) pairs and no pse
    gradient (MQA, few sequences), each pair's chunk groups are dealt round-robin to enough jobs with their own
    dK/dV partials.
    """
    if dpse is None and len(batches) * n2 < tiling.MIN_JOBS:
        jobs, partials = [], []
        for bb in batches:
            for h in range(n2):
                for part in deal(bb.groups, len(batches) * n2):
                    dk, dv = torch.empty_like(bb.dk[h]), torch.empty_like(bb.dv[h])  # zeroed by the caller
                    jobs.append([(bb, h, part, dk, dv, False)])
                    partials.append((bb, h, dk, dv))
        return jobs, partials
    if dpse is not None and dpse.shape[0] == 1 and len(batches) > 1:
        pairs = [[(bb, h) for bb in batches] for h in range(n2)]
    else:
        pairs = [[(bb, h)] for bb in batches for h in range(n2)]
    return [[(bb, h, bb.groups, bb.dk_out[h], bb.dv_out[h], True) for bb, h in pair] for pair in pairs], []


def _backward_kv_head(p: FAProblem, bb: _BackwardBatch, n2: int, groups: list, dk: torch.Tensor, dv: torch.Tensor,
                      sole: bool, dpse, acc: torch.dtype) -> None:
    """The backward tiles of ``groups`` (of KV head ``n2`` and its G query heads) of batch ``bb``, in this thread's
    workspace: dQ rows in place, dK/dV sums into ``dk``/``dv`` (``[Skv, D]``/``[Skv, Dv]``; see
    :func:`_store_or_add`). Lean on tensor calls like the forward (:mod:`.reference`): tiles that can be one call
    (bf16 products, no extras, finite rows) are collected and run a batch at a time (``mm.backward_tiles``), the
    others take :func:`_chunk_head_tiles` in between, so every accumulator sums in the same order either way."""
    if not groups:  # every row of the batch is masked: nothing to add (a sole writer's rows are 0)
        if sole:
            dk.zero_()
            dv.zero_()
        return
    g = p.geom
    buf = Buffers.acquire(acc, bb.k.device)
    job = _Job(p, bb, n2, tile_products(p, bb.k.dtype, buf), buf, dpse)  # the staged keys' dtype
    heads = slice(n2 * g.group, (n2 + 1) * g.group)
    delta, finite = _job_delta(bb, heads, groups, acc, buf)
    bare = job.in_pass and not p.softcap  # tiles that may be one call
    calls = job.mm.backward_tiles(bb.q[heads], bb.do[heads], bb.m[heads], bb.neg_log2_l[heads], delta,
                                  bb.dq[heads], job.k, job.v, bb.unit_rows) if bare else None
    spans = [(min(c[2][0][0] for c in group), max(c[2][-1][1] for c in group)) for group in groups]
    v0, v1 = min(u0 for u0, _ in spans), max(u1 for _, u1 in spans)
    # dK^T and dV^T ([D, columns]): their GEMMs read P and dS row-major, not transposed; a group's sums are added
    # to the job's, which are transposed into dK/dV once at the end
    dkt, dvt = buf.get("dkt", g.d, v1 - v0).zero_(), buf.get("dvt", g.dv, v1 - v0).zero_()
    for group, (u0, u1) in zip(groups, spans):
        if len(groups) == 1:
            tk, tv = dkt, dvt
        else:
            tk, tv = buf.get("tk", g.d, u1 - u0).zero_(), buf.get("tv", g.dv, u1 - u0).zero_()
        for r0, r1, blocks in group:
            for i in range(g.group):
                h = heads.start + i
                nonfinite = not (bb.finite_stats and (finite[i] or bool(torch.isfinite(delta[i, r0:r1]).all())))
                peaked = None if bb.peaked is None else bb.peaked[h]
                peaked = peaked if peaked and bisect.bisect_left(peaked, r0) < bisect.bisect_left(peaked, r1) else None
                if calls is not None and not nonfinite and peaked is None:
                    for c0, c1, band in blocks:
                        calls.add(i, r0, r1, c0, c1, p.mask.tile_band(bb.b, r0, r1, c0, c1) if band else None, c0 - u0)
                    continue
                if calls is not None:
                    calls.run(tk, tv)  # the tiles before this one first: the same order of sums
                _chunk_head_tiles(job, h, r0, r1, blocks, u0, delta[i, r0:r1], nonfinite, peaked, tk, tv)
        if calls is not None:
            calls.run(tk, tv)
        if len(groups) > 1:
            dkt[:, u0 - v0:u1 - v0] += tk
            dvt[:, u0 - v0:u1 - v0] += tv
    _store_or_add(p, dk, dkt, v0, v1, sole)
    _store_or_add(p, dv, dvt, v0, v1, sole)
    buf.release()
    job.mm.release()


class _Job:
    """What the tiles of one backward job share: the problem, the batch, the KV head with its keys and values, the
    products, the thread's workspace, the pse gradient, and how the tiles' passes run."""

    def __init__(self, p: FAProblem, bb: _BackwardBatch, n2: int, mm, buf: Buffers, dpse):
        self.p, self.bb, self.n2, self.mm, self.buf, self.dpse = p, bb, n2, mm, buf, dpse
        self.k, self.v = bb.k[n2], bb.v[n2]
        self.keys = mm.keys(self.k, ())  # never packed: no gain measured here, and every packed shape is one more
        # oneDNN primitive kept in its cache (+1.4 GiB peak in the 32k-token causal backward)
        self.extras = has_tile_extras(p)
        self.fused = p.rounding is None and fused_softmax(buf.dtype, self.k.device)  # buf: the compute dtype's
        self.in_pass = self.fused and not self.extras  # the fused probabilities pass masks the band (tile_band)


def _job_delta(bb: _BackwardBatch, heads: slice, groups: list, acc: torch.dtype, buf: Buffers
               ) -> tuple[torch.Tensor, list[bool]]:
    """``D = rowsum(dy * attention_in)`` (in the compute dtype) of the job's rows of query heads ``heads``, as
    ``[G, Sq, 1]`` in workspace ``"delta"`` (rows outside the job's chunks are not written), and per head whether
    all of its job's rows are finite (else a chunk's rows are checked where it is used: see
    ``tiling.masked_entries``). One product per run of consecutive chunks, not one per chunk and head."""
    runs = []
    for r0, r1 in sorted((r0, r1) for group in groups for r0, r1, _ in group):
        if runs and runs[-1][1] == r0:
            runs[-1][1] = r1
        else:
            runs.append([r0, r1])
    delta = buf.get("delta", heads.stop - heads.start, bb.do.shape[1], 1)
    finite = []
    for i, h in enumerate(range(heads.start, heads.stop)):
        for r0, r1 in runs:
            torch.linalg.vecdot(bb.do[h, r0:r1].to(acc), bb.o[h, r0:r1].to(acc), out=delta[i, r0:r1, 0])
        finite.append(all(bool(torch.isfinite(delta[i, r0:r1]).all()) for r0, r1 in runs))
    return delta, finite


def _chunk_head_tiles(job: _Job, h: int, r0: int, r1: int, blocks: list, u0: int, delta: torch.Tensor,
                      nonfinite: bool, peaked: list[int] | None, tk: torch.Tensor, tv: torch.Tensor) -> None:
    """The tiles of query head ``h``, rows ``r0:r1`` and column ``blocks`` made product by product: dQ rows in
    place, dK^T/dV^T sums into ``tk``/``tv`` (whose column 0 is key ``u0``). ``delta``: the rows' ``D``;
    ``nonfinite``: some row's statistics or ``D`` are not finite; ``peaked``: rows whose ``dP - D`` is formed in
    fp64 (see :func:`_peaked_rows`), or None."""
    p, bb, mm, buf, k, v = job.p, job.bb, job.mm, job.buf, job.k, job.v
    fused, in_pass = job.fused, job.in_pass
    qs = mm.rows("q", bb.q[h, r0:r1], mm.q_scale)
    dot = mm.rows("dy", bb.do[h, r0:r1])
    # (scale*Q)^T and dy^T as dense [D, r]: the dK/dV GEMMs then run on oneDNN (add_mm_nt_ with P and dS
    # transposed views), where a transposed left operand would fall back to MKL, 2-3x slower on AMD
    qs_t, dot_t = mm.transposed("qt", qs), mm.transposed("dyt", dot)
    m, neg_log2_l, dq = bb.m[h, r0:r1], bb.neg_log2_l[h, r0:r1], bb.dq[h, r0:r1]
    for c0, c1, band in blocks:
        tcols = slice(c0 - u0, c1 - u0)
        edge = p.mask.tile_band(bb.b, r0, r1, c0, c1) if band and in_pass else None
        cap_grad = buf.get("cap", r1 - r0, c1 - c0) if p.softcap else None
        prob, t = head_scores(p, bb.b, job.n2, h, r0, r1, c0, c1, qs, job.keys, () if in_pass else band, buf,
                              job.extras, cap_grad)
        drop = None if t is None else t.dropout_scale(buf.get("drop", 1, r1 - r0, c1 - c0))
        drop = None if drop is None else drop[0]
        masked = tiling.masked_entries(p, bb.b, h, r0, r1, c0, c1, band, k.device) if nonfinite else None
        # the fused passes also write P and dS rounded for bf16 products where the tile as computed is the operand
        # (None with the fp32 products: the operands are the tiles)
        plain = fused and drop is None and masked is None
        p_op = mm.rounded_tile("p", r1 - r0, c1 - c0) if plain else None
        if fused:
            probabilities_(prob, m, neg_log2_l, p_op, edge)
        else:
            prob.sub_(m)  # natural units first: exact where s ~ max
            torch.add(neg_log2_l, prob, alpha=LOG2E, out=prob).exp2_()
        if masked is not None:
            prob.masked_fill_(masked, 0.0)
        p_v = prob if drop is None else prob * drop
        if p_op is None:
            p_op = mm.operand("p", p_v if p.rounding is None else p.rounding.grid(p_v))
        mm.add_nn_(tv[:, tcols], dot_t, p_op)
        vc = v[c0:c1]
        plain = plain and peaked is None and t is None and cap_grad is None
        # bf16 products: dS of a plain tile straight from the dP GEMM's registers, as the path below rounds it (no
        # fp32 dP and dS tiles)
        ds_op = mm.grad_operand("ds", dot, vc, prob, delta, bb.unit_rows) if plain else None
        dp = ds = None
        if ds_op is None:
            dp = mm.nt(dot, vc, out=buf.get("dp", r1 - r0, c1 - c0))
            ds_op = mm.rounded_tile("ds", r1 - r0, c1 - c0) if plain else None
            if fused and drop is None and peaked is None:
                grad_(prob, dp, delta, bb.unit_rows, ds_op)  # dS = P (dP - D), in place of P (0 where P == 1)
                ds = prob
            else:
                if drop is not None:
                    dp.mul_(drop)
                dp.sub_(delta)
                if peaked:
                    _exact_dp_minus_d(dp, peaked, r0, r1, dot, vc, bb.delta64[h], drop)
                if bb.unit_rows:  # P == 1: the row's only key, D = dP exactly and dS = 0 (autograd's)
                    dp.masked_fill_(prob == 1.0, 0.0)
                ds = prob.mul_(dp)
        if masked is not None:
            ds.masked_fill_(masked, 0.0)
        if t is not None:
            t.add_pse_grad(ds.unsqueeze(0), job.dpse)  # the pse is added after the softcap
        if cap_grad is not None:
            ds.mul_(cap_grad)
        if ds_op is None:  # (the NPU rounds dS)
            ds_op = mm.operand("ds", ds if p.rounding is None else p.rounding.grid(ds))
        mm.add_nn_(dq, ds_op, k[c0:c1], alpha=p.scale)  # dq starts zeroed
        mm.add_nn_(tk[:, tcols], qs_t, ds_op, alpha=mm.alpha)
        del prob, dp, ds, ds_op, p_v, p_op, t, cap_grad  # freed before the next tile allocates


def _store_or_add(p: FAProblem, target: torch.Tensor, sums_t: torch.Tensor, v0: int, v1: int, sole: bool) -> None:
    """A job's dK (or dV) sums ``sums_t`` (``[D, v1 - v0]``, transposed) into rows ``v0:v1`` of ``target``
    (``[Skv, D]``): added, or, where the job is the rows' ``sole`` writer, stored in the target's dtype (the
    output's rounding; rows no query sees become 0), so that no accumulator is zeroed, added to and copied out."""
    rows = sums_t.transpose(0, 1).contiguous()  # a blocked transpose, then a contiguous add or copy
    if not sole:
        target[v0:v1] += rows
        return
    store(None if target.dtype == rows.dtype else p.rounding, target[v0:v1], rows)
    target[:v0].zero_()
    target[v1:].zero_()


def _exact_dp_minus_d(dp, rows64: list[int], r0: int, r1: int, dy_rows, v_cols, delta64, drop) -> None:
    """Overwrite the rows of tile ``dp`` (= dP - D, fp32) listed in ``rows64`` (batch row numbers, sorted) that fall
    in ``[r0, r1)`` with ``dP - D`` computed in fp64 (rounded once, to fp32)."""
    lo, hi = bisect.bisect_left(rows64, r0), bisect.bisect_left(rows64, r1)
    if lo == hi:
        return
    if hi - lo == r1 - r0:  # every row of the tile
        sel, loc = slice(0, r1 - r0), None
    else:
        loc = torch.tensor(rows64[lo:hi], dtype=torch.long, device=dp.device) - r0
        sel = loc
    d64 = torch.mm(dy_rows[sel].to(torch.float64), v_cols.to(torch.float64).transpose(0, 1))
    if drop is not None:
        d64.mul_(drop[sel])
    d64.sub_(delta64[r0:r1][sel])
    if loc is None:
        dp.copy_(d64)
    else:
        dp.index_copy_(0, loc, d64.to(dp.dtype))
