"""Compression kernels: forward, input gradient and weight-gradient partials (``launch.py`` plans them).

Row ``c`` (block ``k`` of its batch) pools tokens ``start_c .. start_c + l - 1``: ``out[c] = sum_w x[start_c + w] *
weight[w]`` per head, in fp32. The input gradient gives each token the sum over the (at most ``ceil(l / stride)``)
blocks that cover it, in block order; the weight gradient sums ``x[start_c + w] . dy[c]`` over ``BLOCK_R`` rows per
program into a partial that the host adds in program order. Every output element has one writer (deterministic).
"""
import triton
import triton.language as tl

ROW_START: tl.constexpr = tl.constexpr(0)  # per compressed row: its first token
TOKEN_ROW0: tl.constexpr = tl.constexpr(0)  # per token: the batch's first compressed row, ...
TOKEN_OFFSET: tl.constexpr = tl.constexpr(1)  # ... the token's offset in its batch, ...
TOKEN_ROWS: tl.constexpr = tl.constexpr(2)  # ... and the batch's number of compressed rows


@triton.jit
def compress_fwd_kernel(x_ptr, w_ptr, o_ptr, row_start_ptr, x_st, x_sh, w_sw, w_sh, o_st, o_sh,
                        head_d, block, BLOCK_D: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    start = tl.load(row_start_ptr + c)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for w in range(block):
        x = tl.load(x_ptr + (start + w) * x_st + tl.cast(h, tl.int64) * x_sh + d, mask=d < head_d, other=0.0)
        acc += x.to(tl.float32) * tl.load(w_ptr + w * w_sw + h * w_sh).to(tl.float32)
    tl.store(o_ptr + c.to(tl.int64) * o_st + tl.cast(h, tl.int64) * o_sh + d, acc.to(o_ptr.dtype.element_ty),
             mask=d < head_d)


@triton.jit
def compress_dx_kernel(dy_ptr, w_ptr, dx_ptr, token_ptr, dy_st, dy_sh, w_sw, w_sh, dx_st, dx_sh,
                       head_d, block, stride, BLOCK_D: tl.constexpr):
    """``dx[t] = sum_k dy[row0 + k] * weight[offset - k*stride]`` over the blocks ``k`` covering the token."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    row0 = tl.load(token_ptr + t * 3 + TOKEN_ROW0)
    off = tl.load(token_ptr + t * 3 + TOKEN_OFFSET)
    rows = tl.load(token_ptr + t * 3 + TOKEN_ROWS)
    k_lo = tl.maximum(off - block + stride, 0) // stride  # ceil((off - block + 1) / stride), at least 0
    k_hi = tl.minimum(off // stride + 1, rows)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for k in range(k_lo, k_hi):
        dy = tl.load(dy_ptr + (row0 + k) * dy_st + tl.cast(h, tl.int64) * dy_sh + d, mask=d < head_d, other=0.0)
        acc += dy.to(tl.float32) * tl.load(w_ptr + (off - k * stride) * w_sw + h * w_sh).to(tl.float32)
    tl.store(dx_ptr + t.to(tl.int64) * dx_st + tl.cast(h, tl.int64) * dx_sh + d, acc.to(dx_ptr.dtype.element_ty),
             mask=d < head_d)


@triton.jit
def compress_dw_kernel(x_ptr, dy_ptr, row_start_ptr, part_ptr, x_st, x_sh, dy_st, dy_sh, n_rows, n_heads,
                       head_d, block, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """``part[pid, w, h] = sum over rows c of the program of x[start_c + w, h] . dy[c, h]`` (fp32)."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    ok = (r[:, None] < n_rows) & (d[None, :] < head_d)
    start = tl.load(row_start_ptr + r, mask=r < n_rows, other=0)
    dy = tl.load(dy_ptr + r[:, None].to(tl.int64) * dy_st + tl.cast(h, tl.int64) * dy_sh + d[None, :], mask=ok,
                 other=0.0).to(tl.float32)
    for w in range(block):
        x = tl.load(x_ptr + (start[:, None] + w) * x_st + tl.cast(h, tl.int64) * x_sh + d[None, :], mask=ok,
                    other=0.0).to(tl.float32)
        tl.store(part_ptr + (pid.to(tl.int64) * block + w) * n_heads + h, tl.sum(tl.sum(x * dy, 1), 0))
