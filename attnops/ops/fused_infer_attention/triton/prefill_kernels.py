"""FIA prefill kernel: every batch in one launch, FlashAttention's forward over K/V read where they lie. No allocation
here (``prefill.py`` allocates and launches).

One program per (query row block, batch x query head) runs an online softmax over the band's key columns of its
batch. The effective key columns are the shared prefix's first (``prefix_len`` tokens of ``kp``/``vp``), then the
batch's keys: a dense tensor (per-batch start from the metadata: left padding, TND offsets) or a paged cache read
through the block table (ND or NZ, ``kv_tiles.py``); int8 and int4 keys and values are dequantized in the kernel
and rounded to the query dtype, as the NPU's antiquant. The score tile (scale, pse after the scale, band and
explicit mask) is the FlashAttention forward's (``common/triton/common.py``), over the per-batch metadata
rows in its format. The program writes its rows' final output (CAST_ROUND or int8, ``rounding.py``) at their place in
the output layout and their lse (``+inf`` and output 0 on rows that kept nothing).

Batch x heads is folded over the grid's second and third axes (CUDA allows 65535 programs on each), so any batch
size runs.
"""
import triton
import triton.language as tl

from ...._core.triton.helpers import FLT_LOWEST, LOG2E, base2_max, upcast
from ...common.triton.common import KV_START, Q_LEN, Q_START, band_cols, meta, score_tile
from .kv_tiles import channel_offsets, kv_tile, mma_operand, page_of, token_rows
from .rounding import output_tile

