"""The compiled CPU decode kernel (:mod:`attnops.ops.common.cpu_kernels`) on :mod:`.decode`'s chunks.

The kernel computes a chunk's partials ``(row max, row sum, un-normalised output)`` for every KV head (one call
takes all of a decode call's chunks, :func:`compute`), streaming its K and V once from where they lie (pages in any
order, fp32/fp16/bf16/int8) and converting in registers. Per-token and page-managed antiquant scales and offsets
are applied in the kernel; per-channel and per-tensor ones are folded into the query (keys) and into the chunk's
output (values) here.

:func:`unsupported` is the one predicate that routes a call: when it names a reason (or a chunk's mask is not
all-keep), :mod:`.decode` runs its pure-PyTorch partial instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..common import cpu_kernels
from ..common.cpu_kernels import layout
from .problem import FIAProblem
from .quant import Antiquant



def unsupported(p: FIAProblem) -> str | None:
    """Why the kernel cannot serve the decode chunks of ``p`` (None: it serves every chunk whose mask keeps
    everything, see :func:`takes`)."""
    reason = cpu_kernels.unavailable(p.device, p.rounding)
    if reason is not None:
        return reason
    if p.pse is not None:
        return "a pse"
    dtypes = (_cache(p.source.key).dtype, _cache(p.source.value).dtype)
    if any(dt not in layout.DTYPE_CODES for dt in dtypes):
        return f"K/V dtypes {dtypes} (int4 runs on the PyTorch path)"
    return None


def takes(p: FIAProblem, b: int, sq: int, c0: int, c1: int, pieces) -> bool:
    """Whether the kernel computes rows ``[0, sq)`` x columns ``[c0, c1)`` of batch ``b`` (nothing masked there, and
    every run with unit stride along the head dim)."""
    return (p.mask.masked_block(b, 0, sq, c0, c1) is None
            and all(pc.seg.key.stride(-1) == 1 and pc.seg.value.stride(-1) == 1 for pc in pieces))


def _token_factors(quant: Antiquant | None, b: int, piece, r: int, l: int, keep: list) -> tuple[int, ...]:
    """``(scale addr, offset addr, sr, sn, sl)`` of a piece's per-token antiquant (:data:`layout.NO_FACTORS` when
    there is none or it is per-channel); ``r`` blocks of ``l`` tokens."""
    if quant is None or quant.kind == "static":
        return layout.NO_FACTORS
    scale, offset = (None if t is None else t.contiguous()
                     for t in quant.factors(b, piece.pos, piece.block, r, l))
    if offset is not None and offset.stride() != scale.stride():
        offset = offset.expand_as(scale).contiguous()
        scale = scale.expand_as(offset).contiguous()
    keep += [scale, offset]
    sr, sn, sl, _ = scale.stride()
    return scale.data_ptr(), 0 if offset is None else offset.data_ptr(), sr, 0 if scale.shape[1] == 1 else sn, sl


def _runs(p: FIAProblem, b: int, pieces, keep: list) -> list[list[int]]:
    """The kernel's run descriptors (:func:`layout.run_columns`) of a chunk's pieces, one row each."""
    rows = []
    for pc in pieces:
        key, r, l = pc.run("key")
        value = pc.run("value")[0]
        rows.append(layout.run_columns(key, value, r, l, _token_factors(p.key_quant, b, pc, r, l, keep),
                                       _token_factors(p.value_quant, b, pc, r, l, keep)))
    return rows


def _static(quant: Antiquant | None, n2: int) -> tuple[Tensor, Tensor | None] | None:
    """A per-channel/per-tensor antiquant's scale and offset as ``[N2|1, 1, D|1]``, else None."""
    if quant is None or quant.kind != "static":
        return None
    return tuple(None if t is None else t.reshape(t.shape[1], 1, t.shape[3]) for t in (quant.scale, quant.offset))


