"""Ulysses (DeepSpeed-Ulysses / MindSpeed) context parallelism: all-to-all from sequence shards to head shards.

Each rank holds a contiguous slice of the sequence (TND: of the packed tokens) with all heads. One all-to-all
gives every rank the whole sequence for ``N/P`` heads, :func:`attnops.flash_attention` runs on it, and the inverse
all-to-all returns the output to sequence shards. The all-to-alls are autograd functions whose backward is the
inverse exchange, so the operator's own backward does the rest. KV heads that do not split over the ranks are
repeated (``repeat_interleave``; their gradients sum back through autograd).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .._core.checks import Described, int_list, require
from .._core.dropout import check_seed_offset, draw_seed
from .._core.layouts import tokens_view
from .._core.varlen import cumulative_from_cu_seqlens, lengths_from_cumulative
from ..ops.flash_attention import flash_attention
from .comm import GroupInfo, all_to_all, broadcast_seed, check_same_across_ranks, group_info
from .sharding import head_geometry

__all__ = ["ulysses_flash_attention"]


def _seq_to_heads(x: Tensor, info: GroupInfo) -> Tensor:
    """``[B, s, N, D]`` (sequence shard, all heads) -> ``[B, P*s, N/P, D]`` (whole sequence, this rank's heads)."""
    b, s, n, d = x.shape
    p = info.size
    y = all_to_all(x.reshape(b, s, p, n // p, d).permute(2, 0, 1, 3, 4), info)
    return y.permute(1, 0, 2, 3, 4).reshape(b, p * s, n // p, d)


def _heads_to_seq(x: Tensor, info: GroupInfo) -> Tensor:
    """Inverse of :func:`_seq_to_heads`."""
    b, s_all, n, d = x.shape
    p = info.size
    y = all_to_all(x.reshape(b, p, s_all // p, n, d).permute(1, 0, 2, 3, 4), info)
    return y.permute(1, 2, 0, 3, 4).reshape(b, s_all // p, p * n, d)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, info: GroupInfo, to_heads: bool):
        ctx.info, ctx.to_heads = info, to_heads
        return _seq_to_heads(x, info) if to_heads else _heads_to_seq(x, info)

    @staticmethod
    def backward(ctx, grad):
        back = _heads_to_seq(grad, ctx.info) if ctx.to_heads else _seq_to_heads(grad, ctx.info)
        return back, None, None


def _from_bsnd(x: Tensor, layout: str) -> Tensor:
    if layout == "TND":
        return x.squeeze(0)
    if layout == "BSND":
        return x
    if layout == "BNSD":
        return x.permute(0, 2, 1, 3)
    return x.flatten(2) if layout == "BSH" else x.permute(1, 0, 2, 3).flatten(2)


def _kv_repeats(n1: int, n2: int, p: int, group_name: str) -> int:
    """Smallest repeat count ``u`` with ``N2*u`` divisible by P and dividing N1."""
    u = p // math.gcd(n2, p)
    require(n1 % (n2 * u) == 0, "key", f"KV heads that can be repeated to a multiple of the size of {group_name} = "
            f"{p} dividing the {n1} query heads", Described(f"N2={n2}"))
    return u


@dataclass(frozen=True)
class HeadShards:
    """q/k/v after the scatter: the whole (group-local) sequence for this rank's query heads, BSND (TND: ``[T, N, D]``).

    ``heads``: the local query head count; ``head_start``: the first global query head this rank holds."""

    q: Tensor
    k: Tensor
    v: Tensor
    heads: int
    head_start: int
    n1: int


def scatter_heads(query: Tensor, key: Tensor, value: Tensor, info: GroupInfo, layout: str, head_num: int | None,
                  group_name: str = "group") -> HeadShards:
    """All-to-all of sequence-sharded q/k/v (any layout) to head shards over ``info``'s group (differentiable).

    ``layout`` must be normalized (:func:`.sharding.head_geometry`); KV heads are repeated as needed; errors name
    ``group_name`` where the group size is the cause."""
    _, n1, _, n2 = head_geometry(query, key, layout, head_num)
    p = info.size
    as_bsnd = (lambda x, heads: x.unsqueeze(0) if layout == "TND" else tokens_view(x, layout, heads))
    q, k, v = as_bsnd(query, n1), as_bsnd(key, n2), as_bsnd(value, n2)
    require(n1 % p == 0, "query", f"a number of heads divisible by the size of {group_name} = {p}", Described(f"N1={n1}"))
    require(k.shape[1] == q.shape[1], "key", f"the query's local sequence length {q.shape[1]}", Described(f"{k.shape[1]}"))
    repeats = _kv_repeats(n1, k.shape[2], p, group_name)
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
    q, k, v = (_AllToAll.apply(x, info, True) for x in (q, k, v))
    if layout == "TND":
        q, k, v = (x.squeeze(0) for x in (q, k, v))
    heads = n1 // p
    return HeadShards(q, k, v, heads, info.rank * heads, n1)


def gather_heads(out: Tensor, info: GroupInfo, layout: str) -> Tensor:
    """Inverse of :func:`scatter_heads` for an output (``[B, S, N/P, Dv]``; TND ``[T, N/P, Dv]``), in ``layout``."""
    out = _AllToAll.apply(out.unsqueeze(0) if layout == "TND" else out, info, False)
    return _from_bsnd(out, layout)


def head_slice_pse(pse: Tensor | None, pse_type: int, shards: HeadShards) -> Tensor | None:
    """This rank's heads of ``pse`` (slopes ``[N]``/``[B, N]`` for types 2/3, ``[B|1, N, S, S]`` for 0/1)."""
    if pse is None:
        return None
    head_dim = pse.dim() - 1 if pse_type in (2, 3) else 1
    require(pse.dim() > max(head_dim, 0) and pse.shape[head_dim] == shards.n1, "pse",
            f"{shards.n1} heads on dim {head_dim}", pse)
    return pse.narrow(head_dim, shards.head_start, shards.heads)


def global_cumulative(cu_seqlens, actual_seq_len) -> list[int]:
    """The global cumulative lengths (CANN style) from either spelling; exactly one must be given."""
    if cu_seqlens is not None:
        require(actual_seq_len is None, "cu_seqlens", "either cu_seqlens or actual_seq_len, not both", Described("both"))
        actual_seq_len = cumulative_from_cu_seqlens("cu_seqlens", cu_seqlens)
    require(actual_seq_len is not None, "actual_seq_len", "the global cumulative lengths for layout TND", None)
    return int_list("actual_seq_len", actual_seq_len)


def ulysses_flash_attention(query: Tensor, key: Tensor, value: Tensor, *, group=None, layout: str = "BSND",
                            head_num: int | None = None, scale: float | None = None, causal: bool = False,
                            pse: Tensor | None = None, pse_type: int = 1, cu_seqlens=None, actual_seq_len=None,
                            keep_prob: float = 1.0, seed: int | None = None, offset: int = 0) -> Tensor:
    """Ulysses (all-to-all) context-parallel FlashAttention over the ranks of ``group``; differentiable.

    Inputs are this rank's contiguous sequence slice (rank ``r`` holds positions ``[r*S/P, (r+1)*S/P)``; TND: that
    slice of the packed tokens, with the *global* ``actual_seq_len``/``cu_seqlens``) with all heads. Query heads
    must divide by P; KV heads are repeated when needed. ``causal`` selects causal attention; ``pse``: ALiBi slopes
    (``pse_type`` 2/3) or a ``[B|1, N, S, S]`` tensor (types 0/1) for the global sequence; dropout as
    :func:`attnops.flash_attention` with a group-wide seed: rank ``r`` draws its heads' mask at
    ``offset + r * numels_local``, which equals one single-device call with the same ``seed``/``offset`` when the
    batch holds one sequence. Returns the local output slice.
    """
    args = dict(locals())
    info = group_info(group)
    check_same_across_ranks(info, query.device, **args)
    drop_seed, offset = check_seed_offset(0 if seed is None else seed, offset)
    layout = head_geometry(query, key, layout, head_num)[0]
    shards = scatter_heads(query, key, value, info, layout, head_num)
    kw = dict(layout="BSND", scale=scale)
    if layout == "TND":
        cumulative = global_cumulative(cu_seqlens, actual_seq_len)
        lens = lengths_from_cumulative("actual_seq_len", cumulative, shards.q.shape[0])
        kw.update(layout="TND", actual_seq_qlen=cumulative, actual_seq_kvlen=cumulative)
        local_numels = shards.heads * sum(n * n for n in lens)
    else:
        local_numels = shards.q.shape[0] * shards.heads * shards.q.shape[1] ** 2
    if causal:
        kw.update(causal=True)
    if pse is not None:
        kw.update(pse=head_slice_pse(pse, pse_type, shards), pse_type=pse_type)
    if keep_prob < 1.0:
        seed = broadcast_seed(info, draw_seed(), query.device) if seed is None else drop_seed
        kw.update(keep_prob=keep_prob, seed=seed, offset=offset + info.rank * local_numels)
    out = flash_attention(shards.q, shards.k, shards.v, **kw)
    return gather_heads(out, info, layout)
