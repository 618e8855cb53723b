"""Selected-attention kernels: forward, ``D = rowsum(dO * O)``, dQ and dK/dV (``launch.py`` plans them).

One program of the forward and of dQ holds one query token and one KV head with its whole GQA group (``G`` query
heads, padded to ``BLOCK_G >= 16`` rows for ``tl.dot``); the forward and dQ walk the token's selected blocks in slot
order, ``BLOCK_N`` keys at a time. One dK/dV program holds ``BLOCK_N`` keys of one block of its batch and one KV head
and walks the (token, slot) pairs that selected the block, in the fixed order of the inverted lists: every dK/dV
element has one writer and a fixed summation order (deterministic, no atomics).

The grids are ``(row, batch x KV head)``, the pairs folded into axes 1 and 2 past CUDA's 65535 programs per axis
(``FOLD``, as the FlashAttention kernels): a program finds its token (or block) from the per-batch table (int64
``[B, BATCH_COLS]``: first query token, query length, first KV token, KV blocks, the batch's first global block), so
no per-token metadata is built. A selected index outside ``[0, KV blocks of the batch)`` selects nothing (the host
validates indices of CPU tensors only; on the device such a slot is skipped, never read out of bounds). Causal rule:
local KV position ``p`` is kept iff ``p <= row``. Scores are ``scale * q k^T``; statistics are in natural units.
"""
import triton
import triton.language as tl

from ...flash_attention.triton.common import FLT_LOWEST, FLT_MAX, LOG2E, program_batch_head, upcast
from .common import _group_tile, _softmax_init, _softmax_step, _store_group_tile

