"""NSA importance-score kernel: the block scores of compressed attention from the final softmax statistics, without
storing the probabilities. No allocation here (``infer_launch.py`` allocates and launches).

One program per (query row block x selection block tile, batch x KV head; the pairs folded into axes 1 and 2 past
CUDA's 65535 programs per axis, ``FOLD``, as the FlashAttention kernels): for each query head of the GQA group it
recomputes ``P = exp(S - max) / sum`` over the compressed columns that feed the tile's selection blocks (the
FlashAttention score tile: scale, band and explicit mask or causal rule) and accumulates ``P @ W``, where
``W[c, k] = times[m*(k+1) - c]`` is the score formula's weight of column ``c`` in block ``k`` (0 out of range).
A program whose column range is empty (all blocks past the causal edge of its rows, about half of the grid for
causal sequences) loads no query tile and no statistics: it only writes its zeros (and forced blocks).
Forced blocks score ``FLT_MAX``, so the top-k kernel (``topk.py``) takes them first: those of a ``topk_mask``
(``FORCED_MASK``, one byte per (row, block)) or of the layer's rule (``FORCED_LOCAL``: block 0 and the
``local_blocks`` blocks ending at the row's own block, computed).
"""
import triton
import triton.language as tl

from ...._core.triton.helpers import FLT_MAX, LOG2E, program_batch_head
from ...common.triton.common import (KV_START, MASK_STRIDED_CAUSAL, Q_LEN, Q_START, band_cols, meta, row_stats,
                                     score_tile)

FORCED_MASK: tl.constexpr = tl.constexpr(1)  # FORCED: a topk_mask tensor
FORCED_LOCAL: tl.constexpr = tl.constexpr(2)  # FORCED: block 0 and the local blocks ending at the row's own block


@triton.jit
def importance_kernel(q_ptr, k_ptr, smax_ptr, ssum_ptr, score_ptr, meta_ptr, sel_ptr,
                      q_st, q_sh, k_st, k_sh, stat_row, score_st, score_sh,
                      mask_ptr, mask_sb, mask_sh, mask_sr, forced_ptr, forced_sr, local_blocks, first_position,
                      sel_block, scale, n2,
                      group, head_d, m, nn, sel_tiles, batch, bh_fold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, HAS_EXPLICIT: tl.constexpr, FORCED: tl.constexpr,
                      UPCAST: tl.constexpr, PRECISION: tl.constexpr, FOLD: tl.constexpr):
    """Scores ``[rows, KV head, blocks k0..k0+BLOCK_K)`` (fp32, summed over the group) of TND query/key tokens; axis 0
    counts ``sel_tiles`` selection block tiles per row block."""
    pid_m = tl.program_id(0) // sel_tiles
    k0 = (tl.program_id(0) % sel_tiles) * BLOCK_K
    b, hk = program_batch_head(n2, bh_fold, FOLD)
    if FOLD:
        if b >= batch:
            return
    sq = meta(meta_ptr, b, Q_LEN)
    sel = tl.load(sel_ptr + b)
    r0 = pid_m * BLOCK_M
    if (r0 >= sq) | (k0 >= sel):
        return
    rows = r0 + tl.arange(0, BLOCK_M)
    blocks = k0 + tl.arange(0, BLOCK_K)
    dk = tl.arange(0, BLOCK_D)
    taps = m + nn - 1
    band_lo, band_hi = band_cols(meta_ptr, b, r0, tl.minimum(r0 + BLOCK_M, sq))
    c_lo = tl.maximum(m * (k0 + 1) - taps + 1, band_lo)  # the columns feeding blocks k0 .. k0 + BLOCK_K - 1
    c_hi = tl.minimum(m * (k0 + BLOCK_K) + 1, band_hi)
    if HAS_EXPLICIT == MASK_STRIDED_CAUSAL:  # the causal rule: columns complete by the tile's last row
        last = tl.minimum(r0 + BLOCK_M, sq) - 1
        c_hi = tl.minimum(c_hi, tl.where(last >= mask_sh, (last - mask_sh) // mask_sr + 1, 0))
    q_rows = (meta(meta_ptr, b, Q_START) + rows).to(tl.int64)
    kv_base = meta(meta_ptr, b, KV_START)
    k_base = k_ptr + hk.to(tl.int64) * k_sh
    acc = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    heads = tl.where(c_lo < c_hi, group, 0)  # an empty column range (past the causal edge): zeros, no loads
    for g in range(heads):
        h = hk * group + g
        q_tile = tl.load(q_ptr + q_rows[:, None] * q_st + tl.cast(h, tl.int64) * q_sh + dk[None, :],
                         mask=(rows[:, None] < sq) & (dk[None, :] < head_d), other=0.0)
        if UPCAST:
            q_tile = q_tile.to(tl.float32)
        m_i, log2_l = row_stats(smax_ptr, ssum_ptr, meta_ptr, b, h, rows, stat_row)
        for c0 in range((c_lo // BLOCK_N) * BLOCK_N, c_hi, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            col_ok = (cols >= c_lo) & (cols < c_hi)
            k_t = tl.load(k_base + (kv_base + cols).to(tl.int64)[None, :] * k_st + dk[:, None],
                          mask=col_ok[None, :] & (dk[:, None] < head_d), other=0.0)
            if UPCAST:
                k_t = k_t.to(tl.float32)
            qk = tl.dot(q_tile, k_t, input_precision=PRECISION)
            s = score_tile(qk, meta_ptr, b, h, rows, cols, r0, c0, scale, mask_ptr, 0, 0, 0, 0,
                           mask_ptr, mask_sb, mask_sh, mask_sr, 0, False, HAS_EXPLICIT, BLOCK_M, BLOCK_N)
            p = tl.exp2((s - m_i[:, None]) * LOG2E - log2_l[:, None])
            p = tl.where(col_ok[None, :], p, 0.0)
            t = m * (blocks[None, :] + 1) - cols[:, None]  # [BLOCK_N, BLOCK_K] tap of column c in block k
            times = tl.minimum(tl.minimum(t + 1, nn), taps - t)
            w = tl.where((t >= 0) & (t < taps), times, 0).to(tl.float32)
            acc += tl.dot(p, w, input_precision="ieee")
    ok = (rows[:, None] < sq) & (blocks[None, :] < sel)
    if FORCED == FORCED_MASK:  # topk_mask [maxSq, maxSel] (uint8), read at the rows' positions in the batch
        forced = tl.load(forced_ptr + rows[:, None].to(tl.int64) * forced_sr + blocks[None, :], mask=ok, other=0)
        acc = tl.where(forced != 0, FLT_MAX, acc)
    if FORCED == FORCED_LOCAL:  # the layer's rule at the rows' positions (first_position + row) in the batch
        back = ((first_position + rows) // sel_block)[:, None] - blocks[None, :]  # blocks before the row's own
        acc = tl.where((blocks[None, :] == 0) | ((back >= 0) & (back < local_blocks)), FLT_MAX, acc)
    s_off = q_rows[:, None] * score_st + hk.to(tl.int64) * score_sh + blocks[None, :]
    tl.store(score_ptr + s_off, acc, mask=ok)
