"""KV all-gather context parallelism (MindSpeed's ``kvallgather``; ring-flash-attn's llama3 varlen form).

Every rank keeps its query rows and all-gathers K and V over the group; each local query segment attends to the
gathered keys it may see (causal: its sequence's prefix up to the segment's end, bottom-right aligned; full: the
whole sequence). The gather is an autograd function whose backward reduce-scatters dK/dV (fp32 sums) to their
owners, so the operator's own backward does the rest.

Two splits of the sequence over the ranks:

* ``"head_tail"`` (MindSpeed): each sequence cut into ``2P`` chunks, rank ``r`` holds chunks ``r`` and ``2P-1-r``
  (:func:`attnops.distributed.ring_shard`), so causal work is balanced; lengths divisible by ``2P``.
* ``"contiguous"`` (llama3): rank ``r`` holds rows ``[r*L, (r+1)*L)`` of the sequence (TND: of the packed tokens,
  sequences may straddle ranks); ``L = S/P`` (TND: ``T/P``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from .._core import staging
from .._core.checks import Described, check_choice, require
from .._core.layouts import normalize_layout
from .._core.softmax_stats import stats_dtype
from .._core.varlen import lengths_from_cumulative
from ..ops.flash_attention import flash_attention
from .comm import GroupInfo, all_gather, check_same_across_ranks, group_info, reduce_scatter
from .ring import from_internal, to_internal
from .sharding import SEQ_DIM, chunk_ids, head_geometry
from .ulysses import global_cumulative

__all__ = ["Segment", "SegmentBatches", "allgather_flash_attention", "allgather_sequence", "global_lens",
           "local_segments"]

Split = Literal["head_tail", "contiguous"]


@dataclass(frozen=True)
class Segment:
    """A run of local rows that lies in one sequence: local rows ``[local_start, +length)`` are global rows
    ``[start, +length)`` of the sequence occupying global rows ``[seq_start, seq_end)``."""

    local_start: int
    start: int
    length: int
    seq_start: int
    seq_end: int

    def kv_range(self, causal: bool) -> tuple[int, int]:
        """The global KV rows this segment attends to."""
        return self.seq_start, (self.start + self.length if causal else self.seq_end)


def local_segments(lens: list[int], rank: int, world_size: int, split: Split) -> list[Segment]:
    """The segments of ``rank``'s rows, in local order, for global sequence lengths ``lens`` (dense: one)."""
    segments, local = [], 0
    seq_starts = list(itertools.accumulate([0, *lens]))
    if split == "head_tail":
        for s0, n in zip(seq_starts, lens):
            c = n // (2 * world_size)
            for chunk in chunk_ids(rank, world_size):
                segments.append(Segment(local, s0 + chunk * c, c, s0, s0 + n))
                local += c
        return segments
    per_rank = seq_starts[-1] // world_size
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    for s0, s1 in zip(seq_starts, seq_starts[1:]):
        a, b = max(lo, s0), min(hi, s1)
        if a < b:
            segments.append(Segment(local, a, b - a, s0, s1))
            local += b - a
    return segments


@dataclass(frozen=True)
class GatherPlan:
    """How the rank-major concatenation of every rank's rows maps to global rows (``dim``: the sequence axis)."""

    info: GroupInfo
    dim: int
    lens: tuple[int, ...]
    split: str

    def _host_rows(self) -> Tensor:
        """Global row of each position of the rank-major concatenation."""
        return torch.cat([torch.arange(s.start, s.start + s.length)
                          for r in range(self.info.size)
                          for s in local_segments(list(self.lens), r, self.info.size, self.split)])

    def rows(self, device: torch.device, inverse: bool) -> Tensor:
        def build():
            rows = self._host_rows()
            return torch.empty_like(rows).scatter_(0, rows, torch.arange(rows.numel())) if inverse else rows
        return staging.cached_upload(("allgather_rows", self.lens, self.split, self.info.size, inverse), build,
                                     torch.int64, device)


