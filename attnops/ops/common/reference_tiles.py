"""Tiling for the chunked CPU attention engine (:mod:`.reference`, :mod:`.reference_backward`): the tile
budgets, row chunks and column blocks inside the mask band, per-thread tile workspaces, heads-first staging
of the operands, and the dealing of work into jobs."""
from __future__ import annotations

import collections
import math

import torch

from ..._core.gemm import mm_nt, pack_nt
from ..._core.layouts import batch_tokens
from ..._core.parallel import run_jobs
from ..._core.workspace import Buffers
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


def heads_first(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """[S, N, D] (any dtype, any strides) -> a new contiguous [N, S, D] in the compute dtype, times ``scale``."""
    out = torch.empty((x.shape[1], x.shape[0], x.shape[2]), dtype=compute_dtype(x.dtype), device=x.device)
    out.copy_(x.transpose(0, 1))
    return out.mul_(scale) if scale != 1.0 else out


class Workspace:
    """Reusable fp32 tile buffers of ``G * rows * skv`` elements."""

    def __init__(self, group: int, skv_max: int, count: int, dtype: torch.dtype, rows: int | None = None):
        self.rows = rows or max(MIN_ROWS, TILE_BYTES // (dtype.itemsize * group * max(skv_max, 1)))
        self._bufs = [torch.empty(group * self.rows * max(skv_max, 1), dtype=dtype) for _ in range(count)]

    def tile(self, i: int, shape: tuple[int, int, int]) -> torch.Tensor:
        return self._bufs[i][:shape[0] * shape[1] * shape[2]].view(shape)


class Tile:
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


def tiles(p: FAProblem, b: int, rows: int):
    """Yield the non-empty tiles of batch ``b`` (KV head by KV head, ``rows`` query rows at a time)."""
    sq, skv = p.seq.q_lens[b], p.seq.kv_lens[b]
    for n2 in range(p.geom.n2):
        for r0 in range(0, sq, rows):
            r1 = min(sq, r0 + rows)
            c0, c1 = p.mask.col_range(b, r0, r1, skv)
            if c0 < c1:
                yield Tile(p, b, n2, r0, r1, c0, c1)


def has_tile_extras(p: FAProblem) -> bool:
    """Whether tiles need a :class:`Tile` (a pse, dropout or an explicit mask) beyond the band's masking."""
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


def head_scores(p: FAProblem, b: int, n2: int, h: int, r0: int, r1: int, c0: int, c1: int, qs: torch.Tensor,
                 keys: "Keys", band, buf: "Buffers", extras: bool, cap_grad: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, "Tile | None"]:
    """Query head ``h``'s masked scores ``[r1 - r0, c1 - c0]`` (``qs``: its staged rows; ``keys``: those of KV head
    ``n2``, whose ``scores`` apply the scale the rows lack) in workspace ``"s"``, and the :class:`Tile` when
    ``extras`` (for its pse, dropout and pse gradient). ``band``: the tile's :meth:`MaskSpec.band_bounds`, or ``()``
    where the caller's fused pass masks the band. Without extras no tile object is built: every tensor call
    of a worker contends for the GIL. ``cap_grad``: see :func:`softcap_`."""
    s = softcap_(p, keys.scores(qs, c0, c1, buf.get("s", r1 - r0, c1 - c0)), cap_grad)
    if not extras:
        return p.mask.fill_masked_(s, b, r0, r1, c0, c1, None, band), None
    t = Tile(p, b, n2, r0, r1, c0, c1, heads=slice(h, h + 1))
    return t.shift_and_mask_(s.unsqueeze(0), band)[0], t


class Keys:
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

    def scores(self, qs: torch.Tensor, c0: int, c1: int, out: torch.Tensor) -> torch.Tensor:
        """``qs @ keys[c0:c1].T`` (a new tensor, or ``out``)."""
        cols, packed = self.block(c0, c1, qs.shape[0])
        return mm_nt(qs, cols, out=out, packed=packed)


def active_batches(p: FAProblem):
    return [b for b in range(p.seq.batch) if p.seq.q_lens[b] > 0 and p.seq.kv_lens[b] > 0]


def row_chunks(p: FAProblem, b: int, budget: int, max_rows: int, cols_cap: int | None = None
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


def col_blocks(p: FAProblem, b: int, r0: int, r1: int, c0: int, c1: int, band, width: int
                ) -> list[tuple[int, int, list | None]]:
    """Split a row chunk's band ``[c0, c1)`` into equal column blocks of at most ``width`` (with their band parts)."""
    if c1 - c0 <= width:
        return [(c0, c1, band)]
    n = -(-(c1 - c0) // width)
    width = -(-(c1 - c0) // n)
    return [(a, min(c1, a + width), p.mask.band_bounds(b, r0, r1, a, min(c1, a + width)))
            for a in range(c0, c1, width)]


def forward_blocks(p: FAProblem, b: int, r0: int, r1: int, c0: int, c1: int, band
                    ) -> list[tuple[int, int, list | None]]:
    """The forward's column blocks of a row chunk: at most ``FWD_COL_BLOCK`` wide, or, under an NPU rounding, the
    kernel's key blocks (``key_block`` keys aligned to key 0: where the running max P is rounded against moves)."""
    if p.rounding is None:
        return col_blocks(p, b, r0, r1, c0, c1, band, FWD_COL_BLOCK)
    w = p.rounding.key_block
    edges = [c0, *range((c0 // w + 1) * w, c1, w), c1]
    return [(a, e, p.mask.band_bounds(b, r0, r1, a, e)) for a, e in zip(edges, edges[1:])]


def carve(flat: torch.Tensor, shapes) -> list[torch.Tensor]:
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
    for (i, x), out in zip(todo, carve(flat, [(x.shape[1], x.shape[0], x.shape[2]) for _, x in todo])):
        staged[i] = out
        pending += [(out[h], x[:, h]) for h in range(x.shape[1])]
    return staged, pending


def stage_kv(p: FAProblem, buf: "Buffers", active: list[int], device, kv, vv) -> list[list[torch.Tensor]]:
    """The active batches' key and value, staged by :func:`_stage_heads`; the copies run one job per head on the
    workers. Every tile reads them, and a strided operand would cost its GEMMs 5-10%: rows 4 KiB apart (BSND with
    N*D = 1024) share a few cache sets. (Query and ``dy`` rows are read by one chunk each: :func:`stage_rows`.)"""
    staged, copies = [], []
    for name, x in (("k", kv), ("v", vv)):
        heads, pending = _stage_heads(buf, name, [batch_tokens(x, p.seq, b, kv=True) for b in active])
        staged.append(heads)
        copies += pending
    run_jobs(lambda item: item[0].copy_(item[1]), copies, device)
    return staged


def stage_rows(buf: "Buffers", name: str, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
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



def deal(items: list, owners: int) -> list[list]:
    """``items`` (one owner's row chunks or chunk groups) dealt round-robin into as many parts as ``owners`` such
    owners need to make ``MIN_JOBS`` jobs (at most one part per item); round-robin spreads causal rows of different
    cost evenly over the parts."""
    parts = min(-(-MIN_JOBS // owners), len(items))
    return [items[i::parts] for i in range(parts)]


def masked_entries(p: FAProblem, b: int, h: int, r0: int, r1: int, c0: int, c1: int, band,
                   device: torch.device) -> torch.Tensor:
    """The entries ``[r1 - r0, c1 - c0]`` the mask hides from query head ``h``. A row with non-finite statistics
    or ``D`` (NaN or infinite inputs) has NaN there in ``P = exp(s - max)`` or ``dS = P (dP - D)`` (``0 * inf``),
    which must not reach the gradients of keys it does not see; only such rows pay for this."""
    zero = torch.zeros(1, r1 - r0, c1 - c0, device=device)
    return p.mask.fill_masked_(zero, b, r0, r1, c0, c1, slice(h, h + 1), band)[0].isinf()
