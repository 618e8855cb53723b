"""FIA decode kernels (a few query rows per batch): split-KV flash-decoding over a work list. No allocation here
(``decode_plan.py`` allocates, ``launch.py`` launches).

``split_kernel``: one program per (work unit, KV head). A unit is split ``s`` of batch ``b`` (``work[u] = (b, s)``;
batch ``b`` has ``splits[b]`` units from ``first[b]``, ``batches[b] = (first, splits)``). The program reads the
batch's KV length on the device, cuts the batch's columns into ``splits[b]`` equal chunks (multiples of ``GRAIN``)
and carries every query row of the GQA group (``G x Sq`` rows, padded to ``BLOCK_R`` >= 16 for ``tl.dot``) over its
chunk with an online softmax. It reads K/V in place (``kv_tiles.py``): dense tensors (batch ``b`` at ``b * k_sb``,
so the loads keep the tensor's alignment), or through the block table of a paged cache (ND ``[blk, bs, N2*D]``/
``[blk, N2, bs, D]`` or NZ ``[blk, N2, D/x, bs, x]``), block ids clamped into the cache. It dequantizes int8 and int4
(two's complement nibbles packed in int32) keys and values as ``(x + offset) * scale``, adds the pse after the
scale, applies the band and the explicit mask, and writes the unit's fp32 partial row max, row sum and
un-normalised output (a unit past the batch's columns writes nothing).

``merge_kernel``: one program per (batch x query head, output row) merges the valid units of its batch in split
order, ``BLOCK_S`` units a step (results do not depend on scheduling; a batch may have hundreds of units) and writes the
final output row in the output's layout and dtype (``rounding.py``: CAST_ROUND for fp16/bf16, int8 quantization where
the row attended something) and the lse in its final place; rows outside the batch's query rows and rows that saw
nothing get 0 and +inf.

Lengths are device tensors read here (clamped to the call's capacity: no value reads or writes out of bounds). Left
padding moves each batch's first query and key row (``Q_S - pad - Sq_b``, ``KV_S - pad - Skv_b``); masks, pse and
per-token antiquant parameters are read at those offsets.
"""
import triton
import triton.language as tl

from ...._core.triton.helpers import FLT_LOWEST, LOG2E, base2_max, upcast
from .kv_tiles import channel_offsets, kv_tile, page_of, token_rows
from .rounding import output_tile

# per-batch query facts of a varlen call (constexpr VARLEN): int32 [B, 3] rows
QMETA_LEN: tl.constexpr = tl.constexpr(0)  # query rows
QMETA_Q_TOKEN: tl.constexpr = tl.constexpr(1)  # TND: first query token
QMETA_KV_TOKEN: tl.constexpr = tl.constexpr(2)  # TND: first key token
QMETA_COLS: tl.constexpr = tl.constexpr(3)


