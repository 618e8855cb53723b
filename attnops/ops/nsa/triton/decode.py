"""NSA decode kernels over paged KV caches (one query token per request): selected attention over the blocks named
by ``topk_indices`` and compressed attention with its block scores. No allocation here (``infer_launch.py``
allocates and launches).

One program per (request, KV head) serves the whole GQA group at once (its query heads are the rows of the tiles,
padded to ``BLOCK_G``). A KV position ``pos`` of request ``b`` lives at row ``pos % page`` of cache block
``block_table[b, pos // page]``.
"""
import triton
import triton.language as tl

from ...flash_attention.triton.common import LOG2E


@triton.jit
def _paged_tile(cache_ptr, bt_ptr, b, hk, pos, ok, dims, head_dim, bt_sb, c_s0, c_s1, c_s2, page, UPCAST: tl.constexpr):
    """Rows ``pos`` (``[BLOCK_N]``, masked by ``ok``) of KV head ``hk`` of a paged cache as a ``[BLOCK_N, dims]``
    tile (0 where masked)."""
    blk = tl.load(bt_ptr + b.to(tl.int64) * bt_sb + pos // page, mask=ok, other=0).to(tl.int64)
    off = blk * c_s0 + (pos % page).to(tl.int64) * c_s1 + hk.to(tl.int64) * c_s2
    tile = tl.load(cache_ptr + off[:, None] + dims[None, :], mask=ok[:, None] & (dims[None, :] < head_dim), other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _group_query(q_ptr, b, hk, q_sb, q_sh, group, head_d, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                 UPCAST: tl.constexpr):
    """The query rows ``[BLOCK_G, BLOCK_D]`` of KV head ``hk``'s group (0 past the group)."""
    heads = hk * group + tl.arange(0, BLOCK_G)
    dk = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + b.to(tl.int64) * q_sb + heads[:, None].to(tl.int64) * q_sh + dk[None, :],
                mask=(tl.arange(0, BLOCK_G)[:, None] < group) & (dk[None, :] < head_d), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def _store_group(o_ptr, acc, l_i, b, hk, o_sb, o_sh, group, head_dv, BLOCK_G: tl.constexpr,
                 BLOCK_DV: tl.constexpr):
    """``acc / l`` (0 where nothing was attended) for the group's output rows."""
    g = tl.arange(0, BLOCK_G)
    dv = tl.arange(0, BLOCK_DV)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    off = b.to(tl.int64) * o_sb + (hk * group + g)[:, None].to(tl.int64) * o_sh + dv[None, :]
    tl.store(o_ptr + off, out.to(o_ptr.dtype.element_ty), mask=(g[:, None] < group) & (dv[None, :] < head_dv))


@triton.jit
def _softmax_step(q, k_t, v_t, ok, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
    """One online-softmax step over a tile of keys ``k_t [BLOCK_D, BLOCK_N]`` (columns masked by ``ok``)."""
    s = tl.dot(q, k_t, input_precision=PRECISION) * scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((m_i - m_safe) * LOG2E)
    p = tl.exp2((s - m_safe[:, None]) * LOG2E)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v_t.dtype), v_t, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def selected_decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, topk_ptr, bt_ptr, lens_ptr,
                           q_sb, q_sh, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, o_sb, o_sh, t_sb, t_sh, bt_sb,
                           scale, n2, group, head_d, head_dv, page, block, count,
                           BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Softmax attention of request ``b``'s group over the selected blocks (in order, up to the first -1, each cut
    at the KV length; a repeated index counts twice); output 0 when nothing is selected."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    kv_len = tl.load(lens_ptr + b)
    dk = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = _group_query(q_ptr, b, hk, q_sb, q_sh, group, head_d, BLOCK_G, BLOCK_D, UPCAST)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    alive = 1
    for i in range(count):
        idx = tl.load(topk_ptr + b.to(tl.int64) * t_sb + hk.to(tl.int64) * t_sh + i).to(tl.int64)
        alive = tl.where(idx == -1, 0, alive)
        if alive != 0:
            for j0 in range(0, block, BLOCK_N):
                j = j0 + tl.arange(0, BLOCK_N)
                pos = idx * block + j
                ok = (j < block) & (pos < kv_len)
                k_t = tl.trans(_paged_tile(k_ptr, bt_ptr, b, hk, pos, ok, dk, head_d, bt_sb, k_s0, k_s1, k_s2, page,
                                           UPCAST))
                v_t = _paged_tile(v_ptr, bt_ptr, b, hk, pos, ok, dv, head_dv, bt_sb, v_s0, v_s1, v_s2, page, UPCAST)
                m_i, l_i, acc = _softmax_step(q, k_t, v_t, ok, m_i, l_i, acc, scale, PRECISION)
    _store_group(o_ptr, acc, l_i, b, hk, o_sb, o_sh, group, head_dv, BLOCK_G, BLOCK_DV)


@triton.jit
def compress_decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, score_ptr, bt_ptr, lens_ptr,
                           q_sb, q_sh, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, o_sb, o_sh, sc_sb, sc_sh, bt_sb,
                           scale, n2, group, head_d, head_dv, page, m, nn, cmp_stride, cmp_block, sel_block,
                           BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr,
                           PRECISION: tl.constexpr):
    """Softmax attention of request ``b``'s group over its ``S2`` compressed keys, then the group-summed block
    scores ``sum_t times[t] * P[m*(k+1) - t]`` (0 for blocks ``k >= S2 - 1``) from the final max and sum."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    s2 = tl.load(lens_ptr + b)
    dk = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = _group_query(q_ptr, b, hk, q_sb, q_sh, group, head_d, BLOCK_G, BLOCK_D, UPCAST)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for c0 in range(0, s2, BLOCK_N):
        pos = c0 + tl.arange(0, BLOCK_N)
        ok = pos < s2
        k_t = tl.trans(_paged_tile(k_ptr, bt_ptr, b, hk, pos, ok, dk, head_d, bt_sb, k_s0, k_s1, k_s2, page, UPCAST))
        v_t = _paged_tile(v_ptr, bt_ptr, b, hk, pos, ok, dv, head_dv, bt_sb, v_s0, v_s1, v_s2, page, UPCAST)
        m_i, l_i, acc = _softmax_step(q, k_t, v_t, ok, m_i, l_i, acc, scale, PRECISION)
    _store_group(o_ptr, acc, l_i, b, hk, o_sb, o_sh, group, head_dv, BLOCK_G, BLOCK_DV)

    in_group = tl.arange(0, BLOCK_G) < group
    log2_l = tl.log2(tl.where(l_i > 0, l_i, 1.0))
    taps = m + nn - 1
    n_blocks = ((s2 - 1) * cmp_stride + cmp_block + sel_block - 1) // sel_block
    for k0 in range(0, n_blocks, BLOCK_K):
        blocks = k0 + tl.arange(0, BLOCK_K)
        c_lo = tl.maximum(m * (k0 + 1) - taps + 1, 0)
        c_hi = tl.minimum(m * (k0 + BLOCK_K) + 1, s2)
        score = tl.zeros([BLOCK_K], tl.float32)
        for c0 in range(c_lo, c_hi, BLOCK_N):
            pos = c0 + tl.arange(0, BLOCK_N)
            ok = pos < c_hi
            k_t = tl.trans(_paged_tile(k_ptr, bt_ptr, b, hk, pos, ok, dk, head_d, bt_sb, k_s0, k_s1, k_s2, page,
                                       UPCAST))
            s = tl.dot(q, k_t, input_precision=PRECISION) * scale
            p = tl.exp2((s - m_i[:, None]) * LOG2E - log2_l[:, None])
            p_sum = tl.sum(tl.where(in_group[:, None] & ok[None, :], p, 0.0), 0)  # [BLOCK_N], summed over the group
            t = m * (blocks[None, :] + 1) - pos[:, None]
            times = tl.minimum(tl.minimum(t + 1, nn), taps - t)
            w = tl.where((t >= 0) & (t < taps) & (blocks[None, :] < s2 - 1), times, 0).to(tl.float32)
            score += tl.sum(p_sum[:, None] * w, 0)
        off = b.to(tl.int64) * sc_sb + hk.to(tl.int64) * sc_sh + blocks
        tl.store(score_ptr + off, score, mask=blocks < n_blocks)
