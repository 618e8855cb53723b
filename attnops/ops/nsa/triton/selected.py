"""Selected-attention kernels: forward, ``D = rowsum(dO * O)``, dQ and dK/dV (``launch.py`` plans them).

One program of the forward and of dQ holds one query token and one KV head with its whole GQA group (``G`` query
heads, padded to ``BLOCK_G >= 16`` rows for ``tl.dot``); the forward and dQ walk the token's (slot, ``BLOCK_N`` keys)
steps in one loop, which Triton pipelines. One dK/dV program holds ``BLOCK_N`` keys of one block and one KV head and
walks a chunk of the (token, slot) pairs that selected the block, in the fixed order of the inverted lists,
``BLOCK_R`` (pair, query head) rows per step; the partials of a list cut into several chunks are added in chunk order
by a second kernel: every dK/dV element has one writer and a fixed summation order (deterministic, no atomics).

The forward, dQ and key grids are ``(row, batch x KV head)``, the pairs folded into axes 1 and 2 past CUDA's 65535
programs per axis (``FOLD``, as the FlashAttention kernels): a program finds its token from the per-batch table
(int64 ``[B, BATCH_COLS]``: first query token, query length, first KV token, KV blocks, the batch's first global
block), so no per-token metadata is built; the dK/dV grids are one axis of (list chunk, key tile), a chunk's block
found in the per-block table (``[NB, BLOCK_COLS]``). A selected index outside ``[0, KV blocks of the batch)``
selects nothing (the host validates indices of CPU tensors only; on the device such a slot is skipped, never read out
of bounds). Causal rule: local KV position ``p`` is kept iff ``p <= row``. Scores are ``scale * q k^T``; statistics
are in natural units.
"""
import triton
import triton.language as tl

from ...._core.triton.helpers import FLT_LOWEST, FLT_MAX, LOG2E, program_batch_head, upcast
from ...common.triton.common import nan_aware_max
from ...common.triton.inverted_lists import list_chunk
from .common import _group_tile, _softmax_init, _softmax_step, _store_group_tile

Q_START: tl.constexpr = tl.constexpr(0)
Q_LEN: tl.constexpr = tl.constexpr(1)
KV_START: tl.constexpr = tl.constexpr(2)
KV_BLOCKS: tl.constexpr = tl.constexpr(3)
BLOCK_BASE: tl.constexpr = tl.constexpr(4)
BATCH_COLS: tl.constexpr = tl.constexpr(5)
# the per-block table of dK/dV (int64 ``[NB, BLOCK_COLS]``, one row per selectable block of every batch)
BLK_KV_ROW: tl.constexpr = tl.constexpr(0)  # the block's first key (a row of K/V)
BLK_POS: tl.constexpr = tl.constexpr(1)  # its local KV position in its batch
BLK_Q_START: tl.constexpr = tl.constexpr(2)  # the batch's first query token
BLOCK_COLS: tl.constexpr = tl.constexpr(3)


@triton.jit
def _batch(batch_ptr, b, col):
    """Column ``col`` of batch ``b``'s row of the per-batch table."""
    return tl.load(batch_ptr + b * BATCH_COLS + col)


