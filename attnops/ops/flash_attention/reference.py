"""Pure-PyTorch FlashAttention forward and backward (the production CPU path).

Works one batch and one chunk of query rows at a time, in the compute dtype (fp32; fp64 for fp64 inputs), and
only over the KV columns the mask band can keep, so extra memory is O(chunk * Skv) per worker and masked tiles
cost nothing, plus dense heads-first copies of the operands (:func:`_stage_heads`; none for K/V already in BNSD).
A tile is one query head x a row chunk x a column block: 2-D GEMMs (:mod:`attnops._core.gemm`: oneDNN where
PyTorch has it), GQA heads reading their KV head in place. Jobs run side by side on single-threaded workers
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

import bisect
import collections
import math
from dataclasses import dataclass

import torch

from ..._core.gemm import add_mm_nt_, mm_nt, pack_nt
from ..._core.layouts import batch_tokens, tokens_view, with_head_dim
from ..._core.memory import work_memory
from ..._core.npu_rounding import store
from ..._core.parallel import fill_, run_jobs
from ..._core.workspace import Buffers
from ..._core.softmax_stats import FLT_LOWEST, FLT_MAX, STAT_LANES, stats_block, stats_dtype, stats_shape
from .problem import FAProblem

LOG2E = math.log2(math.e)
TILE_BYTES = 8 << 20  # fp32 score tile budget: big enough for efficient GEMMs, small enough for the L3 cache
MIN_ROWS = 16
COL_BLOCK = 1024  # columns per backward tile (the statistics are given: rows need not be whole)
FWD_COL_BLOCK = 4096  # columns per forward tile; wider bands use the online softmax across blocks
MIN_JOBS = 8  # work is split into at least this many jobs where it can be (a constant: results must not depend on
# the thread count, see attnops/_core/parallel.py)
MAX_ROWS = 512  # rows per tile (GEMM M, and the inner dimension of the backward's dK/dV GEMMs)
EDGE_ROWS = 256  # rows per tile where the band's edge crosses the chunk: such tiles compute rows/2 masked
# columns per row (the causal diagonal: ~6% extra at 4096 tokens)
PEAKED_SUM = 4.0  # rows with softmax_sum below this (max probability > 1/4) form dP - D in fp64


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp16/bf16/fp32 inputs; fp64 inputs (Pythonic API, gradcheck) compute in fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _heads_first(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """[S, N, D] (any dtype, any strides) -> a new contiguous [N, S, D] in the compute dtype, times ``scale``."""
    out = torch.empty((x.shape[1], x.shape[0], x.shape[2]), dtype=compute_dtype(x.dtype), device=x.device)
    out.copy_(x.transpose(0, 1))
    return out.mul_(scale) if scale != 1.0 else out


def _heads_view(x: torch.Tensor) -> torch.Tensor:
    """[S, N, D] -> [N, S, D]: a strided view when ``x`` is already in the compute dtype (GEMMs take the row stride
    as their leading dimension; no copy, no fresh pages), else a converted contiguous copy."""
    return x.transpose(0, 1) if x.dtype == compute_dtype(x.dtype) else _heads_first(x)


class _Workspace:
    """Reusable fp32 tile buffers of ``G * rows * skv`` elements."""

    def __init__(self, group: int, skv_max: int, count: int, dtype: torch.dtype, rows: int | None = None):
        self.rows = rows or max(MIN_ROWS, TILE_BYTES // (dtype.itemsize * group * max(skv_max, 1)))
        self._bufs = [torch.empty(group * self.rows * max(skv_max, 1), dtype=dtype) for _ in range(count)]

    def tile(self, i: int, shape: tuple[int, int, int]) -> torch.Tensor:
        return self._bufs[i][:shape[0] * shape[1] * shape[2]].view(shape)


class _Tile:
    """One (batch, KV head, row chunk, column range) tile of the score matrix."""

    def __init__(self, p: FAProblem, b: int, n2: int, r0: int, r1: int, c0: int, c1: int,
                 heads: slice | None = None):
        g = p.geom.group
        self.p, self.b, self.n2, self.r0, self.r1, self.c0, self.c1 = p, b, n2, r0, r1, c0, c1
        self.heads = slice(n2 * g, (n2 + 1) * g) if heads is None else heads  # query heads (of KV head n2)
        self.shape = (self.heads.stop - self.heads.start, r1 - r0, c1 - c0)

    def scores(self, q_rows: torch.Tensor, k_cols: torch.Tensor, out: torch.Tensor, band=None,
               k_packed: torch.Tensor | None = None) -> torch.Tensor:
        """``scale*QK^T + pse`` (pse_type 1: ``scale*(QK^T + pse)``) with masked entries at -inf.

        ``q_rows`` is the tile's query rows times ``scale`` ([G, r, D]); ``k_cols`` the tile's keys ([c, D], of its
        KV head); ``out`` ([G, r, c]) is a workspace the result may live in. ``band``: the tile's
        :meth:`MaskSpec.band_bounds` when the caller has them (shared by the heads of a chunk). ``k_packed``: the
        keys' :func:`pack_nt`, if any.
        """
        if out.shape[0] == 1:  # one head: a plain 2-D GEMM
            s = mm_nt(q_rows[0], k_cols, out=out[0], packed=k_packed).unsqueeze(0)
        else:
            s = torch.matmul(q_rows, k_cols.transpose(0, 1), out=out)
        return self.shift_and_mask_(softcap_(self.p, s), band)

    def shift_and_mask_(self, s: torch.Tensor, band=None) -> torch.Tensor:
        """In place on the tile's ``scale*QK^T`` scores ``s``: add the pse, set masked entries to -inf."""
        p = self.p
        if p.pse is not None:
            pse = p.pse.block(self.b, self.r0, self.r1, self.c0, self.c1, self.heads, s.dtype)
            s.add_(pse, alpha=p.scale if p.pse.add_before_scale else 1.0)
        return p.mask.fill_masked_(s, self.b, self.r0, self.r1, self.c0, self.c1, self.heads, band)

    def dropout_scale(self, out: torch.Tensor) -> torch.Tensor | None:
        """``keep / keep_prob`` in ``out`` ([G, r, c], in the compute dtype), or None without dropout. Entries the
        band masks are 0 (their probabilities are 0 anyway): their bits are not drawn."""
        d = self.p.dropout
        if d is None:
            return None
        p, b = self.p, self.b
        skv = p.seq.kv_lens[b]
        return d.scale_block_(out, b, self.heads, p.seq.q_lens[b], skv, self.r0, self.r1, self.c0, self.c1,
                              col_range=lambda ra, rb: p.mask.col_range(b, ra, rb, skv))

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


