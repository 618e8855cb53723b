"""The merge of split-KV partials shared by the sparse decode kernels (DSA, DeepSeek-V4): per flat query row, the
splits' ``(max, sum, accumulator)`` combined in split order, so the result has the same bits every run."""
from __future__ import annotations

import triton
import triton.language as tl

from ...._core.triton.helpers import LOG2E


@triton.jit
def split_offset(r, h, split, splits, heads):
    """Element offset of (row ``r``, heads ``h``, ``split``) in the ``[R, N1, splits]`` partial statistics."""
    return (r * heads + h) * splits + split


@triton.jit
def merge_splits(pm_ptr, pl_ptr, pacc_ptr, r, h, dv, splits, heads, head_d, BLOCK_H: tl.constexpr,
                 BLOCK_DV: tl.constexpr):
    """Row ``r``'s heads ``h`` and columns ``dv``: the max over the splits first, then the sums and accumulators
    rescaled to it and added in split order. Returns ``(m, l, acc)``; rows without a key keep ``m = -inf``."""
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for split in range(splits):
        m_i = tl.maximum(m_i, tl.load(pm_ptr + split_offset(r, h, split, splits, heads), mask=h < heads,
                                      other=float("-inf")))
    shift = tl.where(m_i == float("-inf"), 0.0, m_i)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for split in range(splits):
        at = split_offset(r, h, split, splits, heads)
        alpha = tl.exp2((tl.load(pm_ptr + at, mask=h < heads, other=float("-inf")) - shift) * LOG2E)
        l_i += alpha * tl.load(pl_ptr + at, mask=h < heads, other=0.0)
        acc += alpha[:, None] * tl.load(pacc_ptr + at[:, None] * head_d + dv[None, :],
                                        mask=(h[:, None] < heads) & (dv[None, :] < head_d), other=0.0)
    return m_i, l_i, acc