@triton.jit
def _key_tile(ptr, first, h2, s_t, s_h, n_keys, width, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """``[BLOCK_N, BLOCK_W]`` rows ``first .. first+n_keys-1`` of KV head ``h2`` (padding: 0)."""
    n = tl.arange(0, BLOCK_N)
    w = tl.arange(0, BLOCK_W)
    off = (first + n[:, None]).to(tl.int64) * s_t + tl.cast(h2, tl.int64) * s_h + w[None, :]
    return tl.load(ptr + off, mask=(n[:, None] < n_keys) & (w[None, :] < width), other=0.0)


@triton.jit
def _token_program(q_ptr, topk_ptr, batch_ptr, b, h2, group, q_st, q_sh, topk_st, topk_sh, head_d,
                   BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    """A (row, batch ``b``, KV head ``h2``) program of the forward or dQ (call it for rows inside the batch only):
    ``(t, head0, kv0, row, n_blocks, q, topk_row)`` with the token, the group's first query head, the batch's first
    KV token and KV blocks, the group's query tile ``[BLOCK_G, BLOCK_D]`` and the address of its indices."""
    row = tl.program_id(0)
    t = _batch(batch_ptr, b, Q_START) + row
    head0 = h2 * group
    q = upcast(_group_tile(q_ptr, t, head0, group, q_st, q_sh, head_d, BLOCK_G, BLOCK_D), UPCAST)
    return (t, head0, _batch(batch_ptr, b, KV_START), row, _batch(batch_ptr, b, KV_BLOCKS), q,
            topk_ptr + t.to(tl.int64) * topk_st + h2.to(tl.int64) * topk_sh)


@triton.jit
def _outside(batch_ptr, b):
    """Whether this program's row lies past batch ``b``'s query tokens (it then does nothing)."""
    return tl.program_id(0) >= _batch(batch_ptr, b, Q_LEN)


@triton.jit
def _selected_tiles(q, k_ptr, v_ptr, topk_row, step, n_blocks, kv0, row, h2, k_st, k_sh, v_st, v_sh, head_d, head_dv,
                    block_size, scale, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Step ``step`` of the token's walk over (slot, ``BLOCK_N`` keys of the slot's block): ``(K, V, S, keep)`` with
    ``S = scale * q K^T`` ``[BLOCK_G, BLOCK_N]``, padding, causally hidden keys and every key of a slot outside
    ``[0, n_blocks)`` at -inf (such a slot reads nothing); ``keep`` ``[BLOCK_N]``: the keys the token sees."""
    n_tiles = tl.cdiv(block_size, BLOCK_N)
    idx = tl.load(topk_row + step // n_tiles).to(tl.int64)
    n0 = (step % n_tiles) * BLOCK_N
    valid = (idx >= 0) & (idx < n_blocks)
    p_block = tl.where(valid, idx, 0) * block_size + n0
    n_keys = tl.where(valid, tl.minimum(block_size - n0, BLOCK_N), 0)
    k = upcast(_key_tile(k_ptr, kv0 + p_block, h2, k_st, k_sh, n_keys, head_d, BLOCK_N, BLOCK_D), UPCAST)
    v = upcast(_key_tile(v_ptr, kv0 + p_block, h2, v_st, v_sh, n_keys, head_dv, BLOCK_N, BLOCK_DV), UPCAST)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    keep = tl.arange(0, BLOCK_N) < n_keys
    if CAUSAL:
        keep = keep & (p_block + tl.arange(0, BLOCK_N) <= row)
    return k, v, tl.where(keep[None, :], s, float("-inf")), keep


@triton.jit
def _row_stats(smax_ptr, ssum_ptr, delta_ptr, t, head0, group, n1, BLOCK_G: tl.constexpr):
    """The backward's per-row inputs of the group's rows: ``(softmax_max, log2(softmax_sum), D)`` (the statistics
    from lane 0 of the true ``[T, N1, 8]``)."""
    g = tl.arange(0, BLOCK_G)
    off = (t.to(tl.int64) * n1 + head0 + g) * 8
    m = tl.load(smax_ptr + off, mask=g < group, other=0.0)
    log2_l = tl.log2(tl.load(ssum_ptr + off, mask=g < group, other=1.0))
    return m, log2_l, tl.load(delta_ptr + t.to(tl.int64) * n1 + head0 + g, mask=g < group, other=0.0)


@triton.jit
def selected_fwd_kernel(q_ptr, k_ptr, v_ptr, topk_ptr, o_ptr, smax_ptr, ssum_ptr, batch_ptr,
                        q_st, q_sh, k_st, k_sh, v_st, v_sh, topk_st, topk_sh, o_st, o_sh,
                        scale, n1, group, head_d, head_dv, block_size, block_count, n2, batch, bh_fold,
                        CAUSAL: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, FOLD: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """Online softmax of the token's group over its selected blocks: the output and the statistics (FLT_LOWEST /
    FLT_MAX on rows that saw no key)."""
    b, h2 = program_batch_head(n2, bh_fold, FOLD)
    if FOLD:
        if b >= batch:
            return
    if _outside(batch_ptr, b):
        return
    t, head0, kv0, row, n_blocks, q, topk_row = _token_program(q_ptr, topk_ptr, batch_ptr, b, h2, group, q_st, q_sh,
                                                               topk_st, topk_sh, head_d, BLOCK_G, BLOCK_D, UPCAST)
    m_i, l_i, acc = _softmax_init(BLOCK_G, BLOCK_DV)
    seen = tl.full([], 0, tl.int1)  # the token sees a key, whatever its score
    for step in range(block_count * tl.cdiv(block_size, BLOCK_N)):
        _, v, s, keep = _selected_tiles(q, k_ptr, v_ptr, topk_row, step, n_blocks, kv0, row, h2, k_st, k_sh, v_st, v_sh,
                                  head_d, head_dv, block_size, scale, CAUSAL, BLOCK_N, BLOCK_D, BLOCK_DV, UPCAST,
                                  PRECISION)
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, PRECISION)
        seen = seen | (tl.max(keep.to(tl.int32), 0) > 0)
    m_i = nan_aware_max(m_i, l_i)
    l_i = tl.where(seen & (m_i == float("-inf")) & (l_i == 0), float("nan"), l_i)  # every seen score -inf: 0 / 0
    kept = (m_i > float("-inf")) | (l_i != l_i)  # a NaN sum (non-finite inputs): its row comes out NaN
    _store_group_tile(o_ptr, acc / tl.where(kept, l_i, 1.0)[:, None], t, head0, group, o_st, o_sh, head_dv, BLOCK_G,
                      BLOCK_DV)
    g = tl.arange(0, BLOCK_G)
    lanes = tl.arange(0, 8)
    stat_off = (t.to(tl.int64) * n1 + head0 + g[:, None]) * 8 + lanes[None, :]
    ok = (g[:, None] < group) & (lanes[None, :] < 8)
    tl.store(smax_ptr + stat_off, tl.broadcast_to(tl.where(kept, m_i, FLT_LOWEST)[:, None], [BLOCK_G, 8]), mask=ok)
    tl.store(ssum_ptr + stat_off, tl.broadcast_to(tl.where(kept, l_i, FLT_MAX)[:, None], [BLOCK_G, 8]), mask=ok)


@triton.jit
def selected_delta_kernel(o_ptr, do_ptr, delta_ptr, o_st, o_sh, do_st, do_sh, n1, group, head_dv,
                          BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr):
    """``D = rowsum(dO * O)`` (fp32 ``[T, N1]``) of one token's GQA group, read by the dQ and dK/dV kernels."""
    t = tl.program_id(0)
    head0 = tl.program_id(1) * group
    o = _group_tile(o_ptr, t, head0, group, o_st, o_sh, head_dv, BLOCK_G, BLOCK_DV).to(tl.float32)
    do = _group_tile(do_ptr, t, head0, group, do_st, do_sh, head_dv, BLOCK_G, BLOCK_DV).to(tl.float32)
    g = tl.arange(0, BLOCK_G)
    tl.store(delta_ptr + t.to(tl.int64) * n1 + head0 + g, tl.sum(o * do, 1), mask=g < group)


@triton.jit
def selected_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, delta_ptr, smax_ptr, ssum_ptr, topk_ptr, batch_ptr,
                       q_st, q_sh, k_st, k_sh, v_st, v_sh, do_st, do_sh, dq_st, dq_sh, topk_st, topk_sh,
                       scale, n1, group, head_d, head_dv, block_size, block_count, n2, batch, bh_fold,
                       CAUSAL: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, FOLD: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """``dq = scale * sum_blocks dS K`` with ``dS = P * (dO V^T - D)``, ``D = rowsum(dO * O)`` (``delta``)."""
    b, h2 = program_batch_head(n2, bh_fold, FOLD)
    if FOLD:
        if b >= batch:
            return
    if _outside(batch_ptr, b):
        return
    t, head0, kv0, row, n_blocks, q, topk_row = _token_program(q_ptr, topk_ptr, batch_ptr, b, h2, group, q_st, q_sh,
                                                               topk_st, topk_sh, head_d, BLOCK_G, BLOCK_D, UPCAST)
    dq = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    do = upcast(_group_tile(do_ptr, t, head0, group, do_st, do_sh, head_dv, BLOCK_G, BLOCK_DV), UPCAST)
    m, log2_l, delta = _row_stats(smax_ptr, ssum_ptr, delta_ptr, t, head0, group, n1, BLOCK_G)
    for step in range(block_count * tl.cdiv(block_size, BLOCK_N)):
        k, v, s, _ = _selected_tiles(q, k_ptr, v_ptr, topk_row, step, n_blocks, kv0, row, h2, k_st, k_sh, v_st, v_sh,
                                  head_d, head_dv, block_size, scale, CAUSAL, BLOCK_N, BLOCK_D, BLOCK_DV, UPCAST,
                                  PRECISION)
        p = tl.exp2((s - m[:, None]) * LOG2E - log2_l[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    _store_group_tile(dq_ptr, dq * scale, t, head0, group, dq_st, dq_sh, head_d, BLOCK_G, BLOCK_D)


@triton.jit
def selected_keys_kernel(topk_ptr, key_ptr, batch_ptr, topk_st, topk_sh, n2, n_blocks, block_count, batch, bh_fold,
                         BLOCK_S: tl.constexpr, FOLD: tl.constexpr):
    """The sort keys of the inverted lists for one token and KV head ``h2``: per slot, list ``h2 * n_blocks +``
    the batch's first block ``+ index``, or ``n2 * n_blocks`` (past every list) for an index outside the batch's
    blocks; ``key`` is a contiguous ``[T, N2, count]``."""
    b, h2 = program_batch_head(n2, bh_fold, FOLD)
    if FOLD:
        if b >= batch:
            return
    if _outside(batch_ptr, b):
        return
    row = tl.program_id(0)
    t = (_batch(batch_ptr, b, Q_START) + row).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    idx = tl.load(topk_ptr + t * topk_st + h2.to(tl.int64) * topk_sh + s, mask=s < block_count, other=0).to(tl.int64)
    key = h2.to(tl.int64) * n_blocks + _batch(batch_ptr, b, BLOCK_BASE) + idx
    key = tl.where((idx >= 0) & (idx < _batch(batch_ptr, b, KV_BLOCKS)), key, tl.cast(n2, tl.int64) * n_blocks)
    tl.store(key_ptr + (t * n2 + h2) * block_count + s, key, mask=s < block_count)


@triton.jit
def _key_rows(ptr, tile, rows, s_t, n_keys, width, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """Stores ``tile`` ``[BLOCK_N, BLOCK_W]`` (cast to the buffer's dtype) as rows ``rows`` (stride ``s_t``) of
    ``ptr`` (the first ``n_keys`` rows, ``width`` columns)."""
    n = tl.arange(0, BLOCK_N)
    w = tl.arange(0, BLOCK_W)
    tl.store(ptr + rows[:, None] * s_t + w[None, :], tile.to(ptr.dtype.element_ty),
             mask=(n[:, None] < n_keys) & (w[None, :] < width))


@triton.jit
def _row_tile(ptr, rows, col0, width, ok, BLOCK_W: tl.constexpr):
    """``[BLOCK_R, BLOCK_W]``: columns ``col0 ..`` (below ``width``) of the rows starting at element offsets ``rows``
    (rows not ``ok``: 0)."""
    w = col0 + tl.arange(0, BLOCK_W)
    return tl.load(ptr + rows[:, None] + w[None, :], mask=ok[:, None] & (w[None, :] < width), other=0.0)


@triton.jit
def selected_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, part_k_ptr, part_v_ptr, delta_ptr, smax_ptr,
                         ssum_ptr, block_ptr, list_start_ptr, token_ptr, unit_list_ptr, unit_end_ptr, slot_end_ptr,
                         q_st, q_sh, k_st, k_sh, v_st, v_sh, do_st, do_sh, dk_st, dk_sh, dv_st, dv_sh,
                         scale, n1, n2, group, head_d, head_dv, block_size, n_blocks, chunk,
                         CAUSAL: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DT: tl.constexpr, SPLIT_D: tl.constexpr,
                         BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """dK/dV of keys ``n0 .. n0+BLOCK_N-1`` of list ``l = unit_list[u]`` (KV head ``l // n_blocks``, global
    block ``l % n_blocks``) over the entries of its chunk (``token``: the list entries' query tokens), in list order,
    ``BLOCK_R`` (entry, query head) rows per step: the products are ``[BLOCK_N, BLOCK_R]`` and ``[BLOCK_N, D]``.
    With ``SPLIT_D`` the head dim is two tiles, columns ``[0, BLOCK_D)`` and ``[BLOCK_D, BLOCK_D + BLOCK_DT)``
    (D=192: 128 + 64 instead of a 256-wide padded tile). A list of one chunk stores dK/dV; a longer one stores its
    chunks' fp32 sums as partials ``slot_end[l] - chunks + c`` (``selected_dkdv_reduce_kernel`` adds them in chunk
    order)."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(block_size, BLOCK_N)
    u = pid // n_tiles
    l = tl.load(unit_list_ptr + u)
    if l >= n2 * n_blocks:
        return
    lo, hi, chunks, c = list_chunk(list_start_ptr, unit_end_ptr, l, u, chunk)
    h2 = l // n_blocks
    blk = l % n_blocks
    n0 = (pid % n_tiles) * BLOCK_N
    n_keys = tl.minimum(block_size - n0, BLOCK_N)
    first = tl.load(block_ptr + blk * BLOCK_COLS + BLK_KV_ROW) + n0
    p0 = tl.load(block_ptr + blk * BLOCK_COLS + BLK_POS) + n0
    q0 = tl.load(block_ptr + blk * BLOCK_COLS + BLK_Q_START)
    k = upcast(_key_tile(k_ptr, first, h2, k_st, k_sh, n_keys, head_d, BLOCK_N, BLOCK_D), UPCAST)
    k_tail = upcast(_key_tile(k_ptr + BLOCK_D, first, h2, k_st, k_sh, n_keys, head_d - BLOCK_D, BLOCK_N, BLOCK_DT),
                    UPCAST)
    v = upcast(_key_tile(v_ptr, first, h2, v_st, v_sh, n_keys, head_dv, BLOCK_N, BLOCK_DV), UPCAST)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dk_tail = tl.zeros([BLOCK_N, BLOCK_DT], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    n = tl.arange(0, BLOCK_N)
    key_ok = n < n_keys
    n_rows = ((hi - lo) * group).to(tl.int32)
    for r0 in range(0, n_rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        ok = r < n_rows
        t = tl.load(token_ptr + lo + r // group, mask=ok, other=0).to(tl.int64)
        head = (h2 * group + r % group).to(tl.int64)
        q_rows = t * q_st + head * q_sh
        q = upcast(_row_tile(q_ptr, q_rows, 0, head_d, ok, BLOCK_D), UPCAST)
        do = upcast(_row_tile(do_ptr, t * do_st + head * do_sh, 0, head_dv, ok, BLOCK_DV), UPCAST)
        stat = (t * n1 + head) * 8
        m = tl.load(smax_ptr + stat, mask=ok, other=0.0)
        log2_l = tl.log2(tl.load(ssum_ptr + stat, mask=ok, other=1.0))
        delta = tl.load(delta_ptr + t * n1 + head, mask=ok, other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # [BLOCK_N, BLOCK_R]: S transposed
        if SPLIT_D:
            q_tail = upcast(_row_tile(q_ptr, q_rows, BLOCK_D, head_d, ok, BLOCK_DT), UPCAST)
            s_t = tl.dot(k_tail, tl.trans(q_tail), s_t, input_precision=PRECISION)
        keep = key_ok[:, None] & ok[None, :]
        if CAUSAL:
            keep = keep & (p0 + n[:, None] <= (t - q0)[None, :])
        p_t = tl.exp2((tl.where(keep, s_t * scale, float("-inf")) - m[None, :]) * LOG2E - log2_l[None, :])
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
        ds_t = (p_t * (tl.dot(v, tl.trans(do), input_precision=PRECISION) - delta[None, :])).to(q.dtype)
        dk += tl.dot(ds_t, q, input_precision=PRECISION)
        if SPLIT_D:
            dk_tail += tl.dot(ds_t, q_tail, input_precision=PRECISION)
    if chunks == 1:
        rows = (first + n).to(tl.int64)
        _key_rows(dk_ptr + h2 * dk_sh, dk * scale, rows, dk_st, n_keys, head_d, BLOCK_N, BLOCK_D)
        if SPLIT_D:
            _key_rows(dk_ptr + h2 * dk_sh + BLOCK_D, dk_tail * scale, rows, dk_st, n_keys, head_d - BLOCK_D, BLOCK_N,
                      BLOCK_DT)
        _key_rows(dv_ptr + h2 * dv_sh, dv, rows, dv_st, n_keys, head_dv, BLOCK_N, BLOCK_DV)
    else:
        rows = (tl.load(slot_end_ptr + l) - chunks + c) * block_size + n0 + n
        _key_rows(part_k_ptr, dk, rows, head_d, n_keys, head_d, BLOCK_N, BLOCK_D)
        if SPLIT_D:
            _key_rows(part_k_ptr + BLOCK_D, dk_tail, rows, head_d, n_keys, head_d - BLOCK_D, BLOCK_N, BLOCK_DT)
        _key_rows(part_v_ptr, dv, rows, head_dv, n_keys, head_dv, BLOCK_N, BLOCK_DV)


@triton.jit
def selected_dkdv_reduce_kernel(dk_ptr, dv_ptr, part_k_ptr, part_v_ptr, block_ptr, list_start_ptr, slot_end_ptr,
                                dk_st, dk_sh, dv_st, dv_sh, scale, head_d, head_dv, block_size, n_blocks, chunk,
                                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK/dV of keys ``n0 .. n0+BLOCK_N-1`` of a list split into several chunks: its partials added in chunk order
    (a fixed order: bit-identical runs); lists of one chunk were stored by ``selected_dkdv_kernel``."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(block_size, BLOCK_N)
    l = pid // n_tiles
    chunks = tl.cdiv(tl.load(list_start_ptr + l + 1) - tl.load(list_start_ptr + l), chunk)
    if chunks <= 1:
        return
    blk = l % n_blocks
    n0 = (pid % n_tiles) * BLOCK_N
    n_keys = tl.minimum(block_size - n0, BLOCK_N)
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    e = tl.arange(0, BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    slot0 = tl.load(slot_end_ptr + l) - chunks
    for c in range(chunks):
        rows = ((slot0 + c) * block_size + n0 + n).to(tl.int64)
        dk += tl.load(part_k_ptr + rows[:, None] * head_d + d[None, :],
                      mask=(n[:, None] < n_keys) & (d[None, :] < head_d), other=0.0)
        dv += tl.load(part_v_ptr + rows[:, None] * head_dv + e[None, :],
                      mask=(n[:, None] < n_keys) & (e[None, :] < head_dv), other=0.0)
    rows = (tl.load(block_ptr + blk * BLOCK_COLS + BLK_KV_ROW) + n0 + n).to(tl.int64)
    h2 = l // n_blocks
    _key_rows(dk_ptr + h2 * dk_sh, dk * scale, rows, dk_st, n_keys, head_d, BLOCK_N, BLOCK_D)
    _key_rows(dv_ptr + h2 * dv_sh, dv, rows, dv_st, n_keys, head_dv, BLOCK_N, BLOCK_DV)
