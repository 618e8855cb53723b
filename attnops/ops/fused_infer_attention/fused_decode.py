"""The compiled CPU decode kernel (:mod:`attnops._core.cpu_kernels`) on :mod:`.decode`'s chunks.

One kernel call computes a chunk's partials ``(row max, row sum, un-normalised output)`` for every KV head,
streaming its K and V once from where they lie (pages in any order, fp32/fp16/bf16/int8) and converting in
registers. Per-token and page-managed antiquant scales and offsets are applied in the kernel; per-channel and
per-tensor ones are folded into the query (keys) and into the chunk's output (values) here.

:func:`unsupported` is the one predicate that routes a call: when it names a reason (or a chunk's mask is not
all-keep), :mod:`.decode` runs its pure-PyTorch partial instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..._core import cpu_kernels
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
    if any(dt not in cpu_kernels.DTYPE_CODES for dt in dtypes):
        return f"K/V dtypes {dtypes} (int4 runs on the PyTorch path)"
    return None


def takes(p: FIAProblem, b: int, sq: int, c0: int, c1: int, pieces) -> bool:
    """Whether the kernel computes rows ``[0, sq)`` x columns ``[c0, c1)`` of batch ``b`` (nothing masked there, and
    every run with unit stride along the head dim)."""
    return (p.mask.masked_block(b, 0, sq, c0, c1) is None
            and all(pc.key.stride(-1) == 1 and pc.value.stride(-1) == 1 for pc in pieces))


def _token_factors(quant: Antiquant | None, b: int, piece, keep: list) -> list[int]:
    """``[scale addr, offset addr, sr, sn, sl]`` of a piece's per-token antiquant (zeros when there is none or it is
    per-channel)."""
    if quant is None or quant.kind == "static":
        return [0] * 5
    r, l = piece.key.shape[0], piece.key.shape[2]
    scale, offset = (None if t is None else t.contiguous()
                     for t in quant.factors(b, piece.pos, piece.block, r, l))
    if offset is not None and offset.stride() != scale.stride():
        offset = offset.expand_as(scale).contiguous()
        scale = scale.expand_as(offset).contiguous()
    keep += [scale, offset]
    sr, sn, sl, _ = scale.stride()
    return [scale.data_ptr(), 0 if offset is None else offset.data_ptr(), sr, 0 if scale.shape[1] == 1 else sn, sl]


def _runs(p: FIAProblem, b: int, pieces, keep: list) -> Tensor:
    """The kernel's run descriptors (``Run`` in ``decode.cpp``) of a chunk's pieces."""
    rows = []
    for pc in pieces:
        k, v = pc.key, pc.value
        rows.append([k.data_ptr(), *k.stride()[:3], v.data_ptr(), *v.stride()[:3], k.shape[0], k.shape[2],
                     *_token_factors(p.key_quant, b, pc, keep), *_token_factors(p.value_quant, b, pc, keep)])
    return torch.tensor(rows, dtype=torch.int64)


def _static(quant: Antiquant | None, n2: int) -> tuple[Tensor, Tensor | None] | None:
    """A per-channel/per-tensor antiquant's scale and offset as ``[N2|1, 1, D|1]``, else None."""
    if quant is None or quant.kind != "static":
        return None
    return tuple(None if t is None else t.reshape(t.shape[1], 1, t.shape[3]) for t in (quant.scale, quant.offset))


def kernel_query(p: FIAProblem, qs: Tensor) -> tuple[Tensor, Tensor | None]:
    """The query ``[N2, rows, D]`` the kernel takes (per-channel key scales folded in) and the score shift
    ``[N2, rows]`` a per-channel key offset adds (``(q * scale) . offset``), or None."""
    static = _static(p.key_quant, p.n2)
    if static is None:
        return qs.contiguous(), None
    scale, offset = static
    q = (qs * scale).contiguous()
    return q, None if offset is None else (q * offset).sum(-1)


