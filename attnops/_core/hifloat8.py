"""HiFloat8 (HiF8), Ascend's tapered-precision 8-bit float, in software: codes are held in ``torch.uint8``.

Bit layout of a code, most significant bit first: the sign ``S``, a prefix-coded dot field that gives the width
``D`` of the exponent field, the exponent, then ``M`` mantissa bits:

=========  ===  ===  =====================
dot        D    M    exponent ``E``
=========  ===  ===  =====================
``11``     4    1    ``|E|`` in 8..15
``10``     3    2    ``|E|`` in 4..7
``01``     2    3    ``|E|`` in 2..3
``001``    1    3    ``|E|`` = 1
``0001``   0    3    ``E`` = 0
``0000``   -    3    denormal
=========  ===  ===  =====================

The exponent is sign-magnitude: its first bit is the sign of ``E`` (1: negative), the other ``D - 1`` bits are
``|E| - 2^(D-1)`` (the leading magnitude bit is implicit). A normal code is ``(-1)^S 2^E (1 + m / 2^M)``. A denormal
code (dot ``0000``) with mantissa ``m`` in 1..7 is ``(-1)^S 2^(m - 23)``; ``0x00`` is zero (the only one) and
``0x80`` NaN. ``S 11 0111 1`` (``0x6F``, ``0xEF``) is +-Inf, so the largest finite magnitude is ``2^15``.

:func:`encode` rounds to the nearest code, ties to the code whose last bit is 0 (round half to even) or away from
zero; finite values beyond ``2^15`` saturate to ``+-2^15``, +-Inf and NaN keep their codes.
"""
from __future__ import annotations

from functools import cache
from typing import Literal

import torch
from torch import Tensor

NAN_CODE = 0x80
INF_CODE = 0x6F
MAX = 2.0 ** 15

# dot prefix (as bits, its width) -> exponent width D; mantissa width is 7 - len(prefix) - D
_NORMAL_DOTS = (("11", 4), ("10", 3), ("01", 2), ("001", 1), ("0001", 0))


class NpuDtype:
    """A torch_npu dtype that torch has no counterpart for (``torch_npu.hifloat8``): a named token that callers pass
    as ``key_dtype`` / ``value_dtype``; the data itself lives in one-byte tensors."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"torch_npu.{self.name}"


HIFLOAT8 = NpuDtype("hifloat8")


def _code_value(code: int) -> float:
    """The value of one code (float, exact in fp64)."""
    sign = -1.0 if code & 0x80 else 1.0
    bits = format(code & 0x7F, "07b")
    if code & 0x7F == INF_CODE:
        return sign * float("inf")
    for prefix, d in _NORMAL_DOTS:
        if bits.startswith(prefix):
            rest = bits[len(prefix):]
            exponent = 0 if d == 0 else (2 ** (d - 1) + int(rest[1:d] or "0", 2)) * (-1 if rest[0] == "1" else 1)
            mantissa = rest[d:]
            return sign * 2.0 ** exponent * (1 + int(mantissa, 2) / 2 ** len(mantissa))
    m = code & 0x07  # dot 0000: denormal
    if m == 0:
        return float("nan") if code == NAN_CODE else 0.0
    return sign * 2.0 ** (m - 23)


@cache
def _table() -> Tensor:
    """``[256]`` fp64: the value of every code."""
    return torch.tensor([_code_value(c) for c in range(256)], dtype=torch.float64)


@cache
def _finite_grid() -> tuple[Tensor, Tensor]:
    """``(values, codes)``: the finite non-negative values, ascending, and their codes."""
    codes = [c for c in range(0x80) if c != INF_CODE]
    values = torch.tensor([_code_value(c) for c in codes], dtype=torch.float64)
    order = torch.argsort(values)
    return values[order], torch.tensor(codes, dtype=torch.int64)[order]


def decode(codes: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The values of HiF8 ``codes`` (one-byte tensor, any shape: uint8, or int8 read as raw bytes) in ``dtype``."""
    raw = codes.view(torch.uint8) if codes.dtype == torch.int8 else codes
    return _table().to(codes.device)[raw.long()].to(dtype)


def encode(x: Tensor, rounding: Literal["half_even", "half_away"] = "half_even") -> Tensor:
    """HiF8 codes (``torch.uint8``, ``x``'s shape) of floating-point ``x``: the nearest code, ties by ``rounding``
    (``"half_even"``: to the code ending in bit 0; ``"half_away"``: away from zero, the paper's TA rounding);
    finite values beyond ``2^15`` saturate, +-Inf and NaN map to their codes."""
    values, codes = (t.to(x.device) for t in _finite_grid())
    v = x.to(torch.float64)
    mag = v.abs().clamp_max(MAX)
    hi = torch.searchsorted(values, mag).clamp_max(values.numel() - 1)
    lo = (hi - 1).clamp_min(0)
    d_lo, d_hi = mag - values[lo], values[hi] - mag
    if rounding == "half_even":
        tie_up = (codes[hi] & 1) == 0
    else:
        tie_up = torch.ones_like(d_lo, dtype=torch.bool)
    pick = torch.where((d_hi < d_lo) | ((d_hi == d_lo) & tie_up), hi, lo)
    code = codes[pick]
    code = torch.where(torch.isinf(v), torch.full_like(code, INF_CODE), code)
    code = torch.where((v < 0) & (code != 0), code | 0x80, code)
    return torch.where(torch.isnan(v), torch.full_like(code, NAN_CODE), code).to(torch.uint8)
