"""Sparse flash attention's backward kernels (``launch.py`` plans them): dQ per query row, then dK/dV of the shared
latent rows from inverted index lists (:mod:`attnops.ops.common.inverted_lists`), deterministic (no atomics).

``sparse_attention_dq_kernel`` (grid: as the forward's, one head tile per program, every latent column): recomputes
``P = exp(scale * (q k^T + q_rope k_rope^T) - max) / sum`` from the forward's statistics over the row's selected
positions (the forward's entry rule: the first ``min(count, ceil(limit / sbs))`` entries up to the first -1, positions
below the causal limit, block ids inside the cache), ``D = rowsum(dO * O)`` and
``dS = P * (dO V^T - D) * scale``; it stores ``dQ = dS K``, ``dQ_rope = dS K_rope`` and ``D``. The head tile 0
program also writes the row's inverted-list keys: per slot the list of its block, the flat key row of the block's
first position (``outer * inner_rows + inner``; blocks are aligned, so blocks of different batches never share
rows), ``n_lists`` for a slot that selects nothing, and ``span``, the positions of the block below the limit.

``sparse_attention_dkdv_kernel`` (grid: list chunk x ``BLOCK_N`` rows of a block): walks its chunk's pairs (row,
slot) in list order, ``BLOCK_M`` (pair, query head) rows per step, and accumulates ``dK^T += Q^T dS`` (with the
rope part) and ``dV^T += dO^T P`` (into dK when the value is the key's latent, MLA), the products'
M being the head dims (wgmma tiles). A list of one chunk stores the rows its pairs reach (the widest span); the
chunks of a longer list store fp32 partials that ``sparse_attention_dkdv_reduce_kernel`` adds in chunk order. Rows
no pair reaches keep the zeros they were allocated with.
"""
import triton
import triton.language as tl

from ...._core.triton.helpers import LOG2E, upcast
from ...common.triton.inverted_lists import list_chunk
from ...common.triton.token_rows import head_rows, key_limit, key_rows, kv_range, load_rows, query_row
from .sparse_attention import entry_count

TINY: tl.constexpr = tl.constexpr(1.1754943508222875e-38)  # the reference's clamp of an empty row's sum
SLOT_TILE: tl.constexpr = tl.constexpr(64)


@triton.jit
def _probabilities(s, ok, m, l, scale):
    """``exp(scale * s - m) / l`` where ``ok`` (0 elsewhere); ``m``/``l`` broadcast along the key axis (axis 1)."""
    p = tl.exp2((s * scale - m[:, None]) * LOG2E) / tl.maximum(l, TINY)[:, None]
    return tl.where(ok, p, 0.0)


@triton.jit
def _write_list_keys(idx_row, key_row, span_row, bt_ptr, b, limit, n_entries, kv_start, bt_sb, page, n_pages, count,
                     sbs, inner_rows, n_lists, KV_MODE: tl.constexpr):
    """Every slot's list key and span (see the module docstring)."""
    for s0 in range(0, count, SLOT_TILE):
        s = s0 + tl.arange(0, SLOT_TILE)
        entry = tl.load(idx_row + s, mask=s < count, other=-1).to(tl.int64)
        pos0 = entry * sbs
        ok = (s < n_entries) & (entry >= 0) & (pos0 < limit)
        outer, inner, ok = key_rows(bt_ptr, b, pos0, ok, kv_start, bt_sb, page, n_pages, KV_MODE)
        span = tl.minimum(tl.maximum(limit - pos0, 0), sbs)
        tl.store(key_row + s, tl.where(ok, outer * inner_rows + inner, n_lists), mask=s < count)
        tl.store(span_row + s, tl.where(ok, span, 0).to(tl.int32), mask=s < count)


