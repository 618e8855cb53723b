"""The indexer KL loss's kernels (``kl_launch.py`` plans them): the loss and the indexer's gradients, deterministic
(no atomics: every output element has one writer and a fixed summation order).

``indexer_kl_loss_kernel`` (grid: ``(S1, B)`` BSND or ``(T1, 1)`` TND, one query row per program, every head): the
row's entries are the first ``min(K, L)`` up to the first -1 (``L`` the causal key limit), those negative or not below
``L`` masked out (the sparse attention's rule). Pass 1 walks them ``BLOCK_N`` at a time for the indexer's scores
``I = sum_g w_g relu(q_index_g . k_index_j)`` and their softmax's running max and sum. Pass 2 recomputes ``I``, takes
``Y = softmax(I)`` and the main attention's head-averaged ``P = mean_h exp(scale * (q_h . k_j + q_rope_h . k_rope_j)
- max_h) / sum_h`` (heads with ``sum_h = 0`` add 0; the 512 latent columns ``BLOCK_C`` at a time), and stores the
row's loss ``sum P' (log P' - log Y')`` (both clamped at 1e-8), ``d_weights = sum_r dI relu(S)`` and
``d_query_index = dS k_index`` with ``dI = Y - P`` and ``dS = dI w [S > 0]`` rounded to the inputs' dtype; it keeps
``dI`` per (row, slot) and writes each slot's inverted-list key (the flat key row it selects, ``n_lists`` for none).

``indexer_kl_loss_dk_kernel`` (grid: list chunks): ``d_key_index`` of one key row over its chunk's (row, slot) pairs
in list order, ``BLOCK_M`` (pair, index head) rows per step, ``dS`` recomputed from the pair's ``dI``; a list of
one chunk stores its row, the chunks of a longer list store fp32 partials that sparse attention's
``sparse_attention_dkdv_reduce_kernel`` adds in chunk order. ``indexer_kl_loss_sum_kernel`` adds the rows' losses
in row order.
"""
import triton
import triton.language as tl

from ...._core.triton.helpers import FLT_LOWEST, LOG2E, base2_max, upcast
from ...common.triton.inverted_lists import list_chunk
from ...common.triton.token_rows import head_rows, key_limit, key_rows, kv_range, load_rows, query_row
from .sparse_attention import entry_count
from .sparse_attention_bwd import _chunked_product, _pair_offsets, _probabilities, _write_list_keys

CLAMP: tl.constexpr = tl.constexpr(1e-8)  # the loss's clamp of both distributions
SUM_TILE: tl.constexpr = tl.constexpr(1024)  # rows per step of the loss sum


@triton.jit
def _index_scores(qi_ptr, b, token, index_heads, qi_sb, qi_st, qi_sh, w, ki_ptr, outer, inner, ok, ki_s0, ki_s1,
                  index_d, UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_DI: tl.constexpr):
    """``(S [BLOCK_G, BLOCK_N], I [BLOCK_N], k_index [BLOCK_N, BLOCK_DI])`` of the gathered key rows (the index query
    is loaded again at each step, L1 hits, rather than held in registers beside the gradient's accumulator)."""
    qi = upcast(head_rows(qi_ptr, b, token, 0, index_heads, qi_sb, qi_st, qi_sh, index_d, BLOCK_G, BLOCK_DI), UPCAST)
    ki = upcast(load_rows(ki_ptr, outer, inner, ok, ki_s0, ki_s1, index_d, BLOCK_DI), UPCAST)
    s = tl.dot(qi, tl.trans(ki), input_precision=PRECISION)
    return s, tl.sum(tl.maximum(s, 0.0) * w[:, None], 0), ki


