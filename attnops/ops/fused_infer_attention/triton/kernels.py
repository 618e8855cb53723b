"""FIA decode kernels (a few query rows per batch): split-KV flash-decoding over a work list. No allocation here
(``plan.py`` allocates, ``launch.py`` launches).

``split_kernel``: one program per (work unit, KV head). A unit is split ``s`` of batch ``b`` (``work[u] = (b, s)``;
batch ``b`` has ``splits[b]`` units from ``first[b]``, ``batches[b] = (first, splits)``). The program reads the
batch's KV length on the device, cuts the batch's columns into ``splits[b]`` equal chunks (multiples of ``GRAIN``)
and carries every query row of the GQA group (``G x Sq`` rows, padded to ``BLOCK_R`` >= 16 for ``tl.dot``) over its
chunk with an online softmax. It reads K/V in place: dense tensors (batch ``b`` at ``b * k_sb``, so the loads keep
the tensor's alignment), or through the block table of a paged cache (ND ``[blk, bs, N2*D]``/``[blk, N2, bs, D]`` or
NZ ``[blk, N2, D/x, bs, x]``), block ids clamped into the cache. It dequantizes int8 and int4 (two's complement
nibbles packed in int32) keys and values as ``(x + offset) * scale``, adds the pse after the scale, applies the band
and the explicit mask, and writes the unit's fp32 partial row max, row sum and un-normalised output (a unit past
the batch's columns writes nothing).

``merge_kernel``: one program per (batch x query head, output row) merges the valid units of its batch in split
order (results do not depend on scheduling) and writes the final output row in the output's layout and dtype
(CAST_ROUND for fp16/bf16, int8 quantization where the row attended something) and the lse in its final place; rows
outside the batch's query rows and rows that saw nothing get 0 and +inf.

Lengths are device tensors read here (clamped to the call's capacity: no value reads or writes out of bounds). Left
padding moves each batch's first query and key row (``Q_S - pad - Sq_b``, ``KV_S - pad - Skv_b``); masks, pse and
per-token antiquant parameters are read at those offsets. Antiquant parameters are addressed through six strides
each (batch, KV head, per-token position, physical block, offset in the block, channel), so per-tensor,
per-channel, per-head, per-token and page-managed parameters share one formula.
"""
import triton
import triton.language as tl

from ...flash_attention.triton.common import FLT_LOWEST, LOG2E, upcast

from . import codes

# KV storage (constexpr K_QUANT / V_QUANT)
KV_FLOAT: tl.constexpr = tl.constexpr(codes.KV_FLOAT)
KV_INT8: tl.constexpr = tl.constexpr(codes.KV_INT8)
KV_INT4: tl.constexpr = tl.constexpr(codes.KV_INT4)
# KV addressing (constexpr KV_LAYOUT)
KV_DENSE: tl.constexpr = tl.constexpr(codes.KV_DENSE)
KV_PAGED: tl.constexpr = tl.constexpr(codes.KV_PAGED)  # [blk, bs, N2*D] or [blk, N2, bs, D]
KV_NZ: tl.constexpr = tl.constexpr(codes.KV_NZ)  # [blk, N2, D/x, bs, x]
# output conversion (constexpr OUT_KIND)
OUT_FLOAT: tl.constexpr = tl.constexpr(codes.OUT_FLOAT)  # fp32 (stored as is)
OUT_ROUND: tl.constexpr = tl.constexpr(codes.OUT_ROUND)  # fp16/bf16 with CAST_ROUND (half away from zero)
OUT_INT8: tl.constexpr = tl.constexpr(codes.OUT_INT8)  # sat_int8(round_half_even(o * scale + offset))
QUANT_STRIDES: tl.constexpr = tl.constexpr(6)  # per antiquant parameter: batch, head, position, block, offset, channel
# per-batch query facts of a varlen call (constexpr VARLEN): int32 [B, 3] rows
QMETA_LEN: tl.constexpr = tl.constexpr(0)  # query rows
QMETA_Q_TOKEN: tl.constexpr = tl.constexpr(1)  # TND: first query token
QMETA_KV_TOKEN: tl.constexpr = tl.constexpr(2)  # TND: first key token
QMETA_COLS: tl.constexpr = tl.constexpr(3)
ROUND_MAGIC: tl.constexpr = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + M - M rounds half to even for |x| < 2**22


