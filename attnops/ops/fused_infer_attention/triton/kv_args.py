"""Host side of ``kv_tiles.py``: the strides by which a kernel addresses a dense KV, a paged cache (ND or NZ) or the
shared prefix (:class:`KVAddressing`), the storage kind of K/V, and the antiquant arguments (parameter pointers and
their strides table, staged once per distinct table). Reads shapes and strides only, never tensor values."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...._core.staging import cached_upload
from ..problem import FIAProblem

KV_FLOAT, KV_INT8, KV_INT4 = 0, 1, 2  # kv_tiles.KV_*


@dataclass(frozen=True)
class KVAddressing:
    """Element strides of a K or V source: ``batch`` (0 for TND, paged caches and the prefix), ``token``, ``head``,
    ``block`` (paged), ``group`` (the ``x``-wide channel groups of an NZ cache), ``chan``; ``nz_x`` is ``x`` (0: ND)."""

    batch: int
    token: int
    head: int
    block: int = 0
    group: int = 0
    chan: int = 1
    nz_x: int = 0

    def args(self) -> tuple[int, int, int, int, int, int]:
        """``(batch, token, head, block, group, chan)``, the order of the kernels' stride arguments."""
        return self.batch, self.token, self.head, self.block, self.group, self.chan


def dense_addressing(view: torch.Tensor) -> KVAddressing:
    """A ``[B, S, N2, W]`` or TND ``[T, N2, W]`` token view."""
    if view.dim() == 3:
        return KVAddressing(0, view.stride(0), view.stride(1), chan=view.stride(2))
    return KVAddressing(view.stride(0), view.stride(1), view.stride(2), chan=view.stride(3))


def cache_addressing(cache: torch.Tensor, n2: int) -> KVAddressing:
    """A paged cache ``[blocknum, blocksize, N2*W]``, ``[blocknum, N2, blocksize, W]`` or NZ
    ``[blocknum, N2, W/x, blocksize, x]``."""
    s = cache.stride()
    if cache.dim() == 5:
        return KVAddressing(0, s[3], s[1], block=s[0], group=s[2], chan=s[4], nz_x=cache.shape[4])
    if cache.dim() == 4:
        return KVAddressing(0, s[2], s[1], block=s[0], chan=s[3])
    return KVAddressing(0, s[1], cache.shape[2] // n2 * s[2], block=s[0], chan=s[2])


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
