"""Launch plan of the paged-KV-cache write (``kv_cache.py``): one launch writes the key and the value rows of every
token, one program per (token, key|value) row; a slot outside the cache skips its row in the kernel, so nothing is
read on the host and the launch is capturable in a CUDA graph."""
from __future__ import annotations

import torch

from ..._core.dispatch import triton_unavailable_reason
from ..._core.triton.launch import KernelFamily, Launch, pow2, unit_last_stride

MAX_ROW_TILE = 1024  # elements copied per loop step of a program
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


def unsupported_reason(tokens: torch.Tensor) -> str | None:
    """Why the kernel cannot write ``tokens``' rows (device, element width), or None."""
    reason = triton_unavailable_reason(tokens.device)
    if reason is None and tokens.element_size() not in BITS:
        reason = f"the cache-write kernel copies 1/2/4/8-byte elements (got {tokens.dtype})"
    return reason


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed as integers of its element width (the kernel copies bits, never converts)."""
    return x.view(BITS[x.element_size()])


def _target(rows: torch.Tensor, cache: torch.Tensor) -> tuple:
    """Kernel arguments of one cache: ``rows [T, width]`` and the cache's 4-D view."""
    rows = unit_last_stride(_bits(rows))
    num_blocks, _, block_size, _ = cache.shape
    return (rows, rows.stride(0), _bits(cache), *cache.stride(), num_blocks * block_size, block_size, rows.shape[1])


def scatter_plan(slots: torch.Tensor, key_rows: torch.Tensor, key_cache: torch.Tensor, value_rows: torch.Tensor,
                 value_cache: torch.Tensor) -> list[Launch]:
    """The launch writing ``key_rows``/``value_rows`` ``[T, width]`` at ``slots [T]`` (int32/int64, on the rows'
    device) into caches given as ``[num_blocks, chunks, block_size, X]`` views (see ``kv_cache.py``)."""
    if slots.shape[0] == 0:
        return []
    args = (slots, *_target(key_rows, key_cache), *_target(value_rows, value_cache))
    return [Launch("scatter_kv_kernel", (slots.shape[0], 2), args,
                   dict(K_X=key_cache.shape[3], V_X=value_cache.shape[3]))]