@triton.jit
def _query_rows(qmeta_ptr, q_pad_ptr, b, q_s, VARLEN: tl.constexpr, Q_LEFT: tl.constexpr):
    """``(rows, first token, first row)`` of batch ``b``'s queries: its row count, its first token of a TND query
    (0 otherwise) and its first valid row after left padding (``Q_S - pad - rows``; 0 without)."""
    if VARLEN:
        rows = tl.load(qmeta_ptr + b * QMETA_COLS + QMETA_LEN).to(tl.int64)
        token = tl.load(qmeta_ptr + b * QMETA_COLS + QMETA_Q_TOKEN).to(tl.int64)
    else:
        rows = b.to(tl.int64) * 0 + q_s
        token = rows * 0
    first = rows * 0
    if Q_LEFT:
        first = tl.maximum(q_s - tl.maximum(tl.load(q_pad_ptr).to(tl.int64), 0) - rows, 0)
        rows = tl.minimum(rows, q_s - first)
    return rows, token, first


@triton.jit
def _kv_columns(lens_ptr, lens_stride, qmeta_ptr, kv_pad_ptr, b, capacity, kv_s, VARLEN: tl.constexpr,
                KV_LEFT: tl.constexpr):
    """``(length, first token, first row)`` of batch ``b``'s keys: its length read on the device and clamped to
    ``[0, capacity]``, its first token of a TND key (0 otherwise) and its first valid row after left padding
    (``KV_S - pad - length``; a negative start empties the batch)."""
    n = tl.minimum(tl.maximum(tl.load(lens_ptr + b * lens_stride).to(tl.int64), 0), capacity)
    token = n * 0
    if VARLEN:
        token = tl.load(qmeta_ptr + b * QMETA_COLS + QMETA_KV_TOKEN).to(tl.int64)
    first = n * 0
    if KV_LEFT:
        start = kv_s - tl.maximum(tl.load(kv_pad_ptr).to(tl.int64), 0) - n
        n = tl.where(start < 0, 0, n)
        first = tl.maximum(start, 0)
    return n, token, first


@triton.jit
def _band(q_rows, kv_len, lo, hi, ALIGN: tl.constexpr):
    """The band ``lo <= j - i <= hi`` of a batch (shifted by ``Skv_b - Sq_b`` when ``ALIGN``)."""
    if ALIGN:
        lo = lo + (kv_len - q_rows)
        hi = hi + (kv_len - q_rows)
    return lo, hi


@triton.jit
def _chunking(q_rows, kv_len, lo, hi, splits, GRAIN: tl.constexpr, HAS_BAND: tl.constexpr):
    """``(first column, end column, chunk)``: the columns the batch's rows may keep and the length of each of its
    ``splits`` units (a multiple of ``GRAIN``); unit ``s`` has ``[first + s*chunk, first + (s+1)*chunk)``."""
    c_first = kv_len * 0
    c_end = tl.where(q_rows > 0, kv_len, 0)
    if HAS_BAND:
        c_first = tl.minimum(tl.maximum(lo, 0), c_end)
        c_end = tl.maximum(tl.minimum(q_rows + hi, c_end), c_first)
    chunk = (tl.cdiv(tl.cdiv(c_end - c_first, splits), GRAIN) * GRAIN).to(tl.int64)
    return c_first, c_end, tl.maximum(chunk, GRAIN)


@triton.jit
def _factor(ptr, strides_ptr, which, b, hk, pos, blk, off, cols_ok, chan, chan_ok, STATIC: tl.constexpr,
            CHAN_AXIS: tl.constexpr):
    """Antiquant parameter ``which`` (a row of the strides table) for a tile: a per-channel vector (``STATIC``:
    per-tensor, per-channel, per-head) or a per-column vector (per-token: ``pos``; page-managed: ``blk``, ``off``),
    broadcast along the tile's other axis (channels on axis ``CHAN_AXIS``)."""
    s = strides_ptr + which * QUANT_STRIDES
    base = ptr + b.to(tl.int64) * tl.load(s) + hk.to(tl.int64) * tl.load(s + 1)
    if STATIC:
        f = tl.load(base + chan.to(tl.int64) * tl.load(s + 5), mask=chan_ok, other=0.0)
    else:
        f = tl.load(base + pos * tl.load(s + 2) + blk * tl.load(s + 3) + off * tl.load(s + 4), mask=cols_ok,
                    other=0.0)
    if STATIC == (CHAN_AXIS == 0):  # the vector runs along axis 0
        tile = f[:, None]
    else:
        tile = f[None, :]
    return tile


