"""Device-side metadata for varlen lengths in device tensors (``cu_seqlens`` never read on the host): the prepare
kernel fills the per-batch metadata table the attention kernels read, the tail kernel fills the rows of tokens past
every sequence (output 0, invalid statistics, zero gradients). No allocation here (``launch.py`` allocates)."""
import triton
import triton.language as tl

from .common import (DROP_OFF, HI, KV_LEN, KV_START, LO, META_COLS, PREFIX, PSE_KS, PSE_QS, Q_LEN, Q_START,
                     STAT_BASE, STAT_HEAD)

SPECIAL_NONE: tl.constexpr = tl.constexpr(0)
SPECIAL_LAST: tl.constexpr = tl.constexpr(1)  # sparse_mode 7: the last batch with queries has its own band
SPECIAL_FIRST: tl.constexpr = tl.constexpr(2)  # sparse_mode 8: the first one
SLOPES_NONE: tl.constexpr = tl.constexpr(0)
SLOPES_ALL: tl.constexpr = tl.constexpr(1)  # every batch counts ALiBi positions from the start indices
SLOPES_FIRST: tl.constexpr = tl.constexpr(2)  # batch 0 alone (varlen sparse_mode 8); the others from 0
SLOPES_BOTTOM_RIGHT: tl.constexpr = tl.constexpr(3)  # every batch, query positions shifted by Skv - Sq (flash-attn)


@triton.jit
def _span(cu_ptr, b, ok, total, bound):
    """``(start, length, end)`` of sequences ``b`` from ``cu_seqlens``: start and end clamped into ``[0, total]``
    (end >= start), the length to ``bound`` too, so no value can address a token outside the packed tensor."""
    start = tl.load(cu_ptr + b, mask=ok, other=0).to(tl.int64)
    end = tl.load(cu_ptr + b + 1, mask=ok, other=0).to(tl.int64)
    start = tl.minimum(tl.maximum(start, 0), total)
    end = tl.minimum(tl.maximum(end, start), total)
    return start, tl.minimum(end - start, bound), end


@triton.jit
def _special_batch(cu_q_ptr, batch, total_q, max_q, SPECIAL: tl.constexpr, BLOCK_B: tl.constexpr):
    """The batch with its own band: the last (``SPECIAL_LAST``) or first (``SPECIAL_FIRST``) one with queries
    (-1 / ``batch`` when none has)."""
    found = batch * 0 - 1 if SPECIAL == SPECIAL_LAST else batch * 1
    for c0 in range(0, batch, BLOCK_B):
        b = c0 + tl.arange(0, BLOCK_B)
        ok = b < batch
        _, sq, _ = _span(cu_q_ptr, b, ok, total_q, max_q)
        if SPECIAL == SPECIAL_LAST:
            found = tl.maximum(found, tl.max(tl.where(ok & (sq > 0), b, -1), 0))
        else:
            found = tl.minimum(found, tl.min(tl.where(ok & (sq > 0), b, batch), 0))
    return found


