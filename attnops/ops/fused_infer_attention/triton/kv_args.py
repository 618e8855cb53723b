"""Host side of ``kv_tiles.py``: the kernels' stride arguments of a dense KV, a paged cache (ND or NZ) or the shared
prefix, the storage kind of K/V, and the antiquant arguments (parameter pointers and their strides table, staged
once per distinct table). Reads shapes and strides only, never tensor values.

A K or V source is addressed through six element strides, in the kernels' argument order: ``batch`` (0 for TND,
paged caches and the prefix), ``token``, ``head``, ``block`` (paged), ``group`` (the ``x``-wide channel groups of an
NZ cache) and ``chan``. Plain tuples: the decode run computes two per call.
"""
from __future__ import annotations

import torch

from ...._core.layouts import token_strides
from ...._core.staging import cached_upload
from ..problem import FIAProblem
from .codes import KV_FLOAT, KV_INT4, KV_INT8


def dense_strides(x: torch.Tensor, layout: str, heads: int) -> tuple[int, int, int, int, int, int]:
    """The six strides of a dense K/V (or shared prefix) ``x`` in ``layout`` with ``heads`` heads: those of its
    ``[B, S, N2, W]`` or TND ``[T, N2, W]`` token view."""
    return (*token_strides(x, layout, heads), 0, 0, x.stride(-1))


def cache_strides(cache: torch.Tensor, n2: int) -> tuple[int, int, int, int, int, int]:
    """The six strides of a paged cache ``[blocknum, blocksize, N2*W]``, ``[blocknum, N2, blocksize, W]`` or NZ
    ``[blocknum, N2, W/x, blocksize, x]``."""
    s = cache.stride()
    if cache.dim() == 5:
        return 0, s[3], s[1], s[0], s[2], s[4]
    if cache.dim() == 4:
        return 0, s[2], s[1], s[0], 0, s[3]
    return 0, s[1], cache.shape[2] // n2 * s[2], s[0], 0, s[2]


def nz_x(x: torch.Tensor) -> int:
    """The kernels' ``NZ_X``: ``x`` of an NZ cache ``[blocknum, N2, W/x, blocksize, x]``, 0 for any other K/V."""
    return x.shape[4] if x.dim() == 5 else 0


def cache_block_size(cache: torch.Tensor) -> int:
    """Tokens per block of a paged cache in any layout."""
    return cache.shape[1] if cache.dim() == 3 else cache.shape[-2]


def storage(x: torch.Tensor, quantized: bool) -> int:
    """The kernels' ``QUANT`` constexpr of a K or V tensor: float, int8, or int4 packed in int32."""
    if not quantized:
        return KV_FLOAT
    return KV_INT4 if x.dtype == torch.int32 else KV_INT8


def _param_strides(kind: str, t: torch.Tensor) -> list[int]:
    """(batch, head, position, block, offset, channel) strides of an antiquant parameter of ``kind``; broadcast
    sizes get stride 0."""
    head = t.stride(1) if t.shape[1] > 1 else 0
    if kind == "static":  # [1, N2|1, 1, D|1]
        return [0, head, 0, 0, 0, t.stride(3) if t.shape[3] > 1 else 0]
    if kind == "token":  # [B, N2|1, S]
        return [t.stride(0), head, t.stride(2), 0, 0, 0]
    return [0, head, 0, t.stride(0), t.stride(2), 0]  # page: [blocknum, N2|1, blocksize]


def antiquant_args(p: FIAProblem, device: torch.device, dummy: torch.Tensor) -> tuple[list, dict]:
    """Scale/offset pointers of K and V (``dummy`` for unused ones) and their int64 ``[4, 6]`` strides table (rows:
    K scale, K offset, V scale, V offset; ``kv_tiles.antiquant_factor``), with the offset flags and whether each is
    per channel (``static``) rather than per token: ``(args, constexprs)``."""
    tensors, strides, flags = [], [], {}
    for name, quant in (("K", p.key_quant), ("V", p.value_quant)):
        for t in (None, None) if quant is None else (quant.scale, quant.offset):
            tensors.append(dummy if t is None else t.to(device, torch.float32))
            strides.append((0,) * 6 if t is None else tuple(_param_strides(quant.kind, tensors[-1])))
        flags[f"{name}_OFFSET"] = quant is not None and quant.offset is not None
        flags[f"{name}_STATIC"] = quant is not None and quant.kind == "static"
    table = tuple(strides)
    return [*tensors, cached_upload(("fia-antiquant-strides", table), lambda: table, torch.int64, device)], flags
