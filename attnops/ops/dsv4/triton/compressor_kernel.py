"""The DeepSeek-V4 compressor's kernels (``compressor_launch.py`` plans them; no allocation here):

1. ``compressor_project_kernel``: ``rows[:, col0 + c] = x @ w.T`` in fp32, a tiled GEMM (launched for ``wkv`` into
   the columns ``[0, W)`` of a ``[T, 2W]`` fp32 scratch, ``W = coff * D``, and for ``wgate`` into ``[W, 2W)``).
2. ``compressor_pool_kernel``: one program per output row. It finds its batch and compressed block ``j`` (from the
   device lengths: ``start_pos``, ``seqused``, ``cu_seqlens``; packed output rows by a prefix sum of the emitted
   counts) and pools the window ``[(j - coff + 1) * r, (j + 1) * r)``: position ``P < start_pos`` from the state
   cache (``[kv | score]``, the score with ``ape`` added), ``P >= start_pos`` from the scratch (plus
   ``ape[P % r]``), positions before 0 left out; block ``i`` of the window contributes its columns
   ``[i * D, (i + 1) * D)``; an online softmax per column over ``BLOCK_R`` positions at a time. Then the optional
   RMSNorm (``norm_weight``) and RoPE of the last ``rope_d`` columns (the partner columns pooled the same way).
   Padding rows are written 0.
3. ``compressor_save_kernel``: one program per (new token, column tile): ``[kv | score + ape]`` to the token's state
   slot (cache mode 1: block ``table[b, P // bs]``, never block 0; mode 2: ring block ``table[b]``, only the tail
   from ``(start_pos + n) // r * r - (coff - 1) * r``). Launched after the pool, so the pool reads the old state.

Every length is clamped into the tensors and a block id outside the cache is neither read nor written.
"""
import triton
import triton.language as tl

from ...._core.triton.helpers import upcast
from ...common.triton.token_rows import query_row

SEARCH_TILE: tl.constexpr = tl.constexpr(64)
NO_LENGTHS: tl.constexpr = tl.constexpr(False)


