"""The preparation of one cached NSA decoding step in one launch: each new token's position (its sequence's length
plus its place in the chunk, clamped into the pages), the lookups indexed by it (page row, compressed row, KV
length), RoPE of its query and key heads from the ``[cos, signed sin]`` table, rounded exactly as the eager ops
(each product rounded to the activations' dtype, then their sum), and with ``MASKS`` the compressed-attention masks
of the first sequence's tokens. No allocation here (``step_launch.py`` allocates and launches).

One program per token walks its heads ``BLOCK_H`` at a time (query heads, then key heads, into one ``[T, N1 + N2,
D]`` output). ``EXACT_MUL`` (on a GPU) multiplies by ``mul.rn.f32``, which the compiler never fuses into an FMA with
the following sum (fp32 activations would otherwise round once where the eager ops round twice).
"""
import triton
import triton.language as tl


@triton.jit
def _product(a, b, EXACT_MUL: tl.constexpr):
    if EXACT_MUL:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return a * b


@triton.jit
def _compressed_masks(out_ptr, pos, rows, n_sel, block, stride, select_block, local, BLOCK_C: tl.constexpr):
    """One token's ``[rows + n_sel]`` row (uint8, 1 = True): compressed row ``c`` masked until complete (``c * stride
    + block - 1 > pos``), then selection block ``s`` forced when it is block 0 or one of the ``local`` blocks ending
    at the token's own."""
    own = pos // select_block
    for c0 in range(0, rows + n_sel, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        back = own - (c - rows)  # selection blocks from the token's own back to this one
        masked = tl.where(c < rows, c * stride + block - 1 > pos, (c == rows) | ((back >= 0) & (back < local)))
        tl.store(out_ptr + c, masked.to(tl.uint8), mask=c < rows + n_sel)


@triton.jit
def decode_step_kernel(lengths_ptr, slot_ptr, compressed_ptr, rope_ptr, q_ptr, k_ptr, pos_ptr, slots_out_ptr,
                       compressed_out_ptr, ends_ptr, qk_ptr, mask_ptr, t, last, slot_row, slot_offset, compressed_row,
                       q_row, q_head, k_row, k_head, heads_q, heads, mask_row, rows, n_sel, block, stride,
                       select_block, local, HALF: tl.constexpr, BLOCK_D: tl.constexpr, EXACT_MUL: tl.constexpr,
                       MASKS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = row // t
    pos = tl.minimum(tl.load(lengths_ptr + b) + row % t, last)
    tl.store(pos_ptr + row, pos)
    tl.store(slots_out_ptr + row, tl.load(slot_ptr + b * slot_row + slot_offset + pos))
    tl.store(compressed_out_ptr + row, tl.load(compressed_ptr + b * compressed_row + pos))
    tl.store(ends_ptr + row, pos + 1)
    if MASKS:
        if row < t:  # the first sequence's tokens (the rows advance together): their compressed-attention masks
            _compressed_masks(mask_ptr + row * mask_row, pos, rows, n_sel, block, stride, select_block, local,
                              BLOCK_C)
    d = tl.arange(0, BLOCK_D)
    inside = d < 2 * HALF
    swapped = (d + HALF) % (2 * HALF)
    cos = tl.load(rope_ptr + pos * (4 * HALF) + d, mask=inside, other=0.0).to(tl.float32)
    sin = tl.load(rope_ptr + pos * (4 * HALF) + 2 * HALF + d, mask=inside, other=0.0).to(tl.float32)
    for h0 in range(0, heads, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H))[:, None]
        is_q = h < heads_q
        is_k = (h >= heads_q) & (h < heads)
        q_at = q_ptr + row * q_row + h * q_head
        k_at = k_ptr + row * k_row + (h - heads_q) * k_head
        x = tl.where(is_q, tl.load(q_at + d[None, :], mask=is_q & inside[None, :], other=0.0),
                     tl.load(k_at + d[None, :], mask=is_k & inside[None, :], other=0.0))
        xs = tl.where(is_q, tl.load(q_at + swapped[None, :], mask=is_q & inside[None, :], other=0.0),
                      tl.load(k_at + swapped[None, :], mask=is_k & inside[None, :], other=0.0))
        dtype = x.dtype
        straight = _product(x.to(tl.float32), cos[None, :], EXACT_MUL).to(dtype).to(tl.float32)
        turned = _product(xs.to(tl.float32), sin[None, :], EXACT_MUL).to(dtype).to(tl.float32)
        out = (straight + turned + 0.0).to(dtype)  # + 0: -0 + -0 sums to +0, as the eager sum from 0
        tl.store(qk_ptr + (row * heads + h) * (2 * HALF) + d[None, :], out, mask=(h < heads) & inside[None, :])
