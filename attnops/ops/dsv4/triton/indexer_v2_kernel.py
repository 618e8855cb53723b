"""The DeepSeek-V4 lightning indexer's kernel: per query token, ``sum_h w[h] * relu(q[h] . k[j])`` over the compressed
keys it may use, fused with the streaming top-k of :mod:`attnops.ops.common.triton.topk` (no score matrix). One
program per query token (``(token, 0)`` packed, ``(row, batch)`` BSND). Lengths, residuals, block table and index
offsets are read from device tensors here (``indexer_v2_launch.py`` plans the call; nothing is read on the host).

Allowed keys: mask mode 0 all ``Lk``; mode 3 (``CAUSAL``) the first ``floor((p + 1) / r)`` (capped at ``Lk``, none
when ``p + 1 <= 0``) with ``p = Lk * r + residual - Lq + i``. The row stores the positions (plus the token's
``output_idx_offset``) in descending score order, then -1, and their fp32 scores, then -inf.
"""
import triton
import triton.language as tl

from ...._core.triton.helpers import upcast
from ...common.triton.token_rows import head_rows, kv_range, query_row
from ...common.triton.topk import streaming_topk, topk_positions, topk_scores

NO_LENGTHS: tl.constexpr = tl.constexpr(False)


@triton.jit
def _clamped_entry(ptr, b, hi):
    """``ptr[b]`` clamped to ``[0, hi]``."""
    return tl.minimum(tl.maximum(tl.load(ptr + b).to(tl.int64), 0), hi)


@triton.jit
def indexer_v2_kernel(q_ptr, k_ptr, w_ptr, idx_ptr, val_ptr, off_ptr, q_ends_ptr, sq_ptr, k_ends_ptr, sk_ptr,
                      res_ptr, bt_ptr, q_sb, q_st, q_sh, k_s0, k_s1, w_sb, w_st, w_sh, o_sb, o_st, off_sb, off_st,
                      bt_sb, s1, s2, n_batch, heads, head_d, page, n_pages, count, ratio,
                      Q_PACKED: tl.constexpr, SEQUSED_Q: tl.constexpr, KV_MODE: tl.constexpr,
                      SEQUSED_K: tl.constexpr, CAUSAL: tl.constexpr, RESIDUAL: tl.constexpr, OFFSET: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    if Q_PACKED:
        b, token, row, q_len, valid = query_row(q_ends_ptr, 1, s1, n_batch, Q_PACKED, NO_LENGTHS)
        if SEQUSED_Q:
            q_len = tl.minimum(q_len, _clamped_entry(sq_ptr, b, s1))
            valid = valid & (row < q_len)
    else:
        b, token, row, q_len, valid = query_row(sq_ptr, 1, s1, n_batch, Q_PACKED, SEQUSED_Q)
    if KV_MODE == 1:
        kv_start, kv_len = kv_range(k_ends_ptr, 1, b, s2, KV_MODE, NO_LENGTHS)
        if SEQUSED_K:
            kv_len = tl.minimum(kv_len, _clamped_entry(sk_ptr, b, s2))
    else:
        kv_start, kv_len = kv_range(sk_ptr, 1, b, s2, KV_MODE, SEQUSED_K)
    limit = kv_len
    if CAUSAL:
        residual = 0
        if RESIDUAL:
            residual = _clamped_entry(res_ptr, b, ratio - 1)
        reach = kv_len * ratio + residual - q_len + row + 1  # p + 1
        limit = tl.minimum(tl.where(reach > 0, reach // ratio, 0), kv_len)
    limit = tl.where(valid, limit, 0)
    q = upcast(head_rows(q_ptr, b, token, 0, heads, q_sb, q_st, q_sh, head_d, BLOCK_H, BLOCK_D), UPCAST)
    h = tl.arange(0, BLOCK_H)
    w = tl.load(w_ptr + b.to(tl.int64) * w_sb + token * w_st + h * w_sh, mask=h < heads, other=0.0).to(tl.float32)
    best = streaming_topk(q, w, k_ptr, bt_ptr, b, limit, kv_start, k_s0, k_s1, bt_sb, page, n_pages, head_d, KV_MODE,
                          BLOCK_D, UPCAST, PRECISION, BLOCK_N, BLOCK_K)
    pos, picked = topk_positions(best)
    if OFFSET:
        pos += tl.load(off_ptr + b.to(tl.int64) * off_sb + token * off_st).to(tl.int32)
    k_slot = tl.arange(0, BLOCK_K)
    out = b.to(tl.int64) * o_sb + token * o_st + k_slot
    tl.store(idx_ptr + out, tl.where(picked, pos, -1), mask=k_slot < count)
    tl.store(val_ptr + out, tl.where(picked, topk_scores(best), float("-inf")), mask=k_slot < count)
