"""``sparse_flash_mla``'s forward kernels (``sparse_flash_mla_launch.py`` plans them).

One program holds one query token and ``BLOCK_H`` of its query heads (every head of the token reads the same shared
key rows, so the heads are the M dimension of the tensor-core products) and ``BLOCK_DV`` output columns. It streams
the token's keys under one online softmax: first the ori window ``[lo, hi)``, then the compressed keys (the causal
prefix ``[0, thr)`` (HCA), or the entries of its ``cmp_sparse_indices`` row (CSA): the first ``min(K, thr)`` up to the
first negative one, each counted when ``0 <= entry < thr``, duplicates twice), ``BLOCK_N`` keys at a time, through
either layout (contiguous rows at a batch's base offset, or a block table). Keys are values: with one column tile
the value tile is the key tile itself (``V_IS_K``); a 512-wide head is two programs of 256 columns on a GPU, each
recomputing the scores.

Per batch the kernels read one int64 row of the batch table (columns ``T_*``, computed on the device by the
launcher: no host read): the first flat query row, the query, ori and compressed lengths, the first key rows of
packed (TND) key stores and the ori length the compressed mask counts from. Every length is clamped to what the
tensors hold, and a block id outside the cache or an index entry outside ``[0, thr)`` masks its key out, so no
value makes a kernel read out of bounds.

``sparse_flash_mla_kernel`` finishes its rows. Decode (few rows) runs ``sparse_flash_mla_split_kernel`` instead:
each row's key stream (window then compressed keys) is cut into ``splits`` equal chunks, one per program, which
store their unnormalised ``(m, l, acc)`` in fp32; ``sparse_flash_mla_combine_kernel`` merges them in split order
(deterministic) and finishes the row. Finishing adds the sink ``exp(sink - m)`` to the sum: ``out = acc / l``,
``lse = m + log(l)``; a row that sees no key (padding rows included) gets 0 in both, sinks or not; a row that sees
keys whose scores are all -inf gets NaN (``0 / 0``) and ``lse = -inf`` without a sink.
"""
import triton
import triton.language as tl

from ...._core.triton.helpers import FLT_LOWEST, LOG2E, upcast
from ...common.triton.common import nan_aware_max
from ...common.triton.split_merge import merge_splits, split_offset

# columns of the per-batch table (int64)
T_Q_ROW: tl.constexpr = tl.constexpr(0)  # flat query row of the batch's first token
T_Q_LEN: tl.constexpr = tl.constexpr(1)
T_ORI_START: tl.constexpr = tl.constexpr(2)  # the batch's first ori key row (TND; 0 for BSND and paged)
T_ORI_LEN: tl.constexpr = tl.constexpr(3)
T_CMP_START: tl.constexpr = tl.constexpr(4)
T_CMP_LEN: tl.constexpr = tl.constexpr(5)
T_CMP_MASK_LEN: tl.constexpr = tl.constexpr(6)  # Lcmp * r + residual (Lori without a residual)
T_COLS: tl.constexpr = tl.constexpr(7)
SEARCH_TILE: tl.constexpr = tl.constexpr(64)


@triton.jit
def _col(table_ptr, b, col):
    return tl.load(table_ptr + b * T_COLS + col)


@triton.jit
def _query_row(table_ptr, n_batch, s1, Q_PACKED: tl.constexpr):
    """``(r, b, i, valid)``: this program's flat query row, its batch (the last one starting at or before it, when
    packed), its token within the batch and whether it is a real query (not padding)."""
    r = tl.program_id(0).to(tl.int64)
    if Q_PACKED:
        count = tl.zeros([], tl.int64)
        for j0 in range(0, n_batch, SEARCH_TILE):
            j = j0 + tl.arange(0, SEARCH_TILE)
            starts = tl.load(table_ptr + j.to(tl.int64) * T_COLS + T_Q_ROW, mask=j < n_batch, other=r + 1)
            count += tl.sum((starts <= r).to(tl.int64), 0)
        b = tl.maximum(count - 1, 0)
    else:
        b = r // s1
    i = r - _col(table_ptr, b, T_Q_ROW)
    return r, b, i, (i >= 0) & (i < _col(table_ptr, b, T_Q_LEN))


