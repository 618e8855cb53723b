"""Ring attention: FlashAttention over a sequence sharded across a process group (load-balanced, causal or full).

Each rank holds query/key/value chunks ``r`` and ``2P-1-r`` (:mod:`.sharding`). KV shards travel around the ring
(P-1 steps of ``isend``/``irecv`` posted before the step's compute, so transfer overlaps compute). At every step each
(query chunk, KV chunk) pair is one :func:`attnops.flash_attention` call with the chunks' global positions:
causal pairs above the diagonal are skipped, diagonal pairs are causal (``causal=True``: equal chunk lengths, no
mask tensor), ALiBi gets the chunks' global ``q_start_idx``/``kv_start_idx``, dropout a pair-specific Philox
offset. Partial results are merged with the softmax statistics
(:func:`attnops.ops.attention_update.merge_softmax_stats`, fp32 accumulation).

The backward replays the ring: every pair calls :func:`attnops.flash_attention_backward` with the *merged*
output and statistics (never recomputed); dK/dV partial sums (fp32) travel with a one-step lag behind the KV, so
their transfer overlaps the next step's compute, and reach their owner after the last step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._core.checks import Described, require
from .._core.dropout import check_seed_offset, draw_seed
from .._core.layouts import tokens_view
from .._core.softmax_stats import stats_dtype
from .._core.varlen import cumulative_from_cu_seqlens, lengths_from_cumulative
from ..ops.attention_update import merge_softmax_stats, tnd_to_blocked
from ..ops.flash_attention import FlashAttentionResult, flash_attention, flash_attention_backward
from .comm import GroupInfo, RingExchange, broadcast_seed, check_same_across_ranks, group_info
from .sharding import RingChunks, chunk_ids, head_geometry

__all__ = ["ring_flash_attention"]


def to_internal(x: Tensor, layout: str, heads: int | None) -> Tensor:
    """Dense layouts -> a BNSD view; TND unchanged."""
    return x if layout == "TND" else tokens_view(x, layout, heads).permute(0, 2, 1, 3)


def from_internal(x: Tensor, layout: str) -> Tensor:
    """Inverse of :func:`to_internal` (a view)."""
    if layout in ("TND", "BNSD"):
        return x
    bsnd = x.permute(0, 2, 1, 3)
    if layout == "BSND":
        return bsnd
    return bsnd.flatten(2) if layout == "BSH" else bsnd.permute(1, 0, 2, 3).flatten(2)


@dataclass(frozen=True)
class RingPlan:
    """Everything one ring call needs besides the tensors: group, chunks and the per-pair operator options."""

    info: GroupInfo
    chunks: RingChunks
    causal: bool
    scale: float
    pse: Tensor | None
    pse_type: int
    keep_prob: float
    seed: int
    offset: int
    pair_numels: int  # dropout elements of one (query chunk, KV chunk) pair

    def pairs(self, src: int):
        """``(query chunk j, KV chunk j, flash_attention keywords)`` of the step whose KV came from rank ``src``."""
        p2 = 2 * self.info.size
        for qj, gq in enumerate(chunk_ids(self.info.rank, self.info.size)):
            for kj, gk in enumerate(chunk_ids(src, self.info.size)):
                if self.causal and gk > gq:
                    continue
                kw = dict(self.chunks.call_kwargs(), scale=self.scale)
                if self.causal and gk == gq:
                    kw.update(causal=True)  # a diagonal pair: equal chunk lengths, no mask tensor needed
                if self.pse is not None:
                    c = self.chunks.chunk_len
                    kw.update(pse=self.pse, pse_type=self.pse_type, q_start_idx=gq * c, kv_start_idx=gk * c)
                if self.keep_prob < 1.0:
                    kw.update(keep_prob=self.keep_prob, seed=self.seed,
                              offset=self.offset + (gq * p2 + gk) * self.pair_numels)
                yield qj, kj, kw


def _ring_forward(plan: RingPlan, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    ch, info = plan.chunks, plan.info
    q_chunks = [ch.take(q, 0), ch.take(q, 1)]
    acc: list[tuple[Tensor, Tensor, Tensor] | None] = [None, None]
    kv = [k.contiguous(), v.contiguous()]
    for step in range(info.size):
        exchange = RingExchange(info, kv) if step < info.size - 1 else None
        for qj, kj, kw in plan.pairs((info.rank - step) % info.size):
            res = flash_attention(q_chunks[qj], ch.take(kv[0], kj), ch.take(kv[1], kj), return_stats=True, **kw)
            part = (res.out.to(res.softmax_max.dtype), res.softmax_max, res.softmax_sum)
            acc[qj] = part if acc[qj] is None else merge_softmax_stats(*acc[qj], *part)
        if exchange is not None:
            kv = exchange.wait()
    out, smax, ssum = (ch.join(acc[0][i], acc[1][i]) for i in range(3))
    return out.to(q.dtype), smax, ssum


def _ring_backward(plan: RingPlan, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, smax: Tensor,
                   ssum: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    ch, info = plan.chunks, plan.info
    acc_dtype = stats_dtype(q.dtype)
    per_chunk = [[ch.take(t, j) for t in (q, dout, out, smax, ssum)] for j in (0, 1)]
    dq = [torch.zeros(c[0].shape, dtype=acc_dtype, device=q.device) for c in per_chunk]
    kv = [k.contiguous(), v.contiguous()]
    pending = None  # dK/dV partial sums in flight from the previous rank
    for step in range(info.size):
        exchange = RingExchange(info, kv) if step < info.size - 1 else None
        dkv = [torch.zeros(t.shape, dtype=acc_dtype, device=t.device) for t in kv]
        for qj, kj, kw in plan.pairs((info.rank - step) % info.size):
            qc, dyc, oc, mc, sc = per_chunk[qj]
            dqc, dkc, dvc, _ = flash_attention_backward(dyc, qc, ch.take(kv[0], kj), ch.take(kv[1], kj), oc, mc, sc,
                                                        **kw)
            dq[qj] += dqc
            ch.add_(dkv[0], kj, dkc)
            ch.add_(dkv[1], kj, dvc)
        if pending is not None:
            for mine, theirs in zip(dkv, pending.wait()):
                mine += theirs
        pending = RingExchange(info, dkv, tag_base=2) if info.size > 1 else None
        if exchange is not None:
            kv = exchange.wait()
    dk, dv = pending.wait() if pending is not None else dkv
    return ch.join(dq[0], dq[1]).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, plan: RingPlan):
        out, smax, ssum = _ring_forward(plan, query, key, value)
        ctx.save_for_backward(query, key, value, out, smax, ssum)
        ctx.plan = plan
        ctx.mark_non_differentiable(smax, ssum)
        return out, smax, ssum

    @staticmethod
    def backward(ctx, dout, _dmax, _dsum):
        q, k, v, out, smax, ssum = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.plan, dout.contiguous(), q, k, v, out, smax, ssum)
        return dq, dk, dv, None


def _chunk_lens(layout, q, k, world_size, cu_seqlens, actual_seq_len) -> list[int]:
    """Per-sequence chunk lengths ``S_b / 2P`` after checking the local shapes against the global lengths."""
    parts = 2 * world_size
    if layout != "TND":
        require(cu_seqlens is None and actual_seq_len is None, "actual_seq_len",
                "None for dense layouts (sequence lengths are for layout 'TND')", actual_seq_len)
        s, skv = q.shape[2], k.shape[2]
        require(skv == s, "key", f"the query's local sequence length {s} (ring attention is self-attention)",
                Described(f"{skv}"))
        require(s % 2 == 0 and s > 0, "query", "a local sequence of two equal chunks (even length > 0)",
                Described(f"S={s}"))
        return [s // 2]
    if cu_seqlens is not None:
        require(actual_seq_len is None, "cu_seqlens", "either cu_seqlens (leading 0) or actual_seq_len, not both",
                Described("both"))
        actual_seq_len = cumulative_from_cu_seqlens("cu_seqlens", cu_seqlens)
    require(actual_seq_len is not None, "actual_seq_len",
            "the global cumulative sequence lengths (or cu_seqlens) for layout TND", None)
    lens = lengths_from_cumulative("actual_seq_len", actual_seq_len)
    require(all(n > 0 and n % parts == 0 for n in lens), "actual_seq_len",
            f"global sequence lengths > 0 divisible by 2 * world_size = {parts}", lens)
    local = sum(lens) // world_size
    for name, t in (("query", q), ("key", k)):
        require(t.shape[0] == local, name, f"{local} local tokens (the global lengths / world_size)", t)
    return [n // parts for n in lens]


def ring_flash_attention(query: Tensor, key: Tensor, value: Tensor, *, group=None, layout: str = "BNSD",
                         head_num: int | None = None, scale: float | None = None, causal: bool = False,
                         pse: Tensor | None = None, pse_type: int = 2, cu_seqlens=None, actual_seq_len=None,
                         keep_prob: float = 1.0, seed: int | None = None, offset: int = 0,
                         softmax_layout: str = "", return_stats: bool = False):
    """Ring (context-parallel) FlashAttention over the ranks of ``group``; differentiable.

    Inputs are this rank's load-balanced shards (:func:`attnops.distributed.ring_shard`): global chunks ``r`` and
    ``2P-1-r`` of every sequence. Dense layouts as :func:`attnops.flash_attention` (key/value: same sequence
    length, GQA and Dv < D allowed); TND with the *global* ``actual_seq_len`` (cumulative, no leading 0) or
    ``cu_seqlens`` (leading 0), each length divisible by ``2P``. ``causal`` selects causal self-attention;
    ``pse``: ALiBi slopes ``[N]``/``[B, N]`` (``pse_type`` 2 or 3) at global positions. Dropout: ``keep_prob`` with a
    group-wide ``seed`` (drawn on group rank 0 and broadcast when None) and ``offset``; the call consumes the same
    number of Philox elements as one single-device call (see :func:`attnops.distributed.ring_dropout_mask`).
    Returns the local output, or a :class:`attnops.FlashAttentionResult` with the local merged statistics
    (dense ``[B, N, 2c, 8]``; TND ``[T_local, N, 8]`` in ``softmax_layout``) when ``return_stats`` is true.
    """
    args = dict(locals())
    info = group_info(group)
    check_same_across_ranks(info, query.device, **args)
    layout, n1, d, n2 = head_geometry(query, key, layout, head_num)
    q, k, v = to_internal(query, layout, n1), to_internal(key, layout, n2), to_internal(value, layout, n2)
    lens = _chunk_lens(layout, q, k, info.size, cu_seqlens, actual_seq_len)
    require(softmax_layout == "" or (softmax_layout == "TND" and layout == "TND"), "softmax_layout",
            "'' (or 'TND' for layout TND)", softmax_layout)
    if pse is not None:
        require(pse_type in (2, 3), "pse_type", "2 or 3 (ALiBi slopes; pse tensors cannot follow a sharded "
                "sequence)", pse_type)
        require(len(set(lens)) == 1, "pse", "TND sequences of equal length with ALiBi (one q_start_idx per call)",
                lens)
    drop_seed, offset = check_seed_offset(0 if seed is None else seed, offset)
    if keep_prob < 1.0 and seed is None:
        drop_seed = broadcast_seed(info, draw_seed(), query.device)
    pair_numels = n1 * sum(c * c for c in lens) * (1 if layout == "TND" else q.shape[0])
    plan = RingPlan(info, RingChunks(layout == "TND", lens), bool(causal), float(d ** -0.5 if scale is None else scale),
                    pse, pse_type, float(keep_prob), drop_seed, offset, pair_numels)
    out, smax, ssum = _RingFlashAttention.apply(q, k, v, plan)
    out = from_internal(out, layout)
    if not return_stats:
        return out
    if layout == "TND" and softmax_layout == "":
        smax, ssum = (tnd_to_blocked(s.contiguous(), [2 * c for c in lens]) for s in (smax, ssum))
    return FlashAttentionResult(out, smax, ssum, plan.seed, plan.offset)
