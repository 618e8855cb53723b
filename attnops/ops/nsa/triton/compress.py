"""Compression kernels: forward, input gradient and weight-gradient partials (``launch.py`` plans them).

Row ``c`` (block ``k`` of its batch) pools tokens ``start_c .. start_c + l - 1``: ``out[c] = sum_w x[start_c + w] *
weight[w]`` per head, in fp32 (the launchers pass the weight as fp32). The input gradient gives each token the sum
over the (at most ``ceil(l / stride)``) blocks that cover it, in block order; the weight gradient sums ``x[start_c + w] . dy[c]`` over ``BLOCK_R`` rows of a
batch per program into a partial that the host adds in program order. Every output element has one writer
(deterministic).

Each program owns ``BLOCK_R`` rows (or tokens) of one (batch, head) as ``[BLOCK_R, D]`` tiles, so every thread reads
16-byte vectors of the feature dimension (a D-vector per program gives one element per thread). The grids are
``(row or token tile of the batch, batch x head)``, the pairs folded into axes 1 and 2 past CUDA's 65535
programs per axis (``FOLD``, as the FlashAttention kernels); a program reads its batch's row of the per-batch table
(int64 ``[B, BATCH_COLS]``: first token, tokens, compressed rows, first compressed row), so no per-row metadata is
built.
"""
import triton
import triton.language as tl

from ...._core.triton.helpers import program_batch_head

START: tl.constexpr = tl.constexpr(0)
LENGTH: tl.constexpr = tl.constexpr(1)
ROWS: tl.constexpr = tl.constexpr(2)
ROW_BASE: tl.constexpr = tl.constexpr(3)
BATCH_COLS: tl.constexpr = tl.constexpr(4)


@triton.jit
def _batch(batch_ptr, b, col):
    """Column ``col`` of batch ``b``'s row of the per-batch table."""
    return tl.load(batch_ptr + b * BATCH_COLS + col)


@triton.jit
def compress_fwd_kernel(x_ptr, w_ptr, o_ptr, batch_ptr, x_st, x_sh, w_sw, w_sh, o_st, o_sh,
                        head_d, block, stride, n_heads, batch, bh_fold, BLOCK_D: tl.constexpr, FOLD: tl.constexpr,
                        BLOCK_R: tl.constexpr):
    """``out[c] = sum_w x[start_c + w] * weight[w]`` for ``BLOCK_R`` rows of a batch (fp32 weights)."""
    b, h = program_batch_head(n_heads, bh_fold, FOLD)
    if FOLD:
        if b >= batch:
            return
    k = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    ok = (k[:, None] < _batch(batch_ptr, b, ROWS)) & (d[None, :] < head_d)
    c = (_batch(batch_ptr, b, ROW_BASE) + k).to(tl.int64)
    start = (_batch(batch_ptr, b, START) + k * stride).to(tl.int64)
    x_head = x_ptr + tl.cast(h, tl.int64) * x_sh + d[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for w in range(block):
        x = tl.load(x_head + (start[:, None] + w) * x_st, mask=ok, other=0.0)
        acc += x.to(tl.float32) * tl.load(w_ptr + w * w_sw + h * w_sh)
    tl.store(o_ptr + c[:, None] * o_st + tl.cast(h, tl.int64) * o_sh + d[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=ok)


@triton.jit
def compress_dx_kernel(dy_ptr, w_ptr, dx_ptr, batch_ptr, dy_st, dy_sh, w_sw, w_sh, dx_st, dx_sh,
                       head_d, block, stride, n_heads, batch, bh_fold, BLOCK_D: tl.constexpr, FOLD: tl.constexpr,
                       BLOCK_R: tl.constexpr):
    """``dx[t] = sum_k dy[row0 + k] * weight[offset - k*stride]`` over the blocks ``k`` covering each of
    ``BLOCK_R`` tokens, in increasing ``k`` (step ``j`` visits block ``offset // stride - j``, from the most blocks
    a token can have, ``cdiv(block, stride)``, down)."""
    b, h = program_batch_head(n_heads, bh_fold, FOLD)
    if FOLD:
        if b >= batch:
            return
    off = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    live = off < _batch(batch_ptr, b, LENGTH)
    rows = _batch(batch_ptr, b, ROWS)
    dy_head = dy_ptr + _batch(batch_ptr, b, ROW_BASE) * dy_st + tl.cast(h, tl.int64) * dy_sh + d[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    steps = (block + stride - 1) // stride
    for i in range(steps):
        k = off // stride - (steps - 1 - i)
        tap = off - k * stride
        ok = live & (k >= 0) & (k < rows) & (tap < block)
        dy = tl.load(dy_head + k.to(tl.int64)[:, None] * dy_st, mask=ok[:, None] & (d[None, :] < head_d), other=0.0)
        weight = tl.load(w_ptr + tap * w_sw + h * w_sh, mask=ok, other=0.0)
        acc += dy.to(tl.float32) * weight[:, None]
    t = (_batch(batch_ptr, b, START) + off).to(tl.int64)
    tl.store(dx_ptr + t[:, None] * dx_st + tl.cast(h, tl.int64) * dx_sh + d[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=live[:, None] & (d[None, :] < head_d))


@triton.jit
def compress_dw_kernel(x_ptr, dy_ptr, batch_ptr, part_ptr, x_st, x_sh, dy_st, dy_sh, n_heads, head_d, block, stride,
                       batch, bh_fold, BLOCK_D: tl.constexpr, FOLD: tl.constexpr, BLOCK_R: tl.constexpr):
    """``part[b * tiles + pid, w, h] = sum over the program's rows c of x[start_c + w, h] . dy[c, h]`` (fp32; 0 for
    a program past its batch's rows)."""
    pid = tl.program_id(0)
    b, h = program_batch_head(n_heads, bh_fold, FOLD)
    if FOLD:
        if b >= batch:
            return
    k = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    ok = (k[:, None] < _batch(batch_ptr, b, ROWS)) & (d[None, :] < head_d)
    c = (_batch(batch_ptr, b, ROW_BASE) + k).to(tl.int64)
    start = _batch(batch_ptr, b, START) + k * stride
    dy = tl.load(dy_ptr + c[:, None] * dy_st + tl.cast(h, tl.int64) * dy_sh + d[None, :], mask=ok,
                 other=0.0).to(tl.float32)
    part = (b.to(tl.int64) * tl.num_programs(0) + pid) * block
    for w in range(block):
        x = tl.load(x_ptr + (start[:, None] + w).to(tl.int64) * x_st + tl.cast(h, tl.int64) * x_sh + d[None, :],
                    mask=ok, other=0.0).to(tl.float32)
        tl.store(part_ptr + (part + w) * n_heads + h, tl.sum(tl.sum(x * dy, 1), 0))