@triton.jit
def _compressed_limit(table_ptr, b, i, ratio, CMP_CAUSAL: tl.constexpr):
    """``thr``: how many leading compressed keys token ``i`` may see (``floor((Lcm - Lq + i + 1) / r)`` causal,
    ``floor(Lcm / r)`` otherwise, within ``[0, Lcmp]``)."""
    lcm = _col(table_ptr, b, T_CMP_MASK_LEN)
    if CMP_CAUSAL:
        x = lcm - _col(table_ptr, b, T_Q_LEN) + i + 1
    else:
        x = lcm
    return tl.minimum(tl.where(x > 0, x // ratio, 0), _col(table_ptr, b, T_CMP_LEN))


@triton.jit
def _listed_entries(idx_row, k_count, thr):
    """Entries of an index row that may count: the first ``min(K, thr)``, cut at the first negative one."""
    c = tl.minimum(k_count, thr)
    first_negative = c
    for e0 in range(0, c, SEARCH_TILE):
        e = e0 + tl.arange(0, SEARCH_TILE)
        v = tl.load(idx_row + e, mask=e < c, other=0)
        first_negative = tl.minimum(first_negative, tl.min(tl.where((v < 0) & (e < c), e, c), 0))
    return first_negative


@triton.jit
def _stream(table_ptr, idx_ptr, b, i, valid, r, idx_sr, k_count, left, right, ratio, HAS_CMP: tl.constexpr,
            SPARSE: tl.constexpr, CMP_CAUSAL: tl.constexpr):
    """``(lo, n_ori, thr, n_cmp, idx_row)``: the token's ori window ``[lo, lo + n_ori)``, its compressed limit and
    how many compressed positions (HCA) or index entries (CSA) its stream walks (all 0 for padding rows)."""
    ori_len = _col(table_ptr, b, T_ORI_LEN)
    p = ori_len - _col(table_ptr, b, T_Q_LEN) + i
    lo = tl.maximum(p - left, 0)
    hi = tl.minimum(p + right + 1, ori_len)
    n_ori = tl.where(valid, tl.maximum(hi - lo, 0), 0)
    thr = tl.zeros([], tl.int64)
    n_cmp = tl.zeros([], tl.int64)
    idx_row = idx_ptr + r * idx_sr
    if HAS_CMP:
        thr = tl.where(valid, tl.maximum(_compressed_limit(table_ptr, b, i, ratio, CMP_CAUSAL), 0), 0)
        if SPARSE:
            n_cmp = _listed_entries(idx_row, k_count, thr).to(tl.int64)
        else:
            n_cmp = thr
    return lo, n_ori, thr, n_cmp, idx_row


@triton.jit
def _row_offsets(bt_ptr, b, pos, ok, start, s_row, s_outer, bt_sb, page, n_pages, PAGED: tl.constexpr):
    """``(offsets, ok)``: element offsets of batch ``b``'s key rows at positions ``pos`` (masked by ``ok``):
    ``b * s_outer + (start + pos) * s_row`` (BSND: ``s_outer`` the batch stride, ``start`` 0; TND: ``s_outer`` 0),
    or through the block table ``block * s_outer + (pos % page) * s_row`` (a block id outside the cache masks its
    row out). Products of strides, so the compiler sees 16-byte aligned rows when the strides are."""
    if PAGED:  # positions fit in int32 (a block table's capacity): 32-bit division
        pos = tl.where(ok, pos, 0).to(tl.int32)
        blk = tl.load(bt_ptr + b * bt_sb + pos // page, mask=ok, other=0).to(tl.int64)
        ok = ok & (blk >= 0) & (blk < n_pages)
        return tl.where(ok, blk, 0) * s_outer + (pos % page).to(tl.int64) * s_row, ok
    return b * s_outer + (start + tl.where(ok, pos, 0).to(tl.int64)) * s_row, ok


@triton.jit
def _attend(q, kv_ptr, off, ok, dv0, head_d, m_i, l_i, acc, scale, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            V_IS_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step over the key rows at ``off`` (``[BLOCK_N]``, masked by ``ok``); values are the same
    rows' columns ``dv0 ..``."""
    d = tl.arange(0, BLOCK_D)
    k = upcast(tl.load(kv_ptr + off[:, None] + d[None, :], mask=ok[:, None] & (d[None, :] < head_d), other=0.0),
               UPCAST)
    s = tl.where(ok[None, :], tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((m_i - shift) * LOG2E)
    p = tl.exp2((s - shift[:, None]) * LOG2E)
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_IS_K:
        v = k
    else:
        dv = dv0 + tl.arange(0, BLOCK_DV)
        v = upcast(tl.load(kv_ptr + off[:, None] + dv[None, :], mask=ok[:, None] & (dv[None, :] < head_d),
                           other=0.0), UPCAST)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _walk(q, b, table_ptr, ori_ptr, cmp_ptr, obt_ptr, cbt_ptr, idx_row, lo, n_ori, thr, f_lo, f_hi, dv0, head_d,
          scale, ori_sr, ori_souter, obt_sb, ori_page, ori_pages, cmp_sr, cmp_souter, cbt_sb, cmp_page, cmp_pages,
          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
          ORI_PAGED: tl.constexpr, CMP_PAGED: tl.constexpr, SPARSE: tl.constexpr, V_IS_K: tl.constexpr,
          UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``(m, l, acc)`` of stream positions ``[f_lo, f_hi)``: positions below ``n_ori`` are the window's keys
    ``lo + f``, the others the compressed stream's entry ``f - n_ori``. A -inf max after keys were seen (every
    score -inf) is marked ``FLT_LOWEST`` (the combine and the finish tell it from a row without keys)."""
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    seen = tl.zeros([], tl.int32)
    ori_start = _col(table_ptr, b, T_ORI_START)
    for f0 in range(f_lo, tl.minimum(f_hi, n_ori), BLOCK_N):
        f = f0 + tl.arange(0, BLOCK_N)
        off, ok = _row_offsets(obt_ptr, b, lo + f, f < tl.minimum(f_hi, n_ori), ori_start, ori_sr, ori_souter, obt_sb,
                               ori_page, ori_pages, ORI_PAGED)
        seen = tl.maximum(seen, tl.max(ok.to(tl.int32), 0))
        m_i, l_i, acc = _attend(q, ori_ptr, off, ok, dv0, head_d, m_i, l_i, acc, scale, BLOCK_D, BLOCK_DV, V_IS_K,
                                UPCAST, PRECISION)
    cmp_start = _col(table_ptr, b, T_CMP_START)
    for e0 in range(tl.maximum(f_lo, n_ori) - n_ori, f_hi - n_ori, BLOCK_N):
        e = e0 + tl.arange(0, BLOCK_N)
        ok = e < f_hi - n_ori
        if SPARSE:
            pos = tl.load(idx_row + e, mask=ok, other=-1).to(tl.int64)
            ok = ok & (pos >= 0) & (pos < thr)
        else:
            pos = e
        off, ok = _row_offsets(cbt_ptr, b, pos, ok, cmp_start, cmp_sr, cmp_souter, cbt_sb, cmp_page, cmp_pages,
                               CMP_PAGED)
        seen = tl.maximum(seen, tl.max(ok.to(tl.int32), 0))
        m_i, l_i, acc = _attend(q, cmp_ptr, off, ok, dv0, head_d, m_i, l_i, acc, scale, BLOCK_D, BLOCK_DV, V_IS_K,
                                UPCAST, PRECISION)
    return tl.where((seen > 0) & (m_i == float("-inf")), FLT_LOWEST, m_i), l_i, acc


@triton.jit
def _finish(acc, m_i, l_i, r, head0, dv0, o_ptr, lse_ptr, sink_ptr, o_sr, o_sh, heads, head_d,
            HAS_SINKS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The sink, ``acc / l`` and ``lse = m + log(l)`` of flat query row ``r``, heads ``head0 ..``, columns
    ``dv0 ..`` (``lse`` by the first column tile); a row without keys (max -inf) gets 0 in both."""
    h = head0 + tl.arange(0, BLOCK_H)
    seen = m_i != float("-inf")
    m_i = tl.where((m_i == FLT_LOWEST) & (l_i == 0), float("-inf"), m_i)  # keys seen, every score -inf
    if HAS_SINKS:
        sink = tl.load(sink_ptr + h, mask=h < heads, other=0.0).to(tl.float32)
        m_fin = tl.maximum(m_i, sink)
        alpha = tl.exp2((m_i - m_fin) * LOG2E)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2((sink - m_fin) * LOG2E)
        m_i = m_fin
    m_i = nan_aware_max(m_i, l_i)
    lse = tl.where((m_i == float("inf")) | (m_i == float("-inf")), m_i, m_i + tl.log(l_i))
    out = tl.where(seen[:, None], acc / l_i[:, None], 0.0)
    dv = dv0 + tl.arange(0, BLOCK_DV)
    o_off = r * o_sr + h[:, None].to(tl.int64) * o_sh + dv[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=(h[:, None] < heads) & (dv[None, :] < head_d))
    tl.store(lse_ptr + r * heads + h, tl.where(seen, lse, 0.0), mask=h < tl.where(dv0 == 0, heads, 0))


@triton.jit
def _query_tile(q_ptr, r, head0, heads, q_sr, q_sh, head_d, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                UPCAST: tl.constexpr):
    """The ``[BLOCK_H, BLOCK_D]`` query rows of heads ``head0 ..`` of flat row ``r`` (0 past the heads)."""
    h = head0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    off = r * q_sr + h[:, None].to(tl.int64) * q_sh + d[None, :]
    return upcast(tl.load(q_ptr + off, mask=(h[:, None] < heads) & (d[None, :] < head_d), other=0.0), UPCAST)


@triton.jit
def _program(q_ptr, table_ptr, idx_ptr, q_sr, q_sh, idx_sr, k_count, n_batch, s1, heads, head_d, dv_tiles, splits,
             left, right, ratio, Q_PACKED: tl.constexpr, HAS_CMP: tl.constexpr, SPARSE: tl.constexpr,
             CMP_CAUSAL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
             BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    """This program's row, batch, head and column tiles, split, query tile and stream range: ``(r, b, split, head0,
    dv0, q, idx_row, lo, n_ori, thr, f_lo, f_hi)`` (the stream's ``n_ori + n_cmp`` positions cut into ``splits``
    chunks of whole key tiles)."""
    r, b, i, valid = _query_row(table_ptr, n_batch, s1, Q_PACKED)
    split = tl.program_id(1) % splits
    tile = tl.program_id(1) // splits
    head0 = (tile // dv_tiles) * BLOCK_H
    dv0 = (tile % dv_tiles) * BLOCK_DV
    q = _query_tile(q_ptr, r, head0, heads, q_sr, q_sh, head_d, BLOCK_H, BLOCK_D, UPCAST)
    lo, n_ori, thr, n_cmp, idx_row = _stream(table_ptr, idx_ptr, b, i, valid, r, idx_sr, k_count, left, right, ratio,
                                             HAS_CMP, SPARSE, CMP_CAUSAL)
    n = n_ori + n_cmp
    chunk = tl.cdiv(tl.cdiv(n, splits), BLOCK_N) * BLOCK_N
    f_lo = split * chunk
    return r, b, split, head0, dv0, q, idx_row, lo, n_ori, thr, f_lo, tl.minimum(n, f_lo + chunk)


@triton.jit
def sparse_flash_mla_kernel(q_ptr, ori_ptr, cmp_ptr, idx_ptr, obt_ptr, cbt_ptr, table_ptr, sink_ptr, o_ptr, lse_ptr,
                            q_sr, q_sh, o_sr, o_sh, idx_sr, ori_sr, ori_souter, obt_sb, ori_page, ori_pages, cmp_sr,
                            cmp_souter, cbt_sb, cmp_page, cmp_pages, k_count, n_batch, s1, heads, head_d, dv_tiles,
                            left, right, ratio, scale,
                            Q_PACKED: tl.constexpr, HAS_CMP: tl.constexpr, SPARSE: tl.constexpr,
                            CMP_CAUSAL: tl.constexpr, ORI_PAGED: tl.constexpr, CMP_PAGED: tl.constexpr,
                            HAS_SINKS: tl.constexpr, V_IS_K: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr,
                            PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """Prefill: grid ``(rows, head tiles x column tiles)``; each program finishes its row's heads and columns."""
    r, b, _, head0, dv0, q, idx_row, lo, n_ori, thr, f_lo, f_hi = _program(
        q_ptr, table_ptr, idx_ptr, q_sr, q_sh, idx_sr, k_count, n_batch, s1, heads, head_d, dv_tiles, 1, left, right,
        ratio, Q_PACKED, HAS_CMP, SPARSE, CMP_CAUSAL, BLOCK_H, BLOCK_D, BLOCK_DV, BLOCK_N, UPCAST)
    m_i, l_i, acc = _walk(q, b, table_ptr, ori_ptr, cmp_ptr, obt_ptr, cbt_ptr, idx_row, lo, n_ori, thr, f_lo, f_hi,
                          dv0, head_d, scale, ori_sr, ori_souter, obt_sb, ori_page, ori_pages, cmp_sr, cmp_souter,
                          cbt_sb, cmp_page, cmp_pages, BLOCK_H, BLOCK_D, BLOCK_DV, BLOCK_N, ORI_PAGED, CMP_PAGED,
                          SPARSE, V_IS_K, UPCAST, PRECISION)
    _finish(acc, m_i, l_i, r, head0, dv0, o_ptr, lse_ptr, sink_ptr, o_sr, o_sh, heads, head_d, HAS_SINKS, BLOCK_H,
            BLOCK_DV)


@triton.jit
def sparse_flash_mla_split_kernel(q_ptr, ori_ptr, cmp_ptr, idx_ptr, obt_ptr, cbt_ptr, table_ptr, pm_ptr, pl_ptr,
                                  pacc_ptr, q_sr, q_sh, idx_sr, ori_sr, ori_souter, obt_sb, ori_page, ori_pages,
                                  cmp_sr, cmp_souter, cbt_sb, cmp_page, cmp_pages, k_count, n_batch, s1, heads, head_d,
                                  dv_tiles, splits, left, right, ratio, scale,
                                  Q_PACKED: tl.constexpr, HAS_CMP: tl.constexpr, SPARSE: tl.constexpr,
                                  CMP_CAUSAL: tl.constexpr, ORI_PAGED: tl.constexpr, CMP_PAGED: tl.constexpr,
                                  V_IS_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                                  BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                                  BLOCK_N: tl.constexpr):
    """Decode: grid ``(rows, head tiles x column tiles x splits)``; each program stores its chunk's unnormalised
    ``(m, l, acc)`` (fp32) for :func:`sparse_flash_mla_combine_kernel`."""
    r, b, split, head0, dv0, q, idx_row, lo, n_ori, thr, f_lo, f_hi = _program(
        q_ptr, table_ptr, idx_ptr, q_sr, q_sh, idx_sr, k_count, n_batch, s1, heads, head_d, dv_tiles, splits, left,
        right, ratio, Q_PACKED, HAS_CMP, SPARSE, CMP_CAUSAL, BLOCK_H, BLOCK_D, BLOCK_DV, BLOCK_N, UPCAST)
    m_i, l_i, acc = _walk(q, b, table_ptr, ori_ptr, cmp_ptr, obt_ptr, cbt_ptr, idx_row, lo, n_ori, thr, f_lo, f_hi,
                          dv0, head_d, scale, ori_sr, ori_souter, obt_sb, ori_page, ori_pages, cmp_sr, cmp_souter,
                          cbt_sb, cmp_page, cmp_pages, BLOCK_H, BLOCK_D, BLOCK_DV, BLOCK_N, ORI_PAGED, CMP_PAGED,
                          SPARSE, V_IS_K, UPCAST, PRECISION)
    h = head0 + tl.arange(0, BLOCK_H)
    dv = dv0 + tl.arange(0, BLOCK_DV)
    at = split_offset(r, h, split, splits, heads)
    first = h < tl.where(dv0 == 0, heads, 0)  # the statistics, by the first column tile
    tl.store(pm_ptr + at, m_i, mask=first)
    tl.store(pl_ptr + at, l_i, mask=first)
    tl.store(pacc_ptr + at[:, None] * head_d + dv[None, :], acc, mask=(h[:, None] < heads) & (dv[None, :] < head_d))


@triton.jit
def sparse_flash_mla_combine_kernel(pm_ptr, pl_ptr, pacc_ptr, sink_ptr, o_ptr, lse_ptr, o_sr, o_sh, heads, head_d,
                                    dv_tiles, splits, HAS_SINKS: tl.constexpr, BLOCK_H: tl.constexpr,
                                    BLOCK_DV: tl.constexpr):
    """Grid ``(rows, head tiles x column tiles)``: the splits of flat row ``r`` merged in split order (the same
    bits every run; the max first, then the rescaled sums and accumulators), then finished as the prefill's."""
    r = tl.program_id(0).to(tl.int64)
    head0 = (tl.program_id(1) // dv_tiles) * BLOCK_H
    dv0 = (tl.program_id(1) % dv_tiles) * BLOCK_DV
    h = head0 + tl.arange(0, BLOCK_H)
    dv = dv0 + tl.arange(0, BLOCK_DV)
    m_i, l_i, acc = merge_splits(pm_ptr, pl_ptr, pacc_ptr, r, h, dv, splits, heads, head_d, BLOCK_H, BLOCK_DV)
    _finish(acc, m_i, l_i, r, head0, dv0, o_ptr, lse_ptr, sink_ptr, o_sr, o_sh, heads, head_d, HAS_SINKS, BLOCK_H,
            BLOCK_DV)
