"""``@triton.jit`` helpers shared by the kernels that address one query token per program and gather key rows (the
lightning indexers of DeepSeek-V3.2 and V4, DSA sparse flash attention): where a query row and its batch's keys live,
read from the device length tensors (no host metadata), and the key rows of any layout. No allocation here.

Query side (``Q_PACKED``): BSND rows are programs ``(row, batch)``, the batch's valid length from its entry of
``actual_seq_lengths_query`` (``q_lens_mode`` 1; stride 0 broadcasts a one-entry tensor) or the padded length (0);
TND tokens are programs ``(token, 0)`` that find their batch among the cumulative ends (a token past the last end is
padding). Key side (``KV_MODE``): 0 dense ``[B, S2, ...]`` (per-batch lengths or S2), 1 TND (cumulative ends), 2
paged (``block_table``, per-batch lengths). Every length is clamped to what the tensors hold and a block id outside
the cache masks its keys out, so no value makes a kernel read out of bounds.
"""
import triton
import triton.language as tl

KV_DENSE: tl.constexpr = tl.constexpr(0)
KV_PACKED: tl.constexpr = tl.constexpr(1)
KV_PAGED: tl.constexpr = tl.constexpr(2)
SEARCH_TILE: tl.constexpr = tl.constexpr(64)


@triton.jit
def _clamped(ptr, i, hi):
    """``ptr[i]`` clamped to ``[0, hi]``."""
    return tl.minimum(tl.maximum(tl.load(ptr + i).to(tl.int64), 0), hi)


@triton.jit
def _cumulative_bounds(ends_ptr, b, total):
    """``(start, end)`` of batch ``b`` from cumulative ends (both clamped to ``[0, total]``; end >= start)."""
    start = tl.where(b > 0, _clamped(ends_ptr, tl.maximum(b - 1, 0), total), 0)
    return start, tl.maximum(_clamped(ends_ptr, b, total), start)


@triton.jit
def _batch_of_token(ends_ptr, t, n_batch):
    """The batch of packed token ``t``: the number of cumulative ends ``<= t`` (``n_batch``: padding)."""
    b = tl.zeros([], tl.int32)
    for j0 in range(0, n_batch, SEARCH_TILE):
        j = j0 + tl.arange(0, SEARCH_TILE)
        ends = tl.load(ends_ptr + j, mask=j < n_batch, other=0).to(tl.int64)
        b += tl.sum(((ends <= t) & (j < n_batch)).to(tl.int32), 0)
    return b


@triton.jit
def query_row(q_lens_ptr, q_lens_stride, s1, n_batch, Q_PACKED: tl.constexpr, Q_LENS: tl.constexpr):
    """``(b, token, row, q_len, valid)`` of this program: its batch, its token (the index along the packed T axis or
    along S for BSND), its row within the batch, the batch's query length and whether the row is a real query."""
    if Q_PACKED:
        token = tl.program_id(0).to(tl.int64)
        b = _batch_of_token(q_lens_ptr, token, n_batch)
        bc = tl.minimum(b, n_batch - 1)
        start, end = _cumulative_bounds(q_lens_ptr, bc, s1)
        return bc, token, token - start, end - start, b < n_batch
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    q_len = s1 + tl.zeros([], tl.int64)  # int64 like the packed branch's (every return is typed)
    if Q_LENS:
        q_len = _clamped(q_lens_ptr, b * q_lens_stride, s1)
    return b, row, row, q_len, row < q_len


@triton.jit
def kv_range(kv_lens_ptr, kv_lens_stride, b, s2, KV_MODE: tl.constexpr, KV_LENS: tl.constexpr):
    """``(first row, length)`` of batch ``b``'s keys (``s2``: the padded length, the packed total or the block table's
    capacity)."""
    if KV_MODE == KV_PACKED:
        start, end = _cumulative_bounds(kv_lens_ptr, b, s2)
        return start, end - start
    length = s2 + tl.zeros([], tl.int64)  # int64 like the packed branch's (every return is typed)
    if KV_LENS:
        length = _clamped(kv_lens_ptr, b * kv_lens_stride, s2)
    return tl.zeros([], tl.int64), length


@triton.jit
def key_limit(kv_len, q_len, row, valid, CAUSAL: tl.constexpr):
    """How many of its batch's first keys a query row sees: all ``kv_len``, or with ``CAUSAL`` those up to its
    bottom-right-aligned diagonal (``kv_len - q_len + row + 1``: negative where it sees none); 0 for a row that is no
    real query."""
    limit = kv_len
    if CAUSAL:
        limit = tl.minimum(kv_len, kv_len - q_len + row + 1)
    return tl.where(valid, limit, 0)


@triton.jit
def key_rows(bt_ptr, b, pos, ok, kv_start, bt_sb, page, n_pages, KV_MODE: tl.constexpr):
    """``(outer, inner, ok)``: the coordinates of batch ``b``'s key positions ``pos`` (masked by ``ok``): dense
    ``(b, pos)``, packed ``(0, start + pos)``, paged ``(block id, pos % page)``; a row's offset in a tensor is
    ``outer * stride(0) + inner * stride(1)``. Paged, ``ok`` drops the positions whose block id is outside the
    cache (such a block contributes no keys)."""
    pos = tl.where(ok, pos, 0).to(tl.int32)
    if KV_MODE == KV_PAGED:
        blk = tl.load(bt_ptr + b.to(tl.int64) * bt_sb + pos // page, mask=ok, other=0)
        ok = ok & (blk >= 0) & (blk < n_pages)
        return tl.where(ok, blk, 0).to(tl.int64), (pos % page).to(tl.int64), ok
    if KV_MODE == KV_PACKED:
        return tl.zeros_like(pos).to(tl.int64), kv_start + pos.to(tl.int64), ok
    return tl.zeros_like(pos).to(tl.int64) + b.to(tl.int64), pos.to(tl.int64), ok


@triton.jit
def load_rows(ptr, outer, inner, ok, s0, s1, width, BLOCK_W: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_W]`` rows at ``(outer, inner)`` of a tensor with strides ``(s0, s1, ..., 1)`` (0 where
    masked)."""
    w = tl.arange(0, BLOCK_W)
    off = outer * s0 + inner * s1
    return tl.load(ptr + off[:, None] + w[None, :], mask=ok[:, None] & (w[None, :] < width), other=0.0)


@triton.jit
def head_rows(ptr, b, token, head0, heads, s_b, s_t, s_h, width, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr):
    """The ``[BLOCK_H, BLOCK_W]`` rows of query heads ``head0 ..`` of one token (padding: 0)."""
    h = head0 + tl.arange(0, BLOCK_H)
    w = tl.arange(0, BLOCK_W)
    off = b.to(tl.int64) * s_b + token * s_t + h[:, None].to(tl.int64) * s_h + w[None, :]
    return tl.load(ptr + off, mask=(h[:, None] < heads) & (w[None, :] < width), other=0.0)
