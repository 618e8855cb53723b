"""NSA decode on the compiled CPU decode kernel (:mod:`attnops._core.cpu_kernels`, the one FIA decode runs on).

Each job's keys are token ranges of a request (in order), cut at page boundaries into ``(page, row range)`` runs
that the kernel streams where they lie in the paged caches ``[blocks, page, N2, D]`` (fp32/fp16/bf16, converted
in registers). Selected attention: one kernel call per (request, KV head), the GQA group's query rows over the
selected blocks. Compressed attention: one call per request for every KV head over its compressed keys; the
probabilities the kernel leaves in its scratch give the block scores. The calls are independent and run on the
single-threaded workers, so results do not depend on the thread count.

:func:`unsupported` routes a call: when it names a reason, :mod:`.decode` runs its PyTorch reference.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..._core import cpu_kernels
from ..._core.parallel import run_jobs

if TYPE_CHECKING:
    from .decode import PagedKV

F32 = torch.float32
_RUN_FIELDS = 20  # int64 fields of decode.cpp's Run
TASKS_PER_THREAD = 4  # worker tasks per thread (each a few kernel calls: one call is ~0.1 ms at 1024 tokens)


def unsupported(kv: PagedKV, query: Tensor, key: Tensor, value: Tensor) -> str | None:
    """Why the kernel cannot serve this decode call (None: it serves it)."""
    reason = cpu_kernels.unavailable(query.device, kv.rounding)
    if reason is not None:
        return reason
    if query.dtype not in cpu_kernels.DTYPE_CODES:
        return f"dtype {query.dtype} (fp64 runs on the PyTorch path)"
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        return "caches without unit stride along the head dim"
    return None


def _runs(key: Tensor, value: Tensor, tables: Tensor, heads: Tensor, starts: Tensor,
          ends: Tensor) -> tuple[Tensor, list[int], list[int]]:
    """Run descriptors ``[n, 20]`` of jobs reading token ranges ``[starts, ends)`` ``[J, C]`` (in order; empty ones
    allowed) through block table rows ``tables [J, maxBlocks]`` from KV head ``heads [J]`` on; with every job's
    number of runs and of tokens."""
    page = key.shape[1]
    span = int((ends - starts).max()) if starts.numel() else 0
    step = torch.arange(-(-span // page) + 1)  # the pages a range of `span` tokens can touch
    first = (starts // page).unsqueeze(-1) + step
    lo = torch.maximum(starts.unsqueeze(-1), first * page).flatten(1)  # [J, C * pages]
    hi = torch.minimum(ends.unsqueeze(-1), (first + 1) * page).flatten(1)
    keep = lo < hi
    blocks = tables.long().gather(1, (lo // page).clamp(0, tables.shape[1] - 1))
    rows, zero, heads = lo % page, torch.zeros_like(lo), heads.long().unsqueeze(-1)
    cols = []
    for cache in (key, value):
        s0, s1, s2, _ = cache.stride()
        addr = cache.data_ptr() + (blocks * s0 + rows * s1 + heads * s2) * cache.element_size()
        cols += [addr, zero, zero + s2, zero + s1]
    lengths = hi - lo
    cols += [zero + 1, lengths]
    cols += [zero] * (_RUN_FIELDS - len(cols))  # no per-token antiquant
    # index_select: a mask or an index tensor in [] takes milliseconds here (an OpenMP region on two threads)
    runs = torch.stack(cols, -1).flatten(0, 1).index_select(0, keep.flatten().nonzero().squeeze(1))
    return runs, keep.sum(1).tolist(), (lengths * keep).sum(1).tolist()


def _each_job(runs: Tensor, counts: list[int], tokens: list[int], fn) -> None:
    """``fn(j, runs of job j, its tokens)`` for every job, on the workers (outputs are allocated empty and written
    there: a fill on the calling thread would start an OpenMP region, see :mod:`attnops._core.parallel`)."""
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    per_task = max(1, -(-len(tokens) // (TASKS_PER_THREAD * torch.get_num_threads())))  # consecutive jobs a task runs

    def task(first: int) -> None:
        for j in range(first, min(first + per_task, len(tokens))):
            fn(j, runs[offsets[j]:offsets[j + 1]], tokens[j])

    run_jobs(task, range(0, len(tokens), per_task), runs.device)


def selected_attention(kv: PagedKV, query: Tensor, key: Tensor, value: Tensor, block_table: Tensor, starts: Tensor,
                       ends: Tensor) -> Tensor:
    """``attention_out [B, N1, Dv]`` fp32 of every KV head's group over its key ranges ``[starts, ends)``
    ``[B, N2, C]`` (0 where a head has none)."""
    batch, n2, g = kv.batch, kv.n2, kv.n1 // kv.n2
    tables = block_table.unsqueeze(1).expand(-1, n2, -1).flatten(0, 1)  # job b * N2 + h: request b, KV head h
    runs, counts, tokens = _runs(key, value, tables, torch.arange(n2).repeat(batch), starts.flatten(0, 1),
                                 ends.flatten(0, 1))
    q = query.to(F32).mul(kv.scale).view(batch * n2, 1, g, -1)
    out = torch.empty(batch * n2, g, kv.dv, dtype=F32)

    def job(j: int, job_runs: Tensor, n: int) -> None:
        if n == 0:
            out[j].zero_()
            return
        _, total, o = cpu_kernels.decode_chunk(q[j], job_runs, n, (key.dtype, value.dtype), kv.dv)
        torch.div(o[0], total[0].unsqueeze(-1), out=out[j])

    _each_job(runs, counts, tokens, job)
    return out.view(batch, kv.n1, kv.dv)


def compress_attention(kv: PagedKV, query: Tensor, key: Tensor, value: Tensor,
                       block_table: Tensor) -> tuple[Tensor, list[Tensor]]:
    """``(attention_out [B, N1, Dv] fp32, per request the probabilities [N1, S2_b] fp32)`` over every request's
    ``S2_b >= 1`` compressed keys."""
    batch, n2, g = kv.batch, kv.n2, kv.n1 // kv.n2
    lens = torch.tensor(kv.kv_lens, dtype=torch.int64).unsqueeze(-1)
    runs, counts, tokens = _runs(key, value, block_table, torch.zeros(batch, dtype=torch.int64),
                                 torch.zeros_like(lens), lens)
    q = query.to(F32).mul(kv.scale).view(batch, n2, g, -1)
    out = torch.empty(batch, kv.n1, kv.dv, dtype=F32)
    probs: list = [None] * batch

    def job(b: int, job_runs: Tensor, n: int) -> None:  # n >= 1 (checked)
        _, total, o, p = cpu_kernels.decode_chunk(q[b], job_runs, n, (key.dtype, value.dtype), kv.dv,
                                                  probabilities=True)
        total = total.unsqueeze(-1)
        torch.div(o, total, out=out[b].view(n2, g, kv.dv))
        probs[b] = (p / total).view(kv.n1, n)

    _each_job(runs, counts, tokens, job)
    return out, probs
