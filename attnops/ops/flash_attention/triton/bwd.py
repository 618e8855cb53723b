"""FlashAttention backward kernels: ``D = rowsum(dO * O)`` (from the given attention output), dQ (one program per
query row block and query head, looping over the band's key blocks) and dK/dV (one program per key block and KV
head, looping over the query heads of its group and the band's query rows). Each gradient element is written by
exactly one program, without atomics, so the backward is deterministic. The given softmax statistics are used
as they are, never recomputed. No allocation here (``launch.py`` allocates and launches)."""
import triton
import triton.language as tl

from .common import (KV_LEN, KV_START, LOG2E, Q_LEN, Q_START, band_cols, band_rows, delta_offsets, dropout_scale,
                     meta, program_batch_head, row_stats, score_tile, upcast)


@triton.jit
def preprocess_kernel(o_ptr, do_ptr, delta_ptr, meta_ptr, o_sb, o_st, o_sh, do_sb, do_st, do_sh, delta_sb, n1,
                      head_dv, batch, bh_fold, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, FOLD: tl.constexpr):
    """``D[row, h] = sum_d dO * O`` in fp32 for one block of query rows of one head."""
    pid_m = tl.program_id(0)
    b, h = program_batch_head(n1, bh_fold, FOLD)
    if FOLD:
        if b >= batch:
            return
    sq = meta(meta_ptr, b, Q_LEN)
    r0 = pid_m * BLOCK_M
    if r0 >= sq:
        return
    rows = r0 + tl.arange(0, BLOCK_M)
    dv = tl.arange(0, BLOCK_DV)
    tok = (meta(meta_ptr, b, Q_START) + rows).to(tl.int64)
    ok = (rows[:, None] < sq) & (dv[None, :] < head_dv)
    o = tl.load(o_ptr + b.to(tl.int64) * o_sb + tok[:, None] * o_st + tl.cast(h, tl.int64) * o_sh + dv[None, :],
                mask=ok, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + b.to(tl.int64) * do_sb + tok[:, None] * do_st + tl.cast(h, tl.int64) * do_sh + dv[None, :],
                 mask=ok, other=0.0).to(tl.float32)
    tl.store(delta_ptr + delta_offsets(meta_ptr, b, h, rows, delta_sb, n1), tl.sum(o * do, 1), mask=rows < sq)


