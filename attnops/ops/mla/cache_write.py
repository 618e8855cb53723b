"""Writes token rows into the MLA caches at slots, in ND, NZ or head-major storage, optionally quantized to int8.

A cache holds rows ``[slots, N, D]``. Token-major (ND): paged ``[num_blocks, block_size, N, D]`` (slot ``p`` is block
``p // block_size``, row ``p % block_size``) or token-shaped ``[B, S, N, D]`` / ``[T, N, D]``. Head-major: the
memory is ``[num_blocks, N, D/x, block_size, x]``; NZ storage takes ``x = 32 / itemsize`` (16 for 2-byte dtypes,
32 for int8), the Norm caches ``[B, N, L, D]`` are the case ``x = D`` with a block per batch (``block_size = L``).
A slot of -1 writes nothing (vllm pads slot mappings with -1).

Slots are validated (:mod:`attnops._core.indices`: -1 or a row of the cache) where they are CPU tensors, unless
``ATTNOPS_VALIDATE=0``; slots on a device are never read on the host (no sync) unless ``ATTNOPS_VALIDATE=1``.
Unvalidated, a slot outside the cache writes nothing. A slot given twice takes the row of its last token on every
device (deterministic).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..._core.checks import Described, require
from ..._core.indices import check_slots, valid_ids, validation_enabled
from ..._core.staging import upload


def nz_width(dtype: torch.dtype) -> int:
    return 32 // torch.empty((), dtype=dtype).element_size()


def quantize_int8(x: Tensor, scale: Tensor, offset: Tensor | None) -> Tensor:
    """``clamp(round_half_even(x * scale (+ offset)), -128, 127)`` as int8."""
    y = x.to(torch.float32) * scale.to(torch.float32)
    if offset is not None:
        y = y + offset.to(torch.float32)
    return torch.round(y).clamp(-128, 127).to(torch.int8)


def _addressed(cache: Tensor, slots: Tensor, heads: int, d: int, block_size: int, x: int | None
               ) -> tuple[Tensor, tuple]:
    """``(view, index)``: ``view[index]`` is the ``T`` rows at ``slots`` (in range) of the cache's storage."""
    if x is None:
        return cache.view(-1, heads, d), (slots,)
    return cache.view(-1, heads, d // x, block_size, x), (slots // block_size, slice(None), slice(None),
                                                         slots % block_size)


def write_rows(cache: Tensor, rows: Tensor, slots: Tensor, *, block_size: int, x: int | None = None,
               name: str = "index") -> None:
    """``cache``'s slot ``slots[t]`` (head ``n``) := ``rows[t, n]`` for the slots inside the cache; ``rows [T, N, D]``
    already in the cache's dtype; ``x``: None for token-major storage, else the head-major column width; ``name``:
    the argument the slots come from (for errors); ``cache`` is updated in place."""
    heads, d = rows.shape[1:]
    if x is not None:
        require(d % x == 0, "cache_mode", f"NZ caches with D % {x} == 0", Described(f"D={d}"))
    capacity = cache.numel() // (heads * d)
    slots = slots.to(torch.int64)
    if validation_enabled(slots.device):
        check_slots(name, slots, capacity, what="the cache's rows")
    if slots.device.type == "cpu":
        slots = upload(slots, torch.int64, cache.device)
    if slots.numel() == 0:
        return
    valid = valid_ids(slots, capacity)
    slots = slots.clamp(0, capacity - 1)
    order = torch.arange(slots.numel(), device=slots.device)
    winner = torch.full((capacity,), -1, dtype=torch.int64, device=slots.device).scatter_reduce_(
        0, slots, torch.where(valid, order, -1), "amax")[slots]
    view, index = _addressed(cache, slots, heads, d, block_size, x)
    old = view[index]
    new = rows.to(cache.device)[winner.clamp(min=0)].view(old.shape)
    view[index] = torch.where((winner >= 0).view(-1, *[1] * (old.dim() - 1)), new, old)


def read_nz(cache: Tensor, block_size: int) -> Tensor:
    """An NZ cache's logical ``[num_blocks, block_size, 1, D]`` rows (for checks and the reference's reads)."""
    d = cache.shape[-1]
    d0 = nz_width(cache.dtype)
    return cache.reshape(-1, d // d0, block_size, d0).permute(0, 2, 1, 3).reshape(-1, block_size, 1, d)
