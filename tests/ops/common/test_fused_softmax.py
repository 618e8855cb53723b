"""The fused softmax passes of the CPU attention engine (``cpu_kernels/softmax.cpp``) against the PyTorch passes
they replace: random tiles with masked (-inf) entries, fully masked rows, NaN, widths that are not a multiple of
the vector width, first and later online-softmax blocks; the band masked inside the passes against
``MaskSpec.fill_masked_``, bit for bit."""
import math

import pytest
import torch

from attnops._core.masks import INF, MaskSpec
from attnops.ops.common import fused_softmax as fused
from attnops.ops.common import reference_tiles as tiling
from tests.helpers import TRIU2048, check_fa, make_qkv

LOG2E = math.log2(math.e)
FLT_LOWEST = torch.finfo(torch.float32).min
pytestmark = pytest.mark.skipif(not fused.fused_softmax(torch.float32, torch.device("cpu")),
                                reason="the CPU kernels library is not available")


def _tile(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Scores with about a third masked, row 1 fully masked and a NaN in row 2 (rows >= 3)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(rows, cols, generator=g) * 4
    s[torch.rand(rows, cols, generator=g) < 0.3] = -math.inf
    s[1] = -math.inf
    s[2, cols // 2] = math.nan
    return s


def _close(a: torch.Tensor, b: torch.Tensor, terms: int = 1) -> None:
    """Equal up to a few roundings per element, and the rounding of a sum of ``terms`` in another order."""
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(a, b, rtol=(4 + terms) * eps, atol=0, equal_nan=True)


@pytest.mark.parametrize("cols", [1, 7, 16, 37, 300])
def test_online_softmax_blocks(cols):
    """Two blocks through the kernel equal the PyTorch online softmax: P, running max, sum and rescale factor."""
    rows = 5
    a, b = _tile(rows, cols, 0), _tile(rows, cols, 1) + 2
    m, l, rescale = (torch.empty(rows, 1) for _ in range(3))
    pa, pb = a.clone(), b.clone()
    fused.softmax_block_(pa, m, l, None, clamp=True)
    m_ref = a.amax(-1, keepdim=True).clamp_min(FLT_LOWEST)
    pa_ref = (a - m_ref).mul(LOG2E).exp2()
    _close(pa, pa_ref)
    _close(m, m_ref)
    _close(l, pa_ref.sum(-1, keepdim=True), terms=cols)
    assert torch.equal(pa[1], torch.zeros(cols)) and m[1].item() == FLT_LOWEST and l[1].item() == 0
    l_ref = l.clone()
    fused.softmax_block_(pb, m, l, rescale, clamp=False)
    m_new = torch.maximum(m_ref, b.amax(-1, keepdim=True))
    rescale_ref = (m_ref - m_new).mul(LOG2E).exp2()
    pb_ref = (b - m_new).mul(LOG2E).exp2()
    _close(pb, pb_ref)
    _close(m, m_new)
    _close(rescale, rescale_ref)
    _close(l, l_ref * rescale_ref + pb_ref.sum(-1, keepdim=True), terms=cols)
    assert math.isnan(m[2].item()) and math.isnan(l[2].item())


BANDS = {  # (lo, hi, prefix or None): causal, bottom-right causal, a window, prefix columns, rows keeping nothing
    "causal": (-INF, 0, None), "bottom-right": (-INF, 23, None), "window": (-9, 4, None), "left-only": (-5, INF, None),
    "prefix": (-INF, -3, 11), "window-prefix": (-12, -6, 30), "empty-rows": (30, 40, None), "keeps-all": (-INF, INF, 5),
}


@pytest.mark.parametrize("band", list(BANDS))
@pytest.mark.parametrize("r0, c0, rows, cols", [(0, 0, 37, 45), (20, 8, 19, 33), (40, 2, 8, 70), (3, 50, 16, 16)])
def test_band_in_pass_equals_python_masking(band, r0, c0, rows, cols):
    """A tile's band (``MaskSpec.tile_band``) masked inside the passes gives the bits of ``fill_masked_`` then the
    pass: random scores with -inf, +inf and NaN (masked NaN scores become -inf too), rows that keep nothing."""
    lo, hi, prefix = BANDS[band]
    spec = MaskSpec((lo,), (hi,), None if prefix is None else (prefix,))
    r1, c1 = r0 + rows, c0 + cols
    g = torch.Generator().manual_seed(rows + cols)
    s = torch.randn(rows, cols, generator=g) * 4
    for value in (math.nan, math.inf, -math.inf):
        s.view(-1)[torch.randint(0, s.numel(), (rows,), generator=g)] = value
    edge = spec.tile_band(0, r0, r1, c0, c1)
    masked = spec.fill_masked_(s.clone().unsqueeze(0), 0, r0, r1, c0, c1)[0]
    bits = lambda t: t.view(torch.int32)  # NaN compared by its bits
    for clamp in (True, False):
        got, want = s.clone(), masked.clone()
        stats = [torch.empty(rows, 1) for _ in range(4)]
        fused.softmax_block_(got, *stats[:2], None, clamp, band=edge)
        fused.softmax_block_(want, *stats[2:], None, clamp)
        for a, b in zip([got, *stats[:2]], [want, *stats[2:]]):
            assert torch.equal(bits(a), bits(b))
    m = masked.amax(-1, keepdim=True).nan_to_num(nan=0.0).clamp_min(FLT_LOWEST).contiguous()
    neg_log2_l = torch.rand(rows, 1, generator=g).add(1).log2().neg()
    got, want = s.clone(), masked.clone()
    got16, want16 = (torch.empty(rows, cols, dtype=torch.bfloat16) for _ in range(2))
    fused.probabilities_(got, m, neg_log2_l, got16, band=edge)
    fused.probabilities_(want, m, neg_log2_l, want16)
    assert torch.equal(bits(got), bits(want)) and torch.equal(got16.view(torch.int16), want16.view(torch.int16))
    if band == "empty-rows":  # rows whose band starts past the tile keep nothing: P = 0
        empty = min(rows, max(0, c1 - lo - r0))
        assert torch.equal(got[empty:], torch.zeros(rows - empty, cols))


@pytest.mark.parametrize("cols", [3, 16, 45])
def test_probabilities_and_grad(cols):
    """The backward's ``P = exp2((s - m) log2 e - log2 l)`` and ``dS = P (dP - D)``, on a strided tile view."""
    rows = 6
    store = _tile(rows, cols + 5, 2)
    s = store[:, 2:2 + cols]  # row stride cols + 5
    m = s.amax(-1, keepdim=True).clamp_min(FLT_LOWEST).contiguous()
    neg_log2_l = torch.rand(rows, 1).add(1).log2().neg()
    p_ref = torch.add(neg_log2_l, s - m, alpha=LOG2E).exp2()
    p = s.clone()
    fused.probabilities_(p, m, neg_log2_l)
    _close(p, p_ref)
    dp, delta = torch.randn(rows, cols), torch.randn(rows, 1)
    p[3, cols // 3] = p_ref[3, cols // 3] = 1.0  # a row's only key
    unit = p.clone()
    fused.grad_(p, dp, delta)
    _close(p, p_ref * (dp - delta))
    fused.grad_(unit, dp, delta, unit_zero=True)  # dS = 0 where P == 1, the rest as before
    assert unit[3, cols // 3].item() == 0.0
    _close(unit, (p_ref * (dp - delta)).masked_fill_(p_ref == 1.0, 0.0))


def test_rejects_scattered_rows():
    """Row vectors must hold consecutive rows: a strided one raises instead of reading the wrong rows."""
    s = torch.randn(4, 8)
    stats = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="row vector"):
        fused.probabilities_(s, stats[:, :1], torch.zeros(4, 1))


@pytest.mark.parametrize("fused_passes", [True, False], ids=["fused", "pytorch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_engine_on_both_paths(monkeypatch, fused_passes, dtype):
    """FlashAttention forward and backward against the fp64 golden with the fused passes and with the PyTorch
    passes they replace (the path taken without a compiler): causal rows of several chunks, a band wider than one
    forward block (the online softmax), fully masked rows (sparse_mode 3 with Sq > Skv)."""
    from attnops.ops.common import reference, reference_backward

    if not fused_passes:
        for module in (reference, reference_backward):
            monkeypatch.setattr(module, "fused_softmax", lambda *_: False)
    monkeypatch.setattr(tiling, "FWD_COL_BLOCK", 48)
    q, k, v, dy = make_qkv("BNSD", b=1, n1=2, sq=150, skv=130, d=16, dtype=dtype, seed=7)
    check_fa(q, k, v, dy, layout="BNSD", head_num=2, scale=0.3, atten_mask=TRIU2048, sparse_mode=3)


def _rounded(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bf16 to nearest even, denormals flushed to 0 (as AVX512-BF16's conversion does)."""
    return torch.where(t.abs() < torch.finfo(torch.float32).tiny, t * 0, t).to(torch.bfloat16)


@pytest.mark.parametrize("cols", [7, 37])
def test_rounded_copies(cols):
    """Each pass's bf16 copy of its result (the operands of the bf16 GEMM) is the fp32 result rounded, in the
    vector body and the scalar tail of a row alike: denormals, NaN and values halfway between two bf16."""
    rows = 6
    s = _tile(rows, cols, 3)
    m, l = torch.empty(rows, 1), torch.empty(rows, 1)
    out16 = torch.empty(rows, cols + 3, dtype=torch.bfloat16)[:, 1:1 + cols]
    fused.softmax_block_(s, m, l, None, clamp=True, out16=out16)
    torch.testing.assert_close(out16, _rounded(s), rtol=0, atol=0, equal_nan=True)
    fused.probabilities_(s, m, torch.zeros(rows, 1), out16=out16)
    torch.testing.assert_close(out16, _rounded(s), rtol=0, atol=0, equal_nan=True)
    p = torch.tensor([1e-39, -1e-39, 1.00390625, 1.01171875, float("nan"), 3e38, 5e-38, -2.5]).repeat(rows, 5)
    exact = p.clone()
    fused.grad_(p[:, :cols], torch.ones(rows, cols), torch.zeros(rows, 1), out16=out16)  # dS = P exactly
    torch.testing.assert_close(out16, _rounded(exact[:, :cols]), rtol=0, atol=0, equal_nan=True)
