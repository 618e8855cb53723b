"""The lightning indexers' streaming top-k (DeepSeek-V3.2's and V4's kernels share it): the weighted-ReLU scores of
one query token against its allowed keys, fused with a running top-k held in registers; no score matrix is stored.

A program holds its token's query heads as the rows of one ``[BLOCK_H, D]`` tile and walks the keys ``j < limit`` in
chunks of ``BLOCK_K`` (the top-k width, a power of two), each chunk in key tiles of ``BLOCK_N``:
``score[j] = sum_h w[h] * relu(q[h] . k[j])`` in fp32, packed with its position into one int64 sort key (the score's
order-preserving bits high, ``j`` with its 32 bits flipped low: equal scores rank the smaller position first). The
running top-k is a descending ``[BLOCK_K]`` vector; a finished chunk is merged into it by one bitonic step: the chunk
sorted ascending, the element-wise maximum with the running vector is exactly the top ``BLOCK_K`` of both, sorted
again. Memory per program: two ``[BLOCK_K]`` int64 vectors and one key tile, whatever the sequence length.
"""
import triton
import triton.language as tl

from ...._core.triton.helpers import upcast
from .token_rows import key_rows, load_rows

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
def streaming_topk(q, w, k_ptr, bt_ptr, b, limit, kv_start, k_s0, k_s1, bt_sb, page, n_pages, head_d,
                   KV_MODE: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The descending ``[BLOCK_K]`` packed top-k of query heads ``q [BLOCK_H, BLOCK_D]`` (weights ``w [BLOCK_H]``,
    fp32, 0 for padding heads) over batch ``b``'s keys ``j < limit`` (:func:`.token_rows.key_rows` addressing);
    ``NONE_KEY`` past the keys. Read it with :func:`topk_positions` and :func:`topk_scores`."""
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
    return best


@triton.jit
def topk_positions(best):
    """``(positions int32, picked)`` of a packed top-k (positions meaningless where not ``picked``)."""
    return ((best & LOW_BITS) ^ LOW_BITS).to(tl.int32), best != NONE_KEY


@triton.jit
def topk_scores(best):
    """The fp32 scores of a packed top-k (meaningless where not picked)."""
    return _unordered((best >> 32).to(tl.int32))
