"""A validated NSA decode batch over paged KV caches (:class:`PagedKV`), shared by the PyTorch decode
(:mod:`.decode`), the compiled CPU kernel's adapter (:mod:`.cpu_decode`) and the Triton launchers."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..._core.indices import valid_ids
from ..common.npu_rounding import NpuRounding


@dataclass(frozen=True)
class PagedKV:
    """A validated decode batch: the query geometry, the paged caches and the per-request lengths (``kv_lens``, or
    None when they are a device tensor the kernels read; ``capacity``: the longest length the block table holds)."""

    batch: int
    n1: int
    n2: int
    dv: int
    kv_lens: tuple[int, ...] | None
    scale: float
    capacity: int
    rounding: NpuRounding | None = None  # precision="npu": the kernels' rounding (None: exact)

    def rows(self, cache: Tensor, table_row: Tensor, pos: Tensor) -> Tensor:
        return paged_rows(cache, table_row, pos)

    def with_lengths(self, lens: Tensor | None) -> "PagedKV":
        """This batch with the lengths of ``lens`` (a CPU copy of the device lengths) when they were not known."""
        return self if self.kv_lens is not None else replace(self, kv_lens=tuple(int(n) for n in lens.tolist()))


def paged_rows(cache: Tensor, table_row: Tensor, pos: Tensor) -> Tensor:
    """The rows ``[L, N, D]`` of one request's KV positions ``pos`` in a paged ``cache [blocks, page, N, D]``
    (``table_row``: the request's block table); rows in a block outside the cache are zeros."""
    page = cache.shape[1]
    blocks = table_row.long()[pos // page]
    valid = valid_ids(blocks, cache.shape[0])
    rows = cache[blocks.clamp(0, cache.shape[0] - 1), pos % page]
    return torch.where(valid.view(-1, *[1] * (rows.dim() - 1)), rows, 0)


def addressable(cache: Tensor, table_row: Tensor, pos: Tensor) -> Tensor:
    """Whether the KV positions ``pos`` of a request lie in blocks of the cache (bool, ``pos``'s shape)."""
    return valid_ids(table_row.long()[pos // cache.shape[1]], cache.shape[0])
