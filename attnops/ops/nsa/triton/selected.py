"""Selected-attention kernels: forward, ``D = rowsum(dO * O)``, dQ and dK/dV (``launch.py`` plans them).

One program of the forward, of D and of dQ holds one query token and one KV head with its whole GQA group (``G``
query heads, padded to ``BLOCK_G >= 16`` rows for ``tl.dot``); the forward and dQ walk the token's selected blocks
in slot order, ``BLOCK_N`` keys at a time. One dK/dV program holds ``BLOCK_N`` keys of one selected block and one
KV head and walks the (token, slot) pairs that selected the block, in the fixed order of the host's inverted lists:
every dK/dV element has one writer and a fixed summation order (deterministic, no atomics).

Per-token metadata (int64 ``[T, 2]``): the batch's first KV token and the token's row in its batch (causal rule:
local KV position ``p`` is kept iff ``p <= row``). Scores are ``scale * q k^T``; statistics are in natural units.
"""
import triton
import triton.language as tl

from ...flash_attention.triton.common import FLT_LOWEST, FLT_MAX, LOG2E, upcast

TOKEN_KV_START: tl.constexpr = tl.constexpr(0)
TOKEN_ROW: tl.constexpr = tl.constexpr(1)


@triton.jit
def _group_tile(ptr, t, head0, group, s_t, s_h, width, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr):
    """The ``[BLOCK_G, BLOCK_W]`` rows of token ``t``, heads ``head0 .. head0+group-1`` (padding: 0)."""
    g = tl.arange(0, BLOCK_G)
    w = tl.arange(0, BLOCK_W)
    off = t.to(tl.int64) * s_t + (head0 + g[:, None]).to(tl.int64) * s_h + w[None, :]
    return tl.load(ptr + off, mask=(g[:, None] < group) & (w[None, :] < width), other=0.0)


