"""``@triton.jit`` helpers that find and load K/V tiles of FusedInferAttention where they lie: the element offset of a
KV token (a dense tensor, or a page of a paged cache through the block table), of a channel within a token's head
(ND, or NZ ``[.., D/x, blocksize, x]``; int4: the int32 word), and the antiquant ``(x + offset) * scale`` of int8
and int4 tiles. No allocation here; the host side is ``kv_args.py``.

Every KV layout is ``head_ptr + token_row + channel_offset`` with ``head_ptr`` at the tile's KV head:

* dense ``[B, S, N2, W]`` / ``[T, N2, W]`` token views: ``token_row = base + t * token_stride`` (``base``: the
  batch's first key, left padding or TND offset included);
* paged ``[blocknum, blocksize, N2*W]``, ``[blocknum, N2, blocksize, W]``, NZ ``[blocknum, N2, W/x, blocksize, x]``:
  token ``t`` of batch ``b`` is in block ``block_table[b, t // blocksize]`` (an id outside the cache masks the
  token's key out, so no table value can address outside it) at offset ``t % blocksize``:
  ``token_row = block * block_stride + offset * token_stride``;
* channel ``c`` (int4: word ``c // 8``, nibble ``c % 8``) at ``c * chan_stride``, or in an NZ cache at
  ``(c // x) * x_stride + (c % x) * chan_stride``.

Antiquant parameters are addressed through six strides each (batch, KV head, per-token position, physical block,
offset in the block, channel; rows of one int64 table: K scale, K offset, V scale, V offset), so per-tensor,
per-channel, per-head, per-token and page-managed parameters share one formula; each is a vector over the tile's
channels (``STATIC``) or over its tokens.
"""
import triton
import triton.language as tl

from ...._core.triton.helpers import upcast
from . import codes

# KV storage (constexpr QUANT)
KV_FLOAT: tl.constexpr = tl.constexpr(codes.KV_FLOAT)
KV_INT8: tl.constexpr = tl.constexpr(codes.KV_INT8)
KV_INT4: tl.constexpr = tl.constexpr(codes.KV_INT4)
QUANT_STRIDES: tl.constexpr = tl.constexpr(6)  # per antiquant parameter: batch, head, position, block, offset, channel


@triton.jit
def page_of(b, tokens, ok, bt_ptr, bt_sb, block_size, num_blocks, PAGED: tl.constexpr):
    """``(physical block, offset in the block, ok)`` (int64) of batch ``b``'s tokens (zeros for a dense KV); a token
    whose block id is outside ``[0, num_blocks)`` drops out of ``ok`` (its key is masked out) and reads block 0."""
    if PAGED:
        blk = tl.load(bt_ptr + b.to(tl.int64) * bt_sb + tokens // block_size, mask=ok, other=0).to(tl.int64)
        ok = ok & (blk >= 0) & (blk < num_blocks)
        blk = tl.where(ok, blk, 0)
        off = (tokens % block_size).to(tl.int64)
    else:
        blk = tokens.to(tl.int64) * 0
        off = blk
    return blk, off, ok


@triton.jit
def token_rows(tokens, blk, off, base, token_stride, block_stride, PAGED: tl.constexpr):
    """Element offsets of tokens from their KV head's pointer: ``blk * block_stride + off * token_stride`` in a paged
    cache, ``base + t * token_stride`` in a dense KV."""
    if PAGED:
        rows = blk * block_stride + off * token_stride
    else:
        rows = base + tokens.to(tl.int64) * token_stride
    return rows


@triton.jit
def channel_offsets(chan, chan_stride, x_stride, QUANT: tl.constexpr, NZ_X: tl.constexpr):
    """Element offsets of channels ``chan`` within a token's head (int4: of their int32 words); ``NZ_X`` > 0: an NZ
    cache whose ``x``-wide channel groups are ``x_stride`` apart."""
    if QUANT == KV_INT4:
        word = chan // 8
    else:
        word = chan
    if NZ_X > 0:
        offs = (word // NZ_X) * x_stride + (word % NZ_X) * chan_stride
    else:
        offs = word * chan_stride
    return offs.to(tl.int64)


@triton.jit
def antiquant_factor(ptr, strides_ptr, which, b, hk, pos, blk, off, cols_ok, chan, chan_ok, STATIC: tl.constexpr,
                     CHAN_AXIS: tl.constexpr):
    """Antiquant parameter ``which`` (a row of the strides table) for a tile: a per-channel vector (``STATIC``:
    per-tensor, per-channel, per-head) or a per-token vector (per-token: ``pos``; page-managed: ``blk``, ``off``),
    broadcast along the tile's other axis (channels on axis ``CHAN_AXIS``)."""
    s = strides_ptr + which * QUANT_STRIDES
    base = ptr + b.to(tl.int64) * tl.load(s) + hk.to(tl.int64) * tl.load(s + 1)
    if STATIC:
        f = tl.load(base + chan.to(tl.int64) * tl.load(s + 5), mask=chan_ok, other=0.0)
    else:
        f = tl.load(base + pos * tl.load(s + 2) + blk * tl.load(s + 3) + off * tl.load(s + 4), mask=cols_ok,
                    other=0.0)
    if STATIC == (CHAN_AXIS == 0):  # the vector runs along axis 0
        tile = f[:, None]
    else:
        tile = f[None, :]
    return tile


@triton.jit
def kv_tile(head_ptr, rows, rows_ok, chan, chan_ok, chan_offs, scale_ptr, offset_ptr, strides_ptr, which, b, hk, pos,
            blk, off, QUANT: tl.constexpr, STATIC: tl.constexpr, HAS_OFFSET: tl.constexpr, CHAN_AXIS: tl.constexpr):
    """A K or V tile of tokens at ``rows`` (element offsets) and channels ``chan`` (at ``chan_offs``), channels on
    axis ``CHAN_AXIS`` (K^T: 0, V: 1); loaded as stored, or dequantized to fp32 when ``QUANT`` (``(x + offset) *
    scale``; int4: two's complement nibbles, channel ``c`` in bits ``4*(c % 8)`` of its word). Tokens or channels
    out of range read 0."""
    if QUANT == KV_INT4:
        shift = (chan % 8) * 4
    else:
        shift = chan * 0
    if CHAN_AXIS == 0:
        offs, ok, shifts = rows[None, :] + chan_offs[:, None], rows_ok[None, :] & chan_ok[:, None], shift[:, None]
    else:
        offs, ok, shifts = rows[:, None] + chan_offs[None, :], rows_ok[:, None] & chan_ok[None, :], shift[None, :]
    x = tl.load(head_ptr + offs, mask=ok, other=0)
    if QUANT != KV_FLOAT:
        if QUANT == KV_INT4:
            x = (((x >> shifts) & 0xF) ^ 8) - 8
        x = x.to(tl.float32)
        if HAS_OFFSET:
            x += antiquant_factor(offset_ptr, strides_ptr, which + 1, b, hk, pos, blk, off, rows_ok, chan, chan_ok,
                                  STATIC, CHAN_AXIS)
        x = x * antiquant_factor(scale_ptr, strides_ptr, which, b, hk, pos, blk, off, rows_ok, chan, chan_ok,
                                 STATIC, CHAN_AXIS)
    return x


@triton.jit
def mma_operand(x, QUANT: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """A loaded K/V tile as a ``tl.dot`` operand: dequantized tiles rounded to the query dtype ``DTYPE`` first (the
    NPU's antiquant output), then fp32 where ``UPCAST`` (fp32 queries, the interpreter)."""
    if QUANT != KV_FLOAT:
        x = x.to(DTYPE)
    return upcast(x, UPCAST)
