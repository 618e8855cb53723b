"""``flash_attn_varlen_func(block_table=...)``: keys and values read from a paged cache, packed per sequence."""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.checks import check_tensor, require
from .._core.indices import check_block_table, validation_enabled

_INTS = (torch.int32, torch.int64)


def packed_from_pages(k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cu_seqlens_k: Tensor):
    """``(k, v)`` ``[T_k, H_k, D]``: token ``t`` of sequence ``b`` (``T_k = cu_seqlens_k[-1]``) is row
    ``t % page`` of page ``block_table[b, t // page]`` of ``k_cache``/``v_cache`` ``[num_blocks, page, H_k, D]``.
    A gather, so gradients reach the caches."""
    check_tensor("block_table", block_table, ndim=2, dtypes=_INTS)
    check_tensor("k", k_cache, ndim=4)
    check_tensor("v", v_cache, shape=tuple(k_cache.shape))
    check_tensor("cu_seqlens_k", cu_seqlens_k, ndim=1, dtypes=(torch.int32,))
    batch = cu_seqlens_k.shape[0] - 1
    require(block_table.shape[0] == batch, "block_table", f"[batch_size={batch}, max_num_blocks]", block_table)
    page = k_cache.shape[1]
    offsets = cu_seqlens_k.long()
    if validation_enabled(block_table.device):
        check_block_table(block_table, offsets.diff(), page, k_cache.shape[0], lengths_name="cu_seqlens_k")
    tokens = torch.arange(int(offsets[-1]), device=k_cache.device)
    seq = torch.searchsorted(offsets[1:], tokens, right=True)
    position = tokens - offsets[seq]
    rows = block_table.long()[seq, position // page] * page + position % page
    return k_cache.flatten(0, 1)[rows], v_cache.flatten(0, 1)[rows]
