"""DeepSeek-V4 sparse flash MLA in normal form: per batch, its query rows and the lengths of its two key sequences,
with where each logical key lives in the flat ``[M, D]`` key stores, and the visibility rules.

Query row ``i`` of a batch with ``Lq`` query rows and ``Lori`` uncompressed ("ori") keys sits at absolute position
``p = Lori - Lq + i``. It sees:

- ori keys ``j`` in ``[lo, hi)``: mask mode 4 (band) ``lo = max(p - win_left, 0)``, ``hi = min(p + win_right + 1,
  Lori)``; mode 3 (right-down causal) ``lo = 0``, the same ``hi``; mode 0 ``[0, Lori)``; a window of -1 is unbounded;
- compressed ("cmp") keys ``c < thr`` with ``thr = min(floor((Lcm - Lq + i + 1) / r), Lcmp)`` under cmp mask mode 3,
  ``min(floor(Lcm / r), Lcmp)`` under mode 0, where ``Lcm = Lcmp * r + residual`` (``Lori`` without a residual).
  With sparse indices (CSA) only the listed compressed positions below ``thr`` (:func:`selected_compressed`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

QUERY_LAYOUTS = ("BSND", "TND")
KV_LAYOUTS = ("BSND", "TND", "PA_BBND")
ORI_MASK_MODES = (0, 3, 4)
CMP_MASK_MODES = (0, 3)
MAX_CMP_RATIO = 128
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class KeyStore:
    """Where logical key ``j`` of batch ``b`` sits in a flat ``[M, D]`` store: ``starts[b] + j`` (contiguous layouts)
    or ``table[b, j // block_size] * block_size + j % block_size`` (paged; ``table`` int64)."""
    starts: tuple[int, ...] | None
    table: Tensor | None
    block_size: int

    def flat(self, b: int, pos: Tensor) -> Tensor:
        """Flat rows of logical positions ``pos`` (int64, non-negative, inside the batch's length; the caller masks
        any other position it passes as 0)."""
        if self.table is None:
            return pos + self.starts[b]
        return self.table[b, pos // self.block_size].clamp(min=0) * self.block_size + pos % self.block_size


@dataclass(frozen=True)
class Batch:
    """One batch: its first flat query row, query rows used (``q_len``), ori and cmp key counts and the ori length
    the cmp mask counts from (``cmp_mask_len``)."""
    q_start: int
    q_len: int
    ori_len: int
    cmp_len: int
    cmp_mask_len: int


@dataclass(frozen=True)
class Masks:
    ori_mode: int
    win_left: int
    win_right: int
    cmp_mode: int
    ratio: int

    @property
    def band_width(self) -> int | None:
        """How many ori keys a row sees at most under a finite band (mode 4, both windows >= 0), else None."""
        if self.ori_mode == 4 and self.win_left >= 0 and self.win_right >= 0:
            return self.win_left + self.win_right + 1
        return None


@dataclass(frozen=True)
class Problem:
    """A validated call: ``rows`` flat query rows (``[B*S1]`` or ``T1``; rows outside every batch's span are
    padding), the batches, both key stores (``cmp`` None without compressed keys) and whether the compressed keys are
    selected by indices (CSA) or taken as a causal prefix (HCA)."""
    rows: int
    batches: tuple[Batch, ...]
    ori: KeyStore
    cmp: KeyStore | None
    sparse: bool
    masks: Masks
    layout_q: str
    layout_kv: str

    def ori_bounds(self, b: Batch, i: Tensor) -> tuple[Tensor, Tensor]:
        """``[lo, hi)`` of the ori keys query rows ``i`` (int64) of batch ``b`` see (empty when ``hi <= lo``)."""
        m = self.masks
        p = b.ori_len - b.q_len + i
        if m.ori_mode == 0:
            return torch.zeros_like(i), torch.full_like(i, b.ori_len)
        hi = torch.full_like(i, b.ori_len) if m.win_right < 0 else (p + m.win_right + 1).clamp(max=b.ori_len)
        lo = torch.zeros_like(i) if m.ori_mode == 3 or m.win_left < 0 else (p - m.win_left).clamp(min=0)
        return lo, hi.clamp(min=0)

    def cmp_limit(self, b: Batch, i: Tensor) -> Tensor:
        """``thr``: how many leading compressed keys query rows ``i`` of batch ``b`` may see (0 without them)."""
        if self.cmp is None:
            return torch.zeros_like(i)
        r = self.masks.ratio
        if self.masks.cmp_mode == 0:
            return torch.full_like(i, min(b.cmp_mask_len // r, b.cmp_len))
        return torch.div(b.cmp_mask_len - b.q_len + i + 1, r, rounding_mode="floor").clamp(0, b.cmp_len)


def selected_compressed(indices: Tensor, limit: Tensor) -> Tensor:
    """Which entries of index rows ``indices [C, K]`` count under per-row limits ``limit [C]`` (bool ``[C, K]``): the
    first ``min(K, limit)`` entries up to the first negative one, those below ``limit`` (duplicates each count)."""
    idx = indices.to(torch.int64)
    first_negative = torch.where((idx < 0).any(1), (idx < 0).byte().argmax(1), idx.shape[1])
    count = torch.minimum(limit.clamp(max=idx.shape[1]), first_negative)
    return (torch.arange(idx.shape[1]) < count[:, None]) & (idx >= 0) & (idx < limit[:, None])


def compute_dtype(x: Tensor) -> torch.dtype:
    """fp64 inputs compute in fp64 (goldens, gradcheck), everything else in fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def lse_shape(q: Tensor, layout_q: str) -> tuple[int, ...]:
    """``softmax_lse``'s shape: ``[B, N2=1, S1, G=N1]`` (BSND query) or ``[N2=1, T1, G=N1]`` (TND)."""
    if layout_q == "BSND":
        return (q.shape[0], 1, q.shape[1], q.shape[2])
    return (1, q.shape[0], q.shape[1])


def flat_rows(x: Tensor, layout_q: str) -> Tensor:
    """A query-shaped tensor ``[B, S1, N, D]`` / ``[T1, N, D]`` as ``[R, N, D]``."""
    return x.flatten(0, 1) if layout_q == "BSND" else x