Q_START: tl.constexpr = tl.constexpr(0)
Q_LEN: tl.constexpr = tl.constexpr(1)
KV_START: tl.constexpr = tl.constexpr(2)
KV_BLOCKS: tl.constexpr = tl.constexpr(3)
BLOCK_BASE: tl.constexpr = tl.constexpr(4)
BATCH_COLS: tl.constexpr = tl.constexpr(5)


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
def _selected_tiles(q, k_ptr, v_ptr, p_block, n0, kv0, row, h2, k_st, k_sh, v_st, v_sh, head_d, head_dv,
                    block_size, scale, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Keys ``n0 .. n0+BLOCK_N-1`` of the selected block at local position ``p_block``: ``(K, V, S)`` with
    ``S = scale * q K^T`` ``[BLOCK_G, BLOCK_N]``, padding and causally hidden keys at -inf."""
    n_keys = tl.minimum(block_size - n0, BLOCK_N)
    first = kv0 + p_block + n0
    k = upcast(_key_tile(k_ptr, first, h2, k_st, k_sh, n_keys, head_d, BLOCK_N, BLOCK_D), UPCAST)
    v = upcast(_key_tile(v_ptr, first, h2, v_st, v_sh, n_keys, head_dv, BLOCK_N, BLOCK_DV), UPCAST)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    pos = p_block + n0 + tl.arange(0, BLOCK_N)
    keep = tl.arange(0, BLOCK_N) < n_keys
    if CAUSAL:
        keep = keep & (pos <= row)
    return k, v, tl.where(keep[None, :], s, float("-inf"))


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
    for slot in range(block_count):
        idx = tl.load(topk_row + slot).to(tl.int64)
        if (idx >= 0) & (idx < n_blocks):
            for n0 in range(0, block_size, BLOCK_N):
                _, v, s = _selected_tiles(q, k_ptr, v_ptr, idx * block_size, n0, kv0, row, h2, k_st, k_sh, v_st,
                                          v_sh, head_d, head_dv, block_size, scale, CAUSAL, BLOCK_N, BLOCK_D,
                                          BLOCK_DV, UPCAST, PRECISION)
                m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, PRECISION)
    kept = m_i > float("-inf")
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
    for slot in range(block_count):
        idx = tl.load(topk_row + slot).to(tl.int64)
        if (idx >= 0) & (idx < n_blocks):
            for n0 in range(0, block_size, BLOCK_N):
                k, v, s = _selected_tiles(q, k_ptr, v_ptr, idx * block_size, n0, kv0, row, h2, k_st, k_sh, v_st,
                                          v_sh, head_d, head_dv, block_size, scale, CAUSAL, BLOCK_N, BLOCK_D,
                                          BLOCK_DV, UPCAST, PRECISION)
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
def selected_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, delta_ptr, smax_ptr, ssum_ptr, batch_ptr,
                         list_start_ptr, pair_ptr,
                         q_st, q_sh, k_st, k_sh, v_st, v_sh, do_st, do_sh, dk_st, dk_sh, dv_st, dv_sh,
                         scale, n1, n2, group, head_d, head_dv, block_size, block_count, n_blocks, batch, bh_fold,
                         CAUSAL: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, FOLD: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """dK/dV of keys ``n0 .. n0+BLOCK_N-1`` of block ``j`` of batch ``b``, KV head ``h2``: the sum over the pairs
    ``list_start[h2*n_blocks + first block of b + j] ..`` (``pair``: the sorted (token, head, slot) positions; the
    token is the position divided by ``n2 * count``) in list order."""
    pid = tl.program_id(0)
    b, h2 = program_batch_head(n2, bh_fold, FOLD)
    if FOLD:
        if b >= batch:
            return
    n_tiles = tl.cdiv(block_size, BLOCK_N)
    j = pid // n_tiles
    if j >= _batch(batch_ptr, b, KV_BLOCKS):
        return
    n0 = (pid % n_tiles) * BLOCK_N
    n_keys = tl.minimum(block_size - n0, BLOCK_N)
    p0 = j.to(tl.int64) * block_size + n0
    first = _batch(batch_ptr, b, KV_START) + p0
    q0 = _batch(batch_ptr, b, Q_START)
    head0 = h2 * group
    k = upcast(_key_tile(k_ptr, first, h2, k_st, k_sh, n_keys, head_d, BLOCK_N, BLOCK_D), UPCAST)
    v = upcast(_key_tile(v_ptr, first, h2, v_st, v_sh, n_keys, head_dv, BLOCK_N, BLOCK_DV), UPCAST)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    n = tl.arange(0, BLOCK_N)
    list_id = h2.to(tl.int64) * n_blocks + _batch(batch_ptr, b, BLOCK_BASE) + j
    lo = tl.load(list_start_ptr + list_id)
    hi = tl.load(list_start_ptr + list_id + 1)
    for i in range(lo, hi):
        t = tl.load(pair_ptr + i) // (n2 * block_count)
        row = t - q0
        q = upcast(_group_tile(q_ptr, t, head0, group, q_st, q_sh, head_d, BLOCK_G, BLOCK_D), UPCAST)
        do = upcast(_group_tile(do_ptr, t, head0, group, do_st, do_sh, head_dv, BLOCK_G, BLOCK_DV), UPCAST)
        m, log2_l, delta = _row_stats(smax_ptr, ssum_ptr, delta_ptr, t, head0, group, n1, BLOCK_G)
        s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale  # [BLOCK_N, BLOCK_G]: S transposed
        keep = n < n_keys
        if CAUSAL:
            keep = keep & (p0 + n <= row)
        s_t = tl.where(keep[:, None], s_t, float("-inf"))
        p_t = tl.exp2((s_t - m[None, :]) * LOG2E - log2_l[None, :])
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    rows = (first + n[:, None]).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    tl.store(dk_ptr + rows * dk_st + tl.cast(h2, tl.int64) * dk_sh + d[None, :],
             (dk * scale).to(dk_ptr.dtype.element_ty), mask=(n[:, None] < n_keys) & (d[None, :] < head_d))
    e = tl.arange(0, BLOCK_DV)
    tl.store(dv_ptr + rows * dv_st + tl.cast(h2, tl.int64) * dv_sh + e[None, :], dv.to(dv_ptr.dtype.element_ty),
             mask=(n[:, None] < n_keys) & (e[None, :] < head_dv))
