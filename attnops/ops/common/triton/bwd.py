"""FlashAttention backward kernels: ``D = rowsum(dO * O)`` (from the given attention output), then one pass over
the key blocks that computes dK, dV and dQ from five tensor-core products per (key block, query row block) pair,
in transposed form so that the key block (or, for dQ, the head dim) is every product's M dimension, as Hopper's
wgmma needs: ``S^T = K Q^T``, ``dP^T = V dO^T``, ``dV += P^T dO``, ``dK += dS^T Q``, ``dQ^T = K^T dS^T``.

A program of the pass owns one query head and every ``splits``-th key block of it (``j, j + splits, ...``). It
writes its dK/dV rows once (with GQA, each query head into its own fp32 partial) and adds the dQ of its key blocks
into its own fp32 partial, in its fixed key block order (relaxed atomic adds, only to skip reading the tile back:
no other program writes that partial). ``grad_sum_kernel`` then sums the partials in index order (dQ over the
splits, dK/dV over a group's heads). No program depends on another, so the backward is deterministic: the same
inputs give bitwise equal gradients. The given softmax statistics are used as they are, never recomputed. No
allocation here (``launch.py`` allocates)."""
import triton
import triton.language as tl

from ...._core.triton.helpers import LOG2E, program_batch_head, upcast
from .common import (KV_LEN, KV_START, Q_LEN, Q_START, band_cols, band_rows, delta_offsets, dropout_scale,
                     kept_score_tile, meta, row_stats, softcap_tanh)


@triton.jit
def preprocess_kernel(o_ptr, do_ptr, delta_ptr, meta_ptr, o_sb, o_st, o_sh, do_sb, do_st, do_sh, delta_sb, n1,
                      head_dv: tl.constexpr, batch, bh_fold, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
                      FOLD: tl.constexpr):
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
              drop_ptr, keep_prob, seed, offset, scale, softcap, n1, group, head_d: tl.constexpr,
              head_dv: tl.constexpr, batch, bh_fold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PSE: tl.constexpr, PSE_BEFORE_SCALE: tl.constexpr,
              HAS_EXPLICIT: tl.constexpr, DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
              PRECISION: tl.constexpr, FOLD: tl.constexpr):
    """``dQ = scale * dS K`` for one query row block of one query head: the backward's dQ where the dK/dV pass
    leaves it out (``DQ`` False: GPUs without wgmma, whose registers do not hold the fifth product; the former
    two-kernel form, which recomputes ``S`` and ``dP``)."""
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
    q_tile = upcast(tl.load(q_ptr + b.to(tl.int64) * q_sb + tok[:, None] * q_st + tl.cast(h, tl.int64) * q_sh
                            + dk[None, :], mask=row_ok & (dk[None, :] < head_d), other=0.0), UPCAST)
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
        qk = tl.dot(q_tile, k_t, input_precision=PRECISION)
        if SOFTCAP:
            cap = softcap_tanh(qk, scale, softcap)
            qk = cap * (softcap / scale)
        s, seen = kept_score_tile(qk, meta_ptr, b, h, rows, cols, r0, c0, scale, pse_ptr, pse_sb, pse_sh, pse_sr,
                                  pse_cols, mask_ptr, mask_sb, mask_sh, mask_sr, PSE, PSE_BEFORE_SCALE, HAS_EXPLICIT,
                                  BLOCK_M, BLOCK_N)
        # P and dS exactly 0 where masked, also on a row whose statistics are NaN (non-finite inputs): no NaN reaches
        # a key the row does not see
        p = tl.where(seen, tl.exp2((s - m[:, None]) * LOG2E - log2l[:, None]), 0.0)
        dp = tl.dot(do_tile, v_t, input_precision=PRECISION)
        if DROPOUT != 0:
            dp = dp * dropout_scale(meta_ptr, b, h, rows, cols, keep_prob, seed, offset, drop_ptr, DROPOUT == 2)
        ds = tl.where(seen, p * (dp - delta[:, None]), 0.0)
        if SOFTCAP:
            ds = ds * (1.0 - cap * cap)
        acc += tl.dot(ds.to(k_t.dtype), tl.trans(k_t), input_precision=PRECISION)
    dq = acc * scale
    tl.store(dq_ptr + b.to(tl.int64) * dq_sb + tok[:, None] * dq_st + tl.cast(h, tl.int64) * dq_sh + dk[None, :],
             dq.to(dq_ptr.dtype.element_ty), mask=row_ok & (dk[None, :] < head_d))


