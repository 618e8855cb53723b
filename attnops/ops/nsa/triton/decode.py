"""NSA decode kernels over paged KV caches (one query token per request): selected attention over the blocks named
by ``topk_indices`` and compressed attention with its block scores. No allocation here (``infer_launch.py``
allocates and launches).

Compressed attention is split over the compressed keys (FlashDecoding): ``compress_decode_kernel`` runs one program
per (request, KV head, split) and stores each split's partial softmax statistics and unnormalised output in fp32;
``compress_decode_score_kernel`` merges them in split order (bitwise deterministic) into the final statistics, from
which it computes the block scores (a second pass over the keys: a score needs the final max and sum) and, in the
program of the first score tile, the output.

One program per (request, KV head) serves the whole GQA group at once (its query heads are the rows of the tiles,
padded to ``BLOCK_G``). A KV position ``pos`` of request ``b`` lives at row ``pos % page`` of cache block
``block_table[b, pos // page]``. Lengths and tables may be device tensors nobody validated: a length is clamped to
the block table's capacity, a negative position reads nothing and a block id outside the cache masks its keys out
(zero rows in a compression), so no value makes a kernel read out of bounds.
"""
import triton
import triton.language as tl

from ...._core.triton.helpers import FLT_LOWEST, FLT_MAX, LOG2E, upcast
from .common import _group_tile, _softmax_init, _softmax_step, _store_group_tile


@triton.jit
def _length(lens_ptr, b, capacity):
    """Request ``b``'s length, clamped to ``[0, capacity]`` (the block table's positions)."""
    return tl.minimum(tl.maximum(tl.load(lens_ptr + b).to(tl.int32), 0), capacity)


