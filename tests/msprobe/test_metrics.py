"""The one-pass chunked metrics against a straightforward implementation of their definitions (docs/compare.md),
and the verdict's shortcuts for exactness and finiteness against torch's."""
from __future__ import annotations

import math

import pytest
import torch

from attnops.msprobe import metrics as metrics_module
from attnops.msprobe.metrics import HISTOGRAM_SHIFT, constants_for, metrics_against
from attnops.msprobe.verdict import judge_tensor


def _straightforward(actual: torch.Tensor, bench: torch.Tensor, dtype: torch.dtype) -> tuple[dict, torch.Tensor]:
    c = constants_for(dtype)
    a, b = actual.double(), bench.double()
    keep = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[keep], b[keep]
    err = (a - b).abs()
    large = b.abs() > c.small_value
    rel = err[large] / (b[large].abs() + c.eps)
    re_all = err / torch.where(b == 0, torch.full_like(b, c.eps), b.abs())
    small = ~large
    metrics = dict(
        cosine=float(a @ b / (a.norm() * b.norm())), max_abs_err=float(err.max()), max_rel_err=float(rel.max()),
        one_thousandth_ratio=float((re_all < 0.001).double().mean()),
        five_thousandths_ratio=float((re_all < 0.005).double().mean()), rmse=float(err.square().mean().sqrt()),
        mean_rel_err=float(rel.mean()), small_value_err_ratio=float((err[small] > c.small_value_atol).double().mean()))
    hist = torch.bincount(err[err > 0].view(torch.int64) >> HISTOGRAM_SHIFT, minlength=1 << (63 - HISTOGRAM_SHIFT))
    return metrics, hist


def _case(dtype: torch.dtype, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    bench = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp(2 * torch.randn(n, generator=g,
                                                                                           dtype=torch.float64))
    bench[::31] = 0.0
    bench[1::37] = -0.0
    bench[2::13] *= 1e-6  # small values, below small_value
    actual = (bench * (1 + 3e-3 * torch.randn(n, generator=g, dtype=torch.float64))).to(dtype)
    actual[3::17] = bench[3::17].to(dtype)  # some exact, some only rounded
    actual[4::41] = 0.0
    actual[5], actual[6], actual[7] = float("nan"), float("inf"), float("-inf")
    bench[8], bench[9], bench[6] = float("nan"), float("-inf"), float("inf")
    return actual, bench


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [7, 1 << 16])
def test_metrics_match_a_straightforward_implementation(monkeypatch, dtype, chunk):
    monkeypatch.setattr(metrics_module, "CHUNK", chunk)
    actual, bench = _case(dtype, 5000, seed=len(str(dtype)) + chunk)
    (m, hist), = metrics_against(bench, [actual], dtype)
    want, want_hist = _straightforward(actual, bench, dtype)
    for name in ("max_abs_err", "max_rel_err", "one_thousandth_ratio", "five_thousandths_ratio",
                 "small_value_err_ratio"):  # maxima and counts: exact in any order
        assert getattr(m, name) == want[name], name
    for name in ("cosine", "rmse", "mean_rel_err"):  # sums: the summation order differs
        assert getattr(m, name) == pytest.approx(want[name], rel=1e-12), name
    assert torch.equal(hist, want_hist)


def test_overflowing_errors_of_float64_tensors_stay_in_their_metrics():
    bench = torch.tensor([-1.7e308, 1.0, 2.0 ** -30, 0.0], dtype=torch.float64)
    actual = torch.tensor([1.7e308, 1.0, 2.0 ** -30, 0.0], dtype=torch.float64)
    (m, _), = metrics_against(bench, [actual], torch.float64)
    assert m.max_abs_err == math.inf and m.max_rel_err == math.inf and m.small_value_err_ratio == 0.0
    assert m.one_thousandth_ratio == 0.75


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_exact_is_torch_equal_with_signed_zeros_nan_and_inf(dtype):
    base = torch.tensor([1.0, -2.0, 0.0, 3.0], dtype=dtype)
    golden = base.double()
    variants = {"same": base.clone(), "negative zero": torch.tensor([1.0, -2.0, -0.0, 3.0], dtype=dtype),
                "other value": torch.tensor([1.0, -2.0, 0.0, 3.5], dtype=dtype)}
    for name, npu in variants.items():
        assert judge_tensor(npu, base, golden).exact == torch.equal(npu, base), name
    for special in (float("nan"), float("inf")):
        npu = base.clone()
        npu[1] = special
        verdict = judge_tensor(npu, npu.clone(), golden)
        assert verdict.exact == torch.equal(npu, npu.clone()) and not verdict.reasons
        other = base.clone()
        other[2] = special
        assert judge_tensor(npu, other, golden).reasons[0] == "inf/NaN positions differ from the emulation's"


def test_an_exact_npu_result_gets_the_emulations_metrics_and_histogram():
    actual, bench = _case(torch.bfloat16, 3000, seed=5)
    emulation = actual.clone()
    emulation[5] = 0.25  # no NaN (inf stays): torch.equal holds
    npu = emulation.clone()
    verdict = judge_tensor(npu, emulation, bench)
    (want, want_hist), = metrics_against(bench, [npu], torch.bfloat16)
    assert verdict.exact and verdict.npu == verdict.emulation == want
    assert torch.equal(verdict.histograms[0], want_hist) and torch.equal(verdict.histograms[1], want_hist)
