"""``@triton.jit`` helpers shared by the forward and backward kernels: per-batch metadata, the score tile
(``scale*QK^T`` + pse, masked entries at -inf) and the dropout keep tile. No allocation here.

Per-batch metadata is one int64 row per batch (columns ``META_*``, filled by ``launch.py`` from host lengths or by
``prepare.py`` on the device), so kernels take one pointer instead of a dozen per-batch tensors. Grid axes 1 and 2
fold batch x heads (:func:`program_batch_head`), so any number of them fits CUDA's 65535 programs per axis.
"""
import triton
import triton.language as tl

# columns of the per-batch metadata rows (int64)
META_FIELDS = ("q_start", "kv_start", "q_len", "kv_len",  # token offsets (TND; 0 for dense) and lengths
               "lo", "hi", "prefix",  # band lo <= j - i <= hi, prefix columns (0: none)
               "drop_off", "pse_q_start", "pse_kv_start",  # dropout element offset, ALiBi start indices
               "stat_base", "stat_head")  # softmax statistics: element offset of the batch, stride of a head
Q_START: tl.constexpr = tl.constexpr(0)
KV_START: tl.constexpr = tl.constexpr(1)
Q_LEN: tl.constexpr = tl.constexpr(2)
KV_LEN: tl.constexpr = tl.constexpr(3)
LO: tl.constexpr = tl.constexpr(4)
HI: tl.constexpr = tl.constexpr(5)
PREFIX: tl.constexpr = tl.constexpr(6)
DROP_OFF: tl.constexpr = tl.constexpr(7)
PSE_QS: tl.constexpr = tl.constexpr(8)
PSE_KS: tl.constexpr = tl.constexpr(9)
STAT_BASE: tl.constexpr = tl.constexpr(10)
STAT_HEAD: tl.constexpr = tl.constexpr(11)
META_COLS: tl.constexpr = tl.constexpr(12)

# pse kinds (constexpr PSE)
PSE_NONE: tl.constexpr = tl.constexpr(0)
PSE_FULL: tl.constexpr = tl.constexpr(1)  # [B|1, N1, R, C]
PSE_ROW: tl.constexpr = tl.constexpr(2)  # [B|1, N1, 1, C], broadcast over rows
PSE_ALIBI: tl.constexpr = tl.constexpr(3)  # ALiBi-compressed [B|1, N1, 1024, C]: last row along the diagonal
PSE_SLOPES: tl.constexpr = tl.constexpr(4)  # pse_type 2: -slope * |j - i| generated in-kernel
PSE_SLOPES_SQRT: tl.constexpr = tl.constexpr(5)  # pse_type 3: -slope * sqrt|j - i|

# explicit-mask kinds (constexpr HAS_EXPLICIT; False/True: none / a mask tensor)
MASK_STRIDED_CAUSAL: tl.constexpr = tl.constexpr(2)  # masked(i, j) = j * stride + shift > i, computed (no tensor)

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
FLT_LOWEST: tl.constexpr = tl.constexpr(-3.4028234663852886e38)
FLT_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)


@triton.jit
def upcast(x, UPCAST: tl.constexpr):
    """fp32 math for loaded tiles where asked (fp32 inputs, and always in the interpreter, which has no bf16)."""
    if UPCAST:
        return x.to(tl.float32)
    return x


@triton.jit
def meta(meta_ptr, b, col):
    return tl.load(meta_ptr + b * META_COLS + col)


@triton.jit
def program_batch_head(heads, bh_fold, FOLD: tl.constexpr):
    """``(b, h)`` of this program: grid axis 1 holds the ``batch x heads`` pairs, or with ``FOLD`` up to ``bh_fold``
    of them and axis 2 counts the folds (the kernel then returns at once for ``b >= batch``: the programs past the
    last pair). Without ``FOLD`` the kernels compile exactly as without folding."""
    bh = tl.program_id(1)
    if FOLD:
        bh += tl.program_id(2) * bh_fold
    return bh // heads, bh % heads


@triton.jit
def band_rows(meta_ptr, b, c0, c1):
    """Query rows ``[r0, r1)`` that keep at least one column of ``[c0, c1)`` (band and prefix)."""
    sq = meta(meta_ptr, b, Q_LEN)
    lo = meta(meta_ptr, b, LO)
    hi = meta(meta_ptr, b, HI)
    pfx = tl.minimum(meta(meta_ptr, b, PREFIX), meta(meta_ptr, b, KV_LEN))
    r0 = tl.maximum(c0 - hi, 0)
    r1 = tl.minimum(c1 - 1 - lo + 1, sq)
    if c0 < pfx:
        r0 = r0 * 0
        r1 = sq
    return r0, r1


