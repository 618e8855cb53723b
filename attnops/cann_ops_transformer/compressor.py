"""ops-transformer's ``compressor`` (C4A / C4Li / C128A, no norm or RoPE stage) with the schema of
``cann_ops_transformer``: :func:`attnops.compressor` under its own argument names, no math here."""
from __future__ import annotations

from torch import Tensor

from ..ops.dsv4.compressor_api import compressor as _compressor


def compressor(x: Tensor, wkv: Tensor, wgate: Tensor, state_cache: Tensor, ape: Tensor, cmp_ratio: int = 4, *,
               state_block_table: Tensor | None = None, cu_seqlens: Tensor | None = None,
               seqused: Tensor | None = None, start_pos: Tensor | None = None, coff: int = 1,
               cache_mode: int = 1) -> Tensor:
    """``cmp_kv``: the compressed rows (``[B, ceil(S / cmp_ratio), D]`` or ``[min(T, T // cmp_ratio + B), D]``);
    ``state_cache`` is updated in place."""
    return _compressor(x, wkv, wgate, state_cache, ape, cmp_ratio=cmp_ratio, coff=coff,
                       state_block_table=state_block_table, cu_seqlens=cu_seqlens, seqused=seqused,
                       start_pos=start_pos, cache_mode=cache_mode)


__all__ = ["compressor"]
