"""The lightning indexer's kernel: weighted-ReLU scores of every allowed key fused with a streaming top-k, one
program per (query row, batch); no score matrix is stored (``launch.py`` plans it).

A program holds its row's query heads as the rows of one ``[BLOCK_H, D]`` tile (64 heads: a tensor-core product
of 64 rows per key tile). It walks the allowed keys (``j < L`` for sparse mode 0, ``j <= Lk - Lq + i`` for mode 3)
in chunks of ``BLOCK_K`` (the top-k width, a power of two >= ``sparse_count``), each chunk in key tiles of
``BLOCK_N``: ``score[j] = sum_h w[h] * relu(q[h] . k[j])`` in fp32, packed with its position into one int64 sort
key (the score's order-preserving bits high, ``j`` with its 32 bits flipped low: equal scores rank the smaller position first,
as the reference does). The running top-k is a descending ``[BLOCK_K]`` vector in registers; a finished chunk is
merged into it by one bitonic step: the chunk sorted ascending, the element-wise maximum with the running vector is
exactly the top ``BLOCK_K`` of both, sorted again. Memory per program is two ``[BLOCK_K]`` int64 vectors and one
key tile, whatever the sequence length; the work is the scores' product plus two sorts of ``BLOCK_K`` per
``BLOCK_K`` keys. The output row lists the positions in descending score order, then -1; ``sparse_values`` (when
asked) the fp32 scores rounded to the query dtype, -inf after the last position.
"""
import triton
import triton.language as tl

from ...._core.triton.helpers import upcast
from .common import head_rows, key_rows, kv_range, load_rows, query_row

NONE_KEY: tl.constexpr = tl.constexpr(-9223372036854775807 - 1)  # sorts below every packed score
LOW_BITS: tl.constexpr = tl.constexpr(0xFFFFFFFF)


@triton.jit
def _ordered(score):
    """int32 whose signed order is ``score``'s float order (negative floats: magnitude bits flipped)."""
    bits = score.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _unordered(key32):
    """The float of :func:`_ordered`'s int32 (the map is its own inverse)."""
    return (key32 ^ ((key32 >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _pack(score, pos, ok):
    """The int64 sort keys of scores at key positions ``pos`` (``NONE_KEY`` where not ``ok``)."""
    key = (_ordered(score).to(tl.int64) << 32) | (pos.to(tl.int64) ^ LOW_BITS)
    return tl.where(ok, key, NONE_KEY)


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
    limit = kv_len
    if CAUSAL:
        limit = tl.minimum(kv_len, kv_len - q_len + row + 1)
    limit = tl.where(valid, tl.maximum(limit, 0), 0)
    q = upcast(head_rows(q_ptr, b, token, 0, heads, q_sb, q_st, q_sh, head_d, BLOCK_H, BLOCK_D), UPCAST)
    h = tl.arange(0, BLOCK_H)
    w = tl.load(w_ptr + b.to(tl.int64) * w_sb + token * w_st + h * w_sh, mask=h < heads, other=0.0).to(tl.float32)
    slot = tl.arange(0, BLOCK_K // BLOCK_N)[:, None]
    best = tl.full([BLOCK_K], NONE_KEY, tl.int64)
    for c0 in range(0, limit, BLOCK_K):
        chunk = tl.full([BLOCK_K // BLOCK_N, BLOCK_N], NONE_KEY, tl.int64)
        for n in range(0, tl.cdiv(tl.minimum(limit - c0, BLOCK_K), BLOCK_N)):
            pos = c0 + n * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = pos < limit
            outer, inner, ok = key_rows(bt_ptr, b, pos, ok, kv_start, bt_sb, page, n_pages, KV_MODE)
            k = upcast(load_rows(k_ptr, outer, inner, ok, k_s0, k_s1, head_d, BLOCK_D), UPCAST)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            score = tl.sum(tl.maximum(s, 0.0) * w[:, None], 0)
            chunk = tl.where(slot == n, _pack(score, pos, ok)[None, :], chunk)
        best = tl.sort(tl.maximum(best, tl.sort(tl.reshape(chunk, [BLOCK_K]))), descending=True)
    k_slot = tl.arange(0, BLOCK_K)
    picked = best != NONE_KEY
    out = b.to(tl.int64) * o_sb + token * o_st + k_slot
    pos = ((best & LOW_BITS) ^ LOW_BITS).to(tl.int32)
    tl.store(idx_ptr + out, tl.where(picked, pos, -1), mask=k_slot < count)
    if RETURN_VALUE:
        score = _unordered((best >> 32).to(tl.int32))
        tl.store(val_ptr + out, tl.where(picked, score, float("-inf")).to(val_ptr.dtype.element_ty),
                 mask=k_slot < count)
