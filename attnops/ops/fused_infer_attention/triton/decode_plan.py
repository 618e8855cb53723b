"""The host arithmetic of the Triton FIA decode kernels, done once per batch composition (FlashInfer's ``plan``):
the work list, the partial buffers and every kernel argument that does not change from call to call.

Work list: batch ``b`` gets ``splits[b]`` units (KV chunks), each a program per KV head. The plan aims for at least
:data:`WAVES` programs per SM (264 on an H100, whatever the KV head count: MQA included). With the KV lengths on the
host, one unit length serves the whole batch, balanced over its TOTAL KV tokens (:func:`balanced_chunk`), so one long
sequence among short ones is split and the short ones are not. With the lengths on the device (a capacity plan), every
batch gets the same number of units, sized for the batch count and the capacity; the kernels cut each batch's actual
columns into that many chunks. Either way the kernels take any length up to the capacity fixed here (paged: the block
table's columns x block size; dense: the KV S), so one plan serves calls whose lengths change: a CUDA graph of
:func:`launch.run` stays correct when new lengths and block tables are written into the captured tensors.

Host metadata (work list, per-batch query facts, paddings, antiquant strides) goes up with
:func:`attnops._core.staging.cached_upload`: pinned, non-blocking, and kept at one address per distinct value.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ...._core import staging
from ...._core.masks import INF
from ...._core.triton.launch import cdiv, placeholder, pow2, unit_last_stride
from ..problem import FIAProblem
from .family import INTERPRET_TILE, MIN_ROWS, precision_flags
from .kv_args import antiquant_args, nz_x, storage
from .out_args import output_args

SPLIT_GRAIN = 64  # GPU unit lengths are multiples of every tile width
INTERPRET_SPLIT = 32  # Triton's interpreter: small units, so tiny tests cover several
MAX_INTERPRET_SPLITS = 64  # Triton's interpreter: units per batch of a capacity plan
WAVES = 2  # programs per SM the plan aims for (the split kernel fits two per SM)
MERGE_SPLITS = 32  # units the merge kernel reads per step


@dataclass(frozen=True)
class DecodePlan:
    """Everything the decode launches need but the call's query, caches, block table and KV lengths.

    ``split_args``/``merge_args``: the kernels' arguments after the per-call ones; ``split_consts``/
    ``merge_consts``: their constexprs. ``query_shape``, ``key_shape``, ... are what a call must match."""

    batch: int
    n1: int
    n2: int
    rows: int  # query rows per batch (padded to the longest)
    in_layout: str
    paged: bool
    units: int
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    lse_shape: tuple[int, ...]
    out_zeroed: bool  # some output rows are written by no program (TND tokens past the last batch)
    merge_rows: int  # second extent of the merge grid
    device: torch.device
    query_shape: tuple[int, ...]
    query_dtype: torch.dtype
    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]
    kv_dtype: torch.dtype
    table_shape: tuple[int, ...] | None
    capacity: int
    lengths: torch.Tensor  # the KV lengths a call without its own uses (int32 [B] or [1])
    split_args: tuple
    merge_args: tuple
    split_consts: dict
    merge_consts: dict


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (an H100's 132 off CUDA: dry runs and ahead-of-time compilation)."""
    return _cuda_sm_count(device.index or 0) if device.type == "cuda" else 132


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def target_units(n2: int, device: torch.device) -> int:
    """Units (programs per KV head) that give ``WAVES`` programs per SM of ``device``."""
    return cdiv(WAVES * _sm_count(device), n2)


def balanced_chunk(kv_lens: list[int], target: int, grain: int) -> int:
    """The unit length (a multiple of ``grain``) for host lengths: the largest that still gives ``target`` units
    (``sum(ceil(len / chunk)) >= target``, binary search), and no more than the batch's mean share
    ``total / target``, so one long sequence among short ones is split into units of the common size."""
    lens = np.asarray(kv_lens, dtype=np.int64)
    share = cdiv(cdiv(max(int(lens.sum()), 1), target), grain)  # in grains
    lo, hi = 1, max(min(cdiv(int(lens.max(initial=0)), grain), share), 1)  # the largest enough in [lo, hi], else lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if int((-(-lens // (mid * grain))).sum()) >= target:
            lo = mid
        else:
            hi = mid - 1
    return lo * grain


