"""Host side of ``sparse_flash_mla``'s forward kernels: the per-batch table, strides, grids and outputs as a plan
``(outputs, [Launch, ...])`` (also compiled by ``python -m attnops aot``), run on :data:`KERNELS`.

Nothing is read back from the device: lengths, cumulative lengths, residuals, block tables and indices stay tensors.
The per-batch table (``sparse_flash_mla_kernels.T_*``) is computed from them by device ops (metadata given on the CPU
goes up first, pinned and without blocking), every length clamped to what its tensor holds; the kernels read it,
so the plan never synchronises and a CUDA graph can capture it. Host facts are shapes and attributes only. The kernels
write every element of the outputs (padding rows included), which are allocated empty. Arguments are validated by
the operator before they get here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ...._core import staging
from ...._core.triton.launch import Launch, placeholder, pow2, unit_last_stride
from ...._core.triton.support import interpreting, precision_flags
from ..validate import Args
from .sparse_flash_mla_family import KERNELS, head_tile, split_count, value_tile

UNBOUNDED = 1 << 40  # a window side without bound (more than any sequence)


def _on(x: Tensor | None, device: torch.device) -> Tensor | None:
    """Metadata as int64 on ``device`` (CPU metadata staged and copied without blocking; no value read)."""
    if x is None:
        return None
    if x.device == device:
        return x.to(torch.int64)
    return staging.upload(x, torch.int64, device)


def _used(used: Tensor | None, stored: Tensor, device: torch.device) -> Tensor:
    """Per-batch lengths: ``used`` clamped to ``[0, stored]``, or ``stored``."""
    return stored if used is None else torch.minimum(_on(used, device).clamp(min=0), stored)


def _segments(cu: Tensor, total: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(starts, lengths)`` of ``[B + 1]`` cumulative lengths, clamped to ``[0, total]`` (lengths >= 0)."""
    c = _on(cu, device).clamp(0, total)
    return c[:-1], (c[1:] - c[:-1]).clamp(min=0)


@dataclass(frozen=True)
class KeySide:
    """One key store as kernel arguments: the tensor, addressed as ``b * s_outer + (start + pos) * s_row`` (BSND,
    TND) or ``block * s_outer + (pos % page) * s_row`` (paged), its block table, per-batch first rows (TND) and
    lengths, and ``capacity``: the most keys a batch can hold (a host bound, for the decode split)."""

    kv: Tensor
    table: Tensor | None
    start: Tensor
    length: Tensor
    s_row: int
    s_outer: int
    page: int
    capacity: int

    def args(self, spare: Tensor) -> tuple:
        """``(kv, table, s_row, s_outer, table stride, page, blocks)`` (``spare`` for an absent table)."""
        table = spare if self.table is None else self.table
        return (self.kv, table, self.s_row, self.s_outer, 0 if self.table is None else self.table.stride(0),
                self.page, self.kv.shape[0] if self.table is not None else 1)


def _key_side(a: Args, kv: Tensor, table: Tensor | None, cu: Tensor | None, used: Tensor | None, batch: int,
              device: torch.device) -> KeySide:
    kv = unit_last_stride(kv)
    if a.layout_kv == "PA_BBND":
        capacity = table.shape[1] * kv.shape[1]
        stored = torch.full((batch,), capacity, dtype=torch.int64, device=device)
        table = table if table.device == device else staging.upload(table, table.dtype, device)
        return KeySide(kv, table, torch.zeros_like(stored), _used(used, stored, device), kv.stride(1), kv.stride(0),
                       kv.shape[1], capacity)
    if a.layout_kv == "TND":
        starts, stored = _segments(cu, kv.shape[0], device)
        return KeySide(kv, None, starts, _used(used, stored, device), kv.stride(0), 0, 1, kv.shape[0])
    stored = torch.full((batch,), kv.shape[1], dtype=torch.int64, device=device)
    return KeySide(kv, None, torch.zeros_like(stored), _used(used, stored, device), kv.stride(1), kv.stride(0), 1,
                   kv.shape[1])


@dataclass(frozen=True)
class Sides:
    """A call's query rows (flat ``[R, N1, D]``), batch count, per-batch table and key stores (``cmp`` None without
    compressed keys)."""

    q: Tensor
    batch: int
    table: Tensor
    ori: KeySide
    cmp: KeySide | None


def sides(a: Args) -> Sides:
    """The :class:`Sides` of a validated call, computed on q's device without reading a value."""
    device = a.q.device
    q = unit_last_stride(a.q).reshape(-1, *a.q.shape[-2:])
    if a.layout_q == "TND":
        batch = a.cu_seqlens_q.shape[0] - 1
        q_row, q_stored = _segments(a.cu_seqlens_q, q.shape[0], device)
    else:
        batch, s1 = a.q.shape[0], a.q.shape[1]
        q_row = torch.arange(batch, dtype=torch.int64, device=device) * s1
        q_stored = torch.full((batch,), s1, dtype=torch.int64, device=device)
    ori = _key_side(a, a.ori_kv, a.ori_block_table, a.cu_seqlens_ori_kv, a.seqused_ori_kv, batch, device)
    residual = _on(a.cmp_residual_kv, device)
    cmp, cmp_cols, mask_len = None, (torch.zeros_like(q_row), torch.zeros_like(q_row)), ori.length
    if a.cmp_kv is not None:
        cmp = _key_side(a, a.cmp_kv, a.cmp_block_table, a.cu_seqlens_cmp_kv, a.seqused_cmp_kv, batch, device)
        if a.layout_kv == "PA_BBND" and a.seqused_cmp_kv is None:  # derived from the ori lengths
            derived = torch.div(ori.length - (0 if residual is None else residual), a.cmp_ratio, rounding_mode="floor")
            cmp = replace(cmp, length=torch.minimum(derived.clamp(min=0), cmp.length))
        cmp_cols = (cmp.start, cmp.length)
        if residual is not None:
            mask_len = cmp.length * a.cmp_ratio + residual
    table = torch.stack([q_row, _used(a.seqused_q, q_stored, device), ori.start, ori.length, *cmp_cols, mask_len], 1)
    return Sides(q, batch, table.contiguous(), ori, cmp)