@triton.jit
def indexer_kl_loss_kernel(q_ptr, qr_ptr, k_ptr, kr_ptr, qi_ptr, ki_ptr, w_ptr, idx_ptr, smax_ptr, ssum_ptr,
                           dqi_ptr, dw_ptr, di_ptr, loss_ptr, key_ptr, span_ptr, q_lens_ptr, kv_lens_ptr,
                           q_sb, q_st, q_sh, qr_sb, qr_st, qr_sh, qi_sb, qi_st, qi_sh, w_sb, w_st, w_sh,
                           dqi_sb, dqi_st, dqi_sh, dw_sb, dw_st, dw_sh, k_s0, k_s1, kr_s0, kr_s1, ki_s0, ki_s1,
                           i_sb, i_st, q_lens_stride, kv_lens_stride, s1, s2, n_batch, heads, head_d, rope_d,
                           index_heads, index_d, count, inner_rows, n_lists, scale,
                           Q_PACKED: tl.constexpr, Q_LENS: tl.constexpr, KV_MODE: tl.constexpr,
                           KV_LENS: tl.constexpr, CAUSAL: tl.constexpr, HAS_ROPE: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr,
                           BLOCK_DI: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """One query row's loss, ``d_weights``, ``d_query_index``, ``dI`` and list keys (see the module docstring)."""
    b, token, row, q_len, valid = query_row(q_lens_ptr, q_lens_stride, s1, n_batch, Q_PACKED, Q_LENS)
    kv_start, kv_len = kv_range(kv_lens_ptr, kv_lens_stride, b, s2, KV_MODE, KV_LENS)
    limit = tl.maximum(key_limit(kv_len, q_len, row, valid, CAUSAL), 0)
    r = token
    if not Q_PACKED:
        r += b.to(tl.int64) * s1
    idx_row = idx_ptr + b.to(tl.int64) * i_sb + token * i_st
    n_entries = entry_count(idx_row, count, limit, 1)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < index_heads
    w = tl.load(w_ptr + b.to(tl.int64) * w_sb + token * w_st + g * w_sh, mask=g_ok, other=0.0).to(tl.float32)
    # pass 1: the indexer softmax's max and sum (keys BSND or TND: key_rows gets no block table, idx_ptr stands in)
    m_i = tl.full([], FLT_LOWEST, tl.float32)
    l_i = tl.zeros([], tl.float32)
    for f0 in range(0, n_entries, BLOCK_N):
        f = f0 + tl.arange(0, BLOCK_N)
        entry = tl.load(idx_row + f, mask=f < n_entries, other=-1).to(tl.int64)
        ok = (f < n_entries) & (entry >= 0) & (entry < limit)
        outer, inner, ok = key_rows(idx_ptr, b, entry, ok, kv_start, 0, 1, 1, KV_MODE)
        _, score, _ = _index_scores(qi_ptr, b, token, index_heads, qi_sb, qi_st, qi_sh, w, ki_ptr, outer, inner, ok,
                                    ki_s0, ki_s1, index_d, UPCAST, PRECISION, BLOCK_G, BLOCK_DI)
        m_new = tl.maximum(m_i, tl.max(tl.where(ok, score, FLT_LOWEST), 0))
        kept = tl.exp2((tl.where(ok, score, m_new) - m_new) * LOG2E)
        l_i = l_i * tl.exp2(base2_max(m_i) - base2_max(m_new)) + tl.sum(tl.where(ok, kept, 0.0), 0)
        m_i = m_new
    # pass 2: P, Y, the loss and the gradients
    h = tl.arange(0, BLOCK_H)
    h_ok = h < heads
    stat = r * heads + h
    m = tl.load(smax_ptr + stat, mask=h_ok, other=0.0).to(tl.float32)
    l = tl.load(ssum_ptr + stat, mask=h_ok, other=0.0).to(tl.float32)
    q_off = b.to(tl.int64) * q_sb + token * q_st + h.to(tl.int64) * q_sh
    qr_off = b.to(tl.int64) * qr_sb + token * qr_st + h.to(tl.int64) * qr_sh
    loss = tl.zeros([], tl.float32)
    d_w = tl.zeros([BLOCK_G], tl.float32)
    d_qi = tl.zeros([BLOCK_G, BLOCK_DI], tl.float32)
    for f0 in range(0, n_entries, BLOCK_N):
        f = f0 + tl.arange(0, BLOCK_N)
        entry = tl.load(idx_row + f, mask=f < n_entries, other=-1).to(tl.int64)
        ok = (f < n_entries) & (entry >= 0) & (entry < limit)
        outer, inner, ok = key_rows(idx_ptr, b, entry, ok, kv_start, 0, 1, 1, KV_MODE)
        s, score, ki = _index_scores(qi_ptr, b, token, index_heads, qi_sb, qi_st, qi_sh, w, ki_ptr, outer, inner,
                                     ok, ki_s0, ki_s1, index_d, UPCAST, PRECISION, BLOCK_G, BLOCK_DI)
        y = tl.where(ok, tl.exp2((tl.where(ok, score, m_i) - m_i) * LOG2E) / l_i, 0.0)
        logit = _chunked_product(q_ptr, q_off, h_ok, k_ptr, outer, inner, ok, k_s0, k_s1, head_d,
                                 tl.zeros([BLOCK_H, BLOCK_N], tl.float32), UPCAST, PRECISION, BLOCK_C)
        if HAS_ROPE:
            logit = _chunked_product(qr_ptr, qr_off, h_ok, kr_ptr, outer, inner, ok, kr_s0, kr_s1, rope_d, logit,
                                     UPCAST, PRECISION, BLOCK_C)
        p = tl.sum(_probabilities(logit, ok[None, :] & (l > 0.0)[:, None], m, l, scale), 0) / heads
        p_c, y_c = tl.maximum(p, CLAMP), tl.maximum(y, CLAMP)
        loss += tl.sum(tl.where(ok, p_c * (tl.log(p_c) - tl.log(y_c)), 0.0), 0)
        d_i = tl.where(ok, y - p, 0.0)
        tl.store(di_ptr + r * count + f, d_i, mask=f < n_entries)
        d_w += tl.sum(tl.maximum(s, 0.0) * d_i[None, :], 1)
        d_s = upcast((d_i[None, :] * w[:, None] * (s > 0.0)).to(qi_ptr.dtype.element_ty), UPCAST)
        d_qi = tl.dot(d_s, ki, d_qi, input_precision=PRECISION)
    tl.store(loss_ptr + r, loss)
    tl.store(dw_ptr + b.to(tl.int64) * dw_sb + token * dw_st + g * dw_sh, d_w.to(dw_ptr.dtype.element_ty), mask=g_ok)
    e = tl.arange(0, BLOCK_DI)
    out = b.to(tl.int64) * dqi_sb + token * dqi_st + g[:, None].to(tl.int64) * dqi_sh + e[None, :]
    tl.store(dqi_ptr + out, d_qi.to(dqi_ptr.dtype.element_ty), mask=g_ok[:, None] & (e[None, :] < index_d))
    _write_list_keys(idx_row, key_ptr + r * count, span_ptr + r * count, idx_ptr, b, limit, n_entries, kv_start, 0,
                     1, 1, count, 1, inner_rows, n_lists, KV_MODE)


@triton.jit
def indexer_kl_loss_dk_kernel(qi_ptr, ki_ptr, w_ptr, di_ptr, dki_ptr, part_ptr, list_start_ptr, pair_ptr,
                              unit_list_ptr, unit_end_ptr, slot_end_ptr, qi_sb, qi_st, qi_sh, w_sb, w_st, w_sh,
                              ki_s0, ki_s1, dki_s0, dki_s1, s1, index_heads, index_d, count, inner_rows, n_lists,
                              chunk, Q_PACKED: tl.constexpr, BLOCK_DI: tl.constexpr, BLOCK_M: tl.constexpr):
    """``d_key_index`` of list ``unit_list[u]``'s key row over its chunk's pairs (``program_id(0)``: unit ``u``)."""
    u = tl.program_id(0)
    lst = tl.load(unit_list_ptr + u)
    if lst >= n_lists:
        return
    lo, hi, chunks, c = list_chunk(list_start_ptr, unit_end_ptr, lst, u, chunk)
    if hi <= lo:
        return
    e = tl.arange(0, BLOCK_DI)
    e_ok = e < index_d
    key_off = (lst // inner_rows) * ki_s0 + (lst % inner_rows) * ki_s1
    ki = tl.load(ki_ptr + key_off + e, mask=e_ok, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_DI], tl.float32)
    n_rows = ((hi - lo) * index_heads).to(tl.int32)
    for m0 in range(0, n_rows, BLOCK_M):
        rr = m0 + tl.arange(0, BLOCK_M)
        ok = rr < n_rows
        pair = tl.load(pair_ptr + lo + rr // index_heads, mask=ok, other=0).to(tl.int64)
        head = (rr % index_heads).to(tl.int64)
        qi_off = _pair_offsets(pair, head, count, s1, qi_sb, qi_st, qi_sh, Q_PACKED)
        qi = tl.load(qi_ptr + qi_off[:, None] + e[None, :], mask=ok[:, None] & e_ok[None, :], other=0.0)
        qi = qi.to(tl.float32)
        w = tl.load(w_ptr + _pair_offsets(pair, head, count, s1, w_sb, w_st, w_sh, Q_PACKED), mask=ok,
                    other=0.0).to(tl.float32)
        d_i = tl.load(di_ptr + pair, mask=ok, other=0.0)
        s = tl.sum(qi * ki[None, :], 1)
        d_s = (d_i * w * (s > 0.0)).to(qi_ptr.dtype.element_ty).to(tl.float32)
        acc += tl.sum(d_s[:, None] * qi, 0)
    if chunks == 1:
        tl.store(dki_ptr + (lst // inner_rows) * dki_s0 + (lst % inner_rows) * dki_s1 + e,
                 acc.to(dki_ptr.dtype.element_ty), mask=e_ok)
    else:
        slot = tl.load(slot_end_ptr + lst) - chunks + c
        tl.store(part_ptr + slot * index_d + e, acc, mask=e_ok)


@triton.jit
def indexer_kl_loss_sum_kernel(row_loss_ptr, loss_ptr, rows):
    """``loss[0]``: the rows' losses added in row order (one program)."""
    acc = tl.zeros([SUM_TILE], tl.float32)
    for r0 in range(0, rows, SUM_TILE):
        r = r0 + tl.arange(0, SUM_TILE)
        acc += tl.load(row_loss_ptr + r, mask=r < rows, other=0.0)
    tl.store(loss_ptr, tl.sum(acc, 0))
