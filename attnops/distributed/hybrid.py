"""Hybrid context parallelism: Ulysses over one process group, ring attention over another.

The scheme of Megatron's hierarchical CP (a2a+p2p), MindSpeed's ``hybrid_cp_algo`` and yunchang's
``LongContextAttention(ulysses_pg, ring_pg)``. The global sequence is cut for the ring group (rank ``r`` of the
ring holds the load-balanced chunks ``r`` and ``2R-1-r``, :func:`.sharding.ring_shard`), and each ring shard is cut
into ``U`` contiguous slices, one per Ulysses rank. The Ulysses all-to-all (:func:`.ulysses.scatter_heads`) gives
every rank its ring shard for ``N/U`` heads, :func:`.ring.ring_flash_attention` runs over the ring group on it, and
the inverse all-to-all returns the output slice.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .._core.checks import Described, check_int, fail, require
from .._core.dropout import check_seed_offset, draw_seed
from .._core.layouts import normalize_layout, tokens_view
from .._core.varlen import lengths_from_cumulative
from .comm import GroupInfo, broadcast_seed, check_same_across_ranks, group_info
from ..ops.flash_attention import FlashAttentionResult
from .ring import ring_flash_attention
from .sharding import SEQ_DIM, head_geometry, ring_shard, ring_unshard
from .ulysses import gather_heads, global_cumulative, head_slice_pse, scatter_heads

__all__ = ["HybridGroups", "hybrid_flash_attention", "hybrid_groups", "hybrid_shard", "hybrid_unshard"]


class HybridGroups(NamedTuple):
    """This process's Ulysses and ring groups, and its rank in each."""

    ulysses: dist.ProcessGroup
    ring: dist.ProcessGroup
    ulysses_rank: int
    ring_rank: int


