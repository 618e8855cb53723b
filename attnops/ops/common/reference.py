"""Pure-PyTorch FlashAttention forward and backward (the production CPU path).

Works one batch and one chunk of query rows at a time, in the compute dtype (fp32; fp64 for fp64 inputs), and
only over the KV columns the mask band can keep, so extra memory is O(chunk * Skv) per worker and masked tiles
cost nothing, plus dense heads-first copies of the operands (:mod:`.reference_tiles`; none for K/V already in BNSD).
A tile is one query head x a row chunk x a column block: 2-D GEMMs (:mod:`.tile_products`: oneDNN's fp32 GEMM where
PyTorch has it, or the bf16 GEMM for bf16 inputs on CPUs with AVX512-BF16), GQA heads reading their KV head in
place. Jobs run side by side on single-threaded workers
(:mod:`attnops._core.parallel`): (batch, query head, row chunks) forward, (batch, KV head, chunk groups) backward,
split until there are ``MIN_JOBS``; every output element and every dK/dV partial has one writer, partials are
added in a fixed order, so results do not depend on the thread count. Exponentials use
``exp2((s - max) * log2(e))`` because ``exp2`` is several times faster than ``exp`` on the CPU; the row max is
subtracted first (exactly, in natural units) so the backward rebuilds P from the stored fp32 statistics without
cancellation error. Tiles live in per-thread workspaces kept between calls (oneDNN's products are fresh tensors,
recycled by the allocator). The backward uses the softmax statistics and attention output it is given; it never
recomputes them. See ``docs/performance.md`` for the measurements behind the tiles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..._core.layouts import batch_tokens, tokens_view, with_head_dim
from ..._core.memory import work_memory
from ..._core.parallel import fill_, run_jobs
from ..._core.softmax_stats import FLT_LOWEST, FLT_MAX, STAT_LANES, stats_block, stats_dtype, stats_shape
from ..._core.workspace import Buffers
from . import reference_tiles as tiling
from .fused_softmax import fused_softmax, softmax_block_
from .problem import FAProblem
from .reference_tiles import (LOG2E, Workspace, active_batches, compute_dtype, deal, forward_blocks, has_tile_extras,
                              head_scores, heads_first, row_chunks, stage_kv, tiles)
from .tile_products import operand_dtype, tile_products


@dataclass
class _ForwardBatch:
    """One batch's operands, heads first, and views of its outputs."""

    b: int
    q: torch.Tensor  # [N1, Sq, D] (a view of the input)
    k: torch.Tensor  # [N2, Skv, D]
    v: torch.Tensor  # [N2, Skv, Dv]
    out: torch.Tensor  # [N1, Sq, Dv] (a view of the output)
    m: torch.Tensor  # [N1, Sq, 1] row max
    l: torch.Tensor  # [N1, Sq, 1] row sum
    smax: torch.Tensor  # [N1, Sq, 8] (views of the statistics)
    ssum: torch.Tensor
    chunks: list  # (r0, r1, column blocks [(c0, c1, band)])