@triton.jit
def band_cols(meta_ptr, b, r0, r1):
    """Key columns ``[c0, c1)`` that query rows ``[r0, r1)`` may keep (band and prefix)."""
    skv = meta(meta_ptr, b, KV_LEN)
    lo = meta(meta_ptr, b, LO)
    hi = meta(meta_ptr, b, HI)
    pfx = tl.minimum(meta(meta_ptr, b, PREFIX), skv)
    c0 = tl.maximum(r0 + lo, 0)
    c1 = tl.minimum(r1 - 1 + hi + 1, skv)
    if pfx > 0:
        c1 = tl.where(c0 < c1, tl.maximum(c1, pfx), pfx)
        c0 = c0 * 0
    return c0, c1


@triton.jit
def tile_needs_mask(meta_ptr, b, r0, c0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """False when every (row, column) of the tile at ``(r0, c0)`` is in bounds and kept by the band or prefix:
    such tiles skip the element-wise mask."""
    sq = meta(meta_ptr, b, Q_LEN)
    skv = meta(meta_ptr, b, KV_LEN)
    lo = meta(meta_ptr, b, LO)
    hi = meta(meta_ptr, b, HI)
    pfx = meta(meta_ptr, b, PREFIX)
    out_of_bounds = (r0 + BLOCK_M > sq) | (c0 + BLOCK_N > skv)
    off_band = (c0 - (r0 + BLOCK_M - 1) < lo) | (c0 + BLOCK_N - 1 - r0 > hi)
    return out_of_bounds | (off_band & (c0 + BLOCK_N > pfx))


@triton.jit
def index_grid(rows, cols, TRANSPOSED: tl.constexpr):
    """``rows`` and ``cols`` as broadcastable 2-D index tiles: ``[R, 1]`` and ``[1, C]``, or with ``TRANSPOSED``
    ``[1, R]`` and ``[C, 1]`` (a ``[C, R]`` tile: keys along the first axis)."""
    r2 = rows[None, :] if TRANSPOSED else rows[:, None]
    c2 = cols[:, None] if TRANSPOSED else cols[None, :]
    return r2, c2


@triton.jit
def score_tile(qk, meta_ptr, b, h, rows, cols, r0, c0, scale,
               pse_ptr, pse_sb, pse_sh, pse_sr, pse_cols,
               mask_ptr, mask_sb, mask_sh, mask_sr,
               PSE: tl.constexpr, PSE_BEFORE_SCALE: tl.constexpr, HAS_EXPLICIT: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """``scale*QK^T + pse`` (pse_type 1: ``scale*(QK^T + pse)``) in fp32 with masked entries at -inf.

    ``qk`` is the fp32 ``[BLOCK_M, BLOCK_N]`` product of query rows ``rows`` and key columns ``cols`` of batch
    ``b``, query head ``h`` (with ``TRANSPOSED`` the ``[BLOCK_N, BLOCK_M]`` product ``K Q^T``). The band test is
    skipped on tiles the band keeps entirely. ``HAS_EXPLICIT`` is False, True (the mask tensor at ``mask_ptr``) or
    ``MASK_STRIDED_CAUSAL`` (the rule's stride and shift in ``mask_sr`` and ``mask_sh``).
    """
    s = qk
    r2, c2 = index_grid(rows, cols, TRANSPOSED)
    if PSE == PSE_FULL or PSE == PSE_ROW or PSE == PSE_ALIBI:
        pse_b = pse_ptr + b.to(tl.int64) * pse_sb + tl.cast(h, tl.int64) * pse_sh
        if PSE == PSE_FULL:
            off = r2.to(tl.int64) * pse_sr + c2
        elif PSE == PSE_ROW:
            off = r2.to(tl.int64) * 0 + c2
        else:  # ALiBi-compressed: the last of the 1024 rows, read along the diagonal distance
            diag = r2 - c2
            off = 1023 * pse_sr + tl.minimum(tl.maximum(pse_cols - 1 - diag, 0), pse_cols - 1).to(tl.int64)
        ok = (r2 < meta(meta_ptr, b, Q_LEN)) & (c2 < meta(meta_ptr, b, KV_LEN))
        pse = tl.load(pse_b + off, mask=ok, other=0.0).to(tl.float32)
        if PSE_BEFORE_SCALE:
            s = (s + pse) * scale
        else:
            s = s * scale + pse
    elif PSE == PSE_SLOPES or PSE == PSE_SLOPES_SQRT:
        slope = tl.load(pse_ptr + b.to(tl.int64) * pse_sb + tl.cast(h, tl.int64) * pse_sh)
        qi = r2.to(tl.int64) + meta(meta_ptr, b, PSE_QS)
        kj = c2.to(tl.int64) + meta(meta_ptr, b, PSE_KS)
        dist = tl.abs(kj - qi).to(tl.float32)
        if PSE == PSE_SLOPES_SQRT:
            dist = tl.sqrt(dist)
        s = s * scale - slope * dist
    else:
        s = s * scale
    if tile_needs_mask(meta_ptr, b, r0, c0, BLOCK_M, BLOCK_N):
        diff = c2.to(tl.int64) - r2
        keep = (diff >= meta(meta_ptr, b, LO)) & (diff <= meta(meta_ptr, b, HI))
        keep = keep | (c2 < meta(meta_ptr, b, PREFIX))
        keep = keep & (r2 < meta(meta_ptr, b, Q_LEN)) & (c2 < meta(meta_ptr, b, KV_LEN))
        s = tl.where(keep, s, float("-inf"))
    if HAS_EXPLICIT == MASK_STRIDED_CAUSAL:  # masks.StridedCausal: mask_sr = stride, mask_sh = shift
        s = tl.where(c2 * mask_sr + mask_sh > r2, float("-inf"), s)
    elif HAS_EXPLICIT:
        ok = (r2 < meta(meta_ptr, b, Q_LEN)) & (c2 < meta(meta_ptr, b, KV_LEN))
        m_off = b.to(tl.int64) * mask_sb + tl.cast(h, tl.int64) * mask_sh + r2.to(tl.int64) * mask_sr + c2
        masked = tl.load(mask_ptr + m_off, mask=ok, other=1)
        s = tl.where(masked != 0, float("-inf"), s)
    return s


@triton.jit
def dropout_scale(meta_ptr, b, h, rows, cols, keep_prob, seed, offset, drop_ptr, PACKED: tl.constexpr,
                  TRANSPOSED: tl.constexpr = False):
    """``keep / keep_prob`` as an fp32 ``[rows, cols]`` tile (``TRANSPOSED``: ``[cols, rows]``); element
    ``(h, i, j)`` of batch ``b`` has the index ``drop_off_b + (h * Sq_b + i) * Skv_b + j`` of
    ``attnops._core.dropout`` (Philox ``tl.rand`` or packed bits). With ``PACKED``, ``offset`` is the packed mask's
    size in bytes: no byte past it is read (dropped)."""
    sq = meta(meta_ptr, b, Q_LEN)
    skv = meta(meta_ptr, b, KV_LEN)
    r2, c2 = index_grid(rows, cols, TRANSPOSED)
    idx = meta(meta_ptr, b, DROP_OFF) + (tl.cast(h, tl.int64) * sq + r2) * skv + c2
    if PACKED:
        ok = (r2 < sq) & (c2 < skv) & ((idx >> 3) < offset)
        byte = tl.load(drop_ptr + (idx >> 3), mask=ok, other=0).to(tl.int32)
        keep = ((byte >> (idx & 7).to(tl.int32)) & 1) != 0
    else:
        keep = tl.rand(seed, idx + offset) < keep_prob
    return tl.where(keep, 1.0 / keep_prob, 0.0)


@triton.jit
def stat_offsets(meta_ptr, b, h, rows, stat_row):
    """Element offsets of the first lane of rows ``rows`` of query head ``h`` in the softmax statistics."""
    return meta(meta_ptr, b, STAT_BASE) + h * meta(meta_ptr, b, STAT_HEAD) + rows.to(tl.int64) * stat_row


@triton.jit
def row_stats(smax_ptr, ssum_ptr, meta_ptr, b, h, rows, stat_row):
    """The given ``(softmax_max, log2(softmax_sum))`` of rows ``rows`` (rows past the batch: 0, 0)."""
    off = stat_offsets(meta_ptr, b, h, rows, stat_row)
    ok = rows < meta(meta_ptr, b, Q_LEN)
    m = tl.load(smax_ptr + off, mask=ok, other=0.0)
    l = tl.load(ssum_ptr + off, mask=ok, other=1.0)
    return m, tl.log2(l)


@triton.jit
def delta_offsets(meta_ptr, b, h, rows, delta_sb, n1):
    """Offsets of ``D = rowsum(dO * O)`` in the fp32 ``[rows, N1]`` buffer of the backward."""
    return (b.to(tl.int64) * delta_sb + meta(meta_ptr, b, Q_START) + rows) * n1 + h
