"""NSA decode on the compiled CPU decode kernel (:mod:`attnops.ops.common.cpu_kernels`, the one FIA decode runs on).

Each job's keys are token ranges of a request (in order), cut at page boundaries into ``(page, row range)`` runs
that the kernel streams where they lie in the paged caches ``[blocks, page, N2, D]`` (fp32/fp16/bf16, converted
in registers). Selected attention: one kernel chunk per (request, KV head), the GQA group's query rows over the
selected blocks. Compressed attention: one chunk per request for every KV head over its compressed keys; the
probabilities the kernel keeps give the block scores. All chunks of a call go to one
:func:`cpu_kernels.decode_chunks` call; they are independent, so results do not depend on the thread count.

:func:`unsupported` routes a call: when it names a reason, :mod:`.decode` runs its PyTorch reference.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..common import cpu_kernels
from ..common.cpu_kernels import layout
from .paged_kv import PagedKV
from ..._core import parallel
from ..._core.indices import valid_ids

F32 = torch.float32


def unsupported(kv: PagedKV, query: Tensor, key: Tensor, value: Tensor) -> str | None:
    """Why the kernel cannot serve this decode call (None: it serves it)."""
    reason = cpu_kernels.unavailable(query.device, kv.rounding)
    if reason is not None:
        return reason
    if query.dtype not in layout.DTYPE_CODES:
        return f"dtype {query.dtype} (fp64 runs on the PyTorch path)"
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        return "caches without unit stride along the head dim"
    return None


def _runs(key: Tensor, value: Tensor, tables: Tensor, heads: Tensor, starts: Tensor,
          ends: Tensor) -> tuple[Tensor, list[int], list[int]]:
    """Run descriptors (:func:`layout.run_columns`) ``[n, len(layout.RUN_FIELDS)]`` of jobs reading token ranges
    ``[starts, ends)`` ``[J, C]`` (in order; empty ones allowed) through block table rows ``tables [J, maxBlocks]``
    from KV head ``heads [J]`` on; with every job's number of runs and of tokens."""
    page = key.shape[1]
    span = int((ends - starts).max()) if starts.numel() else 0
    step = torch.arange(-(-span // page) + 1)  # the pages a range of `span` tokens can touch
    first = (starts // page).unsqueeze(-1) + step
    lo = torch.maximum(starts.unsqueeze(-1), first * page).flatten(1)  # [J, C * pages]
    hi = torch.minimum(ends.unsqueeze(-1), (first + 1) * page).flatten(1)
    blocks = tables.long().gather(1, (lo // page).clamp(0, tables.shape[1] - 1))
    keep = (lo < hi) & valid_ids(blocks, key.shape[0])  # a block outside the cache contributes no keys
    blocks = blocks.clamp(0, key.shape[0] - 1)
    rows, zero, heads = lo % page, torch.zeros_like(lo), heads.long().unsqueeze(-1)
    where = []
    for cache in (key, value):
        s0, s1, s2, _ = cache.stride()
        addr = cache.data_ptr() + (blocks * s0 + rows * s1 + heads * s2) * cache.element_size()
        where.append((addr, zero, zero + s2, zero + s1))
    lengths = hi - lo
    cols = layout.run_columns(*where, zero + 1, lengths, (zero,) * len(layout.NO_FACTORS),
                              (zero,) * len(layout.NO_FACTORS))  # no per-token antiquant
    # index_select: a mask or an index tensor in [] takes milliseconds here (an OpenMP region on two threads)
    runs = torch.stack(cols, -1).flatten(0, 1).index_select(0, keep.flatten().nonzero().squeeze(1))
    return runs, keep.sum(1).tolist(), (lengths * keep).sum(1).tolist()


def _chunks(runs: Tensor, counts: list[int], tokens: list[int], queries: Tensor, dtypes, dv: int,
            outputs: tuple[Tensor, Tensor, Tensor], probabilities: list[int] | None = None) -> None:
    """Job ``j`` (its ``counts[j]`` runs of ``runs``, ``tokens[j]`` keys; jobs without keys are left out) for the
    query ``queries[j]``, its partials into row ``j`` of the ``outputs`` (``m``, ``l``, ``o``), all in one
    :func:`cpu_kernels.decode_chunks` call."""
    rows, first = [], 0
    for j, (count, n) in enumerate(zip(counts, tokens)):
        if n:
            at = tuple(x.data_ptr() + j * x.stride(0) * x.element_size() for x in outputs)
            address = runs.data_ptr() + first * runs.stride(0) * runs.element_size()
            rows.append(layout.chunk_row(queries[j], (address, count), n, dtypes, dv, at,
                                         probabilities[j] if probabilities else 0))
        first += count
    if rows:
        cpu_kernels.decode_chunks(rows)


@parallel.serial_ops()  # small host operations around the kernel (serial_ops says why)
def selected_attention(kv: PagedKV, query: Tensor, key: Tensor, value: Tensor, block_table: Tensor, starts: Tensor,
                       ends: Tensor) -> Tensor:
    """``attention_out [B, N1, Dv]`` fp32 of every KV head's group over its key ranges ``[starts, ends)``
    ``[B, N2, C]`` (0 where a head has none)."""
    batch, n2, g = kv.batch, kv.n2, kv.n1 // kv.n2
    tables = block_table.unsqueeze(1).expand(-1, n2, -1).flatten(0, 1)  # job b * N2 + h: request b, KV head h
    runs, counts, tokens = _runs(key, value, tables, torch.arange(n2).repeat(batch), starts.flatten(0, 1),
                                 ends.flatten(0, 1))
    q = query.to(F32).mul(kv.scale).contiguous().view(batch * n2, 1, g, -1)  # the kernel reads q by address
    m, total, o = (torch.empty(batch * n2, 1, g, *extra, dtype=F32) for extra in ((), (), (kv.dv,)))
    _chunks(runs, counts, tokens, q, (key.dtype, value.dtype), kv.dv, (m, total, o))
    if all(tokens):  # every head has keys (the common case: one operation)
        return o.div_(total.unsqueeze(-1)).view(batch, kv.n1, kv.dv)
    has_keys = torch.tensor(tokens).view(-1, 1, 1, 1) > 0
    out = torch.where(has_keys, o / torch.where(has_keys, total.unsqueeze(-1), 1.0), 0.0)
    return out.view(batch, kv.n1, kv.dv)


@parallel.serial_ops()
def compress_attention(kv: PagedKV, query: Tensor, key: Tensor, value: Tensor,
                       block_table: Tensor) -> tuple[Tensor, list[Tensor]]:
    """``(attention_out [B, N1, Dv] fp32, per request the probabilities [N1, S2_b] fp32)`` over every request's
    ``S2_b >= 1`` compressed keys."""
    batch, n2, g = kv.batch, kv.n2, kv.n1 // kv.n2
    lens = torch.tensor(kv.kv_lens, dtype=torch.int64).unsqueeze(-1)
    runs, counts, tokens = _runs(key, value, block_table, torch.zeros(batch, dtype=torch.int64),
                                 torch.zeros_like(lens), lens)
    q = query.to(F32).mul(kv.scale).contiguous().view(batch, n2, g, -1)  # the kernel reads q by address
    m, total, o = (torch.empty(batch, n2, g, *extra, dtype=F32) for extra in ((), (), (kv.dv,)))
    probs = torch.empty(sum(tokens) * kv.n1, dtype=F32)
    starts = [0]
    for n in tokens:
        starts.append(starts[-1] + n * kv.n1)
    _chunks(runs, counts, tokens, q, (key.dtype, value.dtype), kv.dv, (m, total, o),
            [probs.data_ptr() + start * 4 for start in starts[:-1]])
    total = total.unsqueeze(-1)
    out = (o / total).view(batch, kv.n1, kv.dv)
    return out, [(probs[starts[b]:starts[b + 1]].view(n2, g, n) / total[b]).view(kv.n1, n)
                 for b, n in enumerate(tokens)]
