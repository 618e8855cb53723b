"""HiFloat8 decode / encode on all 256 codes against the paper's formula (attnops.testing.golden_hifloat8)."""
from __future__ import annotations

import math

import pytest
import torch

from attnops._core import hifloat8
from attnops.testing import golden_hifloat8 as G

CODES = torch.arange(256, dtype=torch.uint8)
PAPER = [G.value(c) for c in range(256)]


def _finite_positive():
    """(value, code) of every finite non-negative code, ascending."""
    return sorted((v, c) for c, v in enumerate(PAPER) if c < 0x80 and math.isfinite(v))


def test_decode_matches_the_paper_on_every_code():
    got = hifloat8.decode(CODES, torch.float64).tolist()
    for code, (a, want) in enumerate(zip(got, PAPER)):
        assert a == want or (math.isnan(a) and math.isnan(want)), f"code {code:#04x}: {a} != {want}"
    torch.testing.assert_close(hifloat8.decode(CODES.view(torch.int8), torch.float64),  # int8 storage: raw bytes
                               hifloat8.decode(CODES, torch.float64), rtol=0, atol=0, equal_nan=True)


def test_the_paper_s_ranges():
    """7 exponents with a 3-bit mantissa, 8 with 2 bits, 16 with 1 bit; 38 binades from 2^-22 to 2^15; one zero,
    one NaN, two infinities."""
    finite = [v for v in PAPER if math.isfinite(v)]
    assert min(v for v in finite if v > 0) == 2.0 ** -22 and max(finite) == 2.0 ** 15
    assert sum(math.isnan(v) for v in PAPER) == 1 and sorted(v for v in PAPER if math.isinf(v)) == [-math.inf, math.inf]
    assert finite.count(0.0) == 1
    steps = {}
    for v in finite:
        if v > 0:
            steps.setdefault(math.frexp(v)[1] - 1, set()).add(v)
    by_count = {n: sorted(e for e, vs in steps.items() if len(vs) == n) for n in (1, 2, 4, 8)}
    assert by_count[8] == [-3, -2, -1, 0, 1, 2, 3]
    assert by_count[4] == [-7, -6, -5, -4, 4, 5, 6, 7]
    assert by_count[2] == [*range(-15, -7), *range(8, 15)]
    assert by_count[1] == [*range(-22, -15), 15]  # the denormals; 1.5 * 2^15 is the Inf code

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_code_round_trips(dtype):
    values = torch.tensor(PAPER, dtype=torch.float64).to(dtype)
    assert torch.equal(hifloat8.encode(values), CODES)


@pytest.mark.parametrize("rounding", ["half_even", "half_away"])
def test_nearest_code_and_ties(rounding):
    grid = _finite_positive()
    for (lo, lo_code), (hi, hi_code) in zip(grid, grid[1:]):
        mid = (lo + hi) / 2
        x = torch.tensor([mid, math.nextafter(mid, 0), math.nextafter(mid, math.inf), -mid], dtype=torch.float64)
        tie = (hi_code if hi_code % 2 == 0 else lo_code) if rounding == "half_even" else hi_code
        negative_tie = 0 if tie == 0 else tie | 0x80
        assert hifloat8.encode(x, rounding).tolist() == [tie, lo_code, hi_code, negative_tie], (lo, hi)


def test_saturation_and_special_values():
    x = torch.tensor([1.4 * 2 ** 15, 1e30, -1e30, math.inf, -math.inf, math.nan, 2.0 ** -24, -2.0 ** -24, -0.0])
    assert hifloat8.encode(x).tolist() == [0x6E, 0x6E, 0xEE, 0x6F, 0xEF, 0x80, 0, 0, 0]
