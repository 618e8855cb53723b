"""Generic ``@triton.jit`` helpers with no attention meaning, for every operator's kernels: the fp32 constants,
base-2 exponent tricks, an fp32 tanh the interpreter can run, the upcast of loaded tiles and the program-id fold
of batch x heads."""
import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
FLT_LOWEST: tl.constexpr = tl.constexpr(-3.4028234663852886e38)
FLT_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)


@triton.jit
def tanh(x):
    """fp32 tanh within about an ulp: ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` for ``|x| >= 1/4``, an odd Taylor
    polynomial below (where ``1 - e`` would cancel); the interpreter has no libdevice."""
    a = tl.abs(x)
    e = tl.exp2(a * (-2.0 * LOG2E))
    a2 = a * a
    small = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0 + a2 * (62.0 / 2835.0)))))
    t = tl.where(a < 0.25, small, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def base2_max(m):
    """``m * log2(e)``, finite for rows without a kept score yet (``m`` = FLT_LOWEST: clamped to half of it
    first, so the product and a difference of two such values do not overflow; no real score is that low)."""
    return tl.maximum(m, FLT_LOWEST * 0.5) * LOG2E


@triton.jit
def upcast(x, UPCAST: tl.constexpr):
    """fp32 math for loaded tiles where asked (fp32 inputs, and always in the interpreter, which has no bf16)."""
    if UPCAST:
        return x.to(tl.float32)
    return x


@triton.jit
def program_batch_head(heads, bh_fold, FOLD: tl.constexpr):
    """``(b, h)`` of this program: grid axis 1 holds the ``batch x heads`` pairs, or with ``FOLD`` up to ``bh_fold``
    of them and axis 2 counts the folds (the kernel then returns at once for ``b >= batch``: the programs past the
    last pair). Without ``FOLD`` the kernels compile exactly as without folding."""
    bh = tl.program_id(1)
    if FOLD:
        bh += tl.program_id(2) * bh_fold
    return bh // heads, bh % heads