@triton.jit
def _span(acc, m_i, l_i, q, k_head, v_head, c_begin, c_end, first_col, k_base, v_base, pos_shift, k_chan, v_chan,
          b, h, hk, rows, r0, dk, dv, head_d, head_dv, meta_ptr, bt_ptr, bt_sb, block_size, num_blocks,
          k_st, k_sblk, v_st, v_sblk, ks_ptr, ko_ptr, vs_ptr, vo_ptr, aq_strides_ptr, scale,
          pse_ptr, pse_sb, pse_sh, pse_sr, mask_ptr, mask_sb, mask_sh, mask_sr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, K_QUANT: tl.constexpr,
          V_QUANT: tl.constexpr, K_STATIC: tl.constexpr, V_STATIC: tl.constexpr, K_OFFSET: tl.constexpr,
          V_OFFSET: tl.constexpr, PSE: tl.constexpr, HAS_EXPLICIT: tl.constexpr, DTYPE: tl.constexpr,
          UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """The online softmax over effective columns ``[c_begin, c_end)`` (tiles from ``c_begin``) of one KV source whose
    token ``t`` is column ``first_col + t`` with per-token antiquant position ``t + pos_shift``."""
    for c0 in range(c_begin, c_end, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        ok = cols < c_end
        tokens = cols - first_col
        blk, off, ok = page_of(b, tokens, ok, bt_ptr, bt_sb, block_size, num_blocks, PAGED)
        pos = tokens.to(tl.int64) + pos_shift
        k_rows = token_rows(tokens, blk, off, k_base, k_st, k_sblk, PAGED)
        k_t = kv_tile(k_head, k_rows, ok, dk, dk < head_d, k_chan, ks_ptr, ko_ptr, aq_strides_ptr, 0, b, hk, pos, blk,
                      off, K_QUANT, K_STATIC, K_OFFSET, 0)
        qk = tl.dot(q, mma_operand(k_t, K_QUANT, DTYPE, UPCAST), input_precision=PRECISION)
        s = score_tile(qk, meta_ptr, b, h, rows, cols, r0, c0, scale, pse_ptr, pse_sb, pse_sh, pse_sr, 0,
                       mask_ptr, mask_sb, mask_sh, mask_sr, PSE, False, HAS_EXPLICIT, BLOCK_M, BLOCK_N)
        if PAGED:  # the columns past the end and the keys of blocks outside the cache
            s = tl.where(ok[None, :], s, float("-inf"))
        elif c0 + BLOCK_N > c_end:  # the last tile of a source ends inside the effective columns
            s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(base2_max(m_i) - base2_max(m_new))
        p = tl.exp2((s - m_new[:, None]) * LOG2E)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = token_rows(tokens, blk, off, v_base, v_st, v_sblk, PAGED)
        v = mma_operand(kv_tile(v_head, v_rows, ok, dv, dv < head_dv, v_chan, vs_ptr, vo_ptr, aq_strides_ptr, 2, b, hk,
                                pos, blk, off, V_QUANT, V_STATIC, V_OFFSET, 1), V_QUANT, DTYPE, UPCAST)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def prefill_kernel(q_ptr, k_ptr, v_ptr, kp_ptr, vp_ptr, o_ptr, lse_ptr, meta_ptr, bt_ptr,
                   pse_ptr, pse_sb, pse_sh, pse_sr, mask_ptr, mask_sb, mask_sh, mask_sr,
                   ks_ptr, ko_ptr, vs_ptr, vo_ptr, aq_strides_ptr, oqs_ptr, oqo_ptr,
                   q_sb, q_st, q_sh, k_sb, k_st, k_sh, k_sblk, k_sx, k_sc, v_sb, v_st, v_sh, v_sblk, v_sx, v_sc,
                   kp_st, kp_sh, kp_sc, vp_st, vp_sh, vp_sc, o_sb, o_st, o_sh, lse_sb, lse_st, lse_sh, oq_sh, oq_sc,
                   bt_sb, block_size, num_blocks, prefix_len, scale, n1, group, head_d, head_dv, b_first, n_bh, fold,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   PAGED: tl.constexpr, NZ_X: tl.constexpr, K_QUANT: tl.constexpr, V_QUANT: tl.constexpr,
                   K_STATIC: tl.constexpr, V_STATIC: tl.constexpr, K_OFFSET: tl.constexpr, V_OFFSET: tl.constexpr,
                   HAS_PREFIX: tl.constexpr, PACKED: tl.constexpr, PSE: tl.constexpr, HAS_EXPLICIT: tl.constexpr,
                   OUT_MODE: tl.constexpr, OUT_OFFSET: tl.constexpr, UPCAST: tl.constexpr,
                   PRECISION: tl.constexpr):
    """Rows ``[r0, r0 + BLOCK_M)`` of query head ``h`` of batch ``b_first + bh // n1`` (``bh`` folded over grid axes
    1 and 2, ``fold`` programs on axis 1; ``n_bh`` = batches x heads of the launch): the attention output in the
    output dtype and the lse.

    Strides: ``*_sb``/``*_st``/``*_sh`` batch/token/head (TND and paged: batch stride 0), ``*_sblk`` a cache block,
    ``*_sx`` an NZ channel group, ``*_sc`` a channel; ``lse_*`` of the lse ``[B, N1, Q_S]`` / ``[T, N1]``;
    ``oq_sh``/``oq_sc`` of the int8 output's scale and offset (0 for a per-tensor scale).
    """
    bh = tl.program_id(2) * fold + tl.program_id(1)
    if bh >= n_bh:
        return
    b = b_first + bh // n1
    h = bh % n1
    sq = meta(meta_ptr, b, Q_LEN)
    r0 = tl.program_id(0) * BLOCK_M
    if r0 >= sq:
        return
    hk = h // group
    rows = r0 + tl.arange(0, BLOCK_M)
    dk = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_rows = (meta(meta_ptr, b, Q_START) + rows).to(tl.int64)
    q = tl.load(q_ptr + b.to(tl.int64) * q_sb + q_rows[:, None] * q_st + h.to(tl.int64) * q_sh + dk[None, :],
                mask=(rows[:, None] < sq) & (dk[None, :] < head_d), other=0.0)
    q = upcast(q, UPCAST)
    kv_start = meta(meta_ptr, b, KV_START)
    k_chan = channel_offsets(dk, k_sc, k_sx, K_QUANT, NZ_X)
    v_chan = channel_offsets(dv, v_sc, v_sx, V_QUANT, NZ_X)

    m_i = tl.full([BLOCK_M], FLT_LOWEST, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    c_lo, c_hi = band_cols(meta_ptr, b, r0, tl.minimum(r0 + BLOCK_M, sq))
    if HAS_PREFIX:  # columns [0, prefix_len): the shared prefix, one dense [P, N2, D] run for every batch
        acc, m_i, l_i = _span(
            acc, m_i, l_i, q, kp_ptr + hk.to(tl.int64) * kp_sh, vp_ptr + hk.to(tl.int64) * vp_sh,
            (c_lo // BLOCK_N) * BLOCK_N, tl.minimum(c_hi, prefix_len), 0, 0, 0, 0,
            channel_offsets(dk, kp_sc, 0, K_QUANT, 0), channel_offsets(dv, vp_sc, 0, V_QUANT, 0),
            b, h, hk, rows, r0, dk, dv, head_d, head_dv, meta_ptr, bt_ptr, bt_sb, block_size, num_blocks,
            kp_st, 0, vp_st, 0, ks_ptr, ko_ptr, vs_ptr, vo_ptr, aq_strides_ptr, scale,
            pse_ptr, pse_sb, pse_sh, pse_sr, mask_ptr, mask_sb, mask_sh, mask_sr, BLOCK_M, BLOCK_N, False, K_QUANT,
            V_QUANT, K_STATIC, V_STATIC, K_OFFSET, V_OFFSET, PSE, HAS_EXPLICIT, q_ptr.dtype.element_ty, UPCAST,
            PRECISION)
    first = tl.maximum(c_lo, prefix_len)
    if PACKED:
        pos_shift = prefix_len + kv_start * 0
    else:  # per-token antiquant positions count the left padding
        pos_shift = prefix_len + kv_start
    acc, m_i, l_i = _span(
        acc, m_i, l_i, q, k_ptr + b.to(tl.int64) * k_sb + hk.to(tl.int64) * k_sh,
        v_ptr + b.to(tl.int64) * v_sb + hk.to(tl.int64) * v_sh,
        prefix_len + ((first - prefix_len) // BLOCK_N) * BLOCK_N, c_hi, prefix_len, kv_start * k_st, kv_start * v_st,
        pos_shift, k_chan, v_chan, b, h, hk, rows, r0, dk, dv, head_d, head_dv, meta_ptr, bt_ptr, bt_sb, block_size,
        num_blocks, k_st, k_sblk, v_st, v_sblk, ks_ptr, ko_ptr, vs_ptr, vo_ptr, aq_strides_ptr, scale,
        pse_ptr, pse_sb, pse_sh, pse_sr, mask_ptr, mask_sb, mask_sh, mask_sr, BLOCK_M, BLOCK_N, PAGED, K_QUANT,
        V_QUANT, K_STATIC, V_STATIC, K_OFFSET, V_OFFSET, PSE, HAS_EXPLICIT, q_ptr.dtype.element_ty, UPCAST, PRECISION)

    kept = l_i != 0  # NaN (non-finite inputs): kept, the row comes out NaN
    out = acc / tl.where(kept, l_i, 1.0)[:, None]
    lse = tl.where(kept, m_i + tl.log(tl.where(kept, l_i, 1.0)), float("inf"))
    row_ok = rows < sq
    o_ok = row_ok[:, None] & (dv[None, :] < head_dv)
    quant_offs = h.to(tl.int64) * oq_sh + dv[None, :].to(tl.int64) * oq_sc + rows[:, None] * 0
    o_off = b.to(tl.int64) * o_sb + q_rows[:, None] * o_st + h.to(tl.int64) * o_sh + dv[None, :]
    tl.store(o_ptr + o_off, output_tile(out, kept[:, None], oqs_ptr, oqo_ptr, quant_offs, o_ok, OUT_MODE, OUT_OFFSET,
                                        o_ptr.dtype.element_ty), mask=o_ok)
    tl.store(lse_ptr + b.to(tl.int64) * lse_sb + q_rows * lse_st + h.to(tl.int64) * lse_sh, lse, mask=row_ok)