@triton.jit
def compressor_project_kernel(x_ptr, w_ptr, rows_ptr, tokens, hidden, width, col0, x_st, w_s0, rows_st,
                              UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_T: tl.constexpr,
                              BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        kk = k0 + k
        x = tl.load(x_ptr + t[:, None] * x_st + kk[None, :], mask=(t[:, None] < tokens) & (kk[None, :] < hidden),
                    other=0.0)
        w = tl.load(w_ptr + c[None, :] * w_s0 + kk[:, None], mask=(c[None, :] < width) & (kk[:, None] < hidden),
                    other=0.0)
        acc = tl.dot(upcast(x, UPCAST), upcast(w, UPCAST), acc, input_precision=PRECISION)
    tl.store(rows_ptr + t[:, None] * rows_st + col0 + c[None, :], acc,
             mask=(t[:, None] < tokens) & (c[None, :] < width))


@triton.jit
def _batch_span(cu_ptr, used_ptr, pos_ptr, b, seg_len, total, PACKED: tl.constexpr, SEQUSED: tl.constexpr,
                START_POS: tl.constexpr):
    """``(first x row, new tokens n, start_pos)`` of batch ``b`` (vectorised over ``b``), clamped into ``x``."""
    if PACKED:
        lo = tl.minimum(tl.maximum(tl.load(cu_ptr + b).to(tl.int64), 0), total)
        hi = tl.minimum(tl.maximum(tl.load(cu_ptr + b + 1).to(tl.int64), lo), total)
        start, n = lo, hi - lo
    else:
        start, n = b.to(tl.int64) * seg_len, tl.zeros_like(b).to(tl.int64) + seg_len
    if SEQUSED:
        n = tl.minimum(n, tl.maximum(tl.load(used_ptr + b).to(tl.int64), 0))
    sp = tl.zeros_like(n)
    if START_POS:
        sp = tl.maximum(tl.load(pos_ptr + b).to(tl.int64), 0)
    return start, n, sp


@triton.jit
def _packed_out_row(o, cu_ptr, used_ptr, pos_ptr, n_batch, total, ratio, PACKED: tl.constexpr,
                    SEQUSED: tl.constexpr, START_POS: tl.constexpr):
    """``(b, k)``: packed output row ``o`` is the ``k``-th emitted row of batch ``b`` (``b = n_batch``: padding)."""
    b = tl.zeros([], tl.int64)
    first = tl.zeros([], tl.int64)
    carry = tl.zeros([], tl.int64)
    for j0 in range(0, n_batch, SEARCH_TILE):
        j = j0 + tl.arange(0, SEARCH_TILE)
        ok = j < n_batch
        jc = tl.where(ok, j, 0)
        _, n, sp = _batch_span(cu_ptr, used_ptr, pos_ptr, jc, 0, total, PACKED, SEQUSED, START_POS)
        emitted = tl.where(ok, (sp + n) // ratio - sp // ratio, 0)
        ends = carry + tl.cumsum(emitted, 0)
        before = ok & (ends <= o)
        b += tl.sum(before.to(tl.int64), 0)
        first += tl.sum(tl.where(before, emitted, 0), 0)
        carry += tl.sum(emitted, 0)
    return b, o - first


@triton.jit
def _state_block(bt_ptr, b, pos, ok, bt_sb, bt_len, block_size, n_blocks, RING: tl.constexpr):
    """``(block, ok)``: the state block of batch ``b``'s positions ``pos`` (``ok`` drops ids outside the cache)."""
    if RING:
        blk = tl.load(bt_ptr + b + tl.zeros_like(pos), mask=ok, other=-1).to(tl.int64)
    else:
        entry = pos // block_size
        ok = ok & (entry < bt_len)
        blk = tl.load(bt_ptr + b * bt_sb + entry, mask=ok, other=-1).to(tl.int64)
    return blk, ok & (blk >= 0) & (blk < n_blocks)


@triton.jit
def _pool(cols, dmask, b, base, lo, hi, sp, x_start, rows_ptr, ape_ptr, state_ptr, bt_ptr, rows_st, ape_s0, st_s0,
          st_s1, st_s2, bt_sb, bt_len, block_size, n_blocks, ratio, dim, width, HAS_STATE: tl.constexpr,
          RING: tl.constexpr, BLOCK_R: tl.constexpr):
    """The softmax(score)-weighted sum of kv per column over window positions ``[lo, hi)`` (window start ``base``)
    for the columns ``cols [BLOCK_D]`` of D (0 where no position counts); ``width = coff * D`` is the score half's
    offset in a row."""
    m = tl.full(cols.shape, float("-inf"), tl.float32)
    den = tl.zeros(cols.shape, tl.float32)
    acc = tl.zeros(cols.shape, tl.float32)
    for p0 in range(lo, hi, BLOCK_R):
        p = p0 + tl.arange(0, BLOCK_R)
        ok = p < hi
        col = ((p - base) // ratio * dim)[:, None] + cols[None, :]
        new = ok & (p >= sp)
        cell = new[:, None] & dmask[None, :]
        t = (x_start + p - sp)[:, None] * rows_st
        kv = tl.load(rows_ptr + t + col, mask=cell, other=0.0)
        score = (tl.load(rows_ptr + t + width + col, mask=cell, other=0.0)
                 + tl.load(ape_ptr + (p % ratio)[:, None] * ape_s0 + col, mask=cell, other=0.0).to(tl.float32))
        keep = cell
        if HAS_STATE:
            blk, old = _state_block(bt_ptr, b, p, ok & (p < sp), bt_sb, bt_len, block_size, n_blocks, RING)
            at = state_ptr + (blk * st_s0 + (p % block_size) * st_s1)[:, None] + col * st_s2
            stored = old[:, None] & dmask[None, :]
            kv = tl.where(stored, tl.load(at, mask=stored, other=0.0).to(tl.float32), kv)
            score = tl.where(stored, tl.load(at + width * st_s2, mask=stored, other=0.0).to(tl.float32), score)
            keep = keep | stored
        score = tl.where(keep, score, float("-inf"))
        m_new = tl.maximum(m, tl.max(score, 0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - shift)
        w = tl.exp(score - shift[None, :])
        den = den * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w * kv, 0)
        m = m_new
    return tl.where(den > 0, acc / tl.where(den > 0, den, 1.0), 0.0)


@triton.jit
def compressor_pool_kernel(rows_ptr, ape_ptr, state_ptr, bt_ptr, cu_ptr, used_ptr, pos_ptr, out_ptr, nw_ptr, sin_ptr,
                           cos_ptr, rows_st, ape_s0, st_s0, st_s1, st_s2, bt_sb, bt_len, o_sb, o_sr, rope_sb, rope_sr,
                           seg_len, total, n_batch, ratio, coff, dim, block_size, n_blocks, rope_d, eps,
                           PACKED: tl.constexpr, SEQUSED: tl.constexpr, START_POS: tl.constexpr,
                           HAS_STATE: tl.constexpr, RING: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
                           INTERLEAVED: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    o = tl.program_id(0).to(tl.int64)
    if PACKED:
        b, k = _packed_out_row(o, cu_ptr, used_ptr, pos_ptr, n_batch, total, ratio, PACKED, SEQUSED, START_POS)
        bc = tl.minimum(b, n_batch - 1)
    else:
        b = tl.program_id(1).to(tl.int64)
        k, bc = o, b
    out_at = b * o_sb + o * o_sr  # packed: o_sb = 0
    rope_at = b * rope_sb + o * rope_sr
    x_start, n, sp = _batch_span(cu_ptr, used_ptr, pos_ptr, bc, seg_len, total, PACKED, SEQUSED, START_POS)
    valid = (b < n_batch) & (k < (sp + n) // ratio - sp // ratio)
    j = sp // ratio + k
    base = (j - coff + 1) * ratio
    hi = tl.where(valid, (j + 1) * ratio, 0)
    lo = tl.minimum(tl.maximum(base, 0), hi)
    d = tl.arange(0, BLOCK_D)
    dmask = d < dim
    row = _pool(d, dmask, bc, base, lo, hi, sp, x_start, rows_ptr, ape_ptr, state_ptr, bt_ptr, rows_st, ape_s0, st_s0,
                st_s1, st_s2, bt_sb, bt_len, block_size, n_blocks, ratio, dim, coff * dim, HAS_STATE, RING,
                BLOCK_R)
    if NORM:
        inv = 1.0 / tl.sqrt(tl.sum(row * row, 0) / dim + eps)
        row = row * inv * tl.load(nw_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    if ROPE:
        i = d - (dim - rope_d)  # rope column index (< 0: a nope column)
        half = rope_d // 2
        if INTERLEAVED:
            mate, sign = i ^ 1, tl.where(i % 2 == 0, -1.0, 1.0)
        else:
            mate, sign = tl.where(i < half, i + half, i - half), tl.where(i < half, -1.0, 1.0)
        in_rope = dmask & (i >= 0)
        partner = tl.where(in_rope, dim - rope_d + mate, d)
        other = _pool(partner, dmask, bc, base, lo, hi, sp, x_start, rows_ptr, ape_ptr, state_ptr, bt_ptr, rows_st,
                      ape_s0, st_s0, st_s1, st_s2, bt_sb, bt_len, block_size, n_blocks, ratio, dim, coff * dim,
                      HAS_STATE, RING, BLOCK_R)
        if NORM:
            other = other * inv * tl.load(nw_ptr + partner, mask=dmask, other=0.0).to(tl.float32)
        at = rope_at + tl.where(in_rope, i, 0)
        in_row = tl.where(valid, in_rope, False)
        cos = tl.load(cos_ptr + at, mask=in_row, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + at, mask=in_row, other=0.0).to(tl.float32)
        row = tl.where(in_rope, row * cos + sign * other * sin, row)
    tl.store(out_ptr + out_at + d, tl.where(valid, row, 0.0).to(out_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def compressor_save_kernel(rows_ptr, ape_ptr, state_ptr, bt_ptr, cu_ptr, used_ptr, pos_ptr, rows_st, ape_s0, st_s0,
                           st_s1, st_s2, bt_sb, bt_len, seg_len, total, n_batch, ratio, coff, width, block_size,
                           n_blocks, PACKED: tl.constexpr, SEQUSED: tl.constexpr, START_POS: tl.constexpr,
                           RING: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = seg_len
    if PACKED:
        rows = total
    b, token, t, _, valid = query_row(cu_ptr + 1, 1, rows, n_batch, PACKED, NO_LENGTHS)
    b = b.to(tl.int64)
    x_start, n, sp = _batch_span(cu_ptr, used_ptr, pos_ptr, b, seg_len, total, PACKED, SEQUSED, START_POS)
    c = tl.program_id(2).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    p = sp + t + tl.zeros_like(c)  # the token's position, per column
    ok = tl.where(valid & (t < n), c < width, False)  # (a scalar & a vector is not a mask in the interpreter)
    if RING:
        ok = ok & (p >= (sp + n) // ratio * ratio - (coff - 1) * ratio)
    blk, cm = _state_block(bt_ptr, b, p, ok, bt_sb, bt_len, block_size, n_blocks, RING)
    if not RING:
        cm = cm & (blk != 0)  # entry 0: read-only
    src = rows_ptr + (x_start + t) * rows_st + c
    at = state_ptr + blk * st_s0 + (p % block_size) * st_s1 + c * st_s2
    kv = tl.load(src, mask=cm, other=0.0)
    score = tl.load(src + width, mask=cm, other=0.0) + tl.load(ape_ptr + (p % ratio) * ape_s0 + c, mask=cm,
                                                               other=0.0).to(tl.float32)
    tl.store(at, kv.to(state_ptr.dtype.element_ty), mask=cm)
    tl.store(at + width * st_s2, score.to(state_ptr.dtype.element_ty), mask=cm)
