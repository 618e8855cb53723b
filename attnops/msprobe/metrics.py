"""msprobe's error metrics of one tensor against a benchmark (computed in float64).

Columns of ``msprobe compare`` (cosine, max abs error, the shares of relative errors below 0.001 and 0.005 with
``RE = |a - b| / |b|``, the dtype's eps where ``b = 0``) and of its accuracy checker's benchmark standard (RMSE;
mean and max relative error ``|a - b| / (|b| + eps)`` over the elements with ``|b| > small_value``; the
small-value error ratio: the share of the other elements with ``|a - b| > small_value_atol``). Elements that are
inf or NaN in either tensor are left out (the verdict checks their positions). Constants per output dtype from
msprobe's ``standard_config.py``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

__all__ = ["Metrics", "DtypeConstants", "constants_for", "compute_metrics"]


@dataclass(frozen=True)
class DtypeConstants:
    eps: float
    small_value: float
    small_value_atol: float
    minimum_err: float


_CONSTANTS = {
    torch.float16: DtypeConstants(eps=2.0 ** -10, small_value=2.0 ** -10, small_value_atol=1e-16,
                                  minimum_err=2.0 ** -11),
    torch.bfloat16: DtypeConstants(eps=2.0 ** -8, small_value=2.0 ** -10, small_value_atol=1e-16,
                                   minimum_err=2.0 ** -8),
    torch.float32: DtypeConstants(eps=2.0 ** -23, small_value=2.0 ** -20, small_value_atol=2.0 ** -30,
                                  minimum_err=2.0 ** -14),
}


def constants_for(dtype: torch.dtype) -> DtypeConstants:
    """The constants of ``dtype`` (float64 and others use float32's)."""
    return _CONSTANTS.get(dtype, _CONSTANTS[torch.float32])


@dataclass(frozen=True)
class Metrics:
    cosine: float
    max_abs_err: float
    max_rel_err: float
    one_thousandth_ratio: float
    five_thousandths_ratio: float
    rmse: float
    mean_rel_err: float
    small_value_err_ratio: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


CHUNK = 1 << 20  # elements per pass: the float64 temporaries stay cache-sized and are recycled, not page-faulted
HISTOGRAM_RANGE = (-30.0, 10.0)  # log10 |error| covered by the error histograms (outside: the end bins)
HISTOGRAM_BINS = 400


@dataclass
class _Totals:
    """Running sums of one tensor's errors against the benchmark, chunk by chunk."""

    count: int = 0
    dot: float = 0.0
    norm_a: float = 0.0
    norm_b: float = 0.0
    err_sq: float = 0.0
    err_max: float = 0.0
    below_1e3: int = 0
    below_5e3: int = 0
    large: int = 0
    rel_sum: float = 0.0
    rel_max: float = 0.0
    small_off: int = 0
    histogram: Tensor | None = None

    def add(self, a: Tensor, b: Tensor, b_abs: Tensor, re_den: Tensor, large: Tensor, c: "DtypeConstants") -> None:
        err = (a - b).abs_()
        self.count += err.numel()
        self.dot += float(a @ b)
        self.norm_a += float(a @ a)
        self.norm_b += float(b @ b)
        self.err_sq += float(err @ err)
        self.err_max = max(self.err_max, float(err.max()))
        re_all = err / re_den
        self.below_1e3 += int((re_all < 0.001).sum())
        self.below_5e3 += int((re_all < 0.005).sum())
        rel = err[large].div_(b_abs[large].add_(c.eps))
        if rel.numel():
            self.large += rel.numel()
            self.rel_sum += float(rel.sum())
            self.rel_max = max(self.rel_max, float(rel.max()))
        self.small_off += int((err[~large] > c.small_value_atol).sum())
        nonzero = err[err > 0]
        if nonzero.numel():
            counts = torch.histc(nonzero.log10_().clamp_(*HISTOGRAM_RANGE), HISTOGRAM_BINS, *HISTOGRAM_RANGE)
            self.histogram = counts if self.histogram is None else self.histogram.add_(counts)

    def metrics(self) -> Metrics:
        if self.count == 0:
            return Metrics(1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0)
        norms = math.sqrt(self.norm_a) * math.sqrt(self.norm_b)
        small = self.count - self.large
        return Metrics(
            cosine=self.dot / norms if norms else (1.0 if self.err_max == 0 else 0.0), max_abs_err=self.err_max,
            max_rel_err=self.rel_max, one_thousandth_ratio=self.below_1e3 / self.count,
            five_thousandths_ratio=self.below_5e3 / self.count, rmse=math.sqrt(self.err_sq / self.count),
            mean_rel_err=self.rel_sum / self.large if self.large else 0.0,
            small_value_err_ratio=self.small_off / small if small else 0.0)


def metrics_against(bench: Tensor, actuals: list[Tensor], dtype: torch.dtype
                    ) -> list[tuple[Metrics, Tensor | None]]:
    """Per tensor of ``actuals`` (each ``bench``'s shape): its metrics against ``bench`` with the constants of
    ``dtype`` (the output dtype), and the histogram of its non-zero ``log10 |actual - bench|`` (``HISTOGRAM_BINS``
    counts over ``HISTOGRAM_RANGE``; None without errors). One pass in chunks of ``CHUNK`` elements, the
    benchmark's part shared by the tensors."""
    c = constants_for(dtype)
    b_all = bench.detach().reshape(-1)
    a_all = [a.detach().reshape(-1) for a in actuals]
    totals = [_Totals() for _ in actuals]
    for at in range(0, b_all.numel(), CHUNK):
        b = b_all[at:at + CHUNK].to(torch.float64)
        b_finite = torch.isfinite(b)
        b_abs = b.abs()
        shared = (b, b_abs, torch.where(b == 0, c.eps, b_abs), b_abs > c.small_value)
        for a_flat, t in zip(a_all, totals):
            a = a_flat[at:at + CHUNK].to(torch.float64)
            finite = b_finite & torch.isfinite(a)
            if bool(finite.all()):
                t.add(a, *shared, c)
            else:
                t.add(a[finite], *(x[finite] for x in shared), c)
    return [(t.metrics(), t.histogram) for t in totals]


def compute_metrics(actual: Tensor, bench: Tensor, dtype: torch.dtype) -> Metrics:
    """Metrics of ``actual`` against ``bench`` (same shape) with the constants of ``dtype`` (the output dtype)."""
    return metrics_against(bench, [actual], dtype)[0][0]