@triton.jit
def dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, delta_ptr, smax_ptr, ssum_ptr, meta_ptr,
              q_sb, q_st, q_sh, k_sb, k_st, k_sh, v_sb, v_st, v_sh, do_sb, do_st, do_sh, dq_sb, dq_st, dq_sh,
              stat_row, delta_sb, pse_ptr, pse_sb, pse_sh, pse_sr, pse_cols, mask_ptr, mask_sb, mask_sh, mask_sr,
              drop_ptr, keep_prob, seed, offset, dpse_ptr, dpse_sb, dpse_sh, dpse_sr,
              scale, n1, group, head_d, head_dv, batch, bh_fold,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              PSE: tl.constexpr, PSE_BEFORE_SCALE: tl.constexpr, HAS_EXPLICIT: tl.constexpr,
              DROPOUT: tl.constexpr, DPSE_FULL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
              FOLD: tl.constexpr):
    """``dQ = scale * dS K`` for one query row block of one query head; with ``DPSE_FULL`` also writes the
    score gradient (the pse gradient of a full ``[.., Sq, Skv]`` pse) into the fp32 ``[B, N1, R, C]`` buffer."""
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
    tok = (meta(meta_ptr, b, Q_START) + rows).to(tl.int64)
    row_ok = rows[:, None] < sq
    q_tile = upcast(tl.load(q_ptr + b.to(tl.int64) * q_sb + tok[:, None] * q_st + tl.cast(h, tl.int64) * q_sh + dk[None, :],
                            mask=row_ok & (dk[None, :] < head_d), other=0.0), UPCAST)
    do_tile = upcast(tl.load(do_ptr + b.to(tl.int64) * do_sb + tok[:, None] * do_st + tl.cast(h, tl.int64) * do_sh
                             + dv[None, :], mask=row_ok & (dv[None, :] < head_dv), other=0.0), UPCAST)
    m, log2l = row_stats(smax_ptr, ssum_ptr, meta_ptr, b, h, rows, stat_row)
    delta = tl.load(delta_ptr + delta_offsets(meta_ptr, b, h, rows, delta_sb, n1), mask=rows < sq, other=0.0)
    k_base = k_ptr + b.to(tl.int64) * k_sb + hk.to(tl.int64) * k_sh
    v_base = v_ptr + b.to(tl.int64) * v_sb + hk.to(tl.int64) * v_sh
    kv_base = meta(meta_ptr, b, KV_START)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    c_lo, c_hi = band_cols(meta_ptr, b, r0, tl.minimum(r0 + BLOCK_M, sq))
    for c0 in range((c_lo // BLOCK_N) * BLOCK_N, c_hi, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        kv_rows = (kv_base + cols).to(tl.int64)
        col_ok = cols[None, :] < c_hi
        k_t = upcast(tl.load(k_base + kv_rows[None, :] * k_st + dk[:, None], mask=col_ok & (dk[:, None] < head_d),
                             other=0.0), UPCAST)
        v_t = upcast(tl.load(v_base + kv_rows[None, :] * v_st + dv[:, None], mask=col_ok & (dv[:, None] < head_dv),
                             other=0.0), UPCAST)
        s = score_tile(tl.dot(q_tile, k_t, input_precision=PRECISION), meta_ptr, b, h, rows, cols, r0, c0, scale,
                       pse_ptr, pse_sb, pse_sh, pse_sr, pse_cols, mask_ptr, mask_sb, mask_sh, mask_sr,
                       PSE, PSE_BEFORE_SCALE, HAS_EXPLICIT, BLOCK_M, BLOCK_N)
        p = tl.exp2((s - m[:, None]) * LOG2E - log2l[:, None])
        dp = tl.dot(do_tile, v_t, input_precision=PRECISION)
        if DROPOUT != 0:
            dp = dp * dropout_scale(meta_ptr, b, h, rows, cols, keep_prob, seed, offset, drop_ptr, DROPOUT == 2)
        ds = p * (dp - delta[:, None])
        if DPSE_FULL:
            g = ds * scale if PSE_BEFORE_SCALE else ds
            off = b.to(tl.int64) * dpse_sb + tl.cast(h, tl.int64) * dpse_sh + rows[:, None].to(tl.int64) * dpse_sr \
                + cols[None, :]
            tl.store(dpse_ptr + off, g, mask=row_ok & (cols[None, :] < meta(meta_ptr, b, KV_LEN)))
        acc += tl.dot(ds.to(k_t.dtype), tl.trans(k_t), input_precision=PRECISION)
    dq = acc * scale
    tl.store(dq_ptr + b.to(tl.int64) * dq_sb + tok[:, None] * dq_st + tl.cast(h, tl.int64) * dq_sh + dk[None, :],
             dq.to(dq_ptr.dtype.element_ty), mask=row_ok & (dk[None, :] < head_d))


@triton.jit
def dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, delta_ptr, smax_ptr, ssum_ptr, meta_ptr,
                q_sb, q_st, q_sh, k_sb, k_st, k_sh, v_sb, v_st, v_sh, do_sb, do_st, do_sh,
                dk_sb, dk_st, dk_sh, dv_sb, dv_st, dv_sh,
                stat_row, delta_sb, pse_ptr, pse_sb, pse_sh, pse_sr, pse_cols, mask_ptr, mask_sb, mask_sh, mask_sr,
                drop_ptr, keep_prob, seed, offset, dpse_ptr, dpse_sb, dpse_sh,
                scale, n1, n2, group, head_d, head_dv, batch, bh_fold,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                PSE: tl.constexpr, PSE_BEFORE_SCALE: tl.constexpr, HAS_EXPLICIT: tl.constexpr,
                DROPOUT: tl.constexpr, DPSE_ROW: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                FOLD: tl.constexpr):
    """``dK = scale * dS^T Q`` and ``dV = (P * drop)^T dO`` for one key block of one KV head (its GQA group's
    query heads summed in-program); with ``DPSE_ROW`` also the column sums of the score gradient per query head
    (the gradient of a row-broadcast ``[.., 1, Skv]`` pse) into the fp32 ``[B, N1, 1, C]`` buffer."""
    pid_n = tl.program_id(0)
    b, hk = program_batch_head(n2, bh_fold, FOLD)
    if FOLD:
        if b >= batch:
            return
    skv = meta(meta_ptr, b, KV_LEN)
    sq = meta(meta_ptr, b, Q_LEN)
    c0 = pid_n * BLOCK_N
    if c0 >= skv:
        return
    cols = c0 + tl.arange(0, BLOCK_N)
    dk = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    kv_rows = (meta(meta_ptr, b, KV_START) + cols).to(tl.int64)
    col_ok = cols[:, None] < skv
    k_tile = upcast(tl.load(k_ptr + b.to(tl.int64) * k_sb + kv_rows[:, None] * k_st + hk.to(tl.int64) * k_sh
                            + dk[None, :], mask=col_ok & (dk[None, :] < head_d), other=0.0), UPCAST)
    v_tile = upcast(tl.load(v_ptr + b.to(tl.int64) * v_sb + kv_rows[:, None] * v_st + hk.to(tl.int64) * v_sh
                            + dv[None, :], mask=col_ok & (dv[None, :] < head_dv), other=0.0), UPCAST)
    k_t = tl.trans(k_tile)
    v_t = tl.trans(v_tile)
    acc_k = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    acc_v = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    r_lo, r_hi = band_rows(meta_ptr, b, c0, tl.minimum(c0 + BLOCK_N, skv))
    q_base = meta(meta_ptr, b, Q_START)
    for h in range(hk * group, hk * group + group):
        col_grad = tl.zeros([BLOCK_N], tl.float32)
        for r0 in range((r_lo // BLOCK_M) * BLOCK_M, r_hi, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            tok = (q_base + rows).to(tl.int64)
            row_ok = rows[:, None] < sq
            q_tile = upcast(tl.load(q_ptr + b.to(tl.int64) * q_sb + tok[:, None] * q_st + tl.cast(h, tl.int64) * q_sh
                                    + dk[None, :], mask=row_ok & (dk[None, :] < head_d), other=0.0), UPCAST)
            do_tile = upcast(tl.load(do_ptr + b.to(tl.int64) * do_sb + tok[:, None] * do_st + tl.cast(h, tl.int64) * do_sh
                                     + dv[None, :], mask=row_ok & (dv[None, :] < head_dv), other=0.0), UPCAST)
            m, log2l = row_stats(smax_ptr, ssum_ptr, meta_ptr, b, h, rows, stat_row)
            delta = tl.load(delta_ptr + delta_offsets(meta_ptr, b, h, rows, delta_sb, n1), mask=rows < sq, other=0.0)
            s = score_tile(tl.dot(q_tile, k_t, input_precision=PRECISION), meta_ptr, b, h, rows, cols, r0, c0,
                           scale, pse_ptr, pse_sb, pse_sh, pse_sr, pse_cols, mask_ptr, mask_sb, mask_sh, mask_sr,
                           PSE, PSE_BEFORE_SCALE, HAS_EXPLICIT, BLOCK_M, BLOCK_N)
            p = tl.exp2((s - m[:, None]) * LOG2E - log2l[:, None])
            dp = tl.dot(do_tile, v_t, input_precision=PRECISION)
            p_drop = p
            if DROPOUT != 0:
                drop = dropout_scale(meta_ptr, b, h, rows, cols, keep_prob, seed, offset, drop_ptr, DROPOUT == 2)
                p_drop = p * drop
                dp = dp * drop
            acc_v += tl.dot(tl.trans(p_drop.to(do_tile.dtype)), do_tile, input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            acc_k += tl.dot(tl.trans(ds.to(q_tile.dtype)), q_tile, input_precision=PRECISION)
            if DPSE_ROW:
                col_grad += tl.sum(ds * scale if PSE_BEFORE_SCALE else ds, 0)
        if DPSE_ROW:
            tl.store(dpse_ptr + b.to(tl.int64) * dpse_sb + tl.cast(h, tl.int64) * dpse_sh + cols, col_grad, mask=cols < skv)
    dk_out = acc_k * scale
    tl.store(dk_ptr + b.to(tl.int64) * dk_sb + kv_rows[:, None] * dk_st + hk.to(tl.int64) * dk_sh + dk[None, :],
             dk_out.to(dk_ptr.dtype.element_ty), mask=col_ok & (dk[None, :] < head_d))
    tl.store(dv_ptr + b.to(tl.int64) * dv_sb + kv_rows[:, None] * dv_st + hk.to(tl.int64) * dv_sh + dv[None, :],
             acc_v.to(dv_ptr.dtype.element_ty), mask=col_ok & (dv[None, :] < head_dv))
