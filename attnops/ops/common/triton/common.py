"""``@triton.jit`` helpers shared by the forward and backward kernels: per-batch metadata, the score tile
(``scale*QK^T`` + pse, masked entries at -inf) and the dropout keep tile. No allocation here.

Per-batch metadata is one int64 row per batch (columns ``META_*``, filled by ``launch.py`` from host lengths or by
``prepare.py`` on the device), so kernels take one pointer instead of a dozen per-batch tensors. Grid axes 1 and 2
fold batch x heads (:func:`program_batch_head`), so any number of them fits CUDA's 65535 programs per axis.
"""
import triton
import triton.language as tl

from ...._core.triton.helpers import tanh

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
PSE_ALIBI_COPIES: tl.constexpr = tl.constexpr(6)  # the ALiBi-compressed pse's row 1023 as 8 shifted copies (the forward)

# explicit-mask kinds (constexpr HAS_EXPLICIT; False/True: none / a mask tensor)
MASK_STRIDED_CAUSAL: tl.constexpr = tl.constexpr(2)  # masked(i, j) = j * stride + shift > i, computed (no tensor)



@triton.jit
def softcap_tanh(qk, scale, softcap):
    """``tanh(scale * QK^T / softcap)`` of a raw ``QK^T`` tile: the capped scores are ``softcap`` times it, entered
    into the score path as ``qk = tanh * softcap / scale`` so that it scales them as it does uncapped ones; the
    backward's derivative of the cap is ``1 - tanh^2``."""
    return tanh(qk * (scale / softcap))


@triton.jit
def nan_aware_max(m, l):
    """The row max ``m`` of an online softmax, NaN where a NaN score made the row sum ``l`` NaN: ``tl.max`` and
    ``tl.maximum`` skip NaN, and exp of a NaN score puts it into ``l`` (a NaN ``l`` under a max of +inf comes from
    the +inf score itself, and keeps it)."""
    return tl.where((l != l) & (m != float("inf")), float("nan"), m)