class _GatherKV(torch.autograd.Function):
    """All-gather of K or V into global row order; backward: the reduce-scatter of the gradient (fp32 sums)."""

    @staticmethod
    def forward(ctx, x: Tensor, plan: GatherPlan):
        ctx.plan = plan
        stacked = all_gather(x, plan.info)  # [P, ..., L, ...]
        rank_major = stacked.movedim(0, plan.dim).flatten(plan.dim, plan.dim + 1)
        return rank_major.index_select(plan.dim, plan.rows(x.device, inverse=True))

    @staticmethod
    def backward(ctx, grad: Tensor):
        plan = ctx.plan
        acc = grad.to(stats_dtype(grad.dtype)).index_select(plan.dim, plan.rows(grad.device, inverse=False))
        per_rank = acc.unflatten(plan.dim, (plan.info.size, -1)).movedim(plan.dim, 0)
        return reduce_scatter(per_rank, plan.info).to(grad.dtype), None


@dataclass(frozen=True)
class SegmentBatches:
    """The local segments as the batches of one packed (TND) call: query batch ``i`` is segment ``i``, key batch
    ``i`` the gathered rows it may see. ``q_cum``/``kv_cum``: cumulative lengths (CANN style)."""

    segments: tuple[Segment, ...]
    causal: bool

    @property
    def q_cum(self) -> list[int]:
        return list(itertools.accumulate(s.length for s in self.segments))

    @property
    def kv_cum(self) -> list[int]:
        return list(itertools.accumulate(hi - lo for lo, hi in (s.kv_range(self.causal) for s in self.segments)))

    def kv_rows(self, device: torch.device) -> Tensor:
        """The gathered rows of the key batches, concatenated."""
        return staging.cached_upload(
            ("allgather_kv_rows", self.segments, self.causal),
            lambda: torch.cat([torch.arange(*s.kv_range(self.causal)) for s in self.segments]), torch.int64, device)

    def keys(self, x: Tensor) -> Tensor:
        """The key batches' rows of a gathered ``[T, ...]`` tensor."""
        return x.index_select(0, self.kv_rows(x.device))


def _dense_attention(q: Tensor, k: Tensor, v: Tensor, segments: list[Segment], causal: bool, kw: dict) -> Tensor:
    """One BNSD call per segment: its query rows against the KV rows it may see (ALiBi at global positions)."""
    outs = []
    for s in segments:
        lo, hi = s.kv_range(causal)
        call = dict(kw, causal=causal)
        if "pse" in kw:  # ALiBi with Sq != Skv: bottom-right aligned, query rows start at Skv - Sq + q_start_idx
            call.update(pse_bottom_right=True, q_start_idx=(s.start - lo) - (hi - lo - s.length))
        outs.append(flash_attention(q.narrow(2, s.local_start, s.length), k.narrow(2, lo, hi - lo),
                                    v.narrow(2, lo, hi - lo), layout="BNSD", **call))
    return torch.cat(outs, 2)


def _packed_attention(q: Tensor, k: Tensor, v: Tensor, segments: list[Segment], causal: bool, kw: dict) -> Tensor:
    """One TND call: every segment is a sequence of its own, against its KV rows (bottom-right causal)."""
    batches = SegmentBatches(tuple(segments), causal)
    return flash_attention(q, batches.keys(k), batches.keys(v), layout="TND", causal=causal,
                           actual_seq_qlen=batches.q_cum, actual_seq_kvlen=batches.kv_cum, **kw)


def global_lens(layout: str, local: int, info: GroupInfo, split: str, cu_seqlens, actual_seq_len,
                name: str = "query") -> list[int]:
    """The global sequence lengths (dense: one) after checking them and the local length ``local`` (the rows of
    the argument ``name``) against ``split``."""
    check_choice("split", split, ("head_tail", "contiguous"))
    parts = 2 * info.size if split == "head_tail" else info.size
    if layout != "TND":
        require(cu_seqlens is None and actual_seq_len is None, "actual_seq_len",
                "None for dense layouts (sequence lengths are for layout 'TND')", actual_seq_len)
        require(local > 0 and (split == "contiguous" or local % 2 == 0), name,
                "a local sequence of two equal chunks (even length > 0)" if split == "head_tail" else
                "a local sequence of length > 0", Described(f"S={local}"))
        return [local * info.size]
    lens = lengths_from_cumulative("actual_seq_len", global_cumulative(cu_seqlens, actual_seq_len))
    if split == "head_tail":
        require(all(n > 0 and n % parts == 0 for n in lens), "actual_seq_len",
                f"global sequence lengths > 0 divisible by 2 * world_size = {parts}", lens)
    else:
        require(sum(lens) % parts == 0, "actual_seq_len", f"a total token count divisible by world_size = {parts}",
                lens)
    require(local * info.size == sum(lens), name,
            f"{sum(lens) // info.size} local tokens (the global total / world_size)", Described(f"{local}"))
    return lens


