"""FlashAttention forward kernel: one program per (query row block, batch x query head), online softmax over
the key blocks of the band only. No allocation here (``launch.py`` allocates and launches)."""
import triton
import triton.language as tl

from .common import (FLT_LOWEST, FLT_MAX, KV_START, LOG2E, Q_LEN, Q_START, band_cols, dropout_scale, meta,
                     program_batch_head, score_tile, stat_offsets, upcast)


@triton.jit
def fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, smax_ptr, ssum_ptr, meta_ptr,
               q_sb, q_st, q_sh, k_sb, k_st, k_sh, v_sb, v_st, v_sh, o_sb, o_st, o_sh, stat_row,
               pse_ptr, pse_sb, pse_sh, pse_sr, pse_cols, mask_ptr, mask_sb, mask_sh, mask_sr,
               drop_ptr, keep_prob, seed, offset, scale, n1, group, head_d, head_dv, batch, bh_fold,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               PSE: tl.constexpr, PSE_BEFORE_SCALE: tl.constexpr, HAS_EXPLICIT: tl.constexpr,
               DROPOUT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, FOLD: tl.constexpr):
    """``O = softmax(S) V`` for rows ``[r0, r0 + BLOCK_M)``; writes O (0 on fully-masked rows) and the statistics
    ``softmax_max = rowmax(S)``, ``softmax_sum = rowsum(exp(S - max))`` (FLT_LOWEST / FLT_MAX on fully-masked
    rows) replicated over 8 lanes. Dropout scales P after the sum, like the reference."""
    pid_m = tl.program_id(0)
    b, h = program_batch_head(n1, bh_fold, FOLD)
    if FOLD:
        if b >= batch:
            return
    sq = meta(meta_ptr, b, Q_LEN)
    r0 = pid_m * BLOCK_M
    if r0 >= sq:
        return
    hk = h // group
    rows = r0 + tl.arange(0, BLOCK_M)
    dk = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_rows = (meta(meta_ptr, b, Q_START) + rows).to(tl.int64)
    kv_base = meta(meta_ptr, b, KV_START)
    q_tile = tl.load(q_ptr + b.to(tl.int64) * q_sb + q_rows[:, None] * q_st + tl.cast(h, tl.int64) * q_sh + dk[None, :],
                     mask=(rows[:, None] < sq) & (dk[None, :] < head_d), other=0.0)
    q_tile = upcast(q_tile, UPCAST)
    k_base = k_ptr + b.to(tl.int64) * k_sb + hk.to(tl.int64) * k_sh
    v_base = v_ptr + b.to(tl.int64) * v_sb + hk.to(tl.int64) * v_sh

    m_i = tl.full([BLOCK_M], FLT_LOWEST, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    c_lo, c_hi = band_cols(meta_ptr, b, r0, tl.minimum(r0 + BLOCK_M, sq))
    for c0 in range((c_lo // BLOCK_N) * BLOCK_N, c_hi, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        kv_rows = (kv_base + cols).to(tl.int64)
        col_ok = cols < c_hi
        k_t = tl.load(k_base + kv_rows[None, :] * k_st + dk[:, None], mask=col_ok[None, :] & (dk[:, None] < head_d),
                      other=0.0)
        qk = tl.dot(q_tile, upcast(k_t, UPCAST), input_precision=PRECISION)
        s = score_tile(qk, meta_ptr, b, h, rows, cols, r0, c0, scale, pse_ptr, pse_sb, pse_sh, pse_sr, pse_cols,
                       mask_ptr, mask_sb, mask_sh, mask_sr, PSE, PSE_BEFORE_SCALE, HAS_EXPLICIT, BLOCK_M, BLOCK_N)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2((m_i - m_new) * LOG2E)
        p = tl.exp2((s - m_new[:, None]) * LOG2E)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT != 0:
            p = p * dropout_scale(meta_ptr, b, h, rows, cols, keep_prob, seed, offset, drop_ptr, DROPOUT == 2)
        v_tile = upcast(tl.load(v_base + kv_rows[:, None] * v_st + dv[None, :],
                                mask=col_ok[:, None] & (dv[None, :] < head_dv), other=0.0), UPCAST)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=PRECISION)
        m_i = m_new

    kept = l_i > 0
    out = acc / tl.where(kept, l_i, 1.0)[:, None]
    o_off = b.to(tl.int64) * o_sb + q_rows[:, None] * o_st + tl.cast(h, tl.int64) * o_sh + dv[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=(rows[:, None] < sq) & (dv[None, :] < head_dv))
    lanes = tl.arange(0, 8)
    stat_off = stat_offsets(meta_ptr, b, h, rows, stat_row)[:, None] + lanes[None, :]
    row_ok = (rows[:, None] < sq) & (lanes[None, :] < 8)
    tl.store(smax_ptr + stat_off, tl.broadcast_to(m_i[:, None], [BLOCK_M, 8]), mask=row_ok)
    tl.store(ssum_ptr + stat_off, tl.broadcast_to(tl.where(kept, l_i, FLT_MAX)[:, None], [BLOCK_M, 8]), mask=row_ok)
