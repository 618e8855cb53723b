"""Sparse flash attention's kernel (MLA absorbed, ``attention_mode`` 2): each query row attends to the key positions
its ``sparse_indices`` row lists, over a plain or a quantized (656-byte packed rows) latent cache in any layout
(``launch.py`` plans it).

One program holds one query row and ``BLOCK_H`` of its query heads (64 on a GPU: every head of the token shares the
same latent key rows, so the heads are the M dimension of the tensor-core products; 128 heads are two programs). It
walks the row's entries ``BLOCK_N`` key positions at a time (with ``sparse_block_size`` > 1 an entry names
``sbs`` consecutive positions), gathers the latent rows ``K [BLOCK_N, 512]`` and rope rows ``[BLOCK_N, 64]`` through
the layout (dense, packed or the block table) and runs the online softmax of
``scale * (q k^T + q_rope k_rope^T)``. A program accumulates ``BLOCK_DV`` output columns (grid axis 2 counts head
tiles x value column tiles): with one tile the value is the latent tile itself (``V_IS_K``: loaded once for both
products); on a GPU the 512 latent columns are two programs of 256 (a 64 x 512 fp32 accumulator does not fit in
registers beside the operands), each recomputing the scores and loading its value columns (L2 hits). Entries counted: the first ``min(K, ceil(L_i / sbs))`` up to the first -1, positions
below ``min(Lkv, L_i)`` (``L_i = Lkv - Lq + i + 1`` in sparse mode 3); a repeated entry counts twice.

``QUANT`` (1: int8 codes, 2: fp8 e4m3fn codes, read as bytes and decoded by their bits): the latent rows are the 512 codes of a packed row, dequantized in
the kernel with the row's four fp32 per-128-column scales and rounded to the query dtype (the reference's order);
the rope rows and the scales are the same bytes viewed as the query dtype and fp32 (host views, no copies). The
codes are dequantized a chunk at a time, never a whole row: the scores accumulate over ``SCORE_CHUNK``-column
products (the query heads held as as many tiles), the output in one accumulator per ``VALUE_CHUNK`` columns.

Decode with few programs (one token per request, 2 x 2 head/column tiles) splits each row's entries over ``splits``
programs (axis 2 counts splits too), which store their unnormalised partials in fp32; ``sparse_attention_merge_kernel``
merges them in split order (FlashDecoding; deterministic) and finishes the row.

Outputs: ``acc / l`` (0 for a row that attends to nothing), and when asked the statistics ``(m, l)`` at
``token * N1 + head`` (the BSND ``[B, 1, S1, N1]`` and TND ``[1, T1, N1]`` layouts flatten alike); sinks add
``exp(sink - m)`` to the sum after the keys. Rows without keys: ``(0, 0)``, with sinks ``(sink, 1)``.
"""
import triton
import triton.language as tl

from ...._core.triton.helpers import FLT_LOWEST, LOG2E, upcast
from ...common.triton.common import nan_aware_max
from ...common.triton.split_merge import merge_splits, split_offset
from ...common.triton.token_rows import head_rows, key_limit, key_rows, kv_range, load_rows, query_row

SCALE_TILE: tl.constexpr = tl.constexpr(128)  # latent columns per dequantization scale
# quantized cache: latent columns dequantized per score product and per value product (each inside one scale's
# columns); the widths with no register spills on sm_80 / sm_90 (python -m attnops aot --filter cache)
SCORE_CHUNK: tl.constexpr = tl.constexpr(32)
VALUE_CHUNK: tl.constexpr = tl.constexpr(64)


@triton.jit
def entry_count(idx_row, count, limit, sbs):
    """Entries of the row that count: the first ``min(count, ceil(limit / sbs))``, cut at the first -1."""
    c = tl.minimum(count, tl.cdiv(tl.maximum(limit, 0), sbs))
    first_none = c
    for e0 in range(0, c, 64):
        e = e0 + tl.arange(0, 64)
        v = tl.load(idx_row + e, mask=e < c, other=0)
        first_none = tl.minimum(first_none, tl.min(tl.where((v == -1) & (e < c), e, c), 0))
    return first_none


@triton.jit
def _code_values(codes, QUANT: tl.constexpr):
    """fp32 values of loaded codes: int8 as is; fp8 e4m3fn bytes (loaded as uint8) decoded by their bits, exact and
    the same on GPUs without fp8 conversions: sign, exponent and mantissa moved into an fp16's places (its exponent
    bias 15 instead of 7, subnormals included), times 2^8; the two NaN codes (the only ones whose fp16 reads +-1.875)
    NaN."""
    if QUANT == 1:
        return codes.to(tl.float32)
    bits = codes.to(tl.int16)
    half = ((bits + (bits & 0x80)) << 7).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.where(tl.abs(half) == 1.875, float("nan"), half * 256.0)


