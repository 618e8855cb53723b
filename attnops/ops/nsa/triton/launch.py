"""Host side of the NSA selected-attention and compression kernels: per-batch tables, the inverted top-k lists of
the deterministic dK/dV, grids and outputs. Every launcher builds a plan ``(outputs, [Launch, ...])`` (also compiled
by ``python -m attnops aot``) and runs it on the NSA kernel family (``family.py``, which also sizes the tiles the
grids depend on).

Tensors are read in place through strides (a unit last stride, copied only when missing). The only metadata is one
small per-batch table per call geometry (and, for selected dK/dV, one row per selectable block), built on the host
from the host lengths and uploaded once (:func:`attnops._core.staging.cached_upload`: pinned, non-blocking, kept for
the next call); the kernels find their token from it (grids over ``(row, batch x head)``, the pairs folded into axes 1
and 2 past CUDA's 65535 programs per axis: :func:`.family.pair_grid`). Nothing is read back from the device, so the
plans never synchronise and a CUDA graph can capture them. Outputs the kernels fully write are allocated empty.
"""
from __future__ import annotations

import functools

import torch

from ...._core import staging
from ...._core.softmax_stats import FLT_LOWEST, FLT_MAX, STAT_LANES
from ...._core.triton.launch import Launch, cdiv, pow2, unit_last_stride
from ...._core.triton.support import interpreting
from ...._core.varlen import SeqInfo
from ..compress import CompressSpec
from ..selected import SelectedSpec
from ...common.inverted_lists import InvertedLists, list_chunk
from .family import KERNELS, head_tiles, key_tile, pair_grid, precision_flags, row_tile


def _new(shape, like: torch.Tensor, fill, dtype=None) -> torch.Tensor:
    """An output buffer: empty when the kernels write every element (``fill`` None), else filled with ``fill``."""
    dtype = like.dtype if dtype is None else dtype
    if fill is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    return torch.full(shape, fill, dtype=dtype, device=like.device)


# ------------------------------------------------------------------------------------------- selected attention
@functools.lru_cache(maxsize=256)
def _selected_geometry(seq: SeqInfo, block_size: int) -> tuple[tuple, int, int, int]:
    """``(rows of the per-batch table, selectable blocks NB, query tokens in a batch, keys in a selectable block)``
    (pure host arithmetic, memoized). A batch without queries has no blocks: no token selects its keys."""
    rows, base = [], 0
    for b in range(seq.batch):
        blocks = seq.kv_lens[b] // block_size if seq.q_lens[b] else 0
        rows.append((seq.q_starts[b], seq.q_lens[b], seq.kv_starts[b], blocks, base))
        base += blocks
    return tuple(rows), base, sum(seq.q_lens), base * block_size


def _batch_table(spec: SelectedSpec, device: torch.device) -> torch.Tensor:
    """int64 ``[B, 5]`` (``selected.BATCH_COLS``) on ``device``: uploaded once per geometry."""
    rows = _selected_geometry(spec.seq, spec.block_size)[0]
    return staging.cached_upload(("nsa.selected", rows), lambda: list(rows), torch.int64, device)


def _selected_common(spec: SelectedSpec, query: torch.Tensor, interpret: bool) -> dict:
    return dict(CAUSAL=spec.causal, BLOCK_G=pow2(spec.group), BLOCK_D=pow2(spec.d), BLOCK_DV=pow2(spec.dv),
                **precision_flags(query.dtype, interpret))


def _scalars(spec: SelectedSpec) -> tuple:
    return spec.scale, spec.n1, spec.group, spec.d, spec.dv, spec.block_size


def selected_forward_plan(spec: SelectedSpec, query, key, value, topk, interpret: bool):
    """``((attention_out, softmax_max, softmax_sum), launches)``; tokens outside every batch get out 0 and the
    invalid-row statistics."""
    seq = spec.seq
    covered = _selected_geometry(seq, spec.block_size)[2] == spec.total_q
    shape, stat = (spec.total_q, spec.n1, spec.dv), (spec.total_q, spec.n1, STAT_LANES)
    out = _new(shape, query, None if covered else 0.0)
    smax = _new(stat, query, None if covered else FLT_LOWEST, torch.float32)
    ssum = _new(stat, query, None if covered else FLT_MAX, torch.float32)
    if seq.max_q == 0:
        return (out, smax, ssum), []
    q, k, v, topk = (unit_last_stride(x) for x in (query, key, value, topk))
    grid, bh_fold, fold = pair_grid(seq.max_q, seq.batch, spec.n2)
    launch = Launch("selected_fwd_kernel", grid,
                    (q, k, v, topk, out, smax, ssum, _batch_table(spec, query.device), *q.stride()[:2],
                     *k.stride()[:2], *v.stride()[:2], *topk.stride()[:2], *out.stride()[:2], *_scalars(spec),
                     spec.block_count, spec.n2, seq.batch, bh_fold), {**_selected_common(spec, query, interpret),
                                                                       **fold})
    return (out, smax, ssum), [launch]


