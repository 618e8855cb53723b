"""FlashAttention forward kernel: one program per (query row block, batch x query head), online softmax over
the key blocks of the band only. No allocation here (``launch.py`` allocates and launches).

The key tiles of a row block split in two loops (as in Triton's fused-attention tutorial): the tiles that every row
keeps entirely (no mask: no per-element band test, no bounds checks on K/V) and the edge tiles around them
(masked). Scores are kept in base 2: ``p = exp2(qk * scale * log2(e) - max * log2(e))``, one FFMA per element
without a pse or explicit mask."""
import triton
import triton.language as tl

from ...._core.triton.helpers import FLT_LOWEST, FLT_MAX, LOG2E, base2_max, program_batch_head, upcast
from .common import (KV_START, Q_LEN, Q_START, band_cols, band_keep, dropout_scale, explicit_masked, full_cols, meta,
                     nan_aware_max, pse_scores, softcap_tanh, stat_offsets)


@triton.jit
def _attend(acc, m_i, l_i, seen, q_tile, k_base, v_base, kv_base, c0, c_hi, rows, dk, dv, meta_ptr, b, h, k_st, v_st,
            head_d, head_dv, scale, softcap, pse_ptr, pse_sb, pse_sh, pse_sr, pse_cols, mask_ptr, mask_sb, mask_sh,
            mask_sr, mask_cols, drop_ptr, keep_prob, seed, offset, row_ok,
            BLOCK_N: tl.constexpr, MASKED: tl.constexpr, PSE: tl.constexpr, PSE_BEFORE_SCALE: tl.constexpr,
            HAS_EXPLICIT: tl.constexpr, DROPOUT: tl.constexpr, NEGATIVE_SCALE: tl.constexpr, SOFTCAP: tl.constexpr,
            UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One step of the online softmax: key tile ``[c0, c0 + BLOCK_N)``; ``MASKED``: an edge tile (band, prefix and
    bounds tested per element, keys past ``c_hi`` not read); ``SOFTCAP``: ``QK^T`` capped first. ``seen``: the rows
    that kept a key so far, whatever its score (one row max of the keep mask per masked tile)."""
    cols = c0 + tl.arange(0, BLOCK_N)
    kv_rows = (kv_base + cols).to(tl.int64)
    col_ok = cols < c_hi
    if MASKED:
        k_t = tl.load(k_base + kv_rows[None, :] * k_st + dk[:, None], mask=col_ok[None, :] & (dk[:, None] < head_d),
                      other=0.0)
    else:
        k_t = tl.load(k_base + kv_rows[None, :] * k_st + dk[:, None], mask=dk[:, None] < head_d, other=0.0)
    qk = tl.dot(q_tile, upcast(k_t, UPCAST), input_precision=PRECISION)
    if SOFTCAP:
        qk = softcap_tanh(qk, scale, softcap) * (softcap / scale)
    if PSE == 0 and not HAS_EXPLICIT and not MASKED:  # the tutorial's form: max of QK^T, one FFMA per score
        if NEGATIVE_SCALE:
            m_new = tl.maximum(m_i, tl.min(qk, 1) * scale)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * scale)
        m2 = base2_max(m_new)
        p = tl.exp2(qk * (scale * LOG2E) - m2[:, None])
        seen = seen | row_ok
    else:
        # tensors (pse, explicit mask) are read within their own columns: a bound the compiler can prove aligned
        s = pse_scores(qk, meta_ptr, b, h, rows, cols, row_ok, cols < pse_cols, scale, pse_ptr, pse_sb, pse_sh,
                       pse_sr, pse_cols, PSE, PSE_BEFORE_SCALE)
        keep = tl.full(s.shape, 1, tl.int1)
        if MASKED:
            keep = band_keep(meta_ptr, b, rows, cols)
        if HAS_EXPLICIT:
            keep = keep & (explicit_masked(tl.zeros_like(s), mask_ptr, mask_sb, mask_sh, mask_sr, b, h, rows, cols,
                                           row_ok, cols < mask_cols, HAS_EXPLICIT) == 0)
        if MASKED or HAS_EXPLICIT:
            s = tl.where(keep, s, float("-inf"))
            seen = seen | (tl.max(keep.to(tl.int32), 1) > 0)
        else:
            seen = seen | row_ok
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m2 = base2_max(m_new)
        p = tl.exp2(s * LOG2E - m2[:, None])
    alpha = tl.exp2(base2_max(m_i) - m2)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT != 0:
        p = p * dropout_scale(meta_ptr, b, h, rows, cols, keep_prob, seed, offset, drop_ptr, DROPOUT == 2)
    if MASKED:
        v_tile = tl.load(v_base + kv_rows[:, None] * v_st + dv[None, :], mask=col_ok[:, None] & (dv[None, :] < head_dv),
                         other=0.0)
    else:
        v_tile = tl.load(v_base + kv_rows[:, None] * v_st + dv[None, :], mask=dv[None, :] < head_dv, other=0.0)
    v_tile = upcast(v_tile, UPCAST)
    acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=PRECISION)
    return acc, m_new, l_i, seen


@triton.jit
def fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, smax_ptr, ssum_ptr, meta_ptr,
               q_sb, q_st, q_sh, k_sb, k_st, k_sh, v_sb, v_st, v_sh, o_sb, o_st, o_sh, stat_row,
               pse_ptr, pse_sb, pse_sh, pse_sr, pse_cols, mask_ptr, mask_sb, mask_sh, mask_sr, mask_cols,
               drop_ptr, keep_prob, seed, offset, scale, softcap, n1, group, head_d: tl.constexpr,
               head_dv: tl.constexpr, batch, bh_fold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PSE: tl.constexpr, PSE_BEFORE_SCALE: tl.constexpr,
               HAS_EXPLICIT: tl.constexpr, DROPOUT: tl.constexpr, NEGATIVE_SCALE: tl.constexpr,
               SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, FOLD: tl.constexpr):
    """``O = softmax(S) V`` for rows ``[r0, r0 + BLOCK_M)``; writes O (0 on fully-masked rows) and the statistics
    ``softmax_max = rowmax(S)``, ``softmax_sum = rowsum(exp(S - max))`` (FLT_LOWEST / FLT_MAX on fully-masked
    rows) replicated over 8 lanes. Dropout scales P after the sum, like the reference. ``pse_cols`` /
    ``mask_cols``: the columns of the pse / explicit mask tensor (at least every batch's key count)."""
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
    row_ok = rows < sq
    dk = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_rows = (meta(meta_ptr, b, Q_START) + rows).to(tl.int64)
    kv_base = meta(meta_ptr, b, KV_START)
    q_tile = tl.load(q_ptr + b.to(tl.int64) * q_sb + q_rows[:, None] * q_st + tl.cast(h, tl.int64) * q_sh + dk[None, :],
                     mask=row_ok[:, None] & (dk[None, :] < head_d), other=0.0)
    q_tile = upcast(q_tile, UPCAST)
    k_base = k_ptr + b.to(tl.int64) * k_sb + hk.to(tl.int64) * k_sh
    v_base = v_ptr + b.to(tl.int64) * v_sb + hk.to(tl.int64) * v_sh

    m_i = tl.full([BLOCK_M], FLT_LOWEST, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    seen = tl.zeros([BLOCK_M], tl.int1)
    c_lo, c_hi = band_cols(meta_ptr, b, r0, tl.minimum(r0 + BLOCK_M, sq))
    c_begin = c_lo // BLOCK_N * BLOCK_N
    full_lo, full_hi = full_cols(meta_ptr, b, r0, c_begin, c_hi, BLOCK_M, BLOCK_N)
    for c0 in range(full_lo, full_hi, BLOCK_N):  # tiles kept entirely: no mask
        acc, m_i, l_i, seen = _attend(acc, m_i, l_i, seen, q_tile, k_base, v_base, kv_base, c0, c_hi, rows, dk, dv,
                                      meta_ptr, b, h, k_st, v_st, head_d, head_dv, scale, softcap, pse_ptr, pse_sb,
                                      pse_sh, pse_sr, pse_cols, mask_ptr, mask_sb, mask_sh, mask_sr, mask_cols,
                                      drop_ptr, keep_prob, seed, offset, row_ok, BLOCK_N, False, PSE,
                                      PSE_BEFORE_SCALE, HAS_EXPLICIT, DROPOUT, NEGATIVE_SCALE, SOFTCAP, UPCAST,
                                      PRECISION)
    # edge tiles: [c_begin, full_lo) then [full_hi, c_hi), one loop
    n_left = (full_lo - c_begin) // BLOCK_N
    for t in range(0, n_left + tl.cdiv(c_hi - full_hi, BLOCK_N)):
        c0 = tl.where(t < n_left, c_begin + t * BLOCK_N, full_hi + (t - n_left) * BLOCK_N)
        acc, m_i, l_i, seen = _attend(acc, m_i, l_i, seen, q_tile, k_base, v_base, kv_base, c0, c_hi, rows, dk, dv,
                                      meta_ptr, b, h, k_st, v_st, head_d, head_dv, scale, softcap, pse_ptr, pse_sb,
                                      pse_sh, pse_sr, pse_cols, mask_ptr, mask_sb, mask_sh, mask_sr, mask_cols,
                                      drop_ptr, keep_prob, seed, offset, row_ok, BLOCK_N, True, PSE,
                                      PSE_BEFORE_SCALE, HAS_EXPLICIT, DROPOUT, NEGATIVE_SCALE, SOFTCAP, UPCAST,
                                      PRECISION)

    m_i = nan_aware_max(m_i, l_i)
    unkept = seen & (l_i == 0)  # keys seen, every score -inf: the formula's 0 / 0 (max -inf, sum NaN)
    m_i = tl.where(unkept, float("-inf"), m_i)
    l_i = tl.where(unkept, float("nan"), l_i)
    kept = l_i != 0  # a NaN sum (non-finite inputs) too: its row comes out NaN
    out = acc / tl.where(kept, l_i, 1.0)[:, None]
    o_off = b.to(tl.int64) * o_sb + q_rows[:, None] * o_st + tl.cast(h, tl.int64) * o_sh + dv[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < head_dv))
    lanes = tl.arange(0, 8)
    stat_off = stat_offsets(meta_ptr, b, h, rows, stat_row)[:, None] + lanes[None, :]
    lane_ok = row_ok[:, None] & (lanes[None, :] < 8)
    tl.store(smax_ptr + stat_off, tl.broadcast_to(m_i[:, None], [BLOCK_M, 8]), mask=lane_ok)
    tl.store(ssum_ptr + stat_off, tl.broadcast_to(tl.where(kept, l_i, FLT_MAX)[:, None], [BLOCK_M, 8]), mask=lane_ok)