@triton.jit
def _channel_offsets(chan, sx, QUANT: tl.constexpr, NZ_X: tl.constexpr):
    """``(element offset, int4 bit shift)`` of channels ``chan`` in a head: ``chan`` (ND), ``chan // 8`` words with
    the nibble at ``4 * (chan % 8)`` (int4), or ``(chan // x) * sx + chan % x`` (NZ, ``NZ_X = x`` > 0)."""
    shift = chan * 0
    if QUANT == KV_INT4:
        offsets = chan // 8
        shift = (chan % 8) * 4
    elif NZ_X > 0:
        offsets = (chan // NZ_X).to(tl.int64) * sx + chan % NZ_X
    else:
        offsets = chan
    return offsets, shift


@triton.jit
def _kv_tile(head_ptr, rows, rows_ok, chan, chan_ok, sx, scale_ptr, offset_ptr, strides_ptr, which, b, hk, pos, blk,
             off, QUANT: tl.constexpr, STATIC: tl.constexpr, HAS_OFFSET: tl.constexpr, CHAN_AXIS: tl.constexpr,
             NZ_X: tl.constexpr):
    """A K or V tile of KV rows ``rows`` (element offsets) and channels ``chan``, channels on axis ``CHAN_AXIS``
    (K^T: 0, V: 1); loaded as stored, or dequantized to fp32 when ``QUANT`` (``(x + offset) * scale``)."""
    chan_off, shift = _channel_offsets(chan, sx, QUANT, NZ_X)
    if CHAN_AXIS == 0:
        offs, ok, shifts = rows[None, :] + chan_off[:, None], rows_ok[None, :] & chan_ok[:, None], shift[:, None]
    else:
        offs, ok, shifts = rows[:, None] + chan_off[None, :], rows_ok[:, None] & chan_ok[None, :], shift[None, :]
    x = tl.load(head_ptr + offs, mask=ok, other=0)
    if QUANT != KV_FLOAT:
        if QUANT == KV_INT4:
            x = (((x >> shifts) & 0xF) ^ 8) - 8
        x = x.to(tl.float32)
        if HAS_OFFSET:
            x += _factor(offset_ptr, strides_ptr, which + 1, b, hk, pos, blk, off, rows_ok, chan, chan_ok, STATIC,
                         CHAN_AXIS)
        x = x * _factor(scale_ptr, strides_ptr, which, b, hk, pos, blk, off, rows_ok, chan, chan_ok, STATIC,
                        CHAN_AXIS)
    return x


@triton.jit
def split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, q_sb, q_st, q_sh, k_sb, k_st, k_sh, k_sx, v_sb, v_st, v_sh,
                 v_sx, bt_sb, lens_stride,
                 work_ptr, batches_ptr, qmeta_ptr, q_pad_ptr, kv_pad_ptr, pm_ptr, pl_ptr, po_ptr,
                 pse_ptr, pse_sb, pse_sh, pse_sr, mask_ptr, mask_sb, mask_sr,
                 ks_ptr, ko_ptr, vs_ptr, vo_ptr, aq_strides_ptr,
                 q_s, kv_s, capacity, block_size, num_blocks, lo, hi, scale, n1, group, sq, head_d, head_dv,
                 BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 GRAIN: tl.constexpr, KV_LAYOUT: tl.constexpr, NZ_X: tl.constexpr, K_QUANT: tl.constexpr,
                 V_QUANT: tl.constexpr, K_STATIC: tl.constexpr, V_STATIC: tl.constexpr, K_OFFSET: tl.constexpr,
                 V_OFFSET: tl.constexpr, VARLEN: tl.constexpr, Q_LEFT: tl.constexpr, KV_LEFT: tl.constexpr,
                 HAS_BAND: tl.constexpr, ALIGN: tl.constexpr, HAS_PSE: tl.constexpr, HAS_EXPLICIT: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Partials of unit ``u`` (split ``s`` of batch ``b``) for KV head ``hk``: ``m = rowmax(S)``,
    ``l = rowsum(exp(S - m))``, ``o = exp(S - m) V`` over the unit's columns; rows ``r = g*sq + i`` are query head
    ``hk*group + g``, query row ``i``. Partial buffers are ``[units, N1, sq]`` (and ``[..., Dv]``), contiguous."""
    u = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.load(work_ptr + 2 * u)
    s = tl.load(work_ptr + 2 * u + 1)
    splits = tl.load(batches_ptr + 2 * b + 1)
    q_rows, q_token, q_first = _query_rows(qmeta_ptr, q_pad_ptr, b, q_s, VARLEN, Q_LEFT)
    kv_len, kv_token, kv_first = _kv_columns(lens_ptr, lens_stride, qmeta_ptr, kv_pad_ptr, b, capacity, kv_s,
                                             VARLEN, KV_LEFT)
    lo, hi = _band(q_rows, kv_len, lo, hi, ALIGN)
    c_first, c_end, chunk = _chunking(q_rows, kv_len, lo, hi, splits, GRAIN, HAS_BAND)
    c_lo = c_first + s * chunk
    c_hi = tl.minimum(c_lo + chunk, c_end)

    r = tl.arange(0, BLOCK_R)
    gi = r // sq
    qi = r % sq
    heads = hk * group + gi
    row_ok = (gi < group) & (qi < q_rows)
    dk = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_off = b.to(tl.int64) * q_sb + (q_token + q_first + qi[:, None]) * q_st + heads[:, None].to(tl.int64) * q_sh
    q = tl.load(q_ptr + q_off + dk[None, :], mask=row_ok[:, None] & (dk[None, :] < head_d), other=0.0)
    q = upcast(q, UPCAST)
    k_head = k_ptr + hk.to(tl.int64) * k_sh
    v_head = v_ptr + hk.to(tl.int64) * v_sh
    if KV_LAYOUT == KV_DENSE:
        k_head += b.to(tl.int64) * k_sb
        v_head += b.to(tl.int64) * v_sb
    mask_row = mask_ptr + b.to(tl.int64) * mask_sb + (q_first + qi[:, None]) * mask_sr + kv_first
    pse_row = pse_ptr + b.to(tl.int64) * pse_sb + heads[:, None].to(tl.int64) * pse_sh \
        + (q_first + qi[:, None]) * pse_sr + kv_first

    m_i = tl.full([BLOCK_R], FLT_LOWEST, tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    for c0 in range(c_lo, c_hi, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        ok = cols < c_hi
        pos = kv_first + cols
        if KV_LAYOUT == KV_DENSE:
            blk = cols * 0
            off = blk
            k_rows = (kv_token + pos) * k_st
            v_rows = (kv_token + pos) * v_st
        else:
            blk = tl.load(bt_ptr + b.to(tl.int64) * bt_sb + cols // block_size, mask=ok, other=0).to(tl.int64)
            blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1)
            off = cols % block_size
            k_rows = blk * k_sb + off * k_st
            v_rows = blk * v_sb + off * v_st
        k_t = _kv_tile(k_head, k_rows, ok, dk, dk < head_d, k_sx, ks_ptr, ko_ptr, aq_strides_ptr, 0, b, hk, pos, blk,
                       off, K_QUANT, K_STATIC, K_OFFSET, 0, NZ_X).to(q.dtype)
        sc = tl.dot(q, k_t, input_precision=PRECISION) * scale
        keep = row_ok[:, None] & ok[None, :]
        if HAS_PSE:
            sc += tl.load(pse_row + cols[None, :], mask=keep, other=0.0).to(tl.float32)
        if HAS_BAND:
            diff = cols[None, :] - qi[:, None]
            keep = keep & (diff >= lo) & (diff <= hi)
        if HAS_EXPLICIT:
            keep = keep & (tl.load(mask_row + cols[None, :], mask=keep, other=1) == 0)
        sc = tl.where(keep, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2((m_i - m_new) * LOG2E)
        p = tl.exp2((sc - m_new[:, None]) * LOG2E)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _kv_tile(v_head, v_rows, ok, dv, dv < head_dv, v_sx, vs_ptr, vo_ptr, aq_strides_ptr, 2, b, hk, pos, blk,
                     off, V_QUANT, V_STATIC, V_OFFSET, 1, NZ_X).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new

    row = ((u.to(tl.int64) * n1 + heads) * sq + qi)
    out_ok = (gi < group) & (qi * 0 + c_lo < c_hi)
    tl.store(pm_ptr + row, m_i, mask=out_ok)
    tl.store(pl_ptr + row, l_i, mask=out_ok)
    tl.store(po_ptr + row[:, None] * head_dv + dv[None, :], acc, mask=out_ok[:, None] & (dv[None, :] < head_dv))


@triton.jit
def _cast_round(x, DTYPE: tl.constexpr):
    """fp32 ``x`` as ``DTYPE`` (fp16/bf16) rounded half away from zero (CAST_ROUND) instead of half to even: the
    nearest value, and on a tie the neighbour of larger magnitude."""
    r = x.to(DTYPE)
    back = r.to(tl.float32)
    away = (r.to(tl.int16, bitcast=True) + 1).to(tl.int16).to(DTYPE, bitcast=True).to(tl.float32)  # 1 ulp out
    below = x - back  # exact; same sign as x when r is the neighbour nearer to zero
    tie = (below != 0) & ((below > 0) == (x > 0)) & (2 * tl.abs(below) == tl.abs(away - back))
    return tl.where(tie, away, back)


@triton.jit
def merge_kernel(out_ptr, lse_ptr, lens_ptr, lens_stride, pm_ptr, pl_ptr, po_ptr, batches_ptr, qmeta_ptr, q_pad_ptr,
                 kv_pad_ptr, qs_ptr, qo_ptr, out_sb, out_st, out_sh, lse_sb, lse_st, lse_sh, qs_sh, qs_sd,
                 q_s, kv_s, capacity, lo, hi, n1, sq, head_dv,
                 BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, GRAIN: tl.constexpr, VARLEN: tl.constexpr,
                 Q_LEFT: tl.constexpr, KV_LEFT: tl.constexpr, HAS_BAND: tl.constexpr, ALIGN: tl.constexpr,
                 OUT_KIND: tl.constexpr, HAS_OUT_OFFSET: tl.constexpr, ZERO_FILL: tl.constexpr):
    """Output row ``t`` of query head ``h`` of batch ``b``: ``o = sum_s w_s o_s / sum_s w_s l_s`` and
    ``lse = top + log(sum_s w_s l_s)`` with ``w_s = exp(m_s - top)``, ``top = max_s m_s`` over the batch's units that
    kept a column; 0 and +inf when none did. ``t`` is the row within the batch's ``Q_S`` rows (``ZERO_FILL``: rows
    outside its query rows get 0 and +inf) or, for TND, the batch's query row (stored at its token)."""
    bh = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    b = bh // n1
    h = bh % n1
    q_rows, q_token, q_first = _query_rows(qmeta_ptr, q_pad_ptr, b, q_s, VARLEN, Q_LEFT)
    kv_len, kv_token, kv_first = _kv_columns(lens_ptr, lens_stride, qmeta_ptr, kv_pad_ptr, b, capacity, kv_s,
                                             VARLEN, KV_LEFT)
    first = tl.load(batches_ptr + 2 * b)
    splits = tl.load(batches_ptr + 2 * b + 1)
    lo, hi = _band(q_rows, kv_len, lo, hi, ALIGN)
    c_first, c_end, chunk = _chunking(q_rows, kv_len, lo, hi, splits, GRAIN, HAS_BAND)
    i = t - q_first
    row_ok = (i >= 0) & (i < q_rows)
    valid = tl.where(row_ok, tl.minimum(tl.cdiv(c_end - c_first, chunk), splits), 0)

    sp = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    s_ok = sp < valid
    rows = ((first + sp).to(tl.int64) * n1 + h) * sq + i
    l = tl.load(pl_ptr + rows, mask=s_ok, other=0.0)
    m = tl.where(l > 0, tl.load(pm_ptr + rows, mask=s_ok, other=FLT_LOWEST), FLT_LOWEST)
    top = tl.max(m, 0)
    w = tl.where(l > 0, tl.exp2((m - top) * LOG2E), 0.0)
    total = tl.sum(w * l, 0)
    o = tl.load(po_ptr + rows[:, None] * head_dv + dv[None, :], mask=(s_ok & (l > 0))[:, None] &
                (dv[None, :] < head_dv), other=0.0)
    kept = total > 0
    out = tl.sum(w[:, None] * o, 0) / tl.where(kept, total, 1.0)
    lse = tl.where(kept, top + tl.log(tl.where(kept, total, 1.0)), float("inf"))
    dv_ok = dv < head_dv
    rows_ok = dv * 0 + row_ok.to(tl.int32) > 0  # row_ok along the channels
    if OUT_KIND == OUT_INT8:
        y = out * tl.load(qs_ptr + h.to(tl.int64) * qs_sh + dv * qs_sd, mask=dv_ok, other=0.0)
        if HAS_OUT_OFFSET:
            y += tl.load(qo_ptr + h.to(tl.int64) * qs_sh + dv * qs_sd, mask=dv_ok, other=0.0)
        y = tl.minimum(tl.maximum(y, -128.0), 127.0)
        out = tl.where(kept, (y + ROUND_MAGIC) - ROUND_MAGIC, 0.0)
    elif OUT_KIND == OUT_ROUND:
        out = _cast_round(out, out_ptr.dtype.element_ty)
    row = q_token + t
    out_ptrs = out_ptr + b.to(tl.int64) * out_sb + row * out_st + h.to(tl.int64) * out_sh + dv
    lse_ptrs = lse_ptr + b.to(tl.int64) * lse_sb + row * lse_st + h.to(tl.int64) * lse_sh
    if ZERO_FILL:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dv_ok)
        tl.store(lse_ptrs, lse)
    else:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dv_ok & rows_ok)
        tl.store(lse_ptrs, lse, mask=row_ok)