def window(a: Args) -> tuple[int, int]:
    """``(left, right)``: the ori keys of a token at position ``p`` are ``[p - left, p + right]``."""
    left = a.ori_win_left if a.ori_mask_mode == 4 and a.ori_win_left >= 0 else UNBOUNDED
    right = a.ori_win_right if a.ori_mask_mode in (3, 4) and a.ori_win_right >= 0 else UNBOUNDED
    return left, right


def _stream_bound(a: Args, s: Sides, k_count: int) -> int:
    """The most keys a token's stream can hold (host bound: window or ori capacity, plus index width or compressed
    capacity)."""
    left, right = window(a)
    ori = min(s.ori.capacity, left + right + 1)
    return ori + (0 if s.cmp is None else k_count if a.cmp_sparse_indices is not None else s.cmp.capacity)


def forward_plan(a: Args, interpret: bool):
    """``((out [R, N1, D], lse [R, N1] fp32), launches)`` of a validated call."""
    s = sides(a)
    rows, heads, dim = s.q.shape
    out = torch.empty(rows, heads, dim, dtype=a.q.dtype, device=a.q.device)
    lse = torch.empty(rows, heads, dtype=torch.float32, device=a.q.device)
    if out.numel() == 0:
        return (out, lse), []
    spare = placeholder(a.q.device)
    idx = None if a.cmp_sparse_indices is None else unit_last_stride(a.cmp_sparse_indices).reshape(rows, -1)
    k_count = 0 if idx is None else idx.shape[1]
    cmp = s.cmp or s.ori
    block_h, block_d = head_tile(heads, a.q.dtype, interpret), pow2(dim)
    head_tiles = -(-heads // block_h)
    splits = split_count(rows * head_tiles * -(-dim // value_tile(dim, False, interpret)),
                         _stream_bound(a, s, k_count), interpret)
    block_dv = value_tile(dim, splits > 1, interpret)
    dv_tiles = -(-dim // block_dv)
    tiles = head_tiles * dv_tiles
    ori_args, cmp_args = s.ori.args(spare), cmp.args(spare)
    key_args = (ori_args[0], cmp_args[0], spare if idx is None else idx, ori_args[1], cmp_args[1], s.table)
    strides = (*ori_args[2:], *cmp_args[2:])
    sizes = (k_count, s.batch, 1 if a.layout_q == "TND" else a.q.shape[1], heads, dim, dv_tiles)
    attrs = (*window(a), a.cmp_ratio, float(a.scale))
    flags = dict(Q_PACKED=a.layout_q == "TND", HAS_CMP=s.cmp is not None, SPARSE=idx is not None,
                 CMP_CAUSAL=a.cmp_mask_mode == 3, ORI_PAGED=s.ori.table is not None,
                 CMP_PAGED=cmp.table is not None, V_IS_K=block_dv >= dim, BLOCK_H=block_h, BLOCK_D=block_d,
                 BLOCK_DV=block_dv, **precision_flags(a.q.dtype, interpret))
    sinks = spare if a.sinks is None else a.sinks
    finish = dict(HAS_SINKS=a.sinks is not None, BLOCK_H=block_h, BLOCK_DV=block_dv)
    q_strides = (s.q.stride(0), s.q.stride(1))
    idx_stride = 0 if idx is None else idx.stride(0)
    if splits == 1:
        return (out, lse), [Launch("sparse_flash_mla_kernel", (rows, tiles),
                                   (s.q, *key_args, sinks, out, lse, *q_strides, out.stride(0), out.stride(1),
                                    idx_stride, *strides, *sizes, *attrs),
                                   dict(**flags, HAS_SINKS=a.sinks is not None))]
    pm, pl = (torch.empty(rows, heads, splits, dtype=torch.float32, device=a.q.device) for _ in range(2))
    pacc = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=a.q.device)
    return (out, lse), [
        Launch("sparse_flash_mla_split_kernel", (rows, tiles * splits),
               (s.q, *key_args, pm, pl, pacc, *q_strides, idx_stride, *strides, *sizes, splits, *attrs), flags),
        Launch("sparse_flash_mla_combine_kernel", (rows, tiles),
               (pm, pl, pacc, sinks, out, lse, out.stride(0), out.stride(1), heads, dim, dv_tiles, splits), finish)]


def forward(a: Args) -> tuple[Tensor, Tensor]:
    """``(out [R, N1, D], lse [R, N1])`` of a validated call on the kernels."""
    outputs, launches = forward_plan(a, interpreting(a.q.device))
    KERNELS.run_all(launches, a.q.device)
    return outputs