def _block_table(spec: SelectedSpec, device: torch.device) -> torch.Tensor:
    """int64 ``[NB, 3]`` (``selected.BLOCK_COLS``) on ``device``, one row per selectable block of every batch (its
    first key's row, its first key's local position, the batch's first query token): uploaded once per geometry."""
    rows = _selected_geometry(spec.seq, spec.block_size)[0]
    bs = spec.block_size
    return staging.cached_upload(
        ("nsa.selected.blocks", rows, bs),
        lambda: [(kv0 + j * bs, j * bs, q0) for q0, _, kv0, blocks, _ in rows for j in range(blocks)],
        torch.int64, device)


def selected_backward_plan(spec: SelectedSpec, query, key, value, attention_out, grad, softmax_max, softmax_sum,
                           topk, interpret: bool):
    """``((dq, dk, dv), launches, lists)``: ``D = rowsum(dO * O)`` and dQ per token, the inverted lists' keys, and
    dK/dV per chunk of a (selectable block, KV head) list, then the fixed-order sum of the split lists' partials
    (keys no token selected get 0). With ``lists`` (not None), :meth:`InvertedLists.schedule` must run before the
    last two launches (dK/dV and its reduction), as :func:`selected_backward` does."""
    seq, device = spec.seq, query.device
    _, n_blocks, queries, selectable = _selected_geometry(seq, spec.block_size)
    covered = queries == spec.total_q
    dq = _new(query.shape, query, None if covered else 0.0)
    dk, dv = (_new(t.shape, t, None if selectable == t.shape[0] else 0.0) for t in (key, value))
    if seq.max_q == 0:
        return (dq, dk, dv), [], None
    q, k, v, o, do, topk = (unit_last_stride(x) for x in (query, key, value, attention_out, grad, topk))
    smax, ssum = softmax_max.float().contiguous(), softmax_sum.float().contiguous()
    flags = _selected_common(spec, query, interpret)
    batches = _batch_table(spec, device)
    grid, bh_fold, fold = pair_grid(seq.max_q, seq.batch, spec.n2)
    delta = torch.empty((spec.total_q, spec.n1), dtype=torch.float32, device=device)
    delta_launch = Launch("selected_delta_kernel", (spec.total_q, spec.n2),
                          (o, do, delta, *o.stride()[:2], *do.stride()[:2], spec.n1, spec.group, spec.dv),
                          dict(BLOCK_G=flags["BLOCK_G"], BLOCK_DV=flags["BLOCK_DV"]))
    dq_launch = Launch("selected_dq_kernel", grid,
                       (q, k, v, do, dq, delta, smax, ssum, topk, batches, *q.stride()[:2], *k.stride()[:2],
                        *v.stride()[:2], *do.stride()[:2], *dq.stride()[:2], *topk.stride()[:2], *_scalars(spec),
                        spec.block_count, spec.n2, seq.batch, bh_fold), {**flags, **fold})
    if n_blocks == 0:
        return (dq, dk, dv), [delta_launch, dq_launch], None
    keys = _new((spec.total_q, spec.n2, spec.block_count), query, None if covered else spec.n2 * n_blocks,
                torch.int64)
    lists = InvertedLists.allocate(keys, spec.n2 * n_blocks,
                                   list_chunk(keys.numel(), spec.n2 * n_blocks, spec.group, interpret),
                                   spec.block_size, (spec.d, spec.dv), spec.n2 * spec.block_count)
    keys_launch = Launch("selected_keys_kernel", grid,
                         (topk, lists.keys, batches, *topk.stride()[:2], spec.n2, n_blocks, spec.block_count,
                          seq.batch, bh_fold), dict(BLOCK_S=pow2(spec.block_count, 1), **fold))
    tiles = cdiv(spec.block_size, key_tile(spec.block_size, query.dtype, interpret))
    blocks = _block_table(spec, device)
    dkdv_flags = {name: flags[name] for name in ("CAUSAL", "BLOCK_DV", "UPCAST", "PRECISION")}
    dkdv_flags.update(zip(("BLOCK_D", "BLOCK_DT", "SPLIT_D"), head_tiles(spec.d)))
    dkdv_launch = Launch("selected_dkdv_kernel", (lists.unit_ids.numel() * tiles,),
                         (q, k, v, do, dk, dv, lists.part_k, lists.part_v, delta, smax, ssum, blocks,
                          lists.list_start, lists.token, lists.unit_list, lists.unit_end, lists.slot_end,
                          *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *do.stride()[:2], *dk.stride()[:2],
                          *dv.stride()[:2], spec.scale, spec.n1, spec.n2, spec.group, spec.d, spec.dv,
                          spec.block_size, n_blocks, lists.chunk), dkdv_flags)
    reduce_launch = Launch("selected_dkdv_reduce_kernel", (spec.n2 * n_blocks * tiles,),
                           (dk, dv, lists.part_k, lists.part_v, blocks, lists.list_start, lists.slot_end,
                            *dk.stride()[:2], *dv.stride()[:2], spec.scale, spec.d, spec.dv, spec.block_size,
                            n_blocks, lists.chunk), dict(BLOCK_D=flags["BLOCK_D"], BLOCK_DV=flags["BLOCK_DV"]))
    return (dq, dk, dv), [delta_launch, dq_launch, keys_launch, dkdv_launch, reduce_launch], lists