def _has_tile_extras(p: FAProblem) -> bool:
    """Whether tiles need a :class:`_Tile` (a pse, dropout or an explicit mask) beyond the band's masking."""
    return p.pse is not None or p.dropout is not None or p.mask.has_explicit


def softcap_(p: FAProblem, s: torch.Tensor, cap_grad: torch.Tensor | None = None) -> torch.Tensor:
    """In place on scaled scores ``s``: ``softcap * tanh(s / softcap)`` when ``p.softcap`` > 0 (else ``s`` as it
    is); ``cap_grad`` (``s``'s shape) receives the derivative ``1 - tanh^2`` for the backward."""
    if p.softcap == 0:
        return s
    s.div_(p.softcap).tanh_()
    if cap_grad is not None:
        torch.mul(s, s, out=cap_grad).neg_().add_(1.0)
    return s.mul_(p.softcap)


def _head_scores(p: FAProblem, b: int, n2: int, h: int, r0: int, r1: int, c0: int, c1: int, qs: torch.Tensor,
                 keys: "_Keys", band, buf: "Buffers", extras: bool, cap_grad: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, "_Tile | None"]:
    """Query head ``h``'s masked scores ``[r1 - r0, c1 - c0]`` (``qs``: its rows times the scale; ``keys``: those
    of KV head ``n2``) in workspace ``"s"``, and the :class:`_Tile` when ``extras`` (for its pse, dropout and pse
    gradient). Without extras no tile object is built: every tensor call of a worker contends for the GIL.
    ``cap_grad``: see :func:`softcap_`."""
    k_cols, k_packed = keys.block(c0, c1, r1 - r0)
    s = softcap_(p, mm_nt(qs, k_cols, out=buf.get("s", r1 - r0, c1 - c0), packed=k_packed), cap_grad)
    if not extras:
        return p.mask.fill_masked_(s, b, r0, r1, c0, c1, None, band), None
    t = _Tile(p, b, n2, r0, r1, c0, c1, heads=slice(h, h + 1))
    return t.shift_and_mask_(s.unsqueeze(0), band)[0], t


