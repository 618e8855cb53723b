"""NSA decode on the compiled CPU decode kernel (:mod:`attnops.ops.common.cpu_kernels`, the one FIA decode runs on).

One :func:`cpu_kernels.paged_attention` call per operator call: the library reads the block table, the lengths
and (selected attention) the block indices itself, cuts each job's keys into ``(page, row range)`` runs that the
kernel streams where they lie in the paged caches ``[blocks, page, N2, D]`` (fp32/fp16/bf16, converted in
registers), and normalises the results. Selected attention: one kernel chunk per (request, KV head), the GQA group's
query rows over the selected blocks. Compressed attention: one chunk per request for every KV head over its
compressed keys; the probabilities the kernel keeps give the block scores. The chunks are independent, so results do
not depend on the thread count.

:func:`unsupported` routes a call: when it names a reason, :mod:`.decode` runs its PyTorch reference.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..common import cpu_kernels
from ..common.cpu_kernels import layout
from .paged_kv import PagedKV
from ..._core import parallel

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


def _lengths(kv: PagedKV) -> list[int]:
    """The requests' KV lengths clamped to ``[0, the block table's pages]`` (as the kernel clamps unvalidated ones)."""
    return [max(0, min(n, kv.capacity)) for n in kv.kv_lens]


def _paged_call(kv: PagedKV, query: Tensor, key: Tensor, value: Tensor, block_table: Tensor, lengths: list[int],
                **operator) -> tuple[Tensor, int]:
    """``(attention_out [B, N1, Dv] fp32, the kernel's code)`` of one :func:`cpu_kernels.paged_attention` call
    (``operator``: :func:`layout.paged_call`'s selected indices or probabilities)."""
    q = query.to(F32).mul(kv.scale).contiguous().view(kv.batch, kv.n2, kv.n1 // kv.n2, -1)  # read by address
    tile = query.dtype == key.dtype == torch.bfloat16 and cpu_kernels.tile_scores()  # scores on the AMX tile unit
    unscaled = (query.contiguous().view(q.shape), kv.scale) if tile else None
    out = torch.empty(*q.shape[:-1], kv.dv, dtype=F32)
    held = torch.tensor(lengths, dtype=torch.int64)  # alive until the kernel returns
    code = cpu_kernels.paged_attention(layout.paged_call(q, key, value, block_table, held, out, unscaled=unscaled,
                                                         **operator))
    return out.view(kv.batch, kv.n1, kv.dv), code


@parallel.serial_ops()  # small host operations around the kernel (serial_ops says why)
def selected_attention(kv: PagedKV, query: Tensor, key: Tensor, value: Tensor, block_table: Tensor,
                       topk_indices: Tensor, block: int) -> Tensor:
    """``attention_out [B, N1, Dv]`` fp32 of every KV head's group over the blocks of ``block`` keys its
    ``topk_indices [B, N2, count]`` name (:mod:`.decode`'s rules; 0 where a head has none)."""
    return _paged_call(kv, query, key, value, block_table, _lengths(kv), picks=topk_indices, unit=block)[0]


@parallel.serial_ops()
def compress_attention(kv: PagedKV, query: Tensor, key: Tensor,
                       value: Tensor, block_table: Tensor) -> tuple[Tensor, list[Tensor]] | None:
    """``(attention_out [B, N1, Dv] fp32, per request the probabilities [N1, S2_b] fp32)`` over every request's
    ``S2_b`` compressed keys; None (nothing computed) when some of them lie in a block outside the cache."""
    lengths = _lengths(kv)
    probs = torch.empty(sum(lengths) * kv.n1, dtype=F32)
    out, code = _paged_call(kv, query, key, value, block_table, lengths, probs=probs)
    if code == cpu_kernels.PAGE_OUTSIDE_CACHE:
        return None
    return out, [p.view(kv.n1, n) for p, n in zip(probs.split([n * kv.n1 for n in lengths]), lengths)]