def selected_forward(spec: SelectedSpec, query, key, value, topk):
    outputs, launches = selected_forward_plan(spec, query, key, value, topk, interpreting(query.device))
    KERNELS.run_all(launches, query.device)
    return outputs


def selected_backward(spec: SelectedSpec, query, key, value, attention_out, grad, softmax_max, softmax_sum, topk):
    outputs, launches, lists = selected_backward_plan(spec, query, key, value, attention_out, grad, softmax_max,
                                                      softmax_sum, topk, interpreting(query.device))
    if lists is None:
        KERNELS.run_all(launches, query.device)
        return outputs
    KERNELS.run_all(launches[:-2], query.device)
    lists.schedule()
    KERNELS.run_all(launches[-2:], query.device)
    return outputs


# ------------------------------------------------------------------------------------------------- compression
@functools.lru_cache(maxsize=256)
def _compress_geometry(spec: CompressSpec) -> tuple[tuple, int, int, int]:
    """``(rows of the per-batch table, largest batch's rows, largest batch, tokens in the batches)`` (memoized)."""
    rows, base = [], 0
    for b, (start, length) in enumerate(zip(spec.starts, spec.lengths)):
        rows.append((start, length, spec.blocks(b), base))
        base += spec.blocks(b)
    return tuple(rows), max((r[2] for r in rows), default=0), max(spec.lengths, default=0), sum(spec.lengths)


def _compress_table(spec: CompressSpec, device: torch.device) -> torch.Tensor:
    """int64 ``[B, 4]`` (``compress.BATCH_COLS``) on ``device``: uploaded once per geometry."""
    rows = _compress_geometry(spec)[0]
    return staging.cached_upload(("nsa.compress", rows), lambda: list(rows), torch.int64, device)


def compress_forward_plan(spec: CompressSpec, input, weight, interpret: bool):
    """``(output [C, N, D], launches)``."""
    t, n, d = input.shape
    out = torch.empty((spec.total_blocks, n, d), dtype=input.dtype, device=input.device)
    if out.shape[0] == 0 or n == 0:
        return out, []
    x, w, batches = unit_last_stride(input), weight.float(), len(spec.lengths)
    grid, bh_fold, fold = pair_grid(cdiv(_compress_geometry(spec)[1], row_tile(interpret)), batches, n)
    launch = Launch("compress_fwd_kernel", grid,
                    (x, w, out, _compress_table(spec, input.device), *x.stride()[:2], *w.stride(), *out.stride()[:2],
                     d, spec.block, spec.stride, n, batches, bh_fold), dict(BLOCK_D=pow2(d), **fold))
    return out, [launch]


def compress_backward_plan(spec: CompressSpec, output_grad, input, weight, interpret: bool):
    """``((input_grad, weight_grad_partials), launches)``: the fp32 partials ``[B * programs, l, N]`` are summed in
    program order by :func:`compress_backward`."""
    t, n, d = input.shape
    _, max_rows, max_len, tokens = _compress_geometry(spec)
    batches = len(spec.lengths)
    dx = _new(input.shape, input, None if tokens == t else 0.0)
    programs = cdiv(max_rows, row_tile(interpret))
    parts = _new((batches * programs, spec.block, n), input, None if n and max_len else 0.0, torch.float32)
    if max_len == 0 or n == 0:
        return (dx, parts), []
    x, dy = unit_last_stride(input), unit_last_stride(output_grad)
    table = _compress_table(spec, input.device)
    dx_grid, bh_fold, dx_fold = pair_grid(cdiv(max_len, row_tile(interpret)), batches, n)
    w = weight.float()
    dx_launch = Launch("compress_dx_kernel", dx_grid,
                       (dy, w, dx, table, *dy.stride()[:2], *w.stride(), *dx.stride()[:2], d, spec.block,
                        spec.stride, n, batches, bh_fold), dict(BLOCK_D=pow2(d), **dx_fold))
    dw_grid, _, dw_fold = pair_grid(programs, batches, n)
    dw_launch = Launch("compress_dw_kernel", dw_grid,
                       (x, dy, table, parts, *x.stride()[:2], *dy.stride()[:2], n, d, spec.block, spec.stride,
                        batches, bh_fold), dict(BLOCK_D=pow2(d), **dw_fold))
    return (dx, parts), [dx_launch, dw_launch]


def compress_forward(spec: CompressSpec, input, weight):
    out, launches = compress_forward_plan(spec, input, weight, interpreting(input.device))
    KERNELS.run_all(launches, input.device)
    return out


def compress_backward(spec: CompressSpec, output_grad, input, weight):
    """``(input_grad, weight_grad)``; the weight gradient is the fixed-order sum of the programs' partials."""
    (dx, parts), launches = compress_backward_plan(spec, output_grad, input, weight, interpreting(input.device))
    KERNELS.run_all(launches, input.device)
    return dx, parts.sum(0).to(weight.dtype)