@triton.jit
def _latent_rows(k_ptr, ks_ptr, outer, inner, ok, k_s0, k_s1, ks_s0, ks_s1, head_d, dtype, BLOCK_D: tl.constexpr,
                 QUANT: tl.constexpr, UPCAST: tl.constexpr, col0=0):
    """The ``[BLOCK_N, BLOCK_D]`` latent rows (their columns from ``col0``, ``head_d`` of them), dequantized
    (``QUANT``: a tile inside one scale's columns) and rounded to the query ``dtype``."""
    rows = load_rows(k_ptr, outer, inner, ok, k_s0, k_s1, head_d, BLOCK_D)
    if QUANT:
        base = outer * ks_s0 + inner * ks_s1 + col0 // SCALE_TILE
        scale = tl.load(ks_ptr + base, mask=ok, other=0.0)[:, None]
        rows = (_code_values(rows, QUANT) * scale).to(dtype)
    return upcast(rows, UPCAST)


@triton.jit
def _query_chunks(q_ptr, b, token, head0, heads, q_sb, q_st, q_sh, head_d, BLOCK_H: tl.constexpr,
                  CHUNKS: tl.constexpr, UPCAST: tl.constexpr):
    """The latent query heads ``head0 ..`` as a tuple of ``CHUNKS`` ``[BLOCK_H, SCORE_CHUNK]`` tiles."""
    chunks = ()
    for c in tl.static_range(CHUNKS):
        chunks = chunks + (upcast(head_rows(q_ptr + c * SCORE_CHUNK, b, token, head0, heads, q_sb, q_st, q_sh,
                                            head_d - c * SCORE_CHUNK, BLOCK_H, SCORE_CHUNK), UPCAST),)
    return chunks


@triton.jit
def _dequantized_scores(q, k_ptr, ks_ptr, outer, inner, ok, k_s0, k_s1, ks_s0, ks_s1, head_d, dtype,
                        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr, UPCAST: tl.constexpr,
                        PRECISION: tl.constexpr):
    """``q k^T`` of the query chunks ``q`` (:func:`_query_chunks`) against the quantized latent rows, a chunk at a
    time: each ``[BLOCK_N, SCORE_CHUNK]`` tile dequantized and its product accumulated (registers for one tile, not
    for the whole row)."""
    s = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
    for c in tl.static_range(len(q)):
        k = _latent_rows(k_ptr + c * SCORE_CHUNK, ks_ptr, outer, inner, ok, k_s0, k_s1, ks_s0, ks_s1,
                         head_d - c * SCORE_CHUNK, dtype, SCORE_CHUNK, QUANT, UPCAST, c * SCORE_CHUNK)
        s = tl.dot(q[c], tl.trans(k), s, input_precision=PRECISION)
    return s