@triton.jit
def prepare_kernel(meta_ptr, cu_q_ptr, cu_kv_ptr, prefix_ptr, batch, total_q, total_kv, max_q, max_kv, n1,
                   lo, hi, special_lo, special_hi, pse_q_start, pse_kv_start, inf,
                   LO_DELTA: tl.constexpr, HI_DELTA: tl.constexpr, SPECIAL: tl.constexpr, HAS_PREFIX: tl.constexpr,
                   SLOPES: tl.constexpr, STATS_TND: tl.constexpr, BLOCK_B: tl.constexpr):
    """The int64 ``[B + 1, META_COLS]`` metadata from ``cu_seqlens`` (one program, ``BLOCK_B`` batches a step):
    rows ``0..B-1`` as ``launch_args.batch_meta`` builds them from host lengths (the band by ``masks.BandRule``:
    ``lo`` (+ delta with ``LO_DELTA``), ``hi`` (+ delta with ``HI_DELTA``), the special batch's
    ``delta + special_lo/hi``; prefix clamped to the KV length; dropout offsets summed over the batches before;
    ALiBi start indices; statistics offsets), row ``B`` the end of the last query and KV sequences (columns
    ``q_start``/``kv_start``) for :func:`tail_kernel`."""
    special = -1
    if SPECIAL != SPECIAL_NONE:
        special = _special_batch(cu_q_ptr, batch, total_q, max_q, SPECIAL, BLOCK_B)
    drop_base = tl.zeros([1], tl.int64)
    q_end = tl.zeros([1], tl.int64)
    kv_end = tl.zeros([1], tl.int64)
    for c0 in range(0, batch, BLOCK_B):
        b = c0 + tl.arange(0, BLOCK_B)
        ok = b < batch
        qs, sq, qe = _span(cu_q_ptr, b, ok, total_q, max_q)
        ks, skv, ke = _span(cu_kv_ptr, b, ok, total_kv, max_kv)
        delta = skv - sq
        b_lo = lo + delta if LO_DELTA else lo + delta * 0
        b_hi = hi + delta if HI_DELTA else hi + delta * 0
        if SPECIAL != SPECIAL_NONE:
            b_lo = tl.where(b == special, delta + special_lo, b_lo)
            b_hi = tl.where(b == special, delta + special_hi, b_hi)
        pfx = tl.zeros([BLOCK_B], tl.int64)
        if HAS_PREFIX:
            pfx = tl.minimum(tl.maximum(tl.load(prefix_ptr + b, mask=ok, other=0).to(tl.int64), 0), skv)
        numel = n1 * sq * skv
        drop_off = tl.cumsum(numel, 0) - numel + drop_base
        drop_base += tl.sum(numel, 0)
        pse_qs = tl.zeros([BLOCK_B], tl.int64)
        pse_ks = tl.zeros([BLOCK_B], tl.int64)
        if SLOPES == SLOPES_ALL:
            pse_qs += pse_q_start
            pse_ks += pse_kv_start
        elif SLOPES == SLOPES_FIRST:
            pse_qs = tl.where(b == 0, pse_q_start, pse_qs)
            pse_ks = tl.where(b == 0, pse_kv_start, pse_ks)
        elif SLOPES == SLOPES_BOTTOM_RIGHT:
            pse_qs += pse_q_start + delta
            pse_ks += pse_kv_start
        stat_head = sq * 0 + 8 if STATS_TND else sq * 8
        row = meta_ptr + b.to(tl.int64) * META_COLS
        tl.store(row + Q_START, qs, mask=ok)
        tl.store(row + KV_START, ks, mask=ok)
        tl.store(row + Q_LEN, sq, mask=ok)
        tl.store(row + KV_LEN, skv, mask=ok)
        tl.store(row + LO, tl.minimum(tl.maximum(b_lo, -inf), inf), mask=ok)
        tl.store(row + HI, tl.minimum(tl.maximum(b_hi, -inf), inf), mask=ok)
        tl.store(row + PREFIX, pfx, mask=ok)
        tl.store(row + DROP_OFF, drop_off, mask=ok)
        tl.store(row + PSE_QS, pse_qs, mask=ok)
        tl.store(row + PSE_KS, pse_ks, mask=ok)
        tl.store(row + STAT_BASE, qs * n1 * 8, mask=ok)
        tl.store(row + STAT_HEAD, stat_head, mask=ok)
        q_end = tl.maximum(q_end, tl.max(tl.where(ok, qe, 0), 0))
        kv_end = tl.maximum(kv_end, tl.max(tl.where(ok, ke, 0), 0))
    cols = tl.arange(0, 16)
    ends = tl.where(cols == Q_START, q_end, tl.where(cols == KV_START, kv_end, 0))
    tl.store(meta_ptr + batch * META_COLS + cols, ends, mask=cols < META_COLS)


@triton.jit
def tail_kernel(dst_ptr, meta_ptr, end_col, batch, total, row_elems, value, BLOCK: tl.constexpr):
    """``dst[r, :] = value`` for the rows ``r`` past every sequence of a contiguous ``[rows, row_elems]`` buffer
    (``total`` elements): from metadata row ``batch``'s column ``end_col`` on (grid-stride loop)."""
    start = tl.load(meta_ptr + batch * META_COLS + end_col) * row_elems
    fill = tl.full([BLOCK], value, tl.float32).to(dst_ptr.dtype.element_ty)
    for off in range(start + tl.program_id(0) * BLOCK, total, tl.num_programs(0) * BLOCK):
        idx = off + tl.arange(0, BLOCK)
        tl.store(dst_ptr + idx, fill, mask=idx < total)
