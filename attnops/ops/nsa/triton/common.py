"""``@triton.jit`` helpers shared by the NSA kernels (selected attention and decode): the GQA group's rows of one
token, loaded and stored as ``[BLOCK_G, BLOCK_W]`` tiles, and the online-softmax step. No allocation here."""
import triton
import triton.language as tl

from ...._core.triton.helpers import LOG2E


@triton.jit
def _group_tile(ptr, t, head0, group, s_t, s_h, width, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr):
    """The ``[BLOCK_G, BLOCK_W]`` rows of token ``t``, heads ``head0 .. head0+group-1`` (padding: 0)."""
    g = tl.arange(0, BLOCK_G)
    w = tl.arange(0, BLOCK_W)
    off = t.to(tl.int64) * s_t + (head0 + g[:, None]).to(tl.int64) * s_h + w[None, :]
    return tl.load(ptr + off, mask=(g[:, None] < group) & (w[None, :] < width), other=0.0)


@triton.jit
def _store_group_tile(ptr, tile, t, head0, group, s_t, s_h, width, BLOCK_G: tl.constexpr, BLOCK_W: tl.constexpr):
    """Stores ``tile`` (cast to the buffer's dtype) as the rows of token ``t``, heads ``head0 ..`` (padding
    dropped)."""
    g = tl.arange(0, BLOCK_G)
    w = tl.arange(0, BLOCK_W)
    off = t.to(tl.int64) * s_t + (head0 + g[:, None]).to(tl.int64) * s_h + w[None, :]
    tl.store(ptr + off, tile.to(ptr.dtype.element_ty), mask=(g[:, None] < group) & (w[None, :] < width))


@triton.jit
def _softmax_init(BLOCK_G: tl.constexpr, BLOCK_DV: tl.constexpr):
    """``(max, sum, acc)`` of an online softmax over no key yet."""
    return (tl.full([BLOCK_G], float("-inf"), tl.float32), tl.zeros([BLOCK_G], tl.float32),
            tl.zeros([BLOCK_G, BLOCK_DV], tl.float32))


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One online-softmax step: scores ``s [BLOCK_G, BLOCK_N]`` (hidden keys at -inf) and their values
    ``v [BLOCK_N, BLOCK_DV]`` into ``(max, sum, acc)``; natural units, a row with no key yet shifts by 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((m_i - shift) * LOG2E)
    p = tl.exp2((s - shift[:, None]) * LOG2E)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc
