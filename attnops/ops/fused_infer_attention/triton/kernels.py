"""FIA decode kernels (a few query rows per batch): split-KV flash-decoding. No allocation here (``launch.py``
allocates and launches).

``split_kernel``: one program per (batch, KV head, KV split) carries every query row of the GQA group (``G x Sq``
rows, padded to ``BLOCK_R`` >= 16 for ``tl.dot``) over its split's KV columns with an online softmax. It reads K/V
in place, from a dense tensor or through the block table of a paged cache, dequantizes int8 and int4 (two's
complement nibbles packed in int32) keys and values as ``(x + offset) * scale``, adds the pse after the scale, applies
the band/prefix mask and the explicit mask, and writes the split's fp32 partial row max, row sum and un-normalised
output. ``merge_kernel``: one program per query row merges the splits in split order (results do not depend on
scheduling) into the fp32 output and lse (rows that saw nothing: 0 and +inf).

Per-batch metadata is one int64 row per batch (columns below). Antiquant parameters are addressed through six
strides each (batch, KV head, per-token position, physical block, offset in the block, channel), so per-tensor,
per-channel, per-head, per-token and page-managed parameters share one formula; each is a vector over the tile's
channels or over its columns.
"""
import triton
import triton.language as tl

from ...flash_attention.triton.common import FLT_LOWEST, LOG2E, upcast

# columns of the per-batch metadata rows (int64), filled by launch.py
META_FIELDS = ("q_base", "q_len", "kv_len", "k_base", "v_base", "pos0", "lo", "hi", "prefix")
Q_BASE: tl.constexpr = tl.constexpr(0)
Q_LEN: tl.constexpr = tl.constexpr(1)
KV_LEN: tl.constexpr = tl.constexpr(2)
K_BASE: tl.constexpr = tl.constexpr(3)
V_BASE: tl.constexpr = tl.constexpr(4)
POS0: tl.constexpr = tl.constexpr(5)
LO: tl.constexpr = tl.constexpr(6)
HI: tl.constexpr = tl.constexpr(7)
PREFIX: tl.constexpr = tl.constexpr(8)
META_COLS: tl.constexpr = tl.constexpr(9)

# KV storage (constexpr K_QUANT / V_QUANT)
KV_FLOAT: tl.constexpr = tl.constexpr(0)
KV_INT8: tl.constexpr = tl.constexpr(1)
KV_INT4: tl.constexpr = tl.constexpr(2)
QUANT_STRIDES: tl.constexpr = tl.constexpr(6)  # per antiquant parameter: batch, head, position, block, offset, channel