def allgather_sequence(x: Tensor, *, group=None, layout: str = "TND", cu_seqlens=None, actual_seq_len=None,
                       split: Split = "head_tail") -> Tensor:
    """The whole sequence of a sharded q/k/v-like tensor (this rank's rows in ``split``) in global order, on every
    rank; differentiable: the backward reduce-scatters the gradient (fp32 sums) to the owners. TND: the *global*
    ``actual_seq_len``/``cu_seqlens``."""
    args = dict(locals())
    info = group_info(group)
    check_same_across_ranks(info, x.device, **args)
    layout = normalize_layout("layout", layout)
    dim = SEQ_DIM[layout]
    lens = global_lens(layout, x.shape[dim], info, split, cu_seqlens, actual_seq_len, "x")
    return _GatherKV.apply(x, GatherPlan(info, dim, tuple(lens), split))


def allgather_flash_attention(query: Tensor, key: Tensor, value: Tensor, *, group=None, layout: str = "BSND",
                              head_num: int | None = None, scale: float | None = None, causal: bool = False,
                              pse: Tensor | None = None, pse_type: int = 2, cu_seqlens=None, actual_seq_len=None,
                              split: Split = "head_tail") -> Tensor:
    """KV all-gather context-parallel FlashAttention over the ranks of ``group``; differentiable.

    Inputs are this rank's rows of q/k/v in ``split`` ("head_tail": :func:`attnops.distributed.ring_shard`'s
    load-balanced chunks; "contiguous": rank ``r``'s ``1/P`` of the sequence, TND: of the packed tokens, llama3
    style). Dense layouts: key/value have the query's local length (self-attention); TND: the *global*
    ``actual_seq_len`` (cumulative) or ``cu_seqlens`` (leading 0). ``causal``: causal self-attention; GQA and
    Dv < D as :func:`attnops.flash_attention`; ``pse``: ALiBi slopes (``pse_type`` 2/3, dense layouts) at global
    positions. dK/dV are reduce-scattered back to their owners. Returns the local output.
    """
    args = dict(locals())
    info = group_info(group)
    check_same_across_ranks(info, query.device, **args)
    layout, n1, d, n2 = head_geometry(query, key, layout, head_num)
    q, k, v = to_internal(query, layout, n1), to_internal(key, layout, n2), to_internal(value, layout, n2)
    dim = 0 if layout == "TND" else 2
    require(k.shape[dim] == q.shape[dim], "key", f"the query's local sequence length {q.shape[dim]}",
            Described(f"{k.shape[dim]}"))
    lens = global_lens(layout, q.shape[dim], info, split, cu_seqlens, actual_seq_len)
    kw = dict(scale=float(d ** -0.5 if scale is None else scale))
    if pse is not None:
        require(pse_type in (2, 3), "pse_type", "2 or 3 (ALiBi slopes at global positions)", pse_type)
        require(layout != "TND", "pse", "None for layout TND (one ALiBi offset per operator call)", pse)
        kw.update(pse=pse, pse_type=pse_type)
    plan = GatherPlan(info, dim, tuple(lens), split)
    k_all, v_all = _GatherKV.apply(k, plan), _GatherKV.apply(v, plan)
    segments = local_segments(lens, info.rank, info.size, split)
    attend = _packed_attention if layout == "TND" else _dense_attention
    return from_internal(attend(q, k_all, v_all, segments, bool(causal), kw), layout)
