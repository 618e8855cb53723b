"""Writes token rows into the MLA caches at slots, in ND or NZ storage, optionally quantized to int8.

A cache holds rows ``[slots, N, D]``: paged ``[num_blocks, block_size, N, D]`` (slot ``p`` is block ``p //
block_size``, row ``p % block_size``), or token-shaped ``[B, S, N, D]`` / ``[T, N, D]`` / ``[B, N, L, D]`` (Norm).
NZ storage: the cache's memory is ``[num_blocks, N, D/d0, block_size, d0]`` with ``d0 = 32 / itemsize`` (16 for
2-byte dtypes, 32 for int8). Negative slots write nothing (vllm pads slot mappings with -1).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..._core.checks import require


def nz_width(dtype: torch.dtype) -> int:
    return 32 // torch.empty((), dtype=dtype).element_size()


def quantize_int8(x: Tensor, scale: Tensor, offset: Tensor | None) -> Tensor:
    """``clamp(round_half_even(x * scale (+ offset)), -128, 127)`` as int8."""
    y = x.to(torch.float32) * scale.to(torch.float32)
    if offset is not None:
        y = y + offset.to(torch.float32)
    return torch.round(y).clamp(-128, 127).to(torch.int8)


def write_rows(cache: Tensor, rows: Tensor, slots: Tensor, *, nz: bool, block_size: int) -> None:
    """``cache``'s slot ``slots[t]`` (head ``n``) := ``rows[t, n]`` for ``slots[t] >= 0``; ``rows [T, N, D]`` already
    in the cache's dtype; ``cache`` is updated in place."""
    keep = slots >= 0
    slots, rows = slots[keep].to(torch.int64), rows[keep]
    if not nz:
        flat = cache.view(-1, *rows.shape[1:])
        require(bool((slots < flat.shape[0]).all()), "index", f"slots below the cache's {flat.shape[0]} rows",
                slots.tolist() if slots.numel() < 9 else slots)
        flat[slots.to(cache.device)] = rows.to(cache.device)
        return
    d0 = nz_width(cache.dtype)
    heads, d = rows.shape[1:]
    require(d % d0 == 0, "cache_mode", f"NZ caches with D % {d0} == 0", f"D={d}")
    storage = cache.view(-1, heads, d // d0, block_size, d0)
    require(bool((slots < storage.shape[0] * block_size).all()), "index", "slots inside the NZ cache", slots)
    blocks, offs = slots // block_size, slots % block_size
    storage[blocks.to(cache.device), :, :, offs.to(cache.device)] = rows.reshape(-1, heads, d // d0, d0).to(
        cache.device)


def read_nz(cache: Tensor, block_size: int) -> Tensor:
    """An NZ cache's logical ``[num_blocks, block_size, 1, D]`` rows (for checks and the reference's reads)."""
    d = cache.shape[-1]
    d0 = nz_width(cache.dtype)
    return cache.reshape(-1, d // d0, block_size, d0).permute(0, 2, 1, 3).reshape(-1, block_size, 1, d)