@triton.jit
def _paged_tile(cache_ptr, bt_ptr, b, hk, pos, ok, dims, head_dim, bt_sb, c_s0, c_s1, c_s2, page, n_pages,
                UPCAST: tl.constexpr):
    """``(tile, ok)``: rows ``pos`` (``[BLOCK_N]``, masked by ``ok``; positions within the block table) of KV head
    ``hk`` of a paged cache as a ``[BLOCK_N, dims]`` tile (0 where masked); a row whose block id is outside the
    cache's ``n_pages`` drops out of ``ok`` (its key is masked out)."""
    blk = tl.load(bt_ptr + b.to(tl.int64) * bt_sb + pos // page, mask=ok, other=0).to(tl.int64)
    ok = ok & (blk >= 0) & (blk < n_pages)
    off = tl.where(ok, blk, 0) * c_s0 + (pos % page).to(tl.int64) * c_s1 + hk.to(tl.int64) * c_s2
    return upcast(tl.load(cache_ptr + off[:, None] + dims[None, :], mask=ok[:, None] & (dims[None, :] < head_dim),
                          other=0.0), UPCAST), ok


@triton.jit
def _paged_step(q, k_ptr, v_ptr, bt_ptr, b, hk, pos, ok, head_d, head_dv, bt_sb, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2,
                page, n_pages, m_i, l_i, acc, scale, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step of the group over cache rows ``pos`` (``[BLOCK_N]``, masked by ``ok``); also whether
    it read a key (whatever its score)."""
    k, ok = _paged_tile(k_ptr, bt_ptr, b, hk, pos, ok, tl.arange(0, BLOCK_D), head_d, bt_sb, k_s0, k_s1, k_s2, page,
                        n_pages, UPCAST)
    k_t = tl.trans(k)
    v, _ = _paged_tile(v_ptr, bt_ptr, b, hk, pos, ok, tl.arange(0, BLOCK_DV), head_dv, bt_sb, v_s0, v_s1, v_s2, page,
                       n_pages, UPCAST)
    s = tl.where(ok[None, :], tl.dot(q, k_t, input_precision=PRECISION) * scale, float("-inf"))
    m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, PRECISION)
    return m_i, l_i, acc, tl.max(ok.to(tl.int32), 0) > 0


@triton.jit
def _store_group(o_ptr, acc, l_i, b, hk, o_sb, o_sh, group, head_dv, BLOCK_G: tl.constexpr,
                 BLOCK_DV: tl.constexpr):
    """``acc / l`` (0 where nothing was attended; NaN where ``l`` is) for the group's output rows."""
    _store_group_tile(o_ptr, acc / tl.where(l_i == 0, 1.0, l_i)[:, None], b, hk * group, group, o_sb, o_sh, head_dv,
                      BLOCK_G, BLOCK_DV)


@triton.jit
def _store_partial(stats_ptr, part_ptr, part, m_i, l_i, acc, BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr):
    """A split's partial softmax statistics ``(max, sum)`` and unnormalised output, at index ``part``."""
    g = tl.arange(0, BLOCK_G)
    tl.store(stats_ptr + part * (2 * BLOCK_G) + g, m_i)
    tl.store(stats_ptr + part * (2 * BLOCK_G) + BLOCK_G + g, l_i)
    tl.store(part_ptr + part * (BLOCK_G * BLOCK_DV) + g[:, None] * BLOCK_DV + tl.arange(0, BLOCK_DV)[None, :], acc)


@triton.jit
def selected_decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, stats_ptr, part_ptr, topk_ptr, bt_ptr, lens_ptr,
                           q_sb, q_sh, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, o_sb, o_sh, t_sb, t_sh, bt_sb,
                           scale, n2, group, head_d, head_dv, page, n_pages, capacity, block, count, chunk,
                           BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_DV: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
                           PRECISION: tl.constexpr):
    """Softmax attention of request ``b``'s group over the selected blocks (in order, up to the first -1, each cut
    at the KV length; a repeated index counts twice, another negative one selects nothing); output 0 when nothing
    is selected. With ``SPLIT``, program ``split`` (axis 2) covers slots ``[split * chunk, (split + 1) * chunk)``
    and stores its partial ``(max, sum)`` and ``acc`` for ``decode_merge_kernel``; else it stores the output."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, count)
    kv_len = _length(lens_ptr, b, capacity)
    topk_row = topk_ptr + b.to(tl.int64) * t_sb + hk.to(tl.int64) * t_sh
    q = upcast(_group_tile(q_ptr, b, hk * group, group, q_sb, q_sh, head_d, BLOCK_G, BLOCK_D), UPCAST)
    m_i, l_i, acc = _softmax_init(BLOCK_G, BLOCK_DV)
    seen = tl.full([], 0, tl.int1)  # a key was read, whatever its score
    alive = 1
    for i in range(0, lo):  # a -1 in an earlier split's slots ends the list here too
        alive = tl.where(tl.load(topk_row + i) == -1, 0, alive)
    for i in range(lo, hi):
        idx = tl.load(topk_row + i).to(tl.int64)
        alive = tl.where(idx == -1, 0, alive)
        if alive != 0:
            for j0 in range(0, block, BLOCK_N):
                j = j0 + tl.arange(0, BLOCK_N)
                pos = idx * block + j
                ok = (j < block) & (pos >= 0) & (pos < kv_len)
                m_i, l_i, acc, read = _paged_step(q, k_ptr, v_ptr, bt_ptr, b, hk, pos, ok, head_d, head_dv, bt_sb,
                                                  k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, page, n_pages, m_i, l_i, acc,
                                                  scale, BLOCK_D, BLOCK_DV, UPCAST, PRECISION)
                seen = seen | read
    unkept = seen & (m_i == float("-inf")) & (l_i == 0)  # keys read, every score -inf: the formula's 0 / 0
    if SPLIT:  # marked by a max of FLT_LOWEST (see _merged_stats)
        m_i = tl.where(unkept, FLT_LOWEST, m_i)
        _store_partial(stats_ptr, part_ptr, (b.to(tl.int64) * n2 + hk) * tl.num_programs(2) + split, m_i, l_i, acc,
                       BLOCK_G, BLOCK_DV)
    else:
        _store_group(o_ptr, acc, tl.where(unkept, float("nan"), l_i), b, hk, o_sb, o_sh, group, head_dv, BLOCK_G,
                     BLOCK_DV)


@triton.jit
def compress_decode_kernel(q_ptr, k_ptr, v_ptr, stats_ptr, part_ptr, bt_ptr, lens_ptr,
                           q_sb, q_sh, k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, bt_sb,
                           scale, n2, group, head_d, head_dv, page, n_pages, capacity, chunk,
                           BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Split ``split`` (axis 2) of request ``b``'s group attention over its ``S2`` compressed keys: the online
    softmax over keys ``[split * chunk, (split + 1) * chunk)`` (clipped at ``S2``), stored unnormalised as the
    partial ``(max, sum)`` and ``acc`` of the split (an empty split: ``(-inf, 0)`` and zeros)."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    s2 = _length(lens_ptr, b, capacity)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, s2)
    q = upcast(_group_tile(q_ptr, b, hk * group, group, q_sb, q_sh, head_d, BLOCK_G, BLOCK_D), UPCAST)
    m_i, l_i, acc = _softmax_init(BLOCK_G, BLOCK_DV)
    seen = tl.full([], 0, tl.int1)
    for c0 in range(lo, hi, BLOCK_N):
        pos = c0 + tl.arange(0, BLOCK_N)
        m_i, l_i, acc, read = _paged_step(q, k_ptr, v_ptr, bt_ptr, b, hk, pos, pos < hi, head_d, head_dv, bt_sb,
                                          k_s0, k_s1, k_s2, v_s0, v_s1, v_s2, page, n_pages, m_i, l_i, acc, scale,
                                          BLOCK_D, BLOCK_DV, UPCAST, PRECISION)
        seen = seen | read
    m_i = tl.where(seen & (m_i == float("-inf")) & (l_i == 0), FLT_LOWEST, m_i)  # see _merged_stats
    _store_partial(stats_ptr, part_ptr, (b.to(tl.int64) * n2 + hk) * tl.num_programs(2) + split, m_i, l_i, acc,
                   BLOCK_G, BLOCK_DV)


@triton.jit
def _split_weights(stats_ptr, part, shift, BLOCK_G: tl.constexpr):
    """``(exp(max_s - shift), sum_s)`` of split ``part``'s partial statistics."""
    g = tl.arange(0, BLOCK_G)
    m_s = tl.load(stats_ptr + part * (2 * BLOCK_G) + g)
    return tl.exp2((m_s - shift) * LOG2E), tl.load(stats_ptr + part * (2 * BLOCK_G) + BLOCK_G + g)


@triton.jit
def _merged_stats(stats_ptr, first, splits, BLOCK_G: tl.constexpr):
    """``(max, shift, sum)`` of the group's softmax over all keys from the partials of splits ``first ..
    first + splits - 1``, in that order (the max first, then the rescaled sums: the same bits in every program).
    A split whose keys all score -inf stores a max of FLT_LOWEST: it weighs nothing next to a finite max, and a
    group row that only such splits gave keys gets sum NaN (the formula's 0 / 0)."""
    g = tl.arange(0, BLOCK_G)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for s in range(splits):
        m_i = tl.maximum(m_i, tl.load(stats_ptr + (first + s) * (2 * BLOCK_G) + g))
    shift = tl.where(m_i == float("-inf"), 0.0, m_i)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    for s in range(splits):
        alpha, l_s = _split_weights(stats_ptr, first + s, shift, BLOCK_G)
        l_i += l_s * alpha
    return m_i, shift, tl.where((m_i == FLT_LOWEST) & (l_i == 0), float("nan"), l_i)


@triton.jit
def _store_merged(o_ptr, part_ptr, stats_ptr, first, splits, shift, l_i, b, hk, o_sb, o_sh, group, head_dv,
                  BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Stores the group's output from the partial outputs of splits ``first ..`` (rescaled to ``shift``, summed in
    split order) and the merged sum ``l_i``."""
    g = tl.arange(0, BLOCK_G)
    dv = tl.arange(0, BLOCK_DV)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for s in range(splits):
        alpha, _ = _split_weights(stats_ptr, first + s, shift, BLOCK_G)
        acc += tl.load(part_ptr + (first + s) * (BLOCK_G * BLOCK_DV) + g[:, None] * BLOCK_DV + dv[None, :]) \
            * alpha[:, None]
    _store_group(o_ptr, acc, l_i, b, hk, o_sb, o_sh, group, head_dv, BLOCK_G, BLOCK_DV)


@triton.jit
def decode_merge_kernel(o_ptr, stats_ptr, part_ptr, o_sb, o_sh, n2, group, head_dv, splits, BLOCK_G: tl.constexpr,
                        BLOCK_DV: tl.constexpr):
    """The selected decode's output of (request ``b``, KV head ``hk``) from its splits' partials, merged in split
    order (bitwise deterministic)."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    first = (b.to(tl.int64) * n2 + hk) * splits
    _, shift, l_i = _merged_stats(stats_ptr, first, splits, BLOCK_G)
    _store_merged(o_ptr, part_ptr, stats_ptr, first, splits, shift, l_i, b, hk, o_sb, o_sh, group, head_dv, BLOCK_G,
                  BLOCK_DV)


@triton.jit
def compress_decode_score_kernel(q_ptr, k_ptr, o_ptr, score_ptr, stats_ptr, part_ptr, bt_ptr, lens_ptr,
                                 q_sb, q_sh, k_s0, k_s1, k_s2, o_sb, o_sh, sc_sb, sc_sh, bt_sb,
                                 scale, n2, group, head_d, head_dv, page, n_pages, capacity, splits, m, nn,
                                 cmp_stride, cmp_block, sel_block, n_scores, BLOCK_G: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                                 BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Second pass of the compressed decode, one program per (request x ``BLOCK_K`` selection blocks, KV head): the
    final softmax statistics merged from the splits' partials (fixed order), then the tile's group-summed block
    scores ``sum_t times[t] * P[m*(k+1) - t]`` (0 for blocks ``k >= S2 - 1``) with ``P`` from those final
    statistics, the always chosen blocks (the first and the last two) at ``FLT_MAX`` for the top-k kernel, blocks
    past the request's (up to ``n_scores``) at ``-inf``. The program of the first tile also merges the splits'
    outputs (same order) and stores the attention output."""
    tiles = tl.maximum(tl.cdiv(n_scores, BLOCK_K), 1)  # as the plan's grid
    b = tl.program_id(0) // tiles
    tile = tl.program_id(0) % tiles
    hk = tl.program_id(1)
    k0 = tile * BLOCK_K
    s2 = _length(lens_ptr, b, capacity)
    first = (b.to(tl.int64) * n2 + hk) * splits
    m_i, shift, l_i = _merged_stats(stats_ptr, first, splits, BLOCK_G)
    if tile == 0:
        _store_merged(o_ptr, part_ptr, stats_ptr, first, splits, shift, l_i, b, hk, o_sb, o_sh, group, head_dv,
                      BLOCK_G, BLOCK_DV)

    q = upcast(_group_tile(q_ptr, b, hk * group, group, q_sb, q_sh, head_d, BLOCK_G, BLOCK_D), UPCAST)
    in_group = tl.arange(0, BLOCK_G) < group
    log2_l = tl.log2(tl.where(l_i > 0, l_i, 1.0))
    taps = m + nn - 1
    n_blocks = tl.minimum(((s2 - 1) * cmp_stride + cmp_block + sel_block - 1) // sel_block, n_scores)
    blocks = k0 + tl.arange(0, BLOCK_K)
    c_lo = tl.maximum(m * (k0 + 1) - taps + 1, 0)
    c_hi = tl.minimum(m * (k0 + BLOCK_K) + 1, s2)
    score = tl.zeros([BLOCK_K], tl.float32)
    for c0 in range(c_lo, c_hi, BLOCK_N):
        pos = c0 + tl.arange(0, BLOCK_N)
        ok = pos < c_hi
        k, ok = _paged_tile(k_ptr, bt_ptr, b, hk, pos, ok, tl.arange(0, BLOCK_D), head_d, bt_sb, k_s0, k_s1, k_s2,
                            page, n_pages, UPCAST)
        k_t = tl.trans(k)
        s = tl.dot(q, k_t, input_precision=PRECISION) * scale
        p = tl.exp2((s - m_i[:, None]) * LOG2E - log2_l[:, None])
        p_sum = tl.sum(tl.where(in_group[:, None] & ok[None, :], p, 0.0), 0)  # [BLOCK_N], summed over the group
        t = m * (blocks[None, :] + 1) - pos[:, None]
        times = tl.minimum(tl.minimum(t + 1, nn), taps - t)
        w = tl.where((t >= 0) & (t < taps) & (blocks[None, :] < s2 - 1), times, 0).to(tl.float32)
        score += tl.sum(p_sum[:, None] * w, 0)
    forced = (blocks == 0) | (blocks == n_blocks - 2) | (blocks == n_blocks - 1)
    score = tl.where(blocks < n_blocks, tl.where(forced, FLT_MAX, score), float("-inf"))
    off = b.to(tl.int64) * sc_sb + hk.to(tl.int64) * sc_sh + blocks
    tl.store(score_ptr + off, score, mask=blocks < n_scores)


@triton.jit
def compress_cache_kernel(x_ptr, w_ptr, slot_ptr, bt_ptr, lens_ptr, cache_ptr, x_s0, x_s1, x_s2, w_sw, w_sh, bt_sb,
                          c_s0, c_s1, n_requests, n_pages, capacity, n_rows, page, head_d, block, stride,
                          BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    """``nsa_compress_infer``: when request ``b``'s length ``L`` completes a block (``L >= block``, ``(L - block) %
    stride == 0``), head ``h`` of cache row ``slot_mapping[b]`` gets ``sum_t weight[t, h] * x[L - block + t, h]``
    (fp32 weights; ``BLOCK_T`` taps per step as a ``[BLOCK_T, D]`` tile, 16-byte loads), read through the block
    table. A row that a later completing request names is left to that request (the
    reference's order), so every row has one writer. Lengths are clamped into range; a slot outside the cache writes
    nothing and a block outside the cache gives zero rows."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = _length(lens_ptr, b, capacity)
    if (n < block) | ((n - block) % stride != 0):
        return
    slot = tl.load(slot_ptr + b).to(tl.int64)
    if (slot < 0) | (slot >= n_rows):
        return
    later = 0
    for r0 in range(b + 1, n_requests, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        ok = r < n_requests
        n_r = tl.minimum(tl.maximum(tl.load(lens_ptr + r, mask=ok, other=0).to(tl.int32), 0), capacity)
        s_r = tl.load(slot_ptr + r, mask=ok, other=-1).to(tl.int64)
        completes = ok & (n_r >= block) & ((n_r - block) % stride == 0)
        later += tl.sum((completes & (s_r == slot)).to(tl.int32), 0)
    if later == 0:
        d = tl.arange(0, BLOCK_D)
        acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        for t0 in range(0, block, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            pos = n - block + t
            blk = tl.load(bt_ptr + b.to(tl.int64) * bt_sb + pos // page, mask=t < block, other=0).to(tl.int64)
            inside = (t < block) & (blk >= 0) & (blk < n_pages)
            x = tl.load(x_ptr + (tl.where(inside, blk, 0) * x_s0 + (pos % page).to(tl.int64) * x_s1)[:, None]
                        + tl.cast(h, tl.int64) * x_s2 + d[None, :], mask=inside[:, None] & (d[None, :] < head_d),
                        other=0.0)
            acc += x.to(tl.float32) * tl.load(w_ptr + t * w_sw + h * w_sh, mask=t < block, other=0.0)[:, None]
        tl.store(cache_ptr + slot.to(tl.int64) * c_s0 + tl.cast(h, tl.int64) * c_s1 + d,
                 tl.sum(acc, 0).to(cache_ptr.dtype.element_ty), mask=d < head_d)
