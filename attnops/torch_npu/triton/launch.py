"""Launch plans of the paged-KV-cache kernels (``kv_cache.py``): one launch writes (or reads) the key and the value
rows of every token, one program per (token, key|value) row. The kernels read slots, lengths and tables themselves
and clamp or skip what falls outside the tensors, so nothing is read on the host and the launches are capturable in
a CUDA graph."""
from __future__ import annotations

import torch

from ..._core.dispatch import triton_unavailable_reason
from ..._core.triton.launch import KernelFamily, Launch, pow2, unit_last_stride

MAX_ROW_TILE = 1024  # elements copied per loop step of a program
MAX_BATCH_TILE = 1024  # sequence lengths scanned per loop step of a gather program
BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> integer of that width


def _row_tile(width: int) -> int:
    return min(pow2(width), MAX_ROW_TILE)


def _tile_configs(launch: Launch, args: dict, interpret: bool) -> list:
    """The one configuration: row tiles covering the key and value rows, a warp per 256 elements (1 to 4)."""
    import triton

    k_tile, v_tile = _row_tile(args["k_width"]), _row_tile(args["v_width"])
    warps = 1 if interpret else max(1, min(4, max(k_tile, v_tile) // 256))
    return [triton.Config({"K_TILE": k_tile, "V_TILE": v_tile}, num_warps=warps, num_stages=1)]


KERNELS = KernelFamily("torch_npu_kv_cache", ("attnops.torch_npu.triton.kv_cache",), _tile_configs)


def unsupported_reason(*tokens: torch.Tensor) -> str | None:
    """Why the kernel cannot copy the rows of ``tokens`` (device, element width), or None."""
    reason = triton_unavailable_reason(tokens[0].device)
    for x in tokens:
        if reason is None and x.element_size() not in BITS:
            reason = f"the cache kernels copy 1/2/4/8-byte elements (got {x.dtype})"
    return reason


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed as integers of its element width (the kernel copies bits, never converts)."""
    return x.view(BITS[x.element_size()])


def _target(rows: torch.Tensor, cache: torch.Tensor) -> tuple:
    """Write-kernel arguments of one cache: ``rows [T, width]`` and the cache's 4-D view."""
    rows = unit_last_stride(_bits(rows))
    num_blocks, _, block_size, _ = cache.shape
    return (rows, rows.stride(0), _bits(cache), *cache.stride(), num_blocks * block_size, block_size, rows.shape[1])


def _source(out: torch.Tensor, cache: torch.Tensor) -> tuple:
    """Read-kernel arguments of one cache: the output ``rows [T, width]`` (unit last stride) and the 4-D view."""
    out = _bits(out)
    return (out, out.stride(0), _bits(cache), *cache.stride(), out.shape[1])


def scatter_plan(slots: torch.Tensor, key_rows: torch.Tensor, key_cache: torch.Tensor, value_rows: torch.Tensor,
                 value_cache: torch.Tensor) -> list[Launch]:
    """The launch writing ``key_rows``/``value_rows`` ``[T, width]`` at ``slots [T]`` (int32/int64, on the rows'
    device) into caches given as ``[num_blocks, chunks, block_size, X]`` views (see ``kv_cache.py``)."""
    if slots.shape[0] == 0:
        return []
    args = (slots, *_target(key_rows, key_cache), *_target(value_rows, value_cache))
    return [Launch("scatter_kv_kernel", (slots.shape[0], 2), args,
                   dict(K_X=key_cache.shape[3], V_X=value_cache.shape[3]))]


def gather_plan(lens: torch.Tensor, cumsum: bool, offsets: torch.Tensor | None, table: torch.Tensor,
                num_blocks: int, key_out: torch.Tensor, key_cache: torch.Tensor, value_out: torch.Tensor,
                value_cache: torch.Tensor) -> list[Launch]:
    """The launch filling ``key_out``/``value_out`` ``[T, width]`` (unit last stride, written in place) with the
    tokens of the sequences of ``lens`` (per-sequence, or cumulative from 0 with ``cumsum``) read through ``table``
    ``[B, W]`` (and ``offsets [B]``) from caches given as ``[num_blocks, chunks, block_size, X]`` views; all on the
    outputs' device."""
    batches = lens.shape[0] - 1 if cumsum else lens.shape[0]
    if key_out.shape[0] == 0 or batches == 0:
        return []
    args = (lens, batches, table if offsets is None else offsets, table, table.stride(0), table.shape[1], num_blocks,
            key_cache.shape[2], *_source(key_out, key_cache), *_source(value_out, value_cache))
    return [Launch("gather_kv_kernel", (key_out.shape[0], 2), args,
                   dict(CUMSUM=cumsum, HAS_OFFSETS=offsets is not None, BLOCK_B=min(pow2(batches), MAX_BATCH_TILE),
                        K_X=key_cache.shape[3], V_X=value_cache.shape[3]))]