@triton.jit
def _meta(meta_ptr, b, col):
    return tl.load(meta_ptr + b * META_COLS + col)


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
def _kv_tile(head_ptr, rows, rows_ok, chan, chan_ok, scale_ptr, offset_ptr, strides_ptr, which, b, hk, pos, blk,
             off, QUANT: tl.constexpr, STATIC: tl.constexpr, HAS_OFFSET: tl.constexpr, CHAN_AXIS: tl.constexpr):
    """A K or V tile of KV rows ``rows`` (element offsets) and channels ``chan``, channels on axis ``CHAN_AXIS``
    (K^T: 0, V: 1); loaded as stored, or dequantized to fp32 when ``QUANT`` (``(x + offset) * scale``; int4: two's
    complement nibbles, channel ``c`` in bits ``4*(c % 8)`` of word ``c // 8``)."""
    if QUANT == KV_INT4:
        word_of, shift = chan // 8, (chan % 8) * 4
    else:
        word_of, shift = chan, chan * 0
    if CHAN_AXIS == 0:
        offs, ok, shifts = rows[None, :] + word_of[:, None], rows_ok[None, :] & chan_ok[:, None], shift[:, None]
    else:
        offs, ok, shifts = rows[:, None] + word_of[None, :], rows_ok[:, None] & chan_ok[None, :], shift[None, :]
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
def split_kernel(q_ptr, k_ptr, v_ptr, meta_ptr, bt_ptr, pm_ptr, pl_ptr, po_ptr,
                 pse_ptr, pse_sb, pse_sh, pse_sr, mask_ptr, mask_sb, mask_sh, mask_sr,
                 ks_ptr, ko_ptr, vs_ptr, vo_ptr, aq_strides_ptr,
                 q_st, q_sh, k_st, k_sh, k_sblk, v_st, v_sh, v_sblk, bt_sb, block_size, split_len, n_splits,
                 scale, n1, group, sq, head_d, head_dv,
                 BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 PAGED: tl.constexpr, K_QUANT: tl.constexpr, V_QUANT: tl.constexpr, K_STATIC: tl.constexpr,
                 V_STATIC: tl.constexpr, K_OFFSET: tl.constexpr, V_OFFSET: tl.constexpr, HAS_PSE: tl.constexpr, HAS_BAND: tl.constexpr,
                 HAS_EXPLICIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Partials of split ``s``: ``m = rowmax(S)``, ``l = rowsum(exp(S - m))``, ``o = exp(S - m) V`` over columns
    ``[s*split_len, min((s+1)*split_len, kv_len))``; rows ``r = g*sq + i`` are query head ``hk*group + g``, query
    row ``i``. Partial buffers are ``[B, N1, sq, n_splits]`` (and ``[..., Dv]``), contiguous."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    s = tl.program_id(2)
    kv_len = _meta(meta_ptr, b, KV_LEN)
    c_lo = s * split_len
    c_hi = tl.minimum(c_lo + split_len, kv_len)
    r = tl.arange(0, BLOCK_R)
    gi = r // sq
    qi = r % sq
    heads = hk * group + gi
    row_ok = (gi < group) & (qi < _meta(meta_ptr, b, Q_LEN))
    dk = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_off = _meta(meta_ptr, b, Q_BASE) + qi[:, None].to(tl.int64) * q_st + heads[:, None].to(tl.int64) * q_sh
    q = tl.load(q_ptr + q_off + dk[None, :], mask=row_ok[:, None] & (dk[None, :] < head_d), other=0.0)
    q = upcast(q, UPCAST)
    k_head = k_ptr + hk.to(tl.int64) * k_sh
    v_head = v_ptr + hk.to(tl.int64) * v_sh
    k_base = _meta(meta_ptr, b, K_BASE)
    v_base = _meta(meta_ptr, b, V_BASE)
    pos0 = _meta(meta_ptr, b, POS0)
    lo = _meta(meta_ptr, b, LO)
    hi = _meta(meta_ptr, b, HI)
    prefix = _meta(meta_ptr, b, PREFIX)

    m_i = tl.full([BLOCK_R], FLT_LOWEST, tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    for c0 in range(c_lo, c_hi, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        ok = cols < c_hi
        pos = pos0 + cols.to(tl.int64)
        if PAGED:
            blk = tl.load(bt_ptr + b.to(tl.int64) * bt_sb + cols // block_size, mask=ok, other=0).to(tl.int64)
            off = (cols % block_size).to(tl.int64)
            k_rows = blk * k_sblk + off * k_st
            v_rows = blk * v_sblk + off * v_st
        else:
            blk = cols.to(tl.int64) * 0
            off = blk
            k_rows = k_base + cols.to(tl.int64) * k_st
            v_rows = v_base + cols.to(tl.int64) * v_st
        k_t = _kv_tile(k_head, k_rows, ok, dk, dk < head_d, ks_ptr, ko_ptr, aq_strides_ptr, 0, b, hk, pos, blk, off,
                       K_QUANT, K_STATIC, K_OFFSET, 0).to(q.dtype)
        sc = tl.dot(q, k_t, input_precision=PRECISION) * scale
        keep = row_ok[:, None] & ok[None, :]
        if HAS_PSE:
            pse_off = b.to(tl.int64) * pse_sb + heads[:, None].to(tl.int64) * pse_sh \
                + qi[:, None].to(tl.int64) * pse_sr + cols[None, :]
            sc += tl.load(pse_ptr + pse_off, mask=keep, other=0.0).to(tl.float32)
        if HAS_BAND:
            diff = cols[None, :].to(tl.int64) - qi[:, None]
            keep = keep & (((diff >= lo) & (diff <= hi)) | (cols[None, :] < prefix))
        if HAS_EXPLICIT:
            m_off = b.to(tl.int64) * mask_sb + heads[:, None].to(tl.int64) * mask_sh \
                + qi[:, None].to(tl.int64) * mask_sr + cols[None, :]
            keep = keep & (tl.load(mask_ptr + m_off, mask=keep, other=1) == 0)
        sc = tl.where(keep, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2((m_i - m_new) * LOG2E)
        p = tl.exp2((sc - m_new[:, None]) * LOG2E)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _kv_tile(v_head, v_rows, ok, dv, dv < head_dv, vs_ptr, vo_ptr, aq_strides_ptr, 2, b, hk, pos, blk, off,
                     V_QUANT, V_STATIC, V_OFFSET, 1).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new

    row = ((b.to(tl.int64) * n1 + heads) * sq + qi) * n_splits + s
    out_ok = (gi < group)
    tl.store(pm_ptr + row, m_i, mask=out_ok)
    tl.store(pl_ptr + row, l_i, mask=out_ok)
    tl.store(po_ptr + row[:, None] * head_dv + dv[None, :], acc, mask=out_ok[:, None] & (dv[None, :] < head_dv))


@triton.jit
def merge_kernel(pm_ptr, pl_ptr, po_ptr, o_ptr, lse_ptr, n_splits, head_dv,
                 BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Row ``r``: ``o = sum_s w_s o_s / sum_s w_s l_s`` and ``lse = top + log(sum_s w_s l_s)`` with
    ``w_s = exp(m_s - top)``, ``top = max_s m_s`` over the splits that kept a column; 0 and +inf when none did.
    ``o``: fp32 ``[rows, Dv]``, ``lse``: fp32 ``[rows]``."""
    r = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    s_ok = sp < n_splits
    l = tl.load(pl_ptr + r * n_splits + sp, mask=s_ok, other=0.0)
    m = tl.where(l > 0, tl.load(pm_ptr + r * n_splits + sp, mask=s_ok, other=FLT_LOWEST), FLT_LOWEST)
    top = tl.max(m, 0)
    w = tl.where(l > 0, tl.exp2((m - top) * LOG2E), 0.0)
    total = tl.sum(w * l, 0)
    o = tl.load(po_ptr + (r * n_splits + sp[:, None]) * head_dv + dv[None, :],
                mask=s_ok[:, None] & (dv[None, :] < head_dv), other=0.0)
    kept = total > 0
    out = tl.sum(w[:, None] * o, 0) / tl.where(kept, total, 1.0)
    tl.store(o_ptr + r * head_dv + dv, out, mask=dv < head_dv)
    tl.store(lse_ptr + r, tl.where(kept, top + tl.log(tl.where(kept, total, 1.0)), float("inf")))