def kernel_query(p: FIAProblem, b: int, qs: Tensor) -> tuple[Tensor, Tensor | None, tuple[Tensor, float] | None]:
    """Batch ``b``'s query ``[N2, rows, D]`` the kernel takes (``qs`` with per-channel key scales folded in), the
    score shift ``[N2, rows]`` a per-channel key offset adds (``(q * scale) . offset``) or None, and the bf16 query
    before scaling with its scale (:func:`layout.query_fields`) when the kernel takes bf16 keys' scores on the AMX
    tile unit from it (else None)."""
    static = _static(p.key_quant, p.n2)
    if static is None:
        tile = p.source.query.dtype == torch.bfloat16 and _cache(p.source.key).dtype == torch.bfloat16 \
            and cpu_kernels.tile_scores()
        raw = p.queries[b].transpose(0, 1).reshape(qs.shape).contiguous() if tile else None
        return qs.contiguous(), None, None if raw is None else (raw, p.scale)
    scale, offset = static
    q = (qs * scale).contiguous()
    return q, None if offset is None else (q * offset).sum(-1), None


def compute(p: FIAProblem, chunks: list, queries: dict, partials: dict) -> None:
    """The partials of ``chunks`` (each one :func:`takes`, or a :class:`PagedChunk`) in one
    :func:`cpu_kernels.decode_chunks` call on every CPU thread: chunk ``c``'s row max, row sum and un-normalised
    output go to slot ``c.index`` of ``partials[c.b]`` (``m``, ``total [C_b, N1, Sq]``, ``o [C_b, N1, Sq, Dv]``, each
    slot contiguous fp32); ``queries[b]``: :func:`kernel_query`'s ``(q, shift, unscaled)``."""
    keep: list = []
    runs = [None if isinstance(c, PagedChunk) else _runs(p, c.b, c.pieces, keep) for c in chunks]
    table = torch.tensor([r for rs in runs if rs is not None for r in rs], dtype=layout.DTYPE)
    table = table.view(-1, len(layout.RUN_FIELDS))
    first = 0
    rows = []
    for c, own in zip(chunks, runs):
        if own is None:  # a paged chunk: its descriptors are made
            address, count, dtypes = c.runs.data_ptr(), c.runs.shape[0], c.dtypes
        else:  # this chunk's rows of the table
            count, dtypes = len(own), (c.pieces[0].seg.key.dtype, c.pieces[0].seg.value.dtype)
            address = table.data_ptr() + first * table.stride(0) * table.element_size()
            first += count
        outputs = tuple(x.data_ptr() + c.index * x.stride(0) * x.element_size() for x in partials[c.b])
        rows.append(layout.chunk_row(queries[c.b][0], (address, count), c.length, dtypes, p.dv, outputs,
                                     unscaled=queries[c.b][2]))
    cpu_kernels.decode_chunks(rows)
    static = _static(p.value_quant, p.n2)
    for c in chunks:
        if queries[c.b][1] is not None or static is not None:
            _finish(p, queries[c.b][1], static, *(x[c.index] for x in partials[c.b]))


def _finish(p: FIAProblem, shift: Tensor | None, static, m: Tensor, total: Tensor, o: Tensor) -> None:
    """A kernel chunk's partials ``[N1, Sq(, Dv)]``, in place: plus the score shift of a per-channel key offset, and
    the output through a per-channel/per-tensor value antiquant (``static``: :func:`_static`'s)."""
    if shift is not None:
        m += shift.view_as(m)
    if static is not None:
        scale, offset = static
        o3 = o.view(p.n2, -1, p.dv)
        if offset is not None:
            o3.add_(offset * total.view(p.n2, -1, 1))
        o3.mul_(scale)


@dataclass(frozen=True)
class PagedChunk:
    """Pages of one batch's paged cache as kernel run descriptors (one row per page), made without a tensor view
    per page: ``runs`` ``[pages, len(layout.RUN_FIELDS)]``, ``start``/``length`` its effective columns."""

    b: int
    index: int
    start: int
    length: int
    runs: Tensor
    dtypes: tuple[torch.dtype, torch.dtype]
    keep: tuple  # tensors whose memory ``runs`` points into


def _cache(x) -> Tensor:
    return x[0] if isinstance(x, (list, tuple)) else x


def _page_geometry(cache: Tensor, n2: int) -> tuple[int, int] | None:
    """``(head step, token step)`` in elements of a BnBsH ``[blocknum, blocksize, N2*D]`` or BnNBsD
    ``[blocknum, N2, blocksize, D]`` cache with unit stride along D, else None (NZ and other caches)."""
    if cache.stride(-1) != 1 or cache.dim() not in (3, 4):
        return None
    if cache.dim() == 4:
        return cache.stride(1), cache.stride(2)
    return cache.shape[2] // n2 * cache.stride(2), cache.stride(1)