def hybrid_groups(ulysses_degree: int, ring_degree: int) -> HybridGroups:
    """Build the Ulysses and ring groups of the default group; call it on every rank, in the same order.

    Global rank ``g`` is Ulysses rank ``g % ulysses_degree`` and ring rank ``g // ulysses_degree``: Ulysses groups
    are runs of consecutive ranks (put them inside a node), ring groups stride across them, as
    ``init_device_mesh(device, (ring_degree, ulysses_degree), mesh_dim_names=("ring", "ulysses"))`` does; a
    DeviceMesh's ``mesh.get_group("ulysses")`` / ``mesh.get_group("ring")`` can be passed to
    :func:`hybrid_flash_attention` directly instead."""
    world = group_info(None).size
    check_int("ulysses_degree", ulysses_degree, lo=1)
    check_int("ring_degree", ring_degree, lo=1)
    require(ulysses_degree * ring_degree == world, "ulysses_degree",
            f"ulysses_degree * ring_degree == world_size = {world}",
            Described(f"ulysses_degree={ulysses_degree}, ring_degree={ring_degree}"))
    rank = dist.get_rank()
    ulysses = ring = None
    for r in range(ring_degree):  # every rank creates every group, in the same order
        g = dist.new_group([r * ulysses_degree + u for u in range(ulysses_degree)])
        ulysses = g if r == rank // ulysses_degree else ulysses
    for u in range(ulysses_degree):
        g = dist.new_group([r * ulysses_degree + u for r in range(ring_degree)])
        ring = g if u == rank % ulysses_degree else ring
    return HybridGroups(ulysses, ring, rank % ulysses_degree, rank // ulysses_degree)


def hybrid_shard(x: Tensor, *, ulysses_rank: int, ulysses_degree: int, ring_rank: int, ring_degree: int,
                 layout: str = "BSND", actual_seq_len=None) -> Tensor:
    """The shard of a full (global) q/k/v-like tensor held by (``ulysses_rank``, ``ring_rank``): slice
    ``ulysses_rank`` of ``ulysses_degree`` equal contiguous slices of the ring shard
    :func:`attnops.distributed.ring_shard` (TND: of its packed tokens)."""
    layout = normalize_layout("layout", layout)
    check_int("ulysses_rank", ulysses_rank, lo=0, hi=ulysses_degree - 1)
    shard = ring_shard(x, ring_rank, ring_degree, layout=layout, actual_seq_len=actual_seq_len)
    dim = SEQ_DIM[layout]
    size = shard.shape[dim]
    require(size % ulysses_degree == 0, "x", f"a ring shard whose length divides by ulysses_degree = "
            f"{ulysses_degree}", Described(f"length {size}"))
    return shard.narrow(dim, ulysses_rank * size // ulysses_degree, size // ulysses_degree)


def hybrid_unshard(shards: list[list[Tensor]], *, layout: str = "BSND", actual_seq_len=None) -> Tensor:
    """The full tensor from every rank's shard, ``shards[ring_rank][ulysses_rank]`` (inverse of
    :func:`hybrid_shard`)."""
    layout = normalize_layout("layout", layout)
    dim = SEQ_DIM[layout]
    return ring_unshard([torch.cat(row, dim) for row in shards], layout=layout, actual_seq_len=actual_seq_len)


def to_tokens(stats: Tensor, layout: str) -> Tensor:
    """Statistics in the token-major view the Ulysses exchange takes (``[B, S, N, 8]``; TND unchanged)."""
    return tokens_view(stats, layout, stats.shape[1])


def _info(name: str, group) -> GroupInfo:
    if not isinstance(group, dist.ProcessGroup):
        fail(name, "a torch.distributed.ProcessGroup (see attnops.distributed.hybrid_groups)", type(group).__name__)
    return group_info(group)


def _group_seed(uinfo: GroupInfo, rinfo: GroupInfo, device: torch.device) -> int:
    """One seed for every rank of both groups: ring rank 0's draw spreads over each ring group, then Ulysses
    rank 0's (now the same in every ring group) over each Ulysses group."""
    return broadcast_seed(uinfo, broadcast_seed(rinfo, draw_seed(), device), device)


def hybrid_flash_attention(query: Tensor, key: Tensor, value: Tensor, *, ulysses_group, ring_group,
                           layout: str = "BSND", head_num: int | None = None, scale: float | None = None,
                           causal: bool = False, pse: Tensor | None = None, pse_type: int = 2, cu_seqlens=None,
                           actual_seq_len=None, keep_prob: float = 1.0, seed: int | None = None,
                           offset: int = 0, softmax_layout: str = "", return_stats: bool = False):
    """Hybrid context-parallel FlashAttention: Ulysses over ``ulysses_group`` (size U), ring attention over
    ``ring_group`` (size R); differentiable.

    Inputs are this rank's :func:`hybrid_shard` of the global q/k/v (any layout; TND with the *global*
    ``actual_seq_len``/``cu_seqlens``, each length divisible by ``2R``). Query heads must divide by U (KV heads are
    repeated as needed); everything else as :func:`attnops.distributed.ring_flash_attention`: ``causal`` with load
    balance, GQA, Dv < D, ALiBi slopes (``pse_type`` 2/3) at global positions. Dropout: Ulysses rank ``u`` runs its
    ring call at ``offset + u * (N/U) * sum_b S_b^2``; :func:`attnops.distributed.hybrid_dropout_mask` gives the
    single-device mask that reproduces it. Returns the local output slice, or with ``return_stats`` a
    :class:`attnops.FlashAttentionResult` with the local merged statistics (dense ``[B, N, S_local, 8]``; TND true
    ``[T_local, N, 8]``, which needs ``softmax_layout="TND"``: a local slice is no whole sequence).
    """
    args = dict(locals())
    uinfo, rinfo = _info("ulysses_group", ulysses_group), _info("ring_group", ring_group)
    check_same_across_ranks((uinfo, rinfo), query.device, **args)
    layout = head_geometry(query, key, layout, head_num)[0]
    drop_seed, offset = check_seed_offset(0 if seed is None else seed, offset)
    require(not return_stats or softmax_layout == ("TND" if layout == "TND" else ""), "softmax_layout",
            "'TND' with return_stats for layout TND (a local slice holds no whole sequence), else ''", softmax_layout)
    ring_kw = dict(group=ring_group, layout="BSND", scale=scale, causal=causal, return_stats=return_stats)
    if layout == "TND":
        cumulative = global_cumulative(cu_seqlens, actual_seq_len)
        lens = lengths_from_cumulative("actual_seq_len", cumulative)
        require(all(n > 0 and n % (2 * rinfo.size) == 0 for n in lens), "actual_seq_len",
                f"global sequence lengths > 0 divisible by 2 * ring degree = {2 * rinfo.size}", lens)
        parts = uinfo.size * rinfo.size
        require(sum(lens) % parts == 0 and query.shape[0] * parts == sum(lens), "query",
                f"{sum(lens) // parts} local tokens (the global lengths / (U * R) = {sum(lens)} / {parts})", query)
        ring_kw.update(layout="TND", actual_seq_len=cumulative, softmax_layout=softmax_layout)
    require(pse is None or pse_type in (2, 3), "pse_type", "2 or 3 (ALiBi slopes; pse tensors cannot follow the "
            "ring's sharded sequence)", pse_type)
    shards = scatter_heads(query, key, value, uinfo, layout, head_num, "ulysses_group")
    if pse is not None:
        ring_kw.update(pse=head_slice_pse(pse, pse_type, shards), pse_type=pse_type)
    if keep_prob < 1.0:
        if layout == "TND":
            seq_sq = sum(n * n for n in lens)
        else:  # B * S^2 with the global S
            seq_sq = shards.q.shape[0] * (shards.q.shape[1] * rinfo.size) ** 2
        ring_kw.update(keep_prob=keep_prob, offset=offset + uinfo.rank * shards.heads * seq_sq,
                       seed=_group_seed(uinfo, rinfo, query.device) if seed is None else drop_seed)
    res = ring_flash_attention(shards.q, shards.k, shards.v, **ring_kw)
    if not return_stats:
        return gather_heads(res, uinfo, layout)
    stats_layout = "TND" if layout == "TND" else "BNSD"  # ring statistics: [B, N/U, S, 8] or [T, N/U, 8]
    smax, ssum = (gather_heads(to_tokens(s.contiguous(), stats_layout), uinfo, stats_layout)
                  for s in (res.softmax_max, res.softmax_sum))
    return FlashAttentionResult(gather_heads(res.out, uinfo, layout), smax, ssum, res.seed, res.offset)
