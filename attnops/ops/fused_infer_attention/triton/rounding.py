"""``@triton.jit`` conversions of the FIA output, as the reference's ``quant.py`` does them: CAST_ROUND (fp16/bf16
round half away from zero, not the cast's half to even) and the int8 output ``sat_int8(round_half_even(o * scale
+ offset))``, 0 on rows that attended nothing. No allocation here."""
import triton
import triton.language as tl

from . import codes

# output conversions (constexpr OUT_MODE)
OUT_CAST: tl.constexpr = tl.constexpr(codes.OUT_CAST)  # fp32 output: as computed
OUT_CAST_ROUND: tl.constexpr = tl.constexpr(codes.OUT_CAST_ROUND)  # fp16/bf16 output
OUT_INT8: tl.constexpr = tl.constexpr(codes.OUT_INT8)  # int8 output (quant_scale2, quant_offset2)


@triton.jit
def cast_round(x, DTYPE: tl.constexpr):
    """fp32 ``x`` in 16-bit float ``DTYPE``, ties rounded away from zero: the cast's neighbour ``r`` (half to even)
    moves one step away from zero (the next magnitude's bits) where ``x`` sits exactly halfway above ``r``'s
    magnitude."""
    r = x.to(DTYPE)
    away = (r.to(tl.int16, bitcast=True) + 1).to(DTYPE, bitcast=True)
    below = x - r.to(tl.float32)  # exact; same sign as x when r is the neighbour nearer to zero
    step = tl.abs(away.to(tl.float32) - r.to(tl.float32))
    tie = (below != 0) & ((below > 0) == (x > 0)) & (2 * tl.abs(below) == step)
    return tl.where(tie, away, r)


@triton.jit
def quantize_int8(y):
    """``sat_int8(round_half_even(y))`` of an fp32 tile; NaN gives 0 and +-inf saturate (the NPU's conversion)."""
    y = tl.minimum(tl.maximum(tl.where(y != y, 0.0, y), -128.0), 127.0)  # max/min may drop or keep a NaN
    r = tl.floor(y)
    frac = y - r  # exact
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    r = r + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)
    return r.to(tl.int8)


@triton.jit
def output_tile(out, kept, scale_ptr, offset_ptr, offs, ok, OUT_MODE: tl.constexpr, HAS_OFFSET: tl.constexpr,
                DTYPE: tl.constexpr):
    """An fp32 output tile (``[rows, Dv]``, or one row ``[Dv]``) in the output dtype ``DTYPE``: cast (fp32),
    CAST_ROUND (fp16/bf16) or quantized to int8 with the scale (and offset) at ``offs`` (0 where ``kept``, which
    broadcasts against the tile, is False: rows that kept nothing)."""
    if OUT_MODE == OUT_INT8:
        y = out * tl.load(scale_ptr + offs, mask=ok, other=0.0)
        if HAS_OFFSET:
            y += tl.load(offset_ptr + offs, mask=ok, other=0.0)
        res = tl.where(kept, quantize_int8(y), 0).to(tl.int8)
    elif OUT_MODE == OUT_CAST_ROUND:
        res = cast_round(out, DTYPE)
    else:
        res = out.to(DTYPE)
    return res
