"""The lightning indexer's kernel: weighted-ReLU scores of every allowed key fused with a streaming top-k
(:mod:`attnops.ops.common.triton.topk`), one program per (query row, batch); no score matrix is stored
(``launch.py`` plans it). The allowed keys are ``j < L`` for sparse mode 0, ``j <= Lk - Lq + i`` for mode 3. The
output row lists the positions in descending score order, then -1; ``sparse_values`` (when asked) the fp32 scores
rounded to the query dtype, -inf after the last position.
"""
import triton
import triton.language as tl

from ...._core.triton.helpers import upcast
from ...common.triton.token_rows import head_rows, key_limit, kv_range, query_row
from ...common.triton.topk import streaming_topk, topk_positions, topk_scores


@triton.jit
def indexer_topk_kernel(q_ptr, k_ptr, w_ptr, idx_ptr, val_ptr, q_lens_ptr, kv_lens_ptr, bt_ptr,
                        q_sb, q_st, q_sh, k_s0, k_s1, w_sb, w_st, w_sh, o_sb, o_st, q_lens_stride, kv_lens_stride,
                        bt_sb, s1, s2, n_batch, heads, head_d, page, n_pages, count,
                        Q_PACKED: tl.constexpr, Q_LENS: tl.constexpr, KV_MODE: tl.constexpr, KV_LENS: tl.constexpr,
                        CAUSAL: tl.constexpr, RETURN_VALUE: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    b, token, row, q_len, valid = query_row(q_lens_ptr, q_lens_stride, s1, n_batch, Q_PACKED, Q_LENS)
    kv_start, kv_len = kv_range(kv_lens_ptr, kv_lens_stride, b, s2, KV_MODE, KV_LENS)
    limit = tl.maximum(key_limit(kv_len, q_len, row, valid, CAUSAL), 0)
    q = upcast(head_rows(q_ptr, b, token, 0, heads, q_sb, q_st, q_sh, head_d, BLOCK_H, BLOCK_D), UPCAST)
    h = tl.arange(0, BLOCK_H)
    w = tl.load(w_ptr + b.to(tl.int64) * w_sb + token * w_st + h * w_sh, mask=h < heads, other=0.0).to(tl.float32)
    best = streaming_topk(q, w, k_ptr, bt_ptr, b, limit, kv_start, k_s0, k_s1, bt_sb, page, n_pages, head_d, KV_MODE,
                          BLOCK_D, UPCAST, PRECISION, BLOCK_N, BLOCK_K)
    k_slot = tl.arange(0, BLOCK_K)
    pos, picked = topk_positions(best)
    out = b.to(tl.int64) * o_sb + token * o_st + k_slot
    tl.store(idx_ptr + out, tl.where(picked, pos, -1), mask=k_slot < count)
    if RETURN_VALUE:
        score = topk_scores(best)
        tl.store(val_ptr + out, tl.where(picked, score, float("-inf")).to(val_ptr.dtype.element_ty),
                 mask=k_slot < count)