@triton.jit
def _value_accumulators(BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, QUANT: tl.constexpr):
    """The fp32 output accumulators of ``BLOCK_DV`` columns, a tuple: one ``[BLOCK_H, BLOCK_DV]`` tile, or when
    quantized one per ``VALUE_CHUNK`` columns (:func:`_accumulate_values` dequantizes a value chunk at a time)."""
    if QUANT and BLOCK_DV > VALUE_CHUNK:
        accs = ()
        for c in tl.static_range(BLOCK_DV // VALUE_CHUNK):
            accs = accs + (tl.zeros([BLOCK_H, VALUE_CHUNK], tl.float32),)
    else:
        accs = (tl.zeros([BLOCK_H, BLOCK_DV], tl.float32),)
    return accs


@triton.jit
def _accumulate_values(accs, p, alpha, v_ptr, ks_ptr, outer, inner, ok, v_s0, v_s1, ks_s0, ks_s1, dv0, head_dv, dtype,
                       QUANT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """The accumulators ``accs`` (:func:`_value_accumulators`, columns from ``dv0``) rescaled by ``alpha`` plus
    ``p`` times their value rows (the latent rows' when quantized)."""
    width: tl.constexpr = accs[0].shape[1]
    out = ()
    for c in tl.static_range(len(accs)):
        col0 = dv0 + c * width
        v = _latent_rows(v_ptr + col0, ks_ptr, outer, inner, ok, v_s0, v_s1, ks_s0, ks_s1, head_dv - col0, dtype,
                         width, QUANT, UPCAST, col0)
        out = out + (tl.dot(p.to(v.dtype), v, accs[c] * alpha[:, None], input_precision=PRECISION),)
    return out


@triton.jit
def _finish(acc, m_i, l_i, r, b, token, head0, dv0, o_ptr, smax_ptr, ssum_ptr, sink_ptr, o_sb, o_st, o_sh, heads,
            head_dv, HAS_SINKS: tl.constexpr, RETURN_LSE: tl.constexpr, BLOCK_H: tl.constexpr,
            BLOCK_DV: tl.constexpr):
    """Sinks, ``acc / l`` (0 without keys) and the statistics (at ``r * N1 + head``; ``(0, 0)`` without keys) of
    flat query row ``r`` (``token`` of batch ``b``), heads ``head0 ..``, output columns ``dv0 ..``. A max of
    FLT_LOWEST marks keys seen whose scores are all -inf: NaN (max -inf, sum NaN) unless a sink is finite."""
    h = head0 + tl.arange(0, BLOCK_H)
    if HAS_SINKS:
        sink = tl.load(sink_ptr + h, mask=h < heads, other=0.0).to(tl.float32)
        m_fin = tl.maximum(m_i, sink)
        alpha = tl.exp2((m_i - m_fin) * LOG2E)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2((sink - m_fin) * LOG2E)
        m_i = m_fin
    m_i = nan_aware_max(m_i, l_i)
    unkept = (m_i == FLT_LOWEST) & (l_i == 0)  # keys seen, every score -inf: the formula's 0 / 0
    m_i = tl.where(unkept, float("-inf"), m_i)
    l_i = tl.where(unkept, float("nan"), l_i)
    out = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]  # a NaN l_i: the row comes out NaN
    dv = dv0 + tl.arange(0, BLOCK_DV)
    o_off = b.to(tl.int64) * o_sb + token * o_st + h[:, None].to(tl.int64) * o_sh + dv[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=(h[:, None] < heads) & (dv[None, :] < head_dv))
    if RETURN_LSE:
        stat = r * heads + h
        tl.store(smax_ptr + stat, tl.where((m_i == float("-inf")) & ~unkept, 0.0, m_i), mask=h < heads)
        tl.store(ssum_ptr + stat, l_i, mask=h < heads)


@triton.jit
def sparse_attention_kernel(q_ptr, qr_ptr, k_ptr, kr_ptr, v_ptr, ks_ptr, idx_ptr, o_ptr, smax_ptr, ssum_ptr,
                            sink_ptr, part_ptr, q_lens_ptr, kv_lens_ptr, bt_ptr,
                            q_sb, q_st, q_sh, qr_sb, qr_st, qr_sh, k_s0, k_s1, kr_s0, kr_s1, v_s0, v_s1, ks_s0, ks_s1,
                            i_sb, i_st, o_sb, o_st, o_sh, q_lens_stride, kv_lens_stride, bt_sb,
                            s1, s2, n_batch, heads, head_d, rope_d, head_dv, dv_tiles, splits, page, n_pages, count,
                            sbs, scale,
                            Q_PACKED: tl.constexpr, Q_LENS: tl.constexpr, KV_MODE: tl.constexpr,
                            KV_LENS: tl.constexpr, CAUSAL: tl.constexpr, HAS_ROPE: tl.constexpr,
                            V_IS_K: tl.constexpr, QUANT: tl.constexpr, HAS_SINKS: tl.constexpr,
                            RETURN_LSE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
                            UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    b, token, row, q_len, valid = query_row(q_lens_ptr, q_lens_stride, s1, n_batch, Q_PACKED, Q_LENS)
    kv_start, kv_len = kv_range(kv_lens_ptr, kv_lens_stride, b, s2, KV_MODE, KV_LENS)
    limit = key_limit(kv_len, q_len, row, valid, CAUSAL)
    split = tl.program_id(2) % splits
    tile = tl.program_id(2) // splits
    head0 = (tile // dv_tiles) * BLOCK_H
    dv0 = (tile % dv_tiles) * BLOCK_DV
    dtype = q_ptr.dtype.element_ty
    if QUANT:
        q = _query_chunks(q_ptr, b, token, head0, heads, q_sb, q_st, q_sh, head_d, BLOCK_H, BLOCK_D // SCORE_CHUNK,
                          UPCAST)
    else:
        q = upcast(head_rows(q_ptr, b, token, head0, heads, q_sb, q_st, q_sh, head_d, BLOCK_H, BLOCK_D), UPCAST)
    if HAS_ROPE:
        q_rope = upcast(head_rows(qr_ptr, b, token, head0, heads, qr_sb, qr_st, qr_sh, rope_d, BLOCK_H, BLOCK_R),
                        UPCAST)
    idx_row = idx_ptr + b.to(tl.int64) * i_sb + token * i_st
    n_pos = entry_count(idx_row, count, limit, sbs) * sbs
    chunk = tl.cdiv(tl.cdiv(n_pos, splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(n_pos, lo + chunk)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    accs = _value_accumulators(BLOCK_H, BLOCK_DV, QUANT)
    seen = tl.full([], 0, tl.int1)  # the row (every head) kept a key, whatever its score
    for f0 in range(lo, hi, BLOCK_N):
        f = f0 + tl.arange(0, BLOCK_N)
        entry = tl.load(idx_row + f // sbs, mask=f < hi, other=-1).to(tl.int64)
        pos = entry * sbs + f % sbs
        ok = (f < hi) & (entry >= 0) & (pos < limit)
        outer, inner, ok = key_rows(bt_ptr, b, pos, ok, kv_start, bt_sb, page, n_pages, KV_MODE)
        seen = seen | (tl.max(ok.to(tl.int32), 0) > 0)
        if QUANT:
            s = _dequantized_scores(q, k_ptr, ks_ptr, outer, inner, ok, k_s0, k_s1, ks_s0, ks_s1, head_d, dtype,
                                    BLOCK_H, BLOCK_N, QUANT, UPCAST, PRECISION)
        else:
            k = _latent_rows(k_ptr, ks_ptr, outer, inner, ok, k_s0, k_s1, ks_s0, ks_s1, head_d, dtype, BLOCK_D,
                             QUANT, UPCAST)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if HAS_ROPE:
            k_rope = upcast(load_rows(kr_ptr, outer, inner, ok, kr_s0, kr_s1, rope_d, BLOCK_R), UPCAST)
            s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision=PRECISION)
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2((m_i - shift) * LOG2E)
        p = tl.exp2((s - shift[:, None]) * LOG2E)
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_IS_K:
            accs = (tl.dot(p.to(k.dtype), k, accs[0] * alpha[:, None], input_precision=PRECISION),)
        else:
            accs = _accumulate_values(accs, p, alpha, v_ptr, ks_ptr, outer, inner, ok, v_s0, v_s1, ks_s0, ks_s1, dv0,
                                      head_dv, dtype, QUANT, UPCAST, PRECISION)
        m_i = m_new
    m_i = tl.where(seen & (m_i == float("-inf")) & (l_i == 0), FLT_LOWEST, m_i)  # see _finish
    r = token
    if not Q_PACKED:
        r += b.to(tl.int64) * s1
    width: tl.constexpr = accs[0].shape[1]
    h = head0 + tl.arange(0, BLOCK_H)
    if SPLIT:  # the split's unnormalised partials: (max, sum) per head, acc per head and column
        at = split_offset(r, h, split, splits, heads)
        tl.store(smax_ptr + at, m_i, mask=h < heads)
        tl.store(ssum_ptr + at, l_i, mask=h < heads)
    for c in tl.static_range(len(accs)):
        if SPLIT:
            dv = dv0 + c * width + tl.arange(0, width)
            tl.store(part_ptr + at[:, None] * head_dv + dv[None, :], accs[c],
                     mask=(h[:, None] < heads) & (dv[None, :] < head_dv))
        else:
            _finish(accs[c], m_i, l_i, r, b, token, head0, dv0 + c * width, o_ptr, smax_ptr, ssum_ptr, sink_ptr, o_sb,
                    o_st, o_sh, heads, head_dv, HAS_SINKS, RETURN_LSE and c == 0, BLOCK_H, width)


@triton.jit
def sparse_attention_merge_kernel(pmax_ptr, psum_ptr, part_ptr, o_ptr, smax_ptr, ssum_ptr, sink_ptr,
                                  o_sb, o_st, o_sh, s1, heads, head_dv, dv_tiles, splits,
                                  Q_PACKED: tl.constexpr, HAS_SINKS: tl.constexpr, RETURN_LSE: tl.constexpr,
                                  BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The splits of flat query row ``r`` (axis 0) merged in split order (the same bits every run): the max first,
    then the rescaled sums and accumulators; then :func:`_finish`."""
    r = tl.program_id(0).to(tl.int64)
    head0 = (tl.program_id(1) // dv_tiles) * BLOCK_H
    dv0 = (tl.program_id(1) % dv_tiles) * BLOCK_DV
    h = head0 + tl.arange(0, BLOCK_H)
    dv = dv0 + tl.arange(0, BLOCK_DV)
    m_i, l_i, acc = merge_splits(pmax_ptr, psum_ptr, part_ptr, r, h, dv, splits, heads, head_dv, BLOCK_H,
                                 BLOCK_DV)
    b = tl.zeros([], tl.int64)
    token = r
    if not Q_PACKED:
        b = r // s1
        token = r % s1
    _finish(acc, m_i, l_i, r, b, token, head0, dv0, o_ptr, smax_ptr, ssum_ptr, sink_ptr, o_sb, o_st, o_sh, heads,
            head_dv, HAS_SINKS, RETURN_LSE, BLOCK_H, BLOCK_DV)