@triton.jit
def sparse_attention_dq_kernel(q_ptr, qr_ptr, k_ptr, kr_ptr, v_ptr, idx_ptr, o_ptr, do_ptr, smax_ptr, ssum_ptr,
                               dq_ptr, dqr_ptr, delta_ptr, key_ptr, span_ptr, q_lens_ptr, kv_lens_ptr, bt_ptr,
                               q_sb, q_st, q_sh, qr_sb, qr_st, qr_sh, o_sb, o_st, o_sh, do_sb, do_st, do_sh,
                               dq_sb, dq_st, dq_sh, dqr_sb, dqr_st, dqr_sh, k_s0, k_s1, kr_s0, kr_s1, v_s0, v_s1,
                               i_sb, i_st, q_lens_stride, kv_lens_stride, bt_sb,
                               s1, s2, n_batch, heads, head_d, rope_d, head_dv, dq_tiles, page, n_pages, count,
                               sbs, inner_rows, n_lists, scale,
                               Q_PACKED: tl.constexpr, Q_LENS: tl.constexpr, KV_MODE: tl.constexpr,
                               KV_LENS: tl.constexpr, CAUSAL: tl.constexpr, HAS_ROPE: tl.constexpr,
                               BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                               BLOCK_DQ: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                               BLOCK_N: tl.constexpr):
    """dQ columns ``dq0 .. dq0 + BLOCK_DQ`` (and, in the column tile 0 programs, dQ_rope and ``D``) of one query
    row's head tile (``program_id(2)``: head tile x ``dq_tiles`` column tiles); see the module docstring."""
    b, token, row, q_len, valid = query_row(q_lens_ptr, q_lens_stride, s1, n_batch, Q_PACKED, Q_LENS)
    kv_start, kv_len = kv_range(kv_lens_ptr, kv_lens_stride, b, s2, KV_MODE, KV_LENS)
    limit = key_limit(kv_len, q_len, row, valid, CAUSAL)
    head0 = (tl.program_id(2) // dq_tiles) * BLOCK_H
    dq0 = (tl.program_id(2) % dq_tiles) * BLOCK_DQ
    dtype = q_ptr.dtype.element_ty
    r = token
    if not Q_PACKED:
        r += b.to(tl.int64) * s1
    h = head0 + tl.arange(0, BLOCK_H)
    stat = r * heads + h
    h_ok = h < heads
    m = tl.load(smax_ptr + stat, mask=h_ok, other=0.0)
    l = tl.load(ssum_ptr + stat, mask=h_ok, other=1.0)
    hh = h.to(tl.int64)
    q_off = b.to(tl.int64) * q_sb + token * q_st + hh * q_sh
    do_off = b.to(tl.int64) * do_sb + token * do_st + hh * do_sh
    delta = tl.zeros([BLOCK_H], tl.float32)
    for c0 in range(0, head_dv, BLOCK_C):
        delta += tl.sum(_rows_at(do_ptr + c0, do_off, h_ok, head_dv - c0, BLOCK_C).to(tl.float32)
                        * _rows_at(o_ptr + c0, b.to(tl.int64) * o_sb + token * o_st + hh * o_sh, h_ok, head_dv - c0,
                                   BLOCK_C).to(tl.float32), 1)
    if dq0 == 0:
        tl.store(delta_ptr + stat, delta, mask=h_ok)
    if HAS_ROPE:
        q_rope = upcast(head_rows(qr_ptr, b, token, head0, heads, qr_sb, qr_st, qr_sh, rope_d, BLOCK_H, BLOCK_R),
                        UPCAST)
        dq_rope = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    idx_row = idx_ptr + b.to(tl.int64) * i_sb + token * i_st
    n_entries = entry_count(idx_row, count, limit, sbs)
    n_pos = n_entries * sbs
    dq = tl.zeros([BLOCK_H, BLOCK_DQ], tl.float32)
    for f0 in range(0, n_pos, BLOCK_N):
        f = f0 + tl.arange(0, BLOCK_N)
        entry = tl.load(idx_row + f // sbs, mask=f < n_pos, other=-1).to(tl.int64)
        pos = entry * sbs + f % sbs
        ok = (f < n_pos) & (entry >= 0) & (pos < limit)
        outer, inner, ok = key_rows(bt_ptr, b, pos, ok, kv_start, bt_sb, page, n_pages, KV_MODE)
        s = _chunked_product(q_ptr, q_off, h_ok, k_ptr, outer, inner, ok, k_s0, k_s1, head_d,
                             tl.zeros([BLOCK_H, BLOCK_N], tl.float32), UPCAST, PRECISION, BLOCK_C)
        if HAS_ROPE:
            k_rope = upcast(load_rows(kr_ptr, outer, inner, ok, kr_s0, kr_s1, rope_d, BLOCK_R), UPCAST)
            s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision=PRECISION)
        p = _probabilities(s, ok[None, :], m, l, scale)
        dp = _chunked_product(do_ptr, do_off, h_ok, v_ptr, outer, inner, ok, v_s0, v_s1, head_dv,
                              tl.zeros([BLOCK_H, BLOCK_N], tl.float32), UPCAST, PRECISION, BLOCK_C)
        k = upcast(load_rows(k_ptr + dq0, outer, inner, ok, k_s0, k_s1, head_d - dq0, BLOCK_DQ), UPCAST)
        ds = (p * (dp - delta[:, None]) * scale).to(k.dtype)
        dq = tl.dot(ds, k, dq, input_precision=PRECISION)
        if HAS_ROPE:
            dq_rope = tl.dot(ds, k_rope, dq_rope, input_precision=PRECISION)
    d = dq0 + tl.arange(0, BLOCK_DQ)
    base = b.to(tl.int64) * dq_sb + token * dq_st + h[:, None].to(tl.int64) * dq_sh
    tl.store(dq_ptr + base + d[None, :], dq.to(dtype), mask=(h[:, None] < heads) & (d[None, :] < head_d))
    if HAS_ROPE:
        if dq0 == 0:
            e = tl.arange(0, BLOCK_R)
            base = b.to(tl.int64) * dqr_sb + token * dqr_st + h[:, None].to(tl.int64) * dqr_sh
            tl.store(dqr_ptr + base + e[None, :], dq_rope.to(dtype), mask=h_ok[:, None] & (e[None, :] < rope_d))
    if tl.program_id(2) == 0:  # head tile 0, column tile 0
        _write_list_keys(idx_row, key_ptr + r * count, span_ptr + r * count, bt_ptr, b, limit, n_entries, kv_start,
                         bt_sb, page, n_pages, count, sbs, inner_rows, n_lists, KV_MODE)


@triton.jit
def _pair_offsets(pair, head, count, s1, s_b, s_t, s_h, Q_PACKED: tl.constexpr):
    """Element offsets of the (pair's query row, ``head``) rows of a query-shaped tensor."""
    r = pair // count
    if Q_PACKED:
        return r * s_t + head * s_h
    return (r // s1) * s_b + (r % s1) * s_t + head * s_h


@triton.jit
def _rows_at(ptr, off, ok, width, BLOCK_W: tl.constexpr):
    """``[BLOCK_M, BLOCK_W]``: the first ``width`` columns of the rows at element offsets ``off`` (rows not ``ok``:
    0)."""
    w = tl.arange(0, BLOCK_W)
    return tl.load(ptr + off[:, None] + w[None, :], mask=ok[:, None] & (w[None, :] < width), other=0.0)


@triton.jit
def _store_key_rows(ptr, tile_t, f, keep, s0, s1, inner_rows, col0, width, BLOCK_W: tl.constexpr):
    """Stores the transposed tile ``tile_t [BLOCK_W, BLOCK_N]`` as columns ``col0 ..`` of flat key rows ``f`` (rows
    ``keep``) of a key-shaped tensor with strides ``(s0, s1, .., 1)``."""
    w = tl.arange(0, BLOCK_W)
    off = (f // inner_rows) * s0 + (f % inner_rows) * s1 + col0
    tl.store(ptr + off[None, :] + w[:, None], tile_t.to(ptr.dtype.element_ty),
             mask=keep[None, :] & (w[:, None] < width))


@triton.jit
def _store_part(ptr, tile_t, rows, keep, width, col0, row_width, BLOCK_W: tl.constexpr):
    """Stores the transposed fp32 tile ``tile_t`` as columns ``col0 ..`` of rows ``rows`` of a partial buffer."""
    w = tl.arange(0, BLOCK_W)
    tl.store(ptr + rows[None, :] * row_width + col0 + w[:, None], tile_t, mask=keep[None, :] & (w[:, None] < width))


@triton.jit
def _chunked_product(a_ptr, a_off, a_ok, b_ptr, outer, inner, b_ok, b_s0, b_s1, width, acc, UPCAST: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_C: tl.constexpr):
    """``acc + A B^T`` over ``width`` columns, ``BLOCK_C`` at a time (no whole-latent tile is held): A the rows at
    element offsets ``a_off`` of a query-shaped tensor, B the key-side rows at ``(outer, inner)``."""
    for c0 in range(0, width, BLOCK_C):
        a = upcast(_rows_at(a_ptr + c0, a_off, a_ok, width - c0, BLOCK_C), UPCAST)
        b = upcast(load_rows(b_ptr + c0, outer, inner, b_ok, b_s0, b_s1, width - c0, BLOCK_C), UPCAST)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    return acc


@triton.jit
def sparse_attention_dkdv_kernel(q_ptr, qr_ptr, do_ptr, k_ptr, kr_ptr, v_ptr, dk_ptr, dkr_ptr, dv_ptr, part_k_ptr,
                                 part_v_ptr, delta_ptr, smax_ptr, ssum_ptr, span_ptr, list_start_ptr, pair_ptr,
                                 unit_list_ptr, unit_end_ptr, slot_end_ptr,
                                 q_sb, q_st, q_sh, qr_sb, qr_st, qr_sh, do_sb, do_st, do_sh, k_s0, k_s1, kr_s0,
                                 kr_s1, v_s0, v_s1, dk_s0, dk_s1, dkr_s0, dkr_s1, dv_s0, dv_s1, s1, heads, head_d,
                                 rope_d, head_dv, col_tiles, count, sbs, inner_rows, n_lists, chunk, scale,
                                 Q_PACKED: tl.constexpr, HAS_ROPE: tl.constexpr, V_IS_K: tl.constexpr,
                                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_DK: tl.constexpr,
                                 UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_M: tl.constexpr):
    """dK columns ``d0 .. d0 + BLOCK_DK`` (the rope part in column tile 0) and dV's same columns of rows ``n0 ..`` of
    list ``unit_list[u]``'s block over its chunk's pairs (``program_id(0)``: unit x row tile x column tile). The
    scores and ``dO V^T`` are summed over ``BLOCK_C`` columns at a time (no whole-latent tile is held); partial rows
    are ``head_d + rope_d`` (key) and ``head_dv`` (value) wide."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(sbs, BLOCK_N)
    u = pid // (n_tiles * col_tiles)
    lst = tl.load(unit_list_ptr + u)
    if lst >= n_lists:
        return
    lo, hi, chunks, c = list_chunk(list_start_ptr, unit_end_ptr, lst, u, chunk)
    if hi <= lo:
        return
    n0 = (pid // col_tiles % n_tiles) * BLOCK_N
    d0 = pid % col_tiles * BLOCK_DK
    n = n0 + tl.arange(0, BLOCK_N)
    f = lst + n
    in_block = (n < sbs) & (f < n_lists)
    outer, inner = f // inner_rows, f % inner_rows
    if HAS_ROPE:
        dkr_t = tl.zeros([BLOCK_R, BLOCK_N], tl.float32)
    if not V_IS_K:
        dv_t = tl.zeros([BLOCK_DK, BLOCK_N], tl.float32)
    dk_t = tl.zeros([BLOCK_DK, BLOCK_N], tl.float32)
    reach = tl.zeros([], tl.int32)
    n_rows = ((hi - lo) * heads).to(tl.int32)
    for m0 in range(0, n_rows, BLOCK_M):
        rr = m0 + tl.arange(0, BLOCK_M)
        ok = rr < n_rows
        pair = tl.load(pair_ptr + lo + rr // heads, mask=ok, other=0).to(tl.int64)
        head = (rr % heads).to(tl.int64)
        span = tl.load(span_ptr + pair, mask=ok, other=0)
        reach = tl.maximum(reach, tl.max(span, 0))
        stat = (pair // count) * heads + head
        m = tl.load(smax_ptr + stat, mask=ok, other=0.0)
        l = tl.load(ssum_ptr + stat, mask=ok, other=1.0)
        delta = tl.load(delta_ptr + stat, mask=ok, other=0.0)
        q_off = _pair_offsets(pair, head, count, s1, q_sb, q_st, q_sh, Q_PACKED)
        do_off = _pair_offsets(pair, head, count, s1, do_sb, do_st, do_sh, Q_PACKED)
        s = _chunked_product(q_ptr, q_off, ok, k_ptr, outer, inner, in_block, k_s0, k_s1, head_d,
                             tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST, PRECISION, BLOCK_C)
        if HAS_ROPE:
            q_rope = upcast(_rows_at(qr_ptr, _pair_offsets(pair, head, count, s1, qr_sb, qr_st, qr_sh, Q_PACKED), ok,
                                     rope_d, BLOCK_R), UPCAST)
            k_rope = upcast(load_rows(kr_ptr, outer, inner, in_block, kr_s0, kr_s1, rope_d, BLOCK_R), UPCAST)
            s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision=PRECISION)
        p = _probabilities(s, ok[:, None] & (n[None, :] < span[:, None]), m, l, scale)
        dp = _chunked_product(do_ptr, do_off, ok, v_ptr, outer, inner, in_block, v_s0, v_s1, head_dv,
                              tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST, PRECISION, BLOCK_C)
        q = upcast(_rows_at(q_ptr + d0, q_off, ok, head_d - d0, BLOCK_DK), UPCAST)
        ds = (p * (dp - delta[:, None]) * scale).to(q.dtype)
        dk_t = tl.dot(tl.trans(q), ds, dk_t, input_precision=PRECISION)
        if HAS_ROPE:
            if d0 == 0:
                dkr_t = tl.dot(tl.trans(q_rope), ds, dkr_t, input_precision=PRECISION)
        do = upcast(_rows_at(do_ptr + d0, do_off, ok, head_dv - d0, BLOCK_DK), UPCAST)
        if V_IS_K:
            dk_t = tl.dot(tl.trans(do), p.to(do.dtype), dk_t, input_precision=PRECISION)
        else:
            dv_t = tl.dot(tl.trans(do), p.to(do.dtype), dv_t, input_precision=PRECISION)
    if chunks == 1:
        keep = n < reach
        _store_key_rows(dk_ptr, dk_t, f, keep, dk_s0, dk_s1, inner_rows, d0, head_d - d0, BLOCK_DK)
        if HAS_ROPE:
            if d0 == 0:
                _store_key_rows(dkr_ptr, dkr_t, f, keep, dkr_s0, dkr_s1, inner_rows, 0, rope_d, BLOCK_R)
        if not V_IS_K:
            _store_key_rows(dv_ptr, dv_t, f, keep, dv_s0, dv_s1, inner_rows, d0, head_dv - d0, BLOCK_DK)
    else:
        rows = (tl.load(slot_end_ptr + lst) - chunks + c) * sbs + n
        _store_part(part_k_ptr, dk_t, rows, in_block, head_d - d0, d0, head_d + rope_d, BLOCK_DK)
        if HAS_ROPE:
            if d0 == 0:
                _store_part(part_k_ptr, dkr_t, rows, in_block, rope_d, head_d, head_d + rope_d, BLOCK_R)
        if not V_IS_K:
            _store_part(part_v_ptr, dv_t, rows, in_block, head_dv - d0, d0, head_dv, BLOCK_DK)


@triton.jit
def _part_sum(part_ptr, slot0, chunks, n, keep, sbs, col0, width, row_width, BLOCK_W: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """``[BLOCK_N, BLOCK_W]``: the chunks' partials of rows ``n`` (columns ``col0 ..``) added in chunk order."""
    w = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.float32)
    for c in range(chunks):
        rows = ((slot0 + c) * sbs + n).to(tl.int64)
        acc += tl.load(part_ptr + rows[:, None] * row_width + col0 + w[None, :],
                       mask=keep[:, None] & (w[None, :] < width), other=0.0)
    return acc


@triton.jit
def sparse_attention_dkdv_reduce_kernel(dk_ptr, dkr_ptr, dv_ptr, part_k_ptr, part_v_ptr, span_ptr, list_start_ptr,
                                        pair_ptr, slot_end_ptr, dk_s0, dk_s1, dkr_s0, dkr_s1, dv_s0, dv_s1, head_d,
                                        rope_d,
                                        head_dv, sbs, inner_rows, chunk,
                                        HAS_ROPE: tl.constexpr, V_IS_K: tl.constexpr, BLOCK_D: tl.constexpr,
                                        BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK/dV of rows ``n0 ..`` of a list cut into several chunks (grid: list x row tile): its partials added in
    chunk order (bit-identical runs), stored for the rows its pairs reach; lists of one chunk were stored by
    ``sparse_attention_dkdv_kernel``."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(sbs, BLOCK_N)
    lst = pid // n_tiles
    start = tl.load(list_start_ptr + lst)
    end = tl.load(list_start_ptr + lst + 1)
    chunks = tl.cdiv(end - start, chunk)
    if chunks <= 1:
        return
    reach = tl.zeros([], tl.int32)
    for e0 in range(start, end, SLOT_TILE):
        e = e0 + tl.arange(0, SLOT_TILE)
        pair = tl.load(pair_ptr + e, mask=e < end, other=0)
        reach = tl.maximum(reach, tl.max(tl.load(span_ptr + pair, mask=e < end, other=0), 0))
    n = (pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = n < reach
    slot0 = tl.load(slot_end_ptr + lst) - chunks
    f = lst + n
    dk = _part_sum(part_k_ptr, slot0, chunks, n, keep, sbs, 0, head_d, head_d + rope_d, BLOCK_D, BLOCK_N)
    _store_key_rows(dk_ptr, tl.trans(dk), f, keep, dk_s0, dk_s1, inner_rows, 0, head_d, BLOCK_D)
    if HAS_ROPE:
        dkr = _part_sum(part_k_ptr, slot0, chunks, n, keep, sbs, head_d, rope_d, head_d + rope_d, BLOCK_R, BLOCK_N)
        _store_key_rows(dkr_ptr, tl.trans(dkr), f, keep, dkr_s0, dkr_s1, inner_rows, 0, rope_d, BLOCK_R)
    if not V_IS_K:
        dv = _part_sum(part_v_ptr, slot0, chunks, n, keep, sbs, 0, head_dv, head_dv, BLOCK_DV, BLOCK_N)
        _store_key_rows(dv_ptr, tl.trans(dv), f, keep, dv_s0, dv_s1, inner_rows, 0, head_dv, BLOCK_DV)