def forward(p: FAProblem, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """Returns ``(attention_out, softmax_max, softmax_sum)`` in the problem's layouts.

    Jobs of (batch, query head, row chunks) run side by side on single-threaded workers
    (:mod:`attnops._core.parallel`); with fewer than ``MIN_JOBS`` heads a head's chunks are dealt round-robin to
    several jobs. A job walks its row chunks and writes their output rows and statistics; a chunk's band is split
    in column blocks of at most ``FWD_COL_BLOCK``. Per block: ``S = (scale*Q) K^T``, masked entries -inf, and the
    online softmax: running max ``m``, ``P = exp2((S - m) * log2(e))`` (the max subtracted in natural units first,
    exactly, as the backward does), ``l <- l * exp(m_old - m) + rowsum(P)``, ``O <- O * exp(m_old - m) + P V``;
    ``O / l`` at the end. With one block per chunk that is the plain softmax.
    """
    g = p.geom
    acc = compute_dtype(query.dtype)
    out_shape, stats = with_head_dim(query.shape, g.layout, g.n1, g.dv), stats_shape(p.seq, g.n1, p.total_q)
    with work_memory("query", query, query.device, {"attention_out": (out_shape, query.dtype),
                                                    "softmax_max": (stats, stats_dtype(query.dtype)),
                                                    "softmax_sum": (stats, stats_dtype(query.dtype))}):
        out = torch.empty(out_shape, dtype=query.dtype, device=query.device)
        smax, ssum = (torch.empty(stats, dtype=stats_dtype(query.dtype), device=query.device) for _ in range(2))
    active = active_batches(p)
    chunks = {b: [(r0, r1, forward_blocks(p, b, r0, r1, c0, c1, band))
                  for r0, r1, c0, c1, band in row_chunks(p, b, tiling.TILE_BYTES // acc.itemsize, tiling.MAX_ROWS,
                                                         tiling.FWD_COL_BLOCK)]
              for b in active}
    qv, kv, vv, ov = (tokens_view(t, g.layout, n) for t, n in ((query, g.n1), (key, g.n2), (value, g.n2), (out, g.n1)))
    operands = operand_dtype(query.dtype, query.device)
    k_all, v_all = stage_kv(p, Buffers.acquire(operands, query.device), active, query.device, kv, vv)
    batches = [_ForwardBatch(b, batch_tokens(qv, p.seq, b).transpose(0, 1), k_all[i], v_all[i],
                             batch_tokens(ov, p.seq, b).transpose(0, 1),
                             *(torch.empty((g.n1, p.seq.q_lens[b], 1), dtype=acc, device=query.device)
                               for _ in range(2)),
                             *(stats_block(t, p.seq, b, p.softmax_layout) for t in (smax, ssum)), chunks[b])
               for i, b in enumerate(active)]
    if sum(r1 - r0 for b in active for r0, r1, _ in chunks[b]) < p.total_q:  # rows no job writes: 0 and invalid
        fill_([(out, 0.0), (smax, FLT_LOWEST), (ssum, FLT_MAX)] + [(fb.m, FLT_LOWEST) for fb in batches]
              + [(fb.l, 0.0) for fb in batches], query.device)
    jobs = [(fb, h, part) for fb in batches for h in range(g.n1) for part in deal(fb.chunks, len(batches) * g.n1)]
    run_jobs(lambda job: _forward_rows(p, *job, acc), jobs, query.device)
    Buffers.acquire(operands, query.device).release()
    return out, smax, ssum


def _write_stats(fb: _ForwardBatch, h: int, chunks: list) -> None:
    """Head ``h``'s row max and sum of the rows of ``chunks`` into the statistics (sum FLT_MAX on rows without a
    kept score); consecutive chunks are written together."""
    runs = []
    for r0, r1, _ in chunks:
        if runs and runs[-1][1] == r0:
            runs[-1][1] = r1
        else:
            runs.append([r0, r1])
    for r0, r1 in runs:
        l = fb.l[h, r0:r1]
        fb.smax[h, r0:r1].copy_(fb.m[h, r0:r1].expand(-1, STAT_LANES))
        fb.ssum[h, r0:r1].copy_(l.masked_fill_(l == 0, FLT_MAX).expand(-1, STAT_LANES))


def _forward_rows(p: FAProblem, fb: _ForwardBatch, h: int, chunks: list, acc: torch.dtype) -> None:
    """The forward of the row ``chunks`` of query head ``h`` of batch ``fb`` (see :func:`forward`), in this thread's
    workspace, with the products of the staged keys' dtype (:mod:`.tile_products`). Lean on tensor calls (each
    contends for the GIL with the other workers): views of the head are taken once, and a
    :class:`~.reference_tiles.Tile` is built only for a pse, dropout or explicit mask (:func:`head_scores`)."""
    buf = Buffers.acquire(acc, fb.out.device)
    mm = tile_products(p, fb.k.dtype, buf)
    n2 = h // p.geom.group
    q, v, out, m_h, l_h = fb.q[h], fb.v[n2], fb.out[h], fb.m[h], fb.l[h]
    extras = has_tile_extras(p)
    half = p.rounding is not None and p.rounding.half_softmax  # PFA fp16 high performance: fp16 scores, softmax
    fused = p.rounding is None and fused_softmax(acc, out.device)
    in_pass = fused and not extras  # the fused softmax pass masks the band (MaskSpec.tile_band), not fill_masked_
    calls = mm.forward_tiles(q, fb.k[n2], v, m_h, l_h) if in_pass and not p.softcap else None
    if calls is not None:  # every block in one call (bf16 products)
        _forward_in_one_call(p, fb, h, chunks, calls, buf)
    by_tile = chunks if calls is None else []  # the chunks made product by product
    keys = mm.keys(fb.k[n2], [(c0, c1) for _, _, blocks in by_tile for c0, c1, _ in blocks])
    for r0, r1, blocks in by_tile:
        m, l = m_h[r0:r1], l_h[r0:r1]
        qs = mm.rows("q", q[r0:r1], mm.q_scale)
        kept = not extras and p.mask.keeps_every_row(fb.b, r0, r1, blocks[0][0], blocks[0][1])  # l >= 1
        o = buf.get("o", r1 - r0, v.shape[1])
        for j, (c0, c1, band) in enumerate(blocks):
            edge = p.mask.tile_band(fb.b, r0, r1, c0, c1) if band and in_pass else None
            rescale = None if j == 0 else buf.get("rescale", r1 - r0, 1)
            s, t = head_scores(p, fb.b, n2, h, r0, r1, c0, c1, qs, keys, () if in_pass else band, buf, extras)
            if half:
                p.rounding.grid_(s)
            p16 = mm.rounded_tile("p", r1 - r0, c1 - c0) if fused and p.dropout is None else None
            if fused:
                softmax_block_(s, m, l, rescale, clamp=not kept, out16=p16, band=edge)
            else:
                rescale = _online_softmax_(s, m, l, first=j == 0, kept=kept)
            if half:  # the softmax's running sum and rescaling factor in fp16
                p.rounding.grid_(l)
                if rescale is not None:
                    p.rounding.grid_(rescale)
            drop = None if t is None else t.dropout_scale(buf.get("drop", 1, r1 - r0, c1 - c0))
            if drop is not None:
                s.mul_(drop[0])
            if p.rounding is not None:  # the NPU casts P to the input dtype for the P V product (l: unrounded)
                p.rounding.grid_(s)
            s_op = mm.operand("p", s) if p16 is None else p16
            if j == 0:
                o = mm.nn(s_op, v[c0:c1], out=o)
            else:
                o.mul_(rescale).add_(mm.nn(s_op, v[c0:c1], out=buf.get("pv", r1 - r0, v.shape[1])))
            del s, s_op, p16, t  # freed before the next tile's GEMM allocates its scores: they reuse this memory
        if not kept:
            _nan_rows_without_kept_score_(p, fb.b, h, r0, r1, blocks, m, l)
        l = l if kept else l.clamp_min(1.0)  # l >= 1 on rows with a kept score, else 0 (or NaN)
        if p.rounding is None:
            torch.div(o, l, out=out[r0:r1])
        else:
            p.rounding.store(out[r0:r1], o.div_(l))
    _write_stats(fb, h, chunks)
    buf.release()
    mm.release()


def _forward_in_one_call(p: FAProblem, fb: _ForwardBatch, h: int, chunks: list, calls, buf: Buffers) -> None:
    """The forward of the row ``chunks`` of query head ``h`` with all their blocks in one call (``calls``:
    ``mm.forward_tiles``), each as the engine's separate calls make it: the outputs go to workspace ``"o"`` (the
    chunks' rows one after the other), then are divided by the row sums into the output, one division per run of
    consecutive chunks whose rows all keep a score of their first block (the others as :func:`_forward_rows` does)."""
    out, m_h, l_h = fb.out[h], fb.m[h], fb.l[h]
    o = buf.get("o", sum(r1 - r0 for r0, r1, _ in chunks), out.shape[1])
    at, runs = 0, []
    for r0, r1, blocks in chunks:
        kept = p.mask.keeps_every_row(fb.b, r0, r1, blocks[0][0], blocks[0][1])  # l >= 1
        for j, (c0, c1, band) in enumerate(blocks):
            calls.add(r0, r1, c0, c1, p.mask.tile_band(fb.b, r0, r1, c0, c1) if band else None, j == 0, not kept, at)
        if kept and runs and runs[-1][2] and runs[-1][1] == r0:
            runs[-1][1] = r1
        else:
            runs.append([r0, r1, kept, at, blocks])
        at += r1 - r0
    calls.run(o)
    for r0, r1, kept, at, blocks in runs:
        l = l_h[r0:r1]
        if not kept:
            _nan_rows_without_kept_score_(p, fb.b, h, r0, r1, blocks, m_h[r0:r1], l)
            l = l.clamp_min(1.0)  # l >= 1 on rows with a kept score, else 0 (or NaN)
        torch.div(o[at:at + r1 - r0], l, out=out[r0:r1])


def _nan_rows_without_kept_score_(p: FAProblem, b: int, h: int, r0: int, r1: int, blocks: list, m: torch.Tensor,
                                  l: torch.Tensor) -> None:
    """Rows that see keys but whose every visible score is -inf (``l == 0``, non-finite inputs) get the formula's
    ``0 / 0``: max -inf and sum NaN (so output NaN); rows that see no key stay fully masked. Only chunks with such
    an ``l == 0`` row pay for the mask lookup."""
    empty = l == 0
    if not bool(empty.any()):
        return
    sees = torch.zeros_like(empty)
    for c0, c1, band in blocks:
        sees |= ~tiling.masked_entries(p, b, h, r0, r1, c0, c1, band, l.device).all(-1, keepdim=True)
    nan_rows = empty & sees
    m.masked_fill_(nan_rows, -math.inf)
    l.masked_fill_(nan_rows, math.nan)


def _online_softmax_(s: torch.Tensor, m: torch.Tensor, l: torch.Tensor, first: bool, kept: bool = False
                     ) -> torch.Tensor | None:
    """One column block of the online softmax, in place: ``s`` ([r, c] scores) becomes ``exp2((s - m) * log2 e)``
    with ``m`` ([r, 1]) the running row max and ``l`` the running row sum. Returns the factor ``exp(m_old - m)``
    the output accumulated so far must be scaled by (None for the ``first`` block). ``kept``: every row keeps a
    score of the first block (its max is finite)."""
    if first:
        torch.amax(s, -1, keepdim=True, out=m)
        if not kept:
            m.clamp_min_(FLT_LOWEST)  # -inf (no kept score yet): lowest
        s.sub_(m).mul_(LOG2E).exp2_()
        torch.sum(s, -1, keepdim=True, out=l)
        return None
    m_new = torch.maximum(m, s.amax(-1, keepdim=True))
    rescale = (m - m_new).mul_(LOG2E).exp2_()  # 1 where the max did not move; 0 from FLT_LOWEST
    m.copy_(m_new)
    s.sub_(m).mul_(LOG2E).exp2_()
    l.mul_(rescale).add_(s.sum(-1, keepdim=True))
    return rescale


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
    qs = heads_first(batch_tokens(tokens_view(query, g.layout, g.n1), p.seq, b), p.scale)
    k = heads_first(batch_tokens(tokens_view(key, g.layout, g.n2), p.seq, b, kv=True))
    m, log2_l = _row_stats(softmax_max, softmax_sum, p.seq, b, p.softmax_layout, acc)
    ws = Workspace(g.group, p.seq.max_kv, 1, acc)
    for t in tiles(p, b, ws.rows):
        rows = (t.heads, slice(t.r0, t.r1))
        yield t, _probabilities_(t.scores(qs[rows], k[t.n2, t.c0:t.c1], ws.tile(0, t.shape)), m[rows], log2_l[rows])

