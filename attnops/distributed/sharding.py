"""Load-balanced sequence sharding for ring attention, and the local chunks it produces.

Each sequence is cut into ``2P`` equal chunks; rank ``r`` holds chunks ``r`` and ``2P-1-r`` (in that order), so
every rank gets the same amount of causal work. Dense layouts cut the sequence axis; TND cuts every sequence of
the packed batch (each length divisible by ``2P``) and keeps the sequences' order: per sequence ``b`` the local
rows are ``[chunk r of b, chunk 2P-1-r of b]``.
"""
from __future__ import annotations

import itertools

import torch
from torch import Tensor

from .._core import staging
from .._core.checks import check_tensor, fail, require
from .._core.layouts import normalize_layout
from .._core.varlen import lengths_from_cumulative

SEQ_DIM = {"BNSD": 2, "BSND": 1, "BSH": 1, "SBH": 0, "TND": 0}

__all__ = ["ring_shard", "ring_unshard", "chunk_ids", "RingChunks"]


def chunk_ids(rank: int, world_size: int) -> tuple[int, int]:
    """Global chunk indices held by ``rank``: ``(rank, 2P-1-rank)``."""
    return rank, 2 * world_size - 1 - rank


def _seq_lens(layout: str, actual_seq_len, total: int) -> list[int]:
    if layout != "TND":
        return [total]
    require(actual_seq_len is not None, "actual_seq_len", "the cumulative sequence lengths for layout TND", None)
    return lengths_from_cumulative("actual_seq_len", actual_seq_len, total)


def _divisible(lens: list[int], parts: int, name: str) -> None:
    require(all(n % parts == 0 for n in lens), name, f"sequence lengths divisible by 2 * world_size = {parts}",
            lens)


def ring_shard(x: Tensor, rank: int, world_size: int, *, layout: str = "BNSD", actual_seq_len=None) -> Tensor:
    """Rank ``rank``'s load-balanced shard of a full (global) q/k/v-like tensor.

    ``actual_seq_len``: the global cumulative lengths (CANN style, no leading 0) for layout TND.
    """
    layout = normalize_layout("layout", layout)
    check_tensor("x", x)
    dim = SEQ_DIM[layout]
    lens = _seq_lens(layout, actual_seq_len, x.shape[dim])
    _divisible(lens, 2 * world_size, "x" if layout != "TND" else "actual_seq_len")
    if layout != "TND":
        require(sum(lens) == x.shape[dim], "x", f"sequence length {sum(lens)}", x)
    pieces, start = [], 0
    for n in lens:
        c = n // (2 * world_size)
        for chunk in chunk_ids(rank, world_size):
            pieces.append(x.narrow(dim, start + chunk * c, c))
        start += n
    return torch.cat(pieces, dim)


def ring_unshard(shards: list[Tensor], *, layout: str = "BNSD", actual_seq_len=None) -> Tensor:
    """The full tensor from every rank's shard (inverse of :func:`ring_shard`; for tests and checkpoints)."""
    layout = normalize_layout("layout", layout)
    world_size = len(shards)
    dim = SEQ_DIM[layout]
    lens = _seq_lens(layout, actual_seq_len, sum(s.shape[dim] for s in shards))
    pieces, local_start = [], 0
    for n in lens:
        c = n // (2 * world_size)
        chunks = [None] * (2 * world_size)
        for r, shard in enumerate(shards):
            for j, chunk in enumerate(chunk_ids(r, world_size)):
                chunks[chunk] = shard.narrow(dim, local_start + j * c, c)
        pieces.extend(chunks)
        local_start += 2 * c
    return torch.cat(pieces, dim)


class RingChunks:
    """The two local chunks of a rank's shard in the internal layouts (dense: BNSD ``[B, N, 2c, D]``; TND).

    ``lens`` are the per-sequence chunk lengths ``c_b`` (dense: one entry). ``take(x, j)`` returns local chunk ``j``
    (0: global chunk ``r``, 1: ``2P-1-r``); ``add_(buf, j, value)`` accumulates into it; ``join`` rebuilds the
    local tensor from its two chunks. TND chunks are gathered through row indices built on the host once per
    length list and device and staged up without blocking (:mod:`attnops._core.staging`).
    """

    def __init__(self, packed: bool, lens: list[int]):
        self.packed = packed
        self.lens = lens

    @property
    def chunk_len(self) -> int:
        return self.lens[0]

    def rows(self, j: int, device: torch.device) -> Tensor:
        """The local token rows of chunk ``j`` (TND), on ``device``."""
        return staging.cached_upload(("ring_chunk_rows", tuple(self.lens), j), lambda: self._host_rows(j),
                                     torch.int64, device)

    def _host_rows(self, j: int) -> Tensor:
        starts = itertools.accumulate([0, *self.lens[:-1]])
        return torch.cat([torch.arange(2 * s + j * c, 2 * s + (j + 1) * c) for s, c in zip(starts, self.lens)])

    def take(self, x: Tensor, j: int) -> Tensor:
        if self.packed:
            return x.index_select(0, self.rows(j, x.device))
        c = self.lens[0]
        return x[:, :, j * c:(j + 1) * c]

    def add_(self, buf: Tensor, j: int, value: Tensor) -> None:
        if self.packed:
            buf.index_add_(0, self.rows(j, buf.device), value.to(buf.dtype))
        else:
            self.take(buf, j).add_(value)

    def join(self, first: Tensor, second: Tensor) -> Tensor:
        if not self.packed:
            return torch.cat([first, second], 2)
        out = first.new_empty((first.shape[0] + second.shape[0], *first.shape[1:]))
        out.index_copy_(0, self.rows(0, out.device), first)
        out.index_copy_(0, self.rows(1, out.device), second)
        return out

    def call_kwargs(self) -> dict:
        """flash_attention keywords of a call on one q chunk against one kv chunk."""
        if not self.packed:
            return dict(layout="BNSD")
        cum = list(itertools.accumulate(self.lens))
        return dict(layout="TND", actual_seq_qlen=cum, actual_seq_kvlen=cum, softmax_layout="TND")


def head_geometry(query: Tensor, key: Tensor, layout: str, head_num: int | None) -> tuple[str, int, int, int | None]:
    """``(layout, N1, D, N2)`` of q/k in ``layout`` (normalized); ``N2`` only for the hidden-size layouts BSH/SBH
    (the others carry it in their shape), where ``head_num`` is required."""
    layout = normalize_layout("layout", layout)
    if layout in ("BSH", "SBH") and head_num is None:
        fail("head_num", f"the number of query heads (required for layout {layout})", None)
    n1 = head_num if layout in ("BSH", "SBH") else query.shape[1 if layout in ("TND", "BNSD") else 2]
    d = query.shape[-1] // n1 if layout in ("BSH", "SBH") else query.shape[-1]
    return layout, n1, d, (key.shape[-1] // d if layout in ("BSH", "SBH") else None)

