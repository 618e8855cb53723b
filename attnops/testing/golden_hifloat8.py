"""HiFloat8 code values straight from the paper's definition ("Ascend HiFloat8 Format for Deep Learning",
arXiv 2409.16626), independent of :mod:`attnops._core.hifloat8`: integer bit arithmetic per code.

After the sign bit, the dot field (prefix code ``11``, ``10``, ``01``, ``001``, ``0001``, ``0000``) gives the exponent
width ``D`` = 4, 3, 2, 1, 0 and leaves ``M`` = 1, 2, 3, 3, 3 mantissa bits; the exponent is sign-magnitude with an
implicit leading magnitude 1; dot ``0000`` is the denormal mode ``2^(m - 23)``; ``0x00`` zero, ``0x80`` NaN,
``S 11 0111 1`` +-Inf.
"""
from __future__ import annotations

import math

# (dot prefix value, prefix width, exponent width D, mantissa width M)
DOTS = ((0b11, 2, 4, 1), (0b10, 2, 3, 2), (0b01, 2, 2, 3), (0b001, 3, 1, 3), (0b0001, 4, 0, 3))


def value(code: int) -> float:
    """The real number the 8-bit ``code`` stands for (``nan`` / ``+-inf`` for the special codes)."""
    sign = -1.0 if code >> 7 else 1.0
    body = code & 0x7F
    if code == 0x80:
        return math.nan
    if body == 0b1101111:
        return sign * math.inf
    for prefix, width, d, m in DOTS:
        if body >> (7 - width) == prefix:
            field = (body >> m) & ((1 << d) - 1)
            magnitude = 0 if d == 0 else (1 << (d - 1)) | (field & ((1 << (d - 1)) - 1))
            exponent = -magnitude if d and field >> (d - 1) else magnitude
            return sign * math.ldexp(1 + (body & ((1 << m) - 1)) / (1 << m), exponent)
    low = body & 0b111  # dot 0000
    return 0.0 if low == 0 else sign * math.ldexp(1.0, low - 23)