def partial(p: FIAProblem, chunk, q: Tensor, shift: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The chunk's row max ``[N1, Sq]``, row sum and un-normalised output ``[N1, Sq, Dv]`` (``q``, ``shift``: from
    :func:`kernel_query`; ``chunk``: one of :mod:`.decode`'s, or a :class:`PagedChunk`)."""
    keep: list = []
    if isinstance(chunk, PagedChunk):
        runs, dtypes = chunk.runs, chunk.dtypes
    else:
        runs = _runs(p, chunk.b, chunk.pieces, keep)
        dtypes = (chunk.pieces[0].key.dtype, chunk.pieces[0].value.dtype)
    m, total, o = cpu_kernels.decode_chunk(q, runs, chunk.length, dtypes, p.dv)
    n2, rows = q.shape[:2]
    if shift is not None:
        m += shift
    static = _static(p.value_quant, n2)
    if static is not None:
        scale, offset = static
        o = (o if offset is None else o.add_(offset * total.unsqueeze(-1))).mul_(scale)
    sq = rows // p.group
    return m.view(p.n1, sq), total.view(p.n1, sq), o.view(p.n1, sq, p.dv)


@dataclass(frozen=True)
class PagedChunk:
    """Pages of one batch's paged cache as kernel run descriptors (one row per page), made without a tensor view
    per page: ``runs`` int64 ``[pages, 20]``, ``start``/``length`` its effective columns."""

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


def paged_chunks(p: FIAProblem, b: int, chunk_tokens: int) -> list[PagedChunk] | None:
    """Batch ``b`` of a paged call (no shared prefix, nothing masked) in chunks of whole pages (at least
    ``chunk_tokens`` tokens' worth), descriptors computed with a few tensor operations for all pages at once; None
    when the call is not of that kind (the caller then chunks ``p.kv``)."""
    src = p.source
    if src.kind != "paged" or p.prefix_len or src.block_table is None:
        return None
    kc, vc = _cache(src.key), _cache(src.value)
    geo_k, geo_v = _page_geometry(kc, p.n2), _page_geometry(vc, p.n2)
    n, bs = p.seq.kv_lens[b], src.block_size
    if geo_k is None or geo_v is None or p.mask.masked_block(b, 0, p.queries[b].shape[0], 0, n) is not None:
        return None
    pages = -(-n // bs)
    blocks = src.block_table[b, :pages].to(torch.int64)
    lengths = torch.full((pages,), bs, dtype=torch.int64)
    lengths[-1] = n - (pages - 1) * bs
    cols = [kc.data_ptr() + blocks * (kc.stride(0) * kc.element_size()), 0, geo_k[0], geo_k[1],
            vc.data_ptr() + blocks * (vc.stride(0) * vc.element_size()), 0, geo_v[0], geo_v[1], 1, lengths]
    keep = [kc, vc]
    positions = torch.arange(pages, dtype=torch.int64) * bs
    for quant in (p.key_quant, p.value_quant):
        cols += _page_factors(quant, b, blocks, positions, keep)
    runs = torch.stack([c if isinstance(c, Tensor) else torch.full((pages,), c, dtype=torch.int64) for c in cols], 1)
    per_chunk = max(1, chunk_tokens // bs)
    dtypes = (kc.dtype, vc.dtype)
    return [PagedChunk(b, i, i * per_chunk * bs, int(lengths[i * per_chunk:(i + 1) * per_chunk].sum()),
                       runs[i * per_chunk:(i + 1) * per_chunk], dtypes, tuple(keep))
            for i in range(-(-pages // per_chunk))]


def _page_factors(quant: Antiquant | None, b: int, blocks: Tensor, positions: Tensor, keep: list) -> list:
    """The five antiquant columns of every page (scale addr, offset addr, sr, sn, sl): per-token parameters
    ``[B, N2|1, S]`` at the page's positions, page-managed ones ``[blocknum, N2|1, blocksize]`` at its block."""
    if quant is None or quant.kind == "static":
        return [0] * 5
    scale, offset = quant.scale, quant.offset
    if offset is not None and offset.stride() != scale.stride():
        scale, offset = scale.contiguous(), offset.contiguous()
    keep += [scale, offset]
    s0, s1, s2 = scale.stride()
    first = b * s0 + positions * s2 if quant.kind == "token" else blocks * s0
    addr = [t.data_ptr() + first * 4 for t in (scale, offset) if t is not None]
    return [addr[0], addr[1] if offset is not None else 0, 0, 0 if scale.shape[1] == 1 else s1, s2]