@triton.jit
def meta(meta_ptr, b, col):
    return tl.load(meta_ptr + b * META_COLS + col)


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
def full_cols(meta_ptr, b, r0, c_begin, c_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[a, e)``, multiples of ``BLOCK_N`` with ``c_begin <= a <= e <= c_end`` (``c_begin`` a multiple of
    ``BLOCK_N``; ``a = e = c_begin`` when ``c_end < c_begin``): key tiles that every query row
    ``r0 .. r0 + BLOCK_M - 1`` keeps entirely (band or prefix, columns in bounds), so
    their scores need no mask. Rows past the sequence are not checked: their results are never stored."""
    skv = meta(meta_ptr, b, KV_LEN)
    pfx = tl.minimum(meta(meta_ptr, b, PREFIX), skv)
    a = tl.cdiv(tl.maximum(r0 + BLOCK_M - 1 + meta(meta_ptr, b, LO), 0), BLOCK_N) * BLOCK_N
    e = tl.maximum(tl.minimum(r0 + meta(meta_ptr, b, HI) + 1, skv), 0) // BLOCK_N * BLOCK_N
    pe = pfx // BLOCK_N * BLOCK_N
    if pe > 0:  # prefix columns [0, pfx) are kept by every row: join them when they touch the band's
        if e <= a:
            a = a * 0
            e = pe
        elif a <= pe:
            a = a * 0
            e = tl.maximum(e, pe)
    c_floor = c_end // BLOCK_N * BLOCK_N
    a = tl.multiple_of(tl.maximum(tl.minimum(a, c_floor), c_begin), BLOCK_N)
    e = tl.multiple_of(tl.maximum(tl.minimum(e, c_floor), a), BLOCK_N)
    return a, e


@triton.jit
def index_grid(rows, cols, TRANSPOSED: tl.constexpr):
    """``rows`` and ``cols`` as broadcastable 2-D index tiles: ``[R, 1]`` and ``[1, C]``, or with ``TRANSPOSED``
    ``[1, R]`` and ``[C, 1]`` (a ``[C, R]`` tile: keys along the first axis)."""
    r2 = rows[None, :] if TRANSPOSED else rows[:, None]
    c2 = cols[:, None] if TRANSPOSED else cols[None, :]
    return r2, c2


@triton.jit
def band_keep(meta_ptr, b, rows, cols, TRANSPOSED: tl.constexpr = False):
    """The ``[rows, cols]`` entries (``TRANSPOSED``: ``[cols, rows]``) kept by the band and the prefix, within the
    batch's bounds."""
    r2, c2 = index_grid(rows, cols, TRANSPOSED)
    diff = c2.to(tl.int64) - r2
    keep = (diff >= meta(meta_ptr, b, LO)) & (diff <= meta(meta_ptr, b, HI))
    keep = keep | (c2 < meta(meta_ptr, b, PREFIX))
    return keep & (r2 < meta(meta_ptr, b, Q_LEN)) & (c2 < meta(meta_ptr, b, KV_LEN))


@triton.jit
def pse_scores(qk, meta_ptr, b, h, rows, cols, row_ok, col_ok, scale, pse_ptr, pse_sb, pse_sh, pse_sr, pse_cols,
               PSE: tl.constexpr, PSE_BEFORE_SCALE: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """``scale*QK^T + pse`` (pse_type 1: ``scale*(QK^T + pse)``) in fp32. A pse tensor is read where ``row_ok`` /
    ``col_ok`` (0 elsewhere): a full pse as a ``[rows, cols]`` tile, a row pse as one ``[cols]`` vector; both are
    contiguous along the columns, so they load as 16-byte vectors when the column bound and strides allow it. The
    ALiBi-compressed pse is read along diagonals: element loads from the tensor (``PSE_ALIBI``), or from the 8
    shifted copies of its row 1023 that make every row's read start 16-byte aligned (``PSE_ALIBI_COPIES``:
    ``launch_args.alibi_copies``; ``pse_sr`` is the stride between copies; not ``TRANSPOSED``). Slopes are generated.
    ``TRANSPOSED``: ``qk`` and the result are ``[cols, rows]``."""
    s = qk
    r2, c2 = index_grid(rows, cols, TRANSPOSED)
    rok, cok = index_grid(row_ok, col_ok, TRANSPOSED)
    if PSE == PSE_FULL or PSE == PSE_ROW or PSE == PSE_ALIBI or PSE == PSE_ALIBI_COPIES:
        pse_b = pse_ptr + b.to(tl.int64) * pse_sb + tl.cast(h, tl.int64) * pse_sh
        if PSE == PSE_FULL:
            pse = tl.load(pse_b + r2.to(tl.int64) * pse_sr + c2, mask=rok & cok, other=0.0).to(tl.float32)
        elif PSE == PSE_ROW:
            pse = tl.load(pse_b + c2, mask=cok, other=0.0).to(tl.float32)
        elif PSE == PSE_ALIBI_COPIES:
            tl.static_assert(not TRANSPOSED, "the ALiBi copies serve the forward's [rows, cols] tiles")  # row r reads columns x0 + j, x0 = W - 1 - r + c0, from copy (-x0) mod 8
            x0 = pse_cols - 1 - rows + tl.min(cols, 0)
            start = tl.multiple_of((x0 + 7) // 8 * 8, 8)
            off = (start - x0)[:, None].to(tl.int64) * pse_sr + start[:, None] + tl.arange(0, cols.shape[0])[None, :]
            pse = tl.load(pse_b + off, mask=(row_ok & (x0 >= 0))[:, None], other=0.0).to(tl.float32)
        else:  # ALiBi-compressed: the last of the 1024 rows, read along the diagonal distance
            diag = r2 - c2
            off = 1023 * pse_sr + tl.minimum(tl.maximum(pse_cols - 1 - diag, 0), pse_cols - 1).to(tl.int64)
            pse = tl.load(pse_b + off, mask=rok & cok, other=0.0).to(tl.float32)
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
    return s


@triton.jit
def explicit_masked(s, mask_ptr, mask_sb, mask_sh, mask_sr, b, h, rows, cols, row_ok, col_ok,
                    KIND: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """``s`` at -inf where the explicit mask is set. ``KIND`` True: a uint8 tensor (nonzero = masked; outside
    ``row_ok`` / ``col_ok`` masked too), its rows contiguous along the columns (16-byte vector loads when its strides
    allow); ``MASK_STRIDED_CAUSAL``: the rule ``j * stride + shift > i`` (``mask_sr`` = stride, ``mask_sh`` = shift),
    nothing read. ``TRANSPOSED``: ``s`` is ``[cols, rows]``."""
    r2, c2 = index_grid(rows, cols, TRANSPOSED)
    if KIND == MASK_STRIDED_CAUSAL:
        masked = c2 * mask_sr + mask_sh > r2
    else:
        rok, cok = index_grid(row_ok, col_ok, TRANSPOSED)
        off = b.to(tl.int64) * mask_sb + tl.cast(h, tl.int64) * mask_sh + r2.to(tl.int64) * mask_sr + c2
        masked = tl.load(mask_ptr + off, mask=rok & cok, other=1) != 0
    return tl.where(masked, float("-inf"), s)


@triton.jit
def score_tile(qk, meta_ptr, b, h, rows, cols, r0, c0, scale,
               pse_ptr, pse_sb, pse_sh, pse_sr, pse_cols,
               mask_ptr, mask_sb, mask_sh, mask_sr,
               PSE: tl.constexpr, PSE_BEFORE_SCALE: tl.constexpr, HAS_EXPLICIT: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """``scale*QK^T + pse`` (pse_type 1: ``scale*(QK^T + pse)``) in fp32 with masked entries at -inf.

    ``qk`` is the fp32 ``[BLOCK_M, BLOCK_N]`` product of query rows ``rows`` and key columns ``cols`` of batch
    ``b``, query head ``h`` (with ``TRANSPOSED`` the ``[BLOCK_N, BLOCK_M]`` product ``K Q^T``). The band test is
    skipped on tiles the band keeps entirely. ``HAS_EXPLICIT``: False, True (a mask tensor) or
    ``MASK_STRIDED_CAUSAL`` (:func:`explicit_masked`).
    """
    s, _ = kept_score_tile(qk, meta_ptr, b, h, rows, cols, r0, c0, scale, pse_ptr, pse_sb, pse_sh, pse_sr, pse_cols,
                           mask_ptr, mask_sb, mask_sh, mask_sr, PSE, PSE_BEFORE_SCALE, HAS_EXPLICIT, BLOCK_M,
                           BLOCK_N, TRANSPOSED)
    return s


@triton.jit
def kept_score_tile(qk, meta_ptr, b, h, rows, cols, r0, c0, scale,
                    pse_ptr, pse_sb, pse_sh, pse_sr, pse_cols,
                    mask_ptr, mask_sb, mask_sh, mask_sr,
                    PSE: tl.constexpr, PSE_BEFORE_SCALE: tl.constexpr, HAS_EXPLICIT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """:func:`score_tile`'s scores and where the masks keep them (the backward tells a masked entry from a kept
    score of -inf by it: on a row whose statistics are NaN, only the kept entries may be NaN)."""
    row_ok = rows < meta(meta_ptr, b, Q_LEN)
    col_ok = cols < meta(meta_ptr, b, KV_LEN)
    s = pse_scores(qk, meta_ptr, b, h, rows, cols, row_ok, col_ok, scale, pse_ptr, pse_sb, pse_sh, pse_sr, pse_cols,
                   PSE, PSE_BEFORE_SCALE, TRANSPOSED)
    keep = tl.full(qk.shape, 1, tl.int1)
    if tile_needs_mask(meta_ptr, b, r0, c0, BLOCK_M, BLOCK_N):
        keep = band_keep(meta_ptr, b, rows, cols, TRANSPOSED)
        s = tl.where(keep, s, float("-inf"))
    if HAS_EXPLICIT:
        explicit_keep = explicit_masked(tl.zeros_like(s), mask_ptr, mask_sb, mask_sh, mask_sr, b, h, rows, cols,
                                        row_ok, col_ok, HAS_EXPLICIT, TRANSPOSED) == 0.0
        keep = keep & explicit_keep
        s = tl.where(explicit_keep, s, float("-inf"))
    return s, keep


@triton.jit
def dropout_scale(meta_ptr, b, h, rows, cols, keep_prob, seed, offset, drop_ptr, PACKED: tl.constexpr,
                  TRANSPOSED: tl.constexpr = False):
    """``keep / keep_prob`` as an fp32 ``[rows, cols]`` tile (``TRANSPOSED``: ``[cols, rows]``); element ``(h, i, j)`` of batch ``b`` has the index
    ``drop_off_b + (h * Sq_b + i) * Skv_b + j`` of ``attnops._core.dropout`` (Philox ``tl.rand`` or packed bits).
    With ``PACKED``, ``drop_ptr`` is the packed mask as little-endian int32 words (zero-padded to whole words) and
    ``offset`` their number: each element reads the word that holds its bit (4-byte loads; the words of a row are
    shared by its neighbours, so they come from L1), no word past the end (dropped). Elements past the batch's rows
    or keys are not checked (their scores or gradients are masked)."""
    sq = meta(meta_ptr, b, Q_LEN)
    skv = meta(meta_ptr, b, KV_LEN)
    row_bit = meta(meta_ptr, b, DROP_OFF) + (tl.cast(h, tl.int64) * sq + rows) * skv  # [BLOCK_M]
    r2, c2 = index_grid(row_bit, cols, TRANSPOSED)
    if PACKED:
        bit = r2 + c2
        word = tl.load(drop_ptr + (bit >> 5), mask=(bit >> 5) < offset, other=0)
        keep = ((word >> (bit & 31).to(tl.int32)) & 1) != 0
    else:
        keep = tl.rand(seed, r2 + c2 + offset) < keep_prob
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