def paged_chunks(p: FIAProblem, batches: list[int], chunk_tokens: int) -> dict[int, list[PagedChunk]]:
    """The batches of a paged call among ``batches`` (no shared prefix, nothing masked) in chunks of whole pages (at
    least ``chunk_tokens`` tokens' worth), the descriptors of every page of every batch made by a few tensor
    operations; batches not of that kind are left out (the caller chunks ``p.kv`` for them)."""
    src = p.source
    if src.kind != "paged" or p.prefix_len or src.block_table is None:
        return {}
    kc, vc = _cache(src.key), _cache(src.value)
    geo_k, geo_v = _page_geometry(kc, p.n2), _page_geometry(vc, p.n2)
    bs, lens = src.block_size, p.seq.kv_lens
    batches = [b for b in batches if p.mask.masked_block(b, 0, p.queries[b].shape[0], 0, lens[b]) is None]
    if geo_k is None or geo_v is None or not batches:
        return {}
    pages = [-(-lens[b] // bs) for b in batches]
    index = torch.arange(max(pages), dtype=torch.int64)
    used = index < torch.tensor(pages)[:, None]  # [batches, pages], batch-major like the runs
    rows = torch.tensor(batches)
    blocks = src.block_table[rows, :index.shape[0]].to(torch.int64)[used]
    lengths = (torch.tensor([lens[b] for b in batches])[:, None] - index * bs).clamp(max=bs)[used]
    positions = (index * bs).expand_as(used)[used]
    batch_of = rows[:, None].expand_as(used)[used]
    keep = [kc, vc]
    cols = layout.run_columns((kc.data_ptr() + blocks * (kc.stride(0) * kc.element_size()), 0, *geo_k),
                              (vc.data_ptr() + blocks * (vc.stride(0) * vc.element_size()), 0, *geo_v), 1, lengths,
                              *(_page_factors(quant, batch_of, blocks, positions, keep)
                                for quant in (p.key_quant, p.value_quant)))
    runs = _columns(cols, blocks.shape[0])
    per_chunk = max(1, chunk_tokens // bs)
    dtypes, keep = (kc.dtype, vc.dtype), tuple(keep)
    chunks: dict[int, list[PagedChunk]] = {}
    first_page = 0
    for b, count in zip(batches, pages):
        chunks[b] = [PagedChunk(b, i, start * bs, min(lens[b], (start + per_chunk) * bs) - start * bs,
                                runs[first_page + start:first_page + min(count, start + per_chunk)], dtypes, keep)
                     for i, start in enumerate(range(0, count, per_chunk))]
        first_page += count
    return chunks


def _columns(cols: list, count: int) -> Tensor:
    """``count`` run descriptors ``[count, len(cols)]`` from :func:`layout.run_columns`'s ``cols`` (ints, the same
    in every row, or tensors of one value per row): the ints as one repeated row, then each tensor column."""
    runs = torch.tensor([0 if isinstance(c, Tensor) else c for c in cols], dtype=layout.DTYPE).repeat(count, 1)
    for i, c in enumerate(cols):
        if isinstance(c, Tensor):
            runs[:, i] = c
    return runs


def _page_factors(quant: Antiquant | None, batch: Tensor, blocks: Tensor, positions: Tensor, keep: list) -> tuple:
    """The antiquant columns of every page (scale addr, offset addr, sr, sn, sl): per-token parameters
    ``[B, N2|1, S]`` at the page's batch and positions, page-managed ones ``[blocknum, N2|1, blocksize]`` at its
    block."""
    if quant is None or quant.kind == "static":
        return layout.NO_FACTORS
    scale, offset = quant.scale, quant.offset
    if offset is not None and offset.stride() != scale.stride():
        scale, offset = scale.contiguous(), offset.contiguous()
    keep += [scale, offset]
    s0, s1, s2 = scale.stride()
    first = batch * s0 + positions * s2 if quant.kind == "token" else blocks * s0
    addr = [t.data_ptr() + first * 4 for t in (scale, offset) if t is not None]
    return addr[0], addr[1] if offset is not None else 0, 0, 0 if scale.shape[1] == 1 else s1, s2
