"""The dropout mask of a ring call as one single-device mask, so a single-device call reproduces it exactly.

Pair ``(gq, gk)`` (query chunk ``gq``, KV chunk ``gk``, global chunk indices in ``[0, 2P)``) draws its
``[B, N1, c, c]`` mask (TND: per-sequence ``[N1, c_b, c_b]`` blocks) from Philox at
``offset + (gq * 2P + gk) * pair_numels``. The pairs tile the global score matrix, so a ring call consumes exactly
``N1 * sum_b S_b^2`` elements, like one single-device call; only the element order differs.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.checks import check_int, require
from .._core.dropout import DropoutSpec, check_seed_offset, keep_mask, pack_bits
from .._core.varlen import lengths_from_cumulative

__all__ = ["hybrid_dropout_mask", "ring_dropout_mask"]


def ring_dropout_mask(*, world_size: int, keep_prob: float, seed: int, offset: int = 0, head_num: int,
                      batch: int = 1, seq_len: int | None = None, actual_seq_len=None) -> Tensor:
    """Packed ``drop_mask`` (uint8, LSB first) for a single-device :func:`attnops.flash_attention` call that
    reproduces the dropout of :func:`attnops.distributed.ring_flash_attention` with the same ``seed``/``offset``.

    Dense: ``batch`` and the global ``seq_len``; TND: the global cumulative ``actual_seq_len``.
    """
    check_int("world_size", world_size, lo=1)
    seed, offset = check_seed_offset(seed, offset)
    require(0.0 < keep_prob < 1.0, "keep_prob", "a value in (0, 1) (no mask without dropout)", keep_prob)
    shapes = batch_shapes(batch, seq_len, actual_seq_len)
    blocks = ring_keep_blocks(world_size, keep_prob, seed, offset, head_num, shapes)
    return pack_bits(torch.cat([blk.reshape(-1) for blk in blocks]))


def batch_shapes(batch: int, seq_len: int | None, actual_seq_len) -> list[tuple[int, int]]:
    """``(batch, length)`` per mask block: one dense block, or one ``(1, S_b)`` per TND sequence."""
    if actual_seq_len is not None:
        return [(1, n) for n in lengths_from_cumulative("actual_seq_len", actual_seq_len)]
    require(seq_len is not None, "seq_len", "the global sequence length (dense layouts)", None)
    return [(batch, seq_len)]


def ring_keep_blocks(world_size: int, keep_prob: float, seed: int, offset: int, head_num: int,
                     shapes: list[tuple[int, int]]) -> list[Tensor]:
    """The keep masks (bool ``[b, head_num, S, S]`` per entry of ``shapes``) a ring call draws."""
    p2 = 2 * world_size
    lens = [n for _, n in shapes]
    require(all(n % p2 == 0 for n in lens), "seq_len", f"sequence lengths divisible by 2 * world_size = {p2}", lens)
    blocks = [torch.empty(b, head_num, n, n, dtype=torch.bool) for b, n in shapes]
    pair_numels = head_num * sum(b * (n // p2) ** 2 for b, n in shapes)
    for gq in range(p2):
        for gk in range(p2):
            spec = DropoutSpec(keep_prob, (), seed=seed, offset=offset + (gq * p2 + gk) * pair_numels)
            pair = keep_mask(spec, pair_numels)
            start = 0
            for block, (b, n) in zip(blocks, shapes):
                c = n // p2
                size = b * head_num * c * c
                block[:, :, gq * c:(gq + 1) * c, gk * c:(gk + 1) * c] = pair[start:start + size].view(b, head_num, c, c)
                start += size
    return blocks


def hybrid_dropout_mask(*, ulysses_degree: int, ring_degree: int, keep_prob: float, seed: int, offset: int = 0,
                        head_num: int, batch: int = 1, seq_len: int | None = None, actual_seq_len=None) -> Tensor:
    """Packed ``drop_mask`` for a single-device :func:`attnops.flash_attention` call that reproduces the dropout of
    :func:`attnops.distributed.hybrid_flash_attention` with the same ``seed``/``offset``: Ulysses rank ``u`` runs a
    ring call on heads ``[u*N/U, (u+1)*N/U)`` at ``offset + u * (N/U) * sum_b S_b^2`` (dense: ``B * S^2``)."""
    check_int("ulysses_degree", ulysses_degree, lo=1)
    check_int("ring_degree", ring_degree, lo=1)
    seed, offset = check_seed_offset(seed, offset)
    require(0.0 < keep_prob < 1.0, "keep_prob", "a value in (0, 1) (no mask without dropout)", keep_prob)
    require(head_num % ulysses_degree == 0, "head_num", f"a multiple of ulysses_degree = {ulysses_degree}", head_num)
    shapes = batch_shapes(batch, seq_len, actual_seq_len)
    heads = head_num // ulysses_degree
    numels = heads * sum(b * n * n for b, n in shapes)
    per_rank = [ring_keep_blocks(ring_degree, keep_prob, seed, offset + u * numels, heads, shapes)
                for u in range(ulysses_degree)]
    blocks = [torch.cat([rank_blocks[i] for rank_blocks in per_rank], 1) for i in range(len(shapes))]
    return pack_bits(torch.cat([blk.reshape(-1) for blk in blocks]))