@triton.jit
def _query_rows(qmeta_ptr, q_pad_ptr, b, q_s, VARLEN: tl.constexpr, Q_LEFT: tl.constexpr):
    """``(rows, first token, first row)`` of batch ``b``'s queries: its row count, its first token of a TND query
    (0 otherwise) and its first valid row after left padding (``Q_S - pad - rows``; 0 without)."""
    if VARLEN:
        rows = tl.load(qmeta_ptr + b * QMETA_COLS + QMETA_LEN).to(tl.int64)
        token = tl.load(qmeta_ptr + b * QMETA_COLS + QMETA_Q_TOKEN).to(tl.int64)
    else:
        rows = b.to(tl.int64) * 0 + q_s
        token = 0
    first = 0
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
    token = 0  # a compile-time 0 keeps the offsets' alignment provable
    if VARLEN:
        token = tl.load(qmeta_ptr + b * QMETA_COLS + QMETA_KV_TOKEN).to(tl.int64)
    first = 0
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
    """``(first column, end column, chunk)``: the columns the batch's rows may keep, from the band's first column
    rounded down to a multiple of ``GRAIN`` (the band masks the few before it), and the length of each of its
    ``splits`` units (a multiple of ``GRAIN``); unit ``s`` has ``[first + s*chunk, first + (s+1)*chunk)``. Every
    unit and tile thus starts at a multiple of ``GRAIN`` columns, so the pse and mask rows load as vectors."""
    c_first = kv_len * 0
    c_end = tl.where(q_rows > 0, kv_len, 0)
    if HAS_BAND:
        c_first = (tl.minimum(tl.maximum(lo, 0), c_end) // GRAIN) * GRAIN
        c_end = tl.maximum(tl.minimum(q_rows + hi, c_end), c_first)
    chunk = (tl.cdiv(tl.cdiv(c_end - c_first, splits), GRAIN) * GRAIN).to(tl.int64)
    return c_first, c_end, tl.maximum(chunk, GRAIN)


@triton.jit
def split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, q_sb, q_st, q_sh, k_sb, k_st, k_sh, k_sblk, k_sx, k_sc,
                 v_sb, v_st, v_sh, v_sblk, v_sx, v_sc, bt_sb, lens_stride,
                 work_ptr, batches_ptr, qmeta_ptr, q_pad_ptr, kv_pad_ptr, pm_ptr, pl_ptr, po_ptr,
                 pse_ptr, pse_sb, pse_sh, pse_sr, mask_ptr, mask_sb, mask_sr,
                 ks_ptr, ko_ptr, vs_ptr, vo_ptr, aq_strides_ptr,
                 q_s, kv_s, capacity, side_cols, block_size, num_blocks, lo, hi, scale, n1, group, sq, head_d,
                 head_dv, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 GRAIN: tl.constexpr, PAGED: tl.constexpr, NZ_X: tl.constexpr, K_QUANT: tl.constexpr,
                 V_QUANT: tl.constexpr, K_STATIC: tl.constexpr, V_STATIC: tl.constexpr, K_OFFSET: tl.constexpr,
                 V_OFFSET: tl.constexpr, VARLEN: tl.constexpr, Q_LEFT: tl.constexpr, KV_LEFT: tl.constexpr,
                 HAS_BAND: tl.constexpr, ALIGN: tl.constexpr, HAS_PSE: tl.constexpr, HAS_EXPLICIT: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Partials of unit ``u`` (split ``s`` of batch ``b``) for KV head ``hk``: ``m = rowmax(S)``,
    ``l = rowsum(exp(S - m))``, ``o = exp(S - m) V`` over the unit's columns; rows ``r = g*sq + i`` are query head
    ``hk*group + g``, query row ``i``. Partial buffers are ``[units, N1, sq]`` (and ``[..., Dv]``), contiguous.

    K/V strides (``kv_args``): ``*_sb``/``*_st``/``*_sh`` batch/token/head (paged: batch stride 0),
    ``*_sblk`` a cache block, ``*_sx`` an NZ channel group, ``*_sc`` a channel. ``side_cols``: the columns of the
    pse and mask rows (the least of their widths): their tiles load whole within it and are masked after the load,
    so that they load as vectors."""
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
    if not PAGED:
        k_head += b.to(tl.int64) * k_sb
        v_head += b.to(tl.int64) * v_sb
    k_chan = channel_offsets(dk, k_sc, k_sx, K_QUANT, NZ_X)
    v_chan = channel_offsets(dv, v_sc, v_sx, V_QUANT, NZ_X)
    mask_row = mask_ptr + b.to(tl.int64) * mask_sb + (q_first + qi[:, None]) * mask_sr + kv_first
    pse_row = pse_ptr + b.to(tl.int64) * pse_sb + heads[:, None].to(tl.int64) * pse_sh \
        + (q_first + qi[:, None]) * pse_sr + kv_first

    m_i = tl.full([BLOCK_R], FLT_LOWEST, tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    seen = tl.zeros([BLOCK_R], tl.int1)  # rows that kept a column, whatever its score
    for c0 in range(c_lo, c_hi, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        ok = cols < c_hi
        pos = kv_first + cols
        blk, off, ok = page_of(b, cols, ok, bt_ptr, bt_sb, block_size, num_blocks, PAGED)
        k_rows = token_rows(cols, blk, off, (kv_token + kv_first) * k_st, k_st, k_sblk, PAGED)
        v_rows = token_rows(cols, blk, off, (kv_token + kv_first) * v_st, v_st, v_sblk, PAGED)
        k_t = kv_tile(k_head, k_rows, ok, dk, dk < head_d, k_chan, ks_ptr, ko_ptr, aq_strides_ptr, 0, b, hk, pos, blk,
                      off, K_QUANT, K_STATIC, K_OFFSET, 0).to(q.dtype)
        sc = tl.dot(q, k_t, input_precision=PRECISION) * scale
        keep = row_ok[:, None] & ok[None, :]
        side_ok = row_ok[:, None] & (kv_first + cols < side_cols)[None, :]
        if HAS_PSE:
            sc += tl.load(pse_row + cols[None, :], mask=side_ok, other=0.0).to(tl.float32)
        if HAS_BAND:
            diff = cols[None, :] - qi[:, None]
            keep = keep & (diff >= lo) & (diff <= hi)
        if HAS_EXPLICIT:
            keep = keep & (tl.load(mask_row + cols[None, :], mask=side_ok, other=1) == 0)
        sc = tl.where(keep, sc, float("-inf"))
        seen = seen | (tl.max(keep.to(tl.int32), 1) > 0)
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(base2_max(m_i) - base2_max(m_new))
        p = tl.exp2((sc - m_new[:, None]) * LOG2E)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = kv_tile(v_head, v_rows, ok, dv, dv < head_dv, v_chan, vs_ptr, vo_ptr, aq_strides_ptr, 2, b, hk, pos, blk,
                    off, V_QUANT, V_STATIC, V_OFFSET, 1).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new
    m_i = tl.where(seen & (l_i == 0), float("-inf"), m_i)  # columns kept, every score -inf (FLT_LOWEST: none kept)

    row = ((u.to(tl.int64) * n1 + heads) * sq + qi)
    out_ok = (gi < group) & (qi * 0 + c_lo < c_hi)
    tl.store(pm_ptr + row, m_i, mask=out_ok)
    tl.store(pl_ptr + row, l_i, mask=out_ok)
    tl.store(po_ptr + row[:, None] * head_dv + dv[None, :], acc, mask=out_ok[:, None] & (dv[None, :] < head_dv))


@triton.jit
def merge_kernel(out_ptr, lse_ptr, lens_ptr, lens_stride, pm_ptr, pl_ptr, po_ptr, batches_ptr, qmeta_ptr, q_pad_ptr,
                 kv_pad_ptr, oqs_ptr, oqo_ptr, out_sb, out_st, out_sh, lse_sb, lse_st, lse_sh, oq_sh, oq_sc,
                 q_s, kv_s, capacity, lo, hi, n1, sq, head_dv,
                 BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, GRAIN: tl.constexpr, VARLEN: tl.constexpr,
                 Q_LEFT: tl.constexpr, KV_LEFT: tl.constexpr, HAS_BAND: tl.constexpr, ALIGN: tl.constexpr,
                 OUT_MODE: tl.constexpr, OUT_OFFSET: tl.constexpr, ZERO_FILL: tl.constexpr):
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

    dv = tl.arange(0, BLOCK_DV)
    top = tl.full([], FLT_LOWEST, tl.float32)
    total = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    saw = tl.full([], 0, tl.int1)
    for s0 in range(0, valid, BLOCK_S):  # BLOCK_S units a step, rescaled to the running top
        sp = s0 + tl.arange(0, BLOCK_S)
        s_ok = sp < valid
        rows = ((first + sp).to(tl.int64) * n1 + h) * sq + i
        l = tl.load(pl_ptr + rows, mask=s_ok, other=0.0)
        has = l != 0  # a unit with a kept score; a NaN sum (non-finite inputs) too, so that it reaches the row
        m = tl.load(pm_ptr + rows, mask=s_ok, other=FLT_LOWEST)
        saw = saw | (tl.max((m == float("-inf")).to(tl.int32), 0) > 0)  # a unit whose kept scores are all -inf
        m = tl.where(has, m, FLT_LOWEST)
        new_top = tl.maximum(top, tl.max(m, 0))
        alpha = tl.exp2(base2_max(top) - base2_max(new_top))
        w = tl.where(has, tl.exp2(base2_max(m) - base2_max(new_top)), 0.0)
        o = tl.load(po_ptr + rows[:, None] * head_dv + dv[None, :], mask=(s_ok & has)[:, None] &
                    (dv[None, :] < head_dv), other=0.0)
        total = total * alpha + tl.sum(w * l, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        top = new_top
    total = tl.where(saw & (total == 0), float("nan"), total)  # columns kept, all scores -inf: the formula's 0 / 0
    kept = total != 0  # NaN: kept, the row comes out NaN
    out = acc / tl.where(kept, total, 1.0)
    lse = tl.where(kept, top + tl.log(tl.where(kept, total, 1.0)), float("inf"))
    dv_ok = dv < head_dv
    rows_ok = dv * 0 + row_ok.to(tl.int32) > 0  # row_ok along the channels
    out = output_tile(out, kept, oqs_ptr, oqo_ptr, h.to(tl.int64) * oq_sh + dv * oq_sc, dv_ok, OUT_MODE, OUT_OFFSET,
                      out_ptr.dtype.element_ty)
    row = q_token + t
    out_ptrs = out_ptr + b.to(tl.int64) * out_sb + row * out_st + h.to(tl.int64) * out_sh + dv
    lse_ptrs = lse_ptr + b.to(tl.int64) * lse_sb + row * lse_st + h.to(tl.int64) * lse_sh
    if ZERO_FILL:
        tl.store(out_ptrs, out, mask=dv_ok)
        tl.store(lse_ptrs, lse)
    else:
        tl.store(out_ptrs, out, mask=dv_ok & rows_ok)
        tl.store(lse_ptrs, lse, mask=row_ok)