class _Keys:
    """One job's view of a KV head's keys (``[Skv, D]``) by column block: of the ``blocks`` the job will read, those
    read more than once are re-blocked for oneDNN on their first use (:func:`pack_nt`) and kept for the job."""

    def __init__(self, k: torch.Tensor, blocks):
        self.k, self._uses, self._packed = k, collections.Counter(blocks), {}

    def block(self, c0: int, c1: int, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Keys ``c0:c1`` and their packed form when the job uses them again (else None)."""
        cols = self.k[c0:c1]
        if self._uses[c0, c1] < 2:
            return cols, None
        if (c0, c1) not in self._packed:
            self._packed[c0, c1] = pack_nt(cols, rows)
        return cols, self._packed[c0, c1]


def _active_batches(p: FAProblem):
    return [b for b in range(p.seq.batch) if p.seq.q_lens[b] > 0 and p.seq.kv_lens[b] > 0]


def _row_chunks(p: FAProblem, b: int, budget: int, max_rows: int, cols_cap: int | None = None
                ) -> list[tuple[int, int, int, int, list | None]]:
    """Row chunks ``(r0, r1, c0, c1, band)`` of batch ``b`` with a non-empty band ``[c0, c1)``.

    Each chunk has as many rows as fit ``budget`` score elements (``rows * (c1 - c0)``), at most ``max_rows`` and at
    least ``MIN_ROWS``: GEMMs get tall tiles where the band is narrow (early causal rows) and the tile stays
    cache-sized where it is wide. ``band`` is the chunk's :meth:`MaskSpec.band_bounds` (once for all heads).
    ``cols_cap``: the tiles of a chunk will be at most this wide (column blocks), so only that width counts.
    """
    sq, skv = p.seq.q_lens[b], p.seq.kv_lens[b]
    out = []
    r0 = 0
    while r0 < sq:
        rows = max_rows
        while rows > MIN_ROWS:
            c0, c1 = p.mask.col_range(b, r0, min(sq, r0 + rows), skv)
            if (rows * max(0, min(c1 - c0, cols_cap or c1 - c0)) <= budget
                    and (rows <= EDGE_ROWS or not p.mask.edge_spans(b, r0, min(sq, r0 + rows), c0, c1))):
                break
            rows //= 2
        r1 = min(sq, r0 + max(rows, MIN_ROWS))
        c0, c1 = p.mask.col_range(b, r0, r1, skv)
        if c0 < c1:
            out.append((r0, r1, c0, c1, p.mask.band_bounds(b, r0, r1, c0, c1)))
        r0 = r1
    return out


def _col_blocks(p: FAProblem, b: int, r0: int, r1: int, c0: int, c1: int, band, width: int
                ) -> list[tuple[int, int, list | None]]:
    """Split a row chunk's band ``[c0, c1)`` into equal column blocks of at most ``width`` (with their band parts)."""
    if c1 - c0 <= width:
        return [(c0, c1, band)]
    n = -(-(c1 - c0) // width)
    width = -(-(c1 - c0) // n)
    return [(a, min(c1, a + width), p.mask.band_bounds(b, r0, r1, a, min(c1, a + width)))
            for a in range(c0, c1, width)]


def _forward_blocks(p: FAProblem, b: int, r0: int, r1: int, c0: int, c1: int, band
                    ) -> list[tuple[int, int, list | None]]:
    """The forward's column blocks of a row chunk: at most ``FWD_COL_BLOCK`` wide, or, under an NPU rounding, the
    kernel's key blocks (``key_block`` keys aligned to key 0: where the running max P is rounded against moves)."""
    if p.rounding is None:
        return _col_blocks(p, b, r0, r1, c0, c1, band, FWD_COL_BLOCK)
    w = p.rounding.key_block
    edges = [c0, *range((c0 // w + 1) * w, c1, w), c1]
    return [(a, e, p.mask.band_bounds(b, r0, r1, a, e)) for a, e in zip(edges, edges[1:])]


def _carve(flat: torch.Tensor, shapes) -> list[torch.Tensor]:
    """Consecutive views of ``flat`` with the given shapes."""
    views, at = [], 0
    for shape in shapes:
        n = math.prod(shape)
        views.append(flat[at:at + n].view(shape))
        at += n
    return views


def _stage_heads(buf: "Buffers", name: str, xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
    """GEMM operands of each batch: ``xs`` ([S, N, D] per batch, any dtype and strides) as dense heads-first
    ``[N, S, D]`` in the compute dtype; returns them and the copies still to make (one per head). A tensor already
    dense heads-first and in the compute dtype is used in place (the BNSD layout)."""
    staged, pending, todo = [], [], []
    for x in xs:
        view = x.transpose(0, 1)
        if view.stride(-1) == 1 and view.stride(-2) == x.shape[2] and x.dtype == buf.dtype:
            staged.append(view)
        else:
            staged.append(None)
            todo.append((len(staged) - 1, x))
    flat = buf.get(name, sum(x.numel() for _, x in todo))
    for (i, x), out in zip(todo, _carve(flat, [(x.shape[1], x.shape[0], x.shape[2]) for _, x in todo])):
        staged[i] = out
        pending += [(out[h], x[:, h]) for h in range(x.shape[1])]
    return staged, pending


def _stage_kv(p: FAProblem, buf: "Buffers", active: list[int], device, kv, vv) -> list[list[torch.Tensor]]:
    """The active batches' key and value, staged by :func:`_stage_heads`; the copies run one job per head on the
    workers. Every tile reads them, and a strided operand would cost its GEMMs 5-10%: rows 4 KiB apart (BSND with
    N*D = 1024) share a few cache sets. (Query and ``dy`` rows are read by one chunk each: :func:`_stage_rows`.)"""
    staged, copies = [], []
    for name, x in (("k", kv), ("v", vv)):
        heads, pending = _stage_heads(buf, name, [batch_tokens(x, p.seq, b, kv=True) for b in active])
        staged.append(heads)
        copies += pending
    run_jobs(lambda item: item[0].copy_(item[1]), copies, device)
    return staged


def _stage_rows(buf: "Buffers", name: str, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """One head's rows ``x`` ([r, D], any dtype and strides) times ``scale`` as a dense ``[r, D]`` in the compute
    dtype, in this thread's workspace ``name``: staged by the job that reads them, while they are in the caches
    (rows already dense, in the compute dtype and unscaled are used in place)."""
    if x.dtype == buf.dtype and scale == 1.0 and x.stride(-1) == 1 and (x.shape[0] == 1 or x.stride(0) == x.shape[1]):
        return x
    out = buf.get(name, *x.shape)
    if x.dtype == buf.dtype:
        return torch.mul(x, scale, out=out)  # one rounding, as copying then scaling
    out.copy_(x)
    return out.mul_(scale) if scale != 1.0 else out


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
    active = _active_batches(p)
    chunks = {b: [(r0, r1, _forward_blocks(p, b, r0, r1, c0, c1, band))
                  for r0, r1, c0, c1, band in _row_chunks(p, b, TILE_BYTES // acc.itemsize, MAX_ROWS, FWD_COL_BLOCK)]
              for b in active}
    qv, kv, vv, ov = (tokens_view(t, g.layout, n) for t, n in ((query, g.n1), (key, g.n2), (value, g.n2), (out, g.n1)))
    k_all, v_all = _stage_kv(p, Buffers.acquire(acc, query.device), active, query.device, kv, vv)
    batches = [_ForwardBatch(b, batch_tokens(qv, p.seq, b).transpose(0, 1), k_all[i], v_all[i],
                             batch_tokens(ov, p.seq, b).transpose(0, 1),
                             *(torch.empty((g.n1, p.seq.q_lens[b], 1), dtype=acc, device=query.device)
                               for _ in range(2)),
                             *(stats_block(t, p.seq, b, p.softmax_layout) for t in (smax, ssum)), chunks[b])
               for i, b in enumerate(active)]
    if sum(r1 - r0 for b in active for r0, r1, _ in chunks[b]) < p.total_q:  # rows no job writes: 0 and invalid
        fill_([(out, 0.0), (smax, FLT_LOWEST), (ssum, FLT_MAX)] + [(fb.m, FLT_LOWEST) for fb in batches]
              + [(fb.l, 0.0) for fb in batches], query.device)
    jobs = [(fb, h, part) for fb in batches for h in range(g.n1) for part in _deal(fb.chunks, len(batches) * g.n1)]
    run_jobs(lambda job: _forward_rows(p, *job, acc), jobs, query.device)
    Buffers.acquire(acc, query.device).release()
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
    workspace. Lean on tensor calls (each contends for the GIL with the other workers): views of the head are taken
    once, and a :class:`_Tile` is built only for a pse, dropout or explicit mask (:func:`_head_scores`)."""
    buf = Buffers.acquire(acc, fb.out.device)
    n2 = h // p.geom.group
    q, vt, out, m_h, l_h = fb.q[h], fb.v[n2].t(), fb.out[h], fb.m[h], fb.l[h]
    keys = _Keys(fb.k[n2], [(c0, c1) for _, _, blocks in chunks for c0, c1, _ in blocks])
    extras = _has_tile_extras(p)
    half = p.rounding is not None and p.rounding.half_softmax  # PFA fp16 high performance: fp16 scores, softmax
    for r0, r1, blocks in chunks:
        m, l = m_h[r0:r1], l_h[r0:r1]
        qs = _stage_rows(buf, "q", q[r0:r1], p.scale)
        kept = not extras and p.mask.keeps_every_row(fb.b, r0, r1, blocks[0][0], blocks[0][1])  # l >= 1
        for j, (c0, c1, band) in enumerate(blocks):
            s, t = _head_scores(p, fb.b, n2, h, r0, r1, c0, c1, qs, keys, band, buf, extras)
            if half:
                p.rounding.grid_(s)
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
            if j == 0:
                o = mm_nt(s, vt[:, c0:c1], out=buf.get("o", r1 - r0, vt.shape[0]))
            else:
                o.mul_(rescale).add_(mm_nt(s, vt[:, c0:c1], out=buf.get("pv", r1 - r0, vt.shape[0])))
            del s, t  # freed before the next tile's GEMM allocates its scores: they reuse this memory, still cached
        if not kept:
            _nan_rows_without_kept_score_(p, fb.b, h, r0, r1, blocks, m, l)
        l = l if kept else l.clamp_min(1.0)  # l >= 1 on rows with a kept score, else 0 (or NaN)
        if p.rounding is None:
            torch.div(o, l, out=out[r0:r1])
        else:
            p.rounding.store(out[r0:r1], o.div_(l))
    _write_stats(fb, h, chunks)
    buf.release()


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
        sees |= ~_masked_entries(p, b, h, r0, r1, c0, c1, band, l.device).all(-1, keepdim=True)
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
    qs = _heads_first(batch_tokens(tokens_view(query, g.layout, g.n1), p.seq, b), p.scale)
    k = _heads_first(batch_tokens(tokens_view(key, g.layout, g.n2), p.seq, b, kv=True))
    m, log2_l = _row_stats(softmax_max, softmax_sum, p.seq, b, p.softmax_layout, acc)
    ws = _Workspace(g.group, p.seq.max_kv, 1, acc)
    for t in _tiles(p, b, ws.rows):
        rows = (t.heads, slice(t.r0, t.r1))
        yield t, _probabilities_(t.scores(qs[rows], k[t.n2, t.c0:t.c1], ws.tile(0, t.shape)), m[rows], log2_l[rows])


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
    peaked = (l_b[..., 0] < PEAKED_SUM)
    if not bool(peaked.any()):
        return None
    return [torch.nonzero(row).flatten().tolist() for row in peaked]


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
    o: torch.Tensor  # [N1, Sq, Dv] attention_in
    peaked: list[list[int]] | None  # rows whose dP - D is formed in fp64 (per head)
    delta64: torch.Tensor | None  # [N1, Sq, 1] fp64 D of those rows
    dq: torch.Tensor  # [N1, Sq, D]
    dk: torch.Tensor  # [N2, Skv, D]
    dv: torch.Tensor  # [N2, Skv, Dv]
    groups: list  # lists of row chunks (r0, r1, column blocks) whose dK/dV are summed apart


def backward(p: FAProblem, query, key, value, dy, attention_in, softmax_max, softmax_sum):
    """Returns ``(dq, dk, dv, dpse)``; dpse is None unless a pse tensor of type 0/1 was given.

    Jobs of (batch, KV head) pairs run side by side on single-threaded workers (:mod:`attnops._core.parallel`;
    see :func:`_backward_jobs`); every dQ row and every dK/dV partial has one writer and partials are added in a
    fixed order, so the result does not depend on the thread count. Tiles are one
    query head x a row chunk x at most ``COL_BLOCK`` columns of the band. Per tile, from the given statistics:
    ``P = exp2((S - max) * log2(e) - log2(sum))``, ``dV += P^T dy``, ``dS = P * (dy V^T - D)`` with
    ``D = rowsum(dy * attention_in)`` (see :func:`_peaked_rows` for the rows done in fp64), ``dQ += scale * dS K``,
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
    active = _active_batches(p)
    buf = Buffers.acquire(acc, query.device)
    k_all, v_all = _stage_kv(p, buf, active, query.device, kv, vv)
    batches = []
    for i, b in enumerate(active):
        sq, skv = p.seq.q_lens[b], p.seq.kv_lens[b]
        do = batch_tokens(dyv, p.seq, b).transpose(0, 1)
        o = _heads_view(batch_tokens(ov, p.seq, b))
        l_b = stats_block(softmax_sum, p.seq, b, p.softmax_layout)[..., :1].to(acc)
        peaked = _peaked_rows(l_b, acc, query.dtype)
        if direct:
            dq_b = batch_tokens(dqv, p.seq, b).transpose(0, 1)
            dk_b = batch_tokens(dkv, p.seq, b, kv=True).transpose(0, 1)
            dv_b = batch_tokens(dvv, p.seq, b, kv=True).transpose(0, 1)
        else:
            dq_b, dk_b, dv_b = (torch.empty(n, s_, d_, dtype=acc, device=query.device)
                                for n, s_, d_ in ((g.n1, sq, g.d), (g.n2, skv, g.d), (g.n2, skv, g.dv)))
        # tiles of at most COL_BLOCK columns: the backward needs no whole rows (the statistics are given), and
        # smaller tiles keep its two score-sized buffers in the caches
        chunks = [(r0, r1, _col_blocks(p, b, r0, r1, c0, c1, band, COL_BLOCK))
                  for r0, r1, c0, c1, band in _row_chunks(p, b, TILE_BYTES // acc.itemsize, MAX_ROWS, COL_BLOCK)]
        # dK/dV of a group of chunks (all G heads) are summed apart, then added once: fp32 chains of about
        # sqrt(chunks * G) additions instead of chunks * G
        per_group = max(1, math.isqrt(len(chunks) * g.group) // g.group)
        batches.append(_BackwardBatch(
            b, batch_tokens(qv, p.seq, b).transpose(0, 1), do, k_all[i], v_all[i],
            stats_block(softmax_max, p.seq, b, p.softmax_layout)[..., :1].to(acc), l_b.log2().neg_(),
            o, peaked, _peaked_delta(peaked, do, o), dq_b, dk_b, dv_b,
            [chunks[j:j + per_group] for j in range(0, len(chunks), per_group)]))
    jobs, partials = _backward_jobs(batches, g.n2, dpse)
    accumulators = [dq, dk, dv] + [t for bb in batches if not direct for t in (bb.dq, bb.dk, bb.dv)]
    fill_([(t, 0.0) for t in accumulators + [t for _, _, dk_part, dv_part in partials for t in (dk_part, dv_part)]
           + ([] if dpse is None else [dpse])], query.device)
    run_jobs(lambda job: [_backward_kv_head(p, *task, dpse, acc) for task in job], jobs, query.device)
    outputs = (dqv, dkv, dvv)
    run_jobs(lambda job: _backward_finish(p, *job, partials, None if direct else outputs), [
        (bb, n2) for bb in batches for n2 in range(g.n2)], query.device)
    buf.release()
    if dpse is not None:
        dpse = dpse.to(p.pse.tensor.dtype)
    return dq, dk, dv, dpse


def _backward_finish(p: FAProblem, bb: _BackwardBatch, n2: int, partials: list, outputs) -> None:
    """KV head ``n2`` of batch ``bb`` after the tile jobs: its dK/dV partials added in their fixed order (the result
    does not depend on the thread count), and, when the accumulators are not the outputs (``outputs``: the dq, dk,
    dv token views), dK/dV of the head and dQ of its query heads copied out in the output dtype."""
    for pb, h, dk_part, dv_part in partials:
        if pb is bb and h == n2:
            bb.dk[n2] += dk_part
            bb.dv[n2] += dv_part
    if outputs is not None:
        heads = slice(n2 * p.geom.group, (n2 + 1) * p.geom.group)
        dqv, dkv, dvv = outputs
        store(p.rounding, batch_tokens(dqv, p.seq, bb.b)[:, heads], bb.dq[heads].transpose(0, 1))
        store(p.rounding, batch_tokens(dkv, p.seq, bb.b, kv=True)[:, n2], bb.dk[n2])
        store(p.rounding, batch_tokens(dvv, p.seq, bb.b, kv=True)[:, n2], bb.dv[n2])


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


def _deal(items: list, owners: int) -> list[list]:
    """``items`` (one owner's row chunks or chunk groups) dealt round-robin into as many parts as ``owners`` such
    owners need to make ``MIN_JOBS`` jobs (at most one part per item); round-robin spreads causal rows of different
    cost evenly over the parts."""
    parts = min(-(-MIN_JOBS // owners), len(items))
    return [items[i::parts] for i in range(parts)]


def _backward_jobs(batches: list[_BackwardBatch], n2: int, dpse):
    """The backward's jobs (lists of ``(batch, KV head, chunk groups, dK target, dV target)`` tasks) and the dK/dV
    partials to add afterwards as ``(batch, KV head, dK, dV)``.

    One job per (batch, KV head) writes its dK/dV rows in place; a pse gradient shared by the batches (batch dim 1)
    makes one job per KV head walk every batch. With fewer than ``MIN_JOBS`` (batch, KV head) pairs and no pse
    gradient (MQA, few sequences), each pair's chunk groups are dealt round-robin to enough jobs with their own
    dK/dV partials.
    """
    if dpse is None and len(batches) * n2 < MIN_JOBS:
        jobs, partials = [], []
        for bb in batches:
            for h in range(n2):
                for part in _deal(bb.groups, len(batches) * n2):
                    dk, dv = torch.empty_like(bb.dk[h]), torch.empty_like(bb.dv[h])  # zeroed by the caller
                    jobs.append([(bb, h, part, dk, dv)])
                    partials.append((bb, h, dk, dv))
        return jobs, partials
    if dpse is not None and dpse.shape[0] == 1 and len(batches) > 1:
        pairs = [[(bb, h) for bb in batches] for h in range(n2)]
    else:
        pairs = [[(bb, h)] for bb in batches for h in range(n2)]
    return [[(bb, h, bb.groups, bb.dk[h], bb.dv[h]) for bb, h in pair] for pair in pairs], []


def _backward_kv_head(p: FAProblem, bb: _BackwardBatch, n2: int, groups: list, dk: torch.Tensor, dv: torch.Tensor,
                      dpse, acc: torch.dtype) -> None:
    """The backward tiles of ``groups`` (of KV head ``n2`` and its G query heads) of batch ``bb``, in this thread's
    workspace: dQ rows in place, dK/dV summed into ``dk``/``dv`` (``[Skv, D]``/``[Skv, Dv]``). Lean on tensor calls
    like :func:`_forward_rows`."""
    if not groups:  # every row of the batch is masked: nothing to add
        return
    g = p.geom
    buf = Buffers.acquire(acc, bb.k.device)
    k, v = bb.k[n2], bb.v[n2]
    keys = _Keys(k, ())  # never packed: no gain measured here, and every packed shape is one more oneDNN
    # primitive kept in its cache (+1.4 GiB peak in the 32k-token causal backward)
    extras = _has_tile_extras(p)
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
            for h in range(n2 * g.group, (n2 + 1) * g.group):
                qs = _stage_rows(buf, "q", bb.q[h, r0:r1], p.scale)
                dot = _stage_rows(buf, "dy", bb.do[h, r0:r1])
                qs_t, dot_t = qs.t(), dot.t()
                delta = torch.linalg.vecdot(dot, bb.o[h, r0:r1]).unsqueeze_(-1)  # D = rowsum(dy * attention_in)
                m, neg_log2_l, dq = bb.m[h, r0:r1], bb.neg_log2_l[h, r0:r1], bb.dq[h, r0:r1]
                nonfinite = not bool(torch.isfinite(m).all() and torch.isfinite(neg_log2_l).all()
                                     and torch.isfinite(delta).all())  # see _masked_entries
                peaked = None if bb.peaked is None else bb.peaked[h]
                for c0, c1, band in blocks:
                    tcols = slice(c0 - u0, c1 - u0)
                    cap_grad = buf.get("cap", r1 - r0, c1 - c0) if p.softcap else None
                    prob, t = _head_scores(p, bb.b, n2, h, r0, r1, c0, c1, qs, keys, band, buf, extras, cap_grad)
                    drop = None if t is None else t.dropout_scale(buf.get("drop", 1, r1 - r0, c1 - c0))
                    drop = None if drop is None else drop[0]
                    masked = _masked_entries(p, bb.b, h, r0, r1, c0, c1, band, k.device) if nonfinite else None
                    prob.sub_(m)  # natural units first: exact where s ~ max
                    torch.add(neg_log2_l, prob, alpha=LOG2E, out=prob).exp2_()
                    if masked is not None:
                        prob.masked_fill_(masked, 0.0)
                    p_v = prob if drop is None else prob * drop
                    tv[:, tcols].addmm_(dot_t, p_v if p.rounding is None else p.rounding.grid(p_v))
                    vc = v[c0:c1]
                    dp = mm_nt(dot, vc, out=buf.get("dp", r1 - r0, c1 - c0))
                    if drop is not None:
                        dp.mul_(drop)
                    dp.sub_(delta)
                    if peaked:
                        _exact_dp_minus_d(dp, peaked, r0, r1, dot, vc, bb.delta64[h], drop)
                    ds = prob.mul_(dp)
                    if masked is not None:
                        ds.masked_fill_(masked, 0.0)
                    if t is not None:
                        t.add_pse_grad(ds.unsqueeze(0), dpse)  # the pse is added after the softcap
                    if cap_grad is not None:
                        ds.mul_(cap_grad)
                    ds_mm = ds if p.rounding is None else p.rounding.grid(ds)  # the NPU rounds dS for the cube
                    add_mm_nt_(dq, ds_mm, k[c0:c1].t(), alpha=p.scale)  # dq starts zeroed
                    tk[:, tcols].addmm_(qs_t, ds_mm)
                    del prob, dp, ds, ds_mm, p_v, t, cap_grad  # freed before the next tile allocates (see _forward_rows)
        if len(groups) > 1:
            dkt[:, u0 - v0:u1 - v0] += tk
            dvt[:, u0 - v0:u1 - v0] += tv
    dk[v0:v1] += dkt.transpose(0, 1).contiguous()  # a blocked transpose, then a contiguous add
    dv[v0:v1] += dvt.transpose(0, 1).contiguous()
    buf.release()


def _masked_entries(p: FAProblem, b: int, h: int, r0: int, r1: int, c0: int, c1: int, band,
                    device: torch.device) -> torch.Tensor:
    """The entries ``[r1 - r0, c1 - c0]`` the mask hides from query head ``h``. A row with non-finite statistics
    or ``D`` (NaN or infinite inputs) has NaN there in ``P = exp(s - max)`` or ``dS = P (dP - D)`` (``0 * inf``),
    which must not reach the gradients of keys it does not see; only such rows pay for this."""
    zero = torch.zeros(1, r1 - r0, c1 - c0, device=device)
    return p.mask.fill_masked_(zero, b, r0, r1, c0, c1, slice(h, h + 1), band)[0].isinf()


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