@triton.jit
def _part_columns(BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, GRAD_PARTS: tl.constexpr):
    """``(j, dK columns, dV columns)`` of this program of the dK/dV pass: its key block and its part's head-dim
    columns (all of them, and ``j`` the program itself, when ``GRAD_PARTS`` is 1)."""
    if GRAD_PARTS == 1:
        return tl.program_id(0), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    part = tl.program_id(0) % GRAD_PARTS
    return (tl.program_id(0) // GRAD_PARTS, part * (BLOCK_D // GRAD_PARTS) + tl.arange(0, BLOCK_D // GRAD_PARTS),
            part * (BLOCK_DV // GRAD_PARTS) + tl.arange(0, BLOCK_DV // GRAD_PARTS))


@triton.jit
def dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dqp_ptr, dk_ptr, dv_ptr, delta_ptr, smax_ptr, ssum_ptr, meta_ptr,
                q_sb, q_st, q_sh, k_sb, k_st, k_sh, v_sb, v_st, v_sh, do_sb, do_st, do_sh,
                dq_sb, dq_st, dq_sh, dq_part, dk_sb, dk_st, dk_sh, dk_part, dv_sb, dv_st, dv_sh, dv_part,
                stat_row, delta_sb, pse_ptr, pse_sb, pse_sh, pse_sr, pse_cols, mask_ptr, mask_sb, mask_sh, mask_sr,
                drop_ptr, keep_prob, seed, offset, dpse_ptr, dpse_sb, dpse_sh, dpse_sr,
                scale, softcap, n1, group, splits, head_d: tl.constexpr, head_dv: tl.constexpr, batch, bh_fold,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                PSE: tl.constexpr, PSE_BEFORE_SCALE: tl.constexpr, HAS_EXPLICIT: tl.constexpr,
                DROPOUT: tl.constexpr, DPSE_FULL: tl.constexpr, DPSE_ROW: tl.constexpr, DQ: tl.constexpr,
                SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, FOLD: tl.constexpr,
                GRAD_PARTS: tl.constexpr):
    """For query head ``h`` and its key blocks ``j, j + splits, ...`` (``j``: axis 0): ``dK = scale * dS^T Q`` and
    ``dV = (P * drop)^T dO`` of each key block, written to ``dk_ptr``/``dv_ptr`` at partial ``h % group`` (element
    offsets ``dk_part``/``dv_part`` apart; 0 without GQA: the gradients themselves), and with ``DQ`` ``dS K`` added
    into dQ partial ``j`` (``dq_part`` elements apart, fp32, zero on entry; unscaled; without ``DQ``: ``dq_kernel``).
    ``DPSE_FULL`` also writes the score gradient (the gradient of a full ``[.., Sq, Skv]`` pse) into the fp32
    ``[B, N1, R, C]`` buffer, ``DPSE_ROW`` its column sums (of a row-broadcast ``[.., 1, Skv]`` pse) into the fp32
    ``[B, N1, 1, C]`` buffer. ``SOFTCAP``: scores capped by ``softcap * tanh``, whose derivative scales dS after the
    pse gradient (the pse is added after the cap). ``GRAD_PARTS`` > 1 (no pse gradient): programs
    ``j * GRAD_PARTS + part`` of axis 0 compute S and dS over the whole head dims but dK, dV and dQ for their ``part``
    of the head-dim columns only (smaller accumulators: 64-key blocks fit the registers above D=128)."""
    tl.static_assert(GRAD_PARTS == 1 or not (DPSE_FULL or DPSE_ROW))
    pid_j, gk, gv = _part_columns(BLOCK_D, BLOCK_DV, GRAD_PARTS)
    b, h = program_batch_head(n1, bh_fold, FOLD)
    if FOLD:
        if b >= batch:
            return
    skv = meta(meta_ptr, b, KV_LEN).to(tl.int32)  # positions inside a sequence fit int32 (token offsets: int64)
    sq = meta(meta_ptr, b, Q_LEN).to(tl.int32)
    hk = h // group
    dk = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_base = meta(meta_ptr, b, Q_START)
    kv_base = meta(meta_ptr, b, KV_START)
    q_head = q_ptr + b.to(tl.int64) * q_sb + tl.cast(h, tl.int64) * q_sh
    do_head = do_ptr + b.to(tl.int64) * do_sb + tl.cast(h, tl.int64) * do_sh
    dq_head = dqp_ptr + tl.cast(pid_j, tl.int64) * dq_part + b.to(tl.int64) * dq_sb + tl.cast(h, tl.int64) * dq_sh
    k_head = k_ptr + b.to(tl.int64) * k_sb + hk.to(tl.int64) * k_sh
    v_head = v_ptr + b.to(tl.int64) * v_sb + hk.to(tl.int64) * v_sh
    member = tl.cast(h % group, tl.int64)
    dk_head = dk_ptr + member * dk_part + b.to(tl.int64) * dk_sb + hk.to(tl.int64) * dk_sh
    dv_head = dv_ptr + member * dv_part + b.to(tl.int64) * dv_sb + hk.to(tl.int64) * dv_sh
    for c0 in range(pid_j * BLOCK_N, skv, splits * BLOCK_N):
        tl.debug_barrier()  # the dQ partial's stores of the previous key block are visible to every thread
        cols = c0 + tl.arange(0, BLOCK_N)
        kv_rows = (kv_base + cols).to(tl.int64)
        col_ok = cols[:, None] < skv
        k_tile = upcast(tl.load(k_head + kv_rows[:, None] * k_st + dk[None, :], mask=col_ok & (dk[None, :] < head_d),
                                other=0.0), UPCAST)
        v_tile = upcast(tl.load(v_head + kv_rows[:, None] * v_st + dv[None, :],
                                mask=col_ok & (dv[None, :] < head_dv), other=0.0), UPCAST)
        acc_k = tl.zeros([BLOCK_N, BLOCK_D // GRAD_PARTS], tl.float32)
        acc_v = tl.zeros([BLOCK_N, BLOCK_DV // GRAD_PARTS], tl.float32)
        col_grad = tl.zeros([BLOCK_N], tl.float32)
        r_lo, r_hi = band_rows(meta_ptr, b, c0, tl.minimum(c0 + BLOCK_N, skv))
        for r0 in range((r_lo.to(tl.int32) // BLOCK_M) * BLOCK_M, r_hi.to(tl.int32), BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            tok = (q_base + rows).to(tl.int64)
            row_ok = rows[:, None] < sq
            q_tile = upcast(tl.load(q_head + tok[:, None] * q_st + dk[None, :], mask=row_ok & (dk[None, :] < head_d),
                                    other=0.0), UPCAST)
            do_tile = upcast(tl.load(do_head + tok[:, None] * do_st + dv[None, :],
                                     mask=row_ok & (dv[None, :] < head_dv), other=0.0), UPCAST)
            if GRAD_PARTS == 1:
                k_grad, q_grad, do_grad = k_tile, q_tile, do_tile
            else:  # this part's columns (K's reloaded per step: a copy held in registers would spill)
                k_grad = upcast(tl.load(k_head + kv_rows[:, None] * k_st + gk[None, :],
                                        mask=col_ok & (gk[None, :] < head_d), other=0.0), UPCAST)
                q_grad = upcast(tl.load(q_head + tok[:, None] * q_st + gk[None, :],
                                        mask=row_ok & (gk[None, :] < head_d), other=0.0), UPCAST)
                do_grad = upcast(tl.load(do_head + tok[:, None] * do_st + gv[None, :],
                                         mask=row_ok & (gv[None, :] < head_dv), other=0.0), UPCAST)
            m, log2l = row_stats(smax_ptr, ssum_ptr, meta_ptr, b, h, rows, stat_row)
            delta = tl.load(delta_ptr + delta_offsets(meta_ptr, b, h, rows, delta_sb, n1), mask=rows < sq, other=0.0)
            # transposed tiles [keys, rows]: the key block is the products' M dimension
            qk_t = tl.dot(k_tile, tl.trans(q_tile), input_precision=PRECISION)
            if SOFTCAP:
                cap_t = softcap_tanh(qk_t, scale, softcap)
                qk_t = cap_t * (softcap / scale)
            s_t, seen = kept_score_tile(qk_t, meta_ptr, b, h, rows, cols, r0, c0, scale, pse_ptr, pse_sb, pse_sh,
                                        pse_sr, pse_cols, mask_ptr, mask_sb, mask_sh, mask_sr, PSE, PSE_BEFORE_SCALE,
                                        HAS_EXPLICIT, BLOCK_M, BLOCK_N, True)
            # P and dS exactly 0 where masked, as in dq_kernel
            p_t = tl.where(seen, tl.exp2((s_t - m[None, :]) * LOG2E - log2l[None, :]), 0.0)
            dp_t = tl.dot(v_tile, tl.trans(do_tile), input_precision=PRECISION)
            p_drop = p_t
            if DROPOUT != 0:
                drop = dropout_scale(meta_ptr, b, h, rows, cols, keep_prob, seed, offset, drop_ptr, DROPOUT == 2,
                                     True)
                p_drop = p_t * drop
                dp_t = dp_t * drop
            acc_v += tl.dot(p_drop.to(do_tile.dtype), do_grad, input_precision=PRECISION)
            ds_t = tl.where(seen, p_t * (dp_t - delta[None, :]), 0.0)
            if SOFTCAP:
                ds_in = (ds_t * (1.0 - cap_t * cap_t)).to(q_tile.dtype)
            else:
                ds_in = ds_t.to(q_tile.dtype)
            acc_k += tl.dot(ds_in, q_grad, input_precision=PRECISION)
            # dQ^T = K^T dS^T: the head dim is M (a key block of 32 rows would not be)
            if DQ:
                tl.atomic_add(dq_head + tok[None, :] * dq_st + gk[:, None],
                              tl.dot(tl.trans(k_grad), ds_in, input_precision=PRECISION),
                              mask=(rows[None, :] < sq) & (gk[:, None] < head_d), sem="relaxed")
            if DPSE_FULL:
                g = ds_t * scale if PSE_BEFORE_SCALE else ds_t
                off = b.to(tl.int64) * dpse_sb + tl.cast(h, tl.int64) * dpse_sh \
                    + rows[None, :].to(tl.int64) * dpse_sr + cols[:, None]
                tl.store(dpse_ptr + off, g, mask=(rows[None, :] < sq) & (cols[:, None] < skv))
            if DPSE_ROW:
                col_grad += tl.sum(ds_t * scale if PSE_BEFORE_SCALE else ds_t, 1)
        if DPSE_ROW:
            tl.store(dpse_ptr + b.to(tl.int64) * dpse_sb + tl.cast(h, tl.int64) * dpse_sh + cols, col_grad,
                     mask=cols < skv)
        tl.store(dk_head + kv_rows[:, None] * dk_st + gk[None, :], (acc_k * scale).to(dk_ptr.dtype.element_ty),
                 mask=col_ok & (gk[None, :] < head_d))
        tl.store(dv_head + kv_rows[:, None] * dv_st + gv[None, :], acc_v.to(dv_ptr.dtype.element_ty),
                 mask=col_ok & (gv[None, :] < head_dv))


@triton.jit
def grad_sum_kernel(part_ptr, out_ptr, numel, count, scale, BLOCK: tl.constexpr):
    """``out[e] = scale * sum_i part[i * numel + e]`` over ``i = 0 .. count - 1`` in that order (fp32 partials of a
    gradient: dQ's splits, a GQA group's dK/dV), in ``out``'s dtype; a grid-stride loop over ``numel`` elements."""
    for off in range(tl.program_id(0) * BLOCK, numel, tl.num_programs(0) * BLOCK):
        idx = off + tl.arange(0, BLOCK)
        ok = idx < numel
        acc = tl.zeros([BLOCK], tl.float32)
        for i in range(count):
            acc += tl.load(part_ptr + tl.cast(i, tl.int64) * numel + idx, mask=ok, other=0.0)
        tl.store(out_ptr + idx, (acc * scale).to(out_ptr.dtype.element_ty), mask=ok)
