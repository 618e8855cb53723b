"""FIA decode on the CPU (few query rows per batch): flash-decoding over the KV cache, streamed in place.

Every batch's effective KV columns are cut into chunks of about :data:`CHUNK_TOKENS` tokens (whole pages for a
paged cache), each computed for all query heads of every GQA group at once: its partial row max, row sum and
un-normalised output. The partials of a batch are merged in chunk order, so results do not depend on the thread
count.

Where the compiled kernel is available (:mod:`.fused_decode`), it computes every chunk it takes (one predicate,
:func:`.fused_decode.unsupported`, plus the chunk's mask) in one pass over the chunk's K and V, all such chunks in
one call spread over the CPU threads. The pure-PyTorch partial below computes the others (one job per chunk on the
single-threaded workers of :func:`run_jobs`): fp32 runs are read where they lie (no copy); fp16/bf16 pages are
converted, and int8/int4 pages dequantized, into a per-worker fp32 buffer one chunk at a time, so no gathered copy
of the cache is ever made.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from ..common.npu_rounding import msd_planes
from ..._core.parallel import run_jobs
from ..._core.workspace import Buffers
from . import fused_decode
from .paged import KVSegment
from .problem import FIAProblem

F32 = torch.float32
CHUNK_TOKENS = 2048


@dataclass(frozen=True)
class _Piece:
    """Tokens ``[t0, t1)`` of a segment (whole blocks of a paged run, any range of a single run)."""

    seg: KVSegment
    t0: int
    t1: int

    def _part(self, x: Tensor) -> Tensor:
        if x.shape[0] == 1:
            return x[:, :, self.t0:self.t1]
        per_block = x.shape[2]
        return x[self.t0 // per_block:self.t1 // per_block]

    def run(self, which: str) -> tuple[tuple[int, int, int, int], int, int]:
        """``((addr, sr, sn, sl), blocks, length)`` of :attr:`key` or :attr:`value` (``which``), without making the
        view: its address, its strides in elements along blocks, heads and tokens, and its shape along blocks and
        tokens."""
        x = getattr(self.seg, which)
        sr, sn, sl = x.stride()[:3]
        if x.shape[0] == 1:
            return (x.data_ptr() + self.t0 * sl * x.element_size(), sr, sn, sl), 1, self.t1 - self.t0
        per_block = x.shape[2]
        first = x.data_ptr() + self.t0 // per_block * sr * x.element_size()
        return (first, sr, sn, sl), (self.t1 - self.t0) // per_block, per_block

    @cached_property
    def key(self) -> Tensor:
        return self._part(self.seg.key)

    @cached_property
    def value(self) -> Tensor:
        return self._part(self.seg.value)

    @property
    def pos(self) -> int:
        return self.seg.pos + self.t0

    @property
    def block(self) -> int | None:
        return None if self.seg.block is None else self.seg.block + self.t0 // self.seg.key.shape[2]


@dataclass(frozen=True)
class _Chunk:
    b: int
    index: int
    start: int  # first effective column
    length: int
    pieces: tuple[_Piece, ...]


def _chunks(p: FIAProblem, b: int) -> list[_Chunk]:
    """Batch ``b``'s KV columns in chunks of at most ``CHUNK_TOKENS`` (at least one page), in column order; pages are
    never split (page-managed antiquant scales are indexed from a page's first token)."""
    chunks: list[_Chunk] = []
    pieces: list[_Piece] = []
    start = size = 0
    for seg in p.kv[b]:
        grain = 1 if seg.block is None else seg.key.shape[2]  # pages are never split (page-managed antiquant)
        t = 0
        while t < seg.length:
            room = (CHUNK_TOKENS - size) // grain * grain if size else max(grain, CHUNK_TOKENS // grain * grain)
            if room <= 0:
                chunks.append(_Chunk(b, len(chunks), start, size, tuple(pieces)))
                pieces, start, size = [], start + size, 0
                continue
            take = min(seg.length - t, room)
            pieces.append(_Piece(seg, t, t + take))
            t, size = t + take, size + take
    if pieces:
        chunks.append(_Chunk(b, len(chunks), start, size, tuple(pieces)))
    return chunks


def _tokens_view(x: Tensor) -> Tensor | None:
    """A run ``[R, N2, L, D]`` as ``[N2, R*L, D]`` without a copy, when its blocks follow each other at the token
    stride (dense runs, consecutive pages of a ``[blocknum, blocksize, N2*D]`` cache), else None."""
    r, _, l, _ = x.shape
    sr, sn, sl, sd = x.stride()
    if r > 1 and sr != l * sl:
        return None
    return x.as_strided((x.shape[1], r * l, x.shape[3]), (sn, sl, sd))


def _chunk_parts(p: FIAProblem, chunk: _Chunk, bufs: Buffers | None, which: str) -> list[Tensor]:
    """The chunk's keys or values as fp32 ``[N2, n, D]`` parts in column order: fp32 pieces read where they lie
    (one part per run, or per page where pages do not follow each other), other dtypes and antiquant converted
    into one part in this worker's buffer."""
    quant = p.key_quant if which == "key" else p.value_quant
    runs = [getattr(pc, which) for pc in chunk.pieces]
    if quant is None and runs[0].dtype == F32:
        parts = []
        for run in runs:
            view = _tokens_view(run)
            parts.extend([view] if view is not None else [_tokens_view(block[None]) for block in run])
        return parts
    runs = [run if quant is None else quant.apply(run, chunk.b, pc.pos, pc.block)
            for run, pc in zip(runs, chunk.pieces)]
    shape = (p.n2, chunk.length, runs[0].shape[-1])
    out = bufs.get(which, *shape) if bufs is not None else torch.empty(shape, dtype=F32, device=runs[0].device)
    offset = 0
    for run in runs:
        n = run.shape[0] * run.shape[2]
        out[:, offset:offset + n].unflatten(1, (run.shape[0], run.shape[2])).copy_(run.transpose(0, 1))
        offset += n
    return [out]


def _partial(p: FIAProblem, chunk: _Chunk, queries: dict, partials: dict) -> None:
    """The chunk's row max ``[N1, Sq]``, row sum and un-normalised output ``[N1, Sq, Dv]``, into its slot of
    ``partials[chunk.b]`` (``queries[b]``: the batch's scaled fp32 query ``[N2, G*Sq, D]``)."""
    qs = queries[chunk.b]
    b, sq = chunk.b, qs.shape[1] // p.group
    # this worker's buffers; fresh tensors while torch.compile traces (it cannot trace thread-local state)
    bufs = None if torch.compiler.is_compiling() else Buffers.acquire(F32, qs.device)
    scores = [torch.bmm(qs, k.transpose(-1, -2)) for k in _chunk_parts(p, chunk, bufs, "key")]
    s = (scores[0] if len(scores) == 1 else torch.cat(scores, -1)).view(p.n1, sq, chunk.length)
    c0, c1 = chunk.start, chunk.start + chunk.length
    if p.pse is not None:
        s.add_(p.pse.block(b, 0, sq, c0, c1, slice(0, p.n1), F32))
    p.mask.fill_masked_(s, b, 0, sq, c0, c1, slice(0, p.n1))
    m = s.amax(-1, keepdim=True)
    s.sub_(torch.where(m != -math.inf, m, 0.0)).exp_()  # a NaN max stays: its row turns NaN, as in the formula
    total = s.sum(-1)
    nan_sums_of_unkept_rows_(p, b, slice(0, p.n1), 0, sq, c0, c1, m.squeeze(-1), total)
    if p.rounding is not None:  # P for P V as the NPU's cube reads it (the sum: unrounded)
        s = _npu_probabilities(p, s)
    probs, o, offset = s.view(p.n2, p.group * sq, chunk.length), None, 0
    for v in _chunk_parts(p, chunk, bufs, "value"):
        part = probs[:, :, offset:offset + v.shape[1]]
        o = torch.bmm(part, v) if o is None else o.baddbmm_(part, v)
        offset += v.shape[1]
    for slots, x in zip(partials[b], (m.squeeze(-1), total, o.view(p.n1, sq, -1))):
        slots[chunk.index].copy_(x)


def nan_sums_of_unkept_rows_(p: FIAProblem, b: int, heads: slice, r0: int, r1: int, c0: int, c1: int, m: Tensor,
                             total: Tensor) -> None:
    """In place: the row sum ``total`` ``[heads, r]`` becomes NaN (the formula's ``0 / 0``) on rows whose max ``m`` is
    -inf although the mask lets them see a column of ``[c0, c1)`` (every visible score -inf); rows that see none
    keep their sum 0. Only a tile with a -inf row max pays for the mask lookup."""
    unkept = m == -math.inf
    if not bool(unkept.any()):
        return
    masked = p.mask.masked_block(b, r0, r1, c0, c1, heads)
    total.masked_fill_(unkept if masked is None else unkept & ~masked.all(-1), math.nan)


def _npu_probabilities(p: FIAProblem, s: Tensor) -> Tensor:
    """P ``[N1, Sq, n]`` as the IFA kernel multiplies it with V: int8 planes against an int8 value cache (MSD,
    relative to the chunk's row max), else cast to the input dtype (CAST_ROUND)."""
    if p.value_quant is not None and p.rounding.query_planes:
        return msd_planes(s, p.rounding.query_planes)
    return p.rounding.grid_(s)


def _msd_queries(p: FIAProblem, q: Tensor) -> Tensor:
    """The query ``[Sq, N1, D]`` (fp32) as IFA's MSD sees it against an int8 key cache: times the key's static
    antiquant scale, in int8 planes, and divided by the scale again (the product with the dequantized keys then
    equals the kernel's plane products with the int8 keys, up to fp32 rounding)."""
    scale = p.key_quant.scale[0, :, 0, :]  # [N2|1, D|1]
    if scale.shape[0] > 1:
        scale = scale.repeat_interleave(p.group, 0)
    return msd_planes(q * scale, p.rounding.query_planes) / scale


def _merge(m: Tensor, total: Tensor, o: Tensor) -> tuple[Tensor, Tensor]:
    """Chunk partials stacked in chunk order (``m``, ``total [C, N1, Sq]``, ``o [C, N1, Sq, Dv]``; ``o`` is scaled in
    place, so that no temporary is as large as it) -> ``(o [Sq, N1, Dv], lse [N1, Sq])``; rows that saw nothing: 0,
    +inf; a NaN max or sum (non-finite inputs) gives NaN, never a finite value. A chunk without a finite score for a
    row (max -inf) weighs nothing in it; its sum NaN (keys seen, every score -inf) makes a row that no chunk gave a
    finite score NaN, as the formula's ``0 / 0``."""
    top = m.amax(0)
    if bool(m.isfinite().all()):  # every chunk gave every row a finite max: the same values in fewer operations
        w = (m - top).exp()
        total = (w * total).sum(0)
        return (o.mul_(w.unsqueeze(-1)).sum(0) / total.unsqueeze(-1)).transpose(0, 1), top + total.log()
    valid = top != -math.inf
    unkept = m == -math.inf
    w = torch.where(unkept, 0.0, (m - top).exp())
    o = o.mul_(w.unsqueeze(-1)).sum(0)
    seen = (unkept & total.isnan()).any(0)  # keys seen, every score -inf
    total = torch.where(unkept, 0.0, w * total).sum(0)
    o = torch.where(valid.unsqueeze(-1), o / torch.where(valid, total, 1.0).unsqueeze(-1),
                    torch.where(seen, math.nan, 0.0).unsqueeze(-1))
    lse = torch.where(valid, top + total.log(), torch.where(seen, math.nan, math.inf))
    return o.transpose(0, 1), lse


def forward(p: FIAProblem, batches: list[int], convert=None) -> dict[int, tuple[Tensor, Tensor]]:
    """``{b: (o [Sq_b, N1, Dv], lse [N1, Sq_b])}`` for the decode ``batches`` (each with KV and queries): ``o`` fp32,
    or ``convert(o)`` when given (an elementwise cast, applied to several batches at once)."""
    queries = _queries(p, batches)
    fused = {b: fused_decode.kernel_query(p, b, q) for b, q in queries.items()} if fused_decode.unsupported(p) is None \
        else {}
    paged = fused_decode.paged_chunks(p, list(fused), CHUNK_TOKENS)
    chunks = [c for b in batches for c in (paged.get(b) or _chunks(p, b))]
    counts = {b: 0 for b in batches}
    for c in chunks:
        counts[c.b] += 1
    groups: dict = {}  # batches with as many chunks and query rows merge together: a few ops for all of them
    for b in batches:
        groups.setdefault((counts[b], p.queries[b].shape[0]), []).append(b)
    slots = _Partials(p, groups)
    kernel, other = [], []
    for c in chunks:
        takes = isinstance(c, fused_decode.PagedChunk) or (c.b in fused and fused_decode.takes(
            p, c.b, p.queries[c.b].shape[0], c.start, c.start + c.length, c.pieces))
        (kernel if takes else other).append(c)
    run_jobs(lambda c: _partial(p, c, queries, slots.partials), other, p.device)
    if kernel:
        fused_decode.compute(p, kernel, fused, slots.partials)
    return slots.merge(convert)


class _Partials:
    """The chunk partials of every group of batches (as many chunks and query rows) stacked in one set of tensors,
    merged for all the group's batches at once.

    ``partials[b]``: batch ``b``'s slots, slot ``i`` for chunk ``i``: row max and row sum ``[C_b, N1, Sq_b]`` and the
    un-normalised output ``[C_b, N1, Sq_b, Dv]`` (fp32, each slot contiguous)."""

    def __init__(self, p: FIAProblem, groups: dict) -> None:
        self.partials: dict = {}
        self.stacked: dict = {}
        for (count, sq), batches in groups.items():
            shape = (count, len(batches), p.n1, sq)
            stacked = (torch.empty(shape, dtype=F32, device=p.device), torch.empty(shape, dtype=F32, device=p.device),
                       torch.empty(*shape, p.dv, dtype=F32, device=p.device))
            self.stacked[tuple(batches)] = stacked
            self.partials.update(zip(batches, zip(*(x.unbind(1) for x in stacked))))

    def merge(self, convert) -> dict[int, tuple[Tensor, Tensor]]:
        """``{b: (o [Sq_b, N1, Dv], lse [N1, Sq_b])}``: :func:`_merge` of each group's batches, their heads side by
        side (the merge is elementwise over heads and rows, so each batch gets the bits of a merge of its own), then
        ``convert``."""
        merged = {}
        for group, stacked in self.stacked.items():
            o, lse = _merge(*(x.flatten(1, 2) for x in stacked))  # [Sq, batches*N1, Dv], [batches*N1, Sq]
            if convert is not None:
                o = convert(o)
            merged.update(zip(group, zip(o.chunk(len(group), 1), lse.chunk(len(group)))))
        return merged


def _queries(p: FIAProblem, batches: list[int]) -> dict[int, Tensor]:
    """Each batch's scaled fp32 query ``[N2, G*Sq, D]`` (head ``n2*G + g``), contiguous; batches with as many query
    rows are converted together."""
    msd = p.rounding is not None and p.rounding.query_planes and p.key_quant is not None
    by_rows: dict = {}
    for b in batches:
        by_rows.setdefault(p.queries[b].shape[0], []).append(b)
    queries = {}
    for sq, group in by_rows.items():
        q = torch.stack([p.queries[b] for b in group]).to(F32)  # [batches, Sq, N1, D]
        q = (_msd_queries(p, q) if msd else q).transpose(1, 2).reshape(len(group), p.n2, p.group * sq, p.d)
        queries.update(zip(group, q.mul(p.scale)))
    return queries