@triton.jit
def _key_tile(ptr, first, h2, s_t, s_h, n_keys, width, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """``[BLOCK_N, BLOCK_W]`` rows ``first .. first+n_keys-1`` of KV head ``h2`` (padding: 0)."""
    n = tl.arange(0, BLOCK_N)
    w = tl.arange(0, BLOCK_W)
    off = (first + n[:, None]).to(tl.int64) * s_t + tl.cast(h2, tl.int64) * s_h + w[None, :]
    return tl.load(ptr + off, mask=(n[:, None] < n_keys) & (w[None, :] < width), other=0.0)


@triton.jit
def _scores(q, k, p0, n_keys, row, scale, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """``scale * q k^T`` ``[BLOCK_G, BLOCK_N]`` of keys at local positions ``p0 ..``; padding and causally
    hidden keys at -inf."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    pos = p0 + tl.arange(0, BLOCK_N)
    keep = tl.arange(0, BLOCK_N) < n_keys
    if CAUSAL:
        keep = keep & (pos <= row)
    return tl.where(keep[None, :], s, float("-inf"))


@triton.jit
def _row_stats(smax_ptr, ssum_ptr, t, head0, group, n1, BLOCK_G: tl.constexpr):
    """Given ``(softmax_max, log2(softmax_sum))`` of the group's rows (lane 0 of the true ``[T, N1, 8]``)."""
    g = tl.arange(0, BLOCK_G)
    off = (t.to(tl.int64) * n1 + head0 + g) * 8
    m = tl.load(smax_ptr + off, mask=g < group, other=0.0)
    l = tl.load(ssum_ptr + off, mask=g < group, other=1.0)
    return m, tl.log2(l)


@triton.jit
def selected_fwd_kernel(q_ptr, k_ptr, v_ptr, topk_ptr, o_ptr, smax_ptr, ssum_ptr, token_ptr,
                        q_st, q_sh, k_st, k_sh, v_st, v_sh, topk_st, topk_sh, o_st, o_sh,
                        scale, n1, group, head_d, head_dv, block_size, block_count,
                        CAUSAL: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    h2 = tl.program_id(1)
    head0 = h2 * group
    kv0 = tl.load(token_ptr + t * 2 + TOKEN_KV_START)
    row = tl.load(token_ptr + t * 2 + TOKEN_ROW)
    q = upcast(_group_tile(q_ptr, t, head0, group, q_st, q_sh, head_d, BLOCK_G, BLOCK_D), UPCAST)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    topk_row = topk_ptr + t.to(tl.int64) * topk_st + h2.to(tl.int64) * topk_sh
    for slot in range(block_count):
        p_block = tl.load(topk_row + slot).to(tl.int64) * block_size
        for n0 in range(0, block_size, BLOCK_N):
            n_keys = tl.minimum(block_size - n0, BLOCK_N)
            first = kv0 + p_block + n0
            k = upcast(_key_tile(k_ptr, first, h2, k_st, k_sh, n_keys, head_d, BLOCK_N, BLOCK_D), UPCAST)
            s = _scores(q, k, p_block + n0, n_keys, row, scale, CAUSAL, BLOCK_N, PRECISION)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2((m_i - shift) * LOG2E)
            p = tl.exp2((s - shift[:, None]) * LOG2E)
            v = upcast(_key_tile(v_ptr, first, h2, v_st, v_sh, n_keys, head_dv, BLOCK_N, BLOCK_DV), UPCAST)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
    kept = m_i > float("-inf")
    out = acc / tl.where(kept, l_i, 1.0)[:, None]
    g = tl.arange(0, BLOCK_G)
    dv = tl.arange(0, BLOCK_DV)
    o_off = t.to(tl.int64) * o_st + (head0 + g[:, None]).to(tl.int64) * o_sh + dv[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=(g[:, None] < group) & (dv[None, :] < head_dv))
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
def selected_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dq_ptr, delta_ptr, smax_ptr, ssum_ptr, topk_ptr, token_ptr,
                       q_st, q_sh, k_st, k_sh, v_st, v_sh, do_st, do_sh, dq_st, dq_sh, topk_st, topk_sh,
                       scale, n1, group, head_d, head_dv, block_size, block_count,
                       CAUSAL: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """``dq = scale * sum_blocks dS K`` with ``dS = P * (dO V^T - D)``, ``D = rowsum(dO * O)`` (``delta``)."""
    t = tl.program_id(0)
    h2 = tl.program_id(1)
    head0 = h2 * group
    kv0 = tl.load(token_ptr + t * 2 + TOKEN_KV_START)
    row = tl.load(token_ptr + t * 2 + TOKEN_ROW)
    q = upcast(_group_tile(q_ptr, t, head0, group, q_st, q_sh, head_d, BLOCK_G, BLOCK_D), UPCAST)
    do = upcast(_group_tile(do_ptr, t, head0, group, do_st, do_sh, head_dv, BLOCK_G, BLOCK_DV), UPCAST)
    m, log2_l = _row_stats(smax_ptr, ssum_ptr, t, head0, group, n1, BLOCK_G)
    g = tl.arange(0, BLOCK_G)
    delta = tl.load(delta_ptr + t.to(tl.int64) * n1 + head0 + g, mask=g < group, other=0.0)
    dq = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    topk_row = topk_ptr + t.to(tl.int64) * topk_st + h2.to(tl.int64) * topk_sh
    for slot in range(block_count):
        p_block = tl.load(topk_row + slot).to(tl.int64) * block_size
        for n0 in range(0, block_size, BLOCK_N):
            n_keys = tl.minimum(block_size - n0, BLOCK_N)
            first = kv0 + p_block + n0
            k = upcast(_key_tile(k_ptr, first, h2, k_st, k_sh, n_keys, head_d, BLOCK_N, BLOCK_D), UPCAST)
            v = upcast(_key_tile(v_ptr, first, h2, v_st, v_sh, n_keys, head_dv, BLOCK_N, BLOCK_DV), UPCAST)
            s = _scores(q, k, p_block + n0, n_keys, row, scale, CAUSAL, BLOCK_N, PRECISION)
            p = tl.exp2((s - m[:, None]) * LOG2E - log2_l[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    d = tl.arange(0, BLOCK_D)
    off = t.to(tl.int64) * dq_st + (head0 + g[:, None]).to(tl.int64) * dq_sh + d[None, :]
    tl.store(dq_ptr + off, (dq * scale).to(dq_ptr.dtype.element_ty), mask=(g[:, None] < group) & (d[None, :] < head_d))


@triton.jit
def selected_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, delta_ptr, smax_ptr, ssum_ptr, token_ptr,
                         block_ptr, list_start_ptr, pair_token_ptr,
                         q_st, q_sh, k_st, k_sh, v_st, v_sh, do_st, do_sh, dk_st, dk_sh, dv_st, dv_sh,
                         scale, n1, n2, group, head_d, head_dv, block_size, n_blocks,
                         CAUSAL: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """dK/dV of keys ``n0 .. n0+BLOCK_N-1`` of selected block ``j`` (``block_ptr[j]``: its first KV token and its
    first local position), KV head ``h2``: the sum over the pairs ``list_start[h2*n_blocks + j] ..`` (tokens in
    ``pair_token``) in list order."""
    pid = tl.program_id(0)
    h2 = tl.program_id(1)
    n_tiles = tl.cdiv(block_size, BLOCK_N)
    j = pid // n_tiles
    n0 = (pid % n_tiles) * BLOCK_N
    n_keys = tl.minimum(block_size - n0, BLOCK_N)
    first = tl.load(block_ptr + j * 2) + n0
    p0 = tl.load(block_ptr + j * 2 + 1) + n0
    head0 = h2 * group
    k = upcast(_key_tile(k_ptr, first, h2, k_st, k_sh, n_keys, head_d, BLOCK_N, BLOCK_D), UPCAST)
    v = upcast(_key_tile(v_ptr, first, h2, v_st, v_sh, n_keys, head_dv, BLOCK_N, BLOCK_DV), UPCAST)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    g = tl.arange(0, BLOCK_G)
    n = tl.arange(0, BLOCK_N)
    list_id = h2.to(tl.int64) * n_blocks + j
    lo = tl.load(list_start_ptr + list_id)
    hi = tl.load(list_start_ptr + list_id + 1)
    for i in range(lo, hi):
        t = tl.load(pair_token_ptr + i)
        row = tl.load(token_ptr + t * 2 + TOKEN_ROW)
        q = upcast(_group_tile(q_ptr, t, head0, group, q_st, q_sh, head_d, BLOCK_G, BLOCK_D), UPCAST)
        do = upcast(_group_tile(do_ptr, t, head0, group, do_st, do_sh, head_dv, BLOCK_G, BLOCK_DV), UPCAST)
        m, log2_l = _row_stats(smax_ptr, ssum_ptr, t, head0, group, n1, BLOCK_G)
        delta = tl.load(delta_ptr + t.to(tl.int64) * n1 + head0 + g, mask=g < group, other=0.0)
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