def split_counts(kv_lens: list[int] | None, batch: int, n2: int, capacity: int, device: torch.device,
                 interpret: bool) -> tuple[torch.Tensor, int]:
    """``(splits [B] int64 on the CPU, chunk grain)``: units per batch of :func:`balanced_chunk` over the host
    lengths ``kv_lens``, or, when they are on the device (None), the same count for every batch: the
    :func:`target_units` shared among the batches, at most one per grain of the capacity."""
    grain = INTERPRET_TILE if interpret else SPLIT_GRAIN
    if kv_lens is None:
        most = max(cdiv(capacity, INTERPRET_SPLIT if interpret else grain), 1)
        n = min(MAX_INTERPRET_SPLITS, most) if interpret else min(cdiv(target_units(n2, device), batch), most)
        return torch.full((batch,), n), grain
    chunk = INTERPRET_SPLIT if interpret else balanced_chunk(kv_lens, target_units(n2, device), grain)
    return torch.from_numpy(np.maximum(-(-np.asarray(kv_lens, dtype=np.int64) // chunk), 1)), grain


def _work_tables(splits: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(work [W, 2] = (batch, split), batches [B, 2] = (first unit, splits), W, max splits)`` on ``device``."""
    first = splits.cumsum(0) - splits
    units = int(splits.sum())
    key = ("fia-work", splits.numpy().tobytes())

    def work():
        b = torch.repeat_interleave(torch.arange(len(splits)), splits)
        return torch.stack([b, torch.arange(units) - first[b]], 1)

    return (staging.cached_upload(key, work, torch.int32, device),
            staging.cached_upload(key + ("batches",), lambda: torch.stack([first, splits], 1), torch.int32, device),
            units, int(splits.max()))


def _pse_args(p: FIAProblem, device: torch.device) -> tuple[list, bool]:
    """The pse ``[B|1, N1, >= Q_S, >= KV_S]`` (read at the left-padding offsets), its batch, head and row strides."""
    if p.pse_shift is None:
        return [placeholder(device), 0, 0, 0], False
    t = unit_last_stride(p.pse_shift)
    return [t, t.stride(0) if t.shape[0] > 1 else 0, t.stride(1), t.stride(2)], True


def _mask_args(p: FIAProblem, device: torch.device) -> tuple[list, bool]:
    """The explicit mask ``[Bm, 1, R, C]`` (bool read as uint8; non-zero = masked), its batch and row strides."""
    e = p.rule.explicit
    if e is None:
        return [placeholder(device, torch.uint8), 0, 0], False
    e = unit_last_stride(e)
    e = e.view(torch.uint8) if e.dtype == torch.bool else e
    return [e, e.stride(0) if e.shape[0] > 1 else 0, e.stride(2)], True


def _side_cols(p: FIAProblem) -> int:
    """The columns every row of the pse and of the explicit mask has (the least of their widths; 0 without)."""
    widths = [t.shape[-1] for t in (p.pse_shift, p.rule.explicit) if t is not None]
    return min(widths, default=0)


def _padding(value, device: torch.device) -> torch.Tensor:
    """A left padding as a device scalar the kernels read (a device tensor as given)."""
    if isinstance(value, torch.Tensor):
        return value
    return staging.cached_upload(("fia-padding", value), lambda: [value], torch.int64, device)


def _varlen_meta(p: FIAProblem, device: torch.device) -> torch.Tensor:
    """int32 ``[B, 3]`` per-batch query rows and (TND) first query and key tokens."""
    tnd = p.source.in_layout == "TND"
    rows = [(n, p.row_starts[b] if tnd else 0, p.kv_starts[b] if tnd else 0) for b, n in enumerate(p.seq.q_lens)]
    return staging.cached_upload(("fia-qmeta", tuple(rows)), lambda: rows, torch.int32, device)


def out_strides(layout: str, shape: tuple[int, ...], heads: int) -> tuple[int, int, int]:
    """(batch, token, head) element strides of a contiguous output of ``shape`` in ``layout``."""
    if layout == "TND":
        return 0, shape[1] * shape[2], shape[2]
    if layout == "BNSD":
        return shape[1] * shape[2] * shape[3], shape[3], shape[2] * shape[3]
    token = shape[2] * shape[3] if layout == "BSND" else shape[2]
    return shape[1] * token, token, token // heads


def lengths_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """Host KV lengths as the int32 device tensor the kernels read (one upload per distinct list)."""
    host = torch.tensor(values, dtype=torch.int32)
    return staging.cached_upload(("fia-lengths", host.numpy().tobytes()), lambda: host, torch.int32, device)


def make_plan(p: FIAProblem, interpret: bool, lengths_on_host: bool = True) -> DecodePlan:
    """The plan of a problem the decode verifier accepted. ``lengths_on_host``: balance the work over ``p``'s host
    KV lengths; otherwise (or when they are on the device) plan for the capacity."""
    src, device = p.source, p.device
    key, value, query = src.key, src.value, src.query
    batch, sq, tnd = p.batch, p.q_rows, src.in_layout == "TND"
    paged = src.kind == "paged"
    capacity = src.block_table.shape[1] * src.block_size if paged else src.kv_s
    host_lens = list(p.seq.kv_lens) if src.kv_lengths is None and lengths_on_host else None
    splits, grain = split_counts(host_lens, batch, p.n2, capacity, device, interpret)
    work, batches, units, max_splits = _work_tables(splits, device)
    row_count = units * p.n1 * sq
    pm, pl = (torch.empty(row_count, dtype=torch.float32, device=device) for _ in range(2))
    po = torch.empty(row_count * p.dv, dtype=torch.float32, device=device)
    lengths = src.kv_lengths if src.kv_lengths is not None else lengths_tensor(list(p.seq.kv_lens), device)
    qmeta = _varlen_meta(p, device) if src.q_lens_given else placeholder(device, torch.int32)
    q_pad = _padding(src.query_padding, device) if src.query_padding is not None else placeholder(device, torch.int64)
    kv_pad = _padding(src.kv_padding, device) if src.kv_padding is not None else placeholder(device, torch.int64)
    pse, has_pse = _pse_args(p, device)
    mask, has_mask = _mask_args(p, device)
    antiquant, aq_flags = antiquant_args(p, device, placeholder(device))
    band = p.rule.band  # FIA's bands shift both sides by Skv_b - Sq_b or neither (an unbounded side stays so)
    lo, hi = max(band.lo, -INF), min(band.hi, INF)
    has_band = lo > -INF or hi < INF
    num_blocks = key.shape[0] if paged else 1
    flags = dict(GRAIN=grain, VARLEN=src.q_lens_given, Q_LEFT=src.query_padding is not None,
                 KV_LEFT=src.kv_padding is not None, HAS_BAND=has_band, ALIGN=(band.lo_delta or band.hi_delta) and has_band)
    split_consts = dict(BLOCK_R=pow2(p.group * sq, MIN_ROWS), BLOCK_D=pow2(p.d), BLOCK_DV=pow2(p.dv), **flags,
                        PAGED=paged, NZ_X=nz_x(key), K_QUANT=storage(key, p.key_quant is not None),
                        V_QUANT=storage(value, p.value_quant is not None), **aq_flags, HAS_PSE=has_pse,
                        HAS_EXPLICIT=has_mask, **precision_flags(query.dtype, interpret))
    split_args = (work, batches, qmeta, q_pad, kv_pad, pm, pl, po, *pse, *mask, *antiquant, src.q_s, src.kv_s,
                  capacity, _side_cols(p), src.block_size, num_blocks, lo, hi, p.scale, p.n1, p.group, sq, p.d, p.dv)
    quant_args, quant_strides, quant_flags = output_args(p, placeholder(device))
    out_st = out_strides(p.out_layout, p.out_shape, p.n1)
    lse_st = (0, p.n1, 1) if tnd else (p.n1 * p.lse_shape[2], 1, p.lse_shape[2])
    merge_args = (pm, pl, po, batches, qmeta, q_pad, kv_pad, *quant_args, *out_st, *lse_st, *quant_strides,
                  src.q_s, src.kv_s, capacity, lo, hi, p.n1, sq, p.dv)
    merge_consts = dict(BLOCK_S=min(pow2(max_splits, 2), MERGE_SPLITS), BLOCK_DV=pow2(p.dv), **flags, **quant_flags,
                        ZERO_FILL=not tnd)
    return DecodePlan(
        batch=batch, n1=p.n1, n2=p.n2, rows=sq, in_layout=src.in_layout, paged=paged, units=units,
        out_shape=p.out_shape, out_dtype=p.out_dtype, lse_shape=p.lse_shape,
        out_zeroed=tnd and sum(p.seq.q_lens) < src.q_s, merge_rows=sq if tnd else src.q_s, device=device,
        query_shape=tuple(query.shape), query_dtype=query.dtype, key_shape=tuple(key.shape),
        value_shape=tuple(value.shape), kv_dtype=key.dtype,
        table_shape=tuple(src.block_table.shape) if paged else None, capacity=capacity, lengths=lengths,
        split_args=split_args, merge_args=merge_args, split_consts=split_consts, merge_consts=merge_consts)
