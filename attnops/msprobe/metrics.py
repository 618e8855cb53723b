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

from .._core.parallel import run_jobs

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


CHUNK = 1 << 16  # elements per job: the float64 temporaries stay in the core's cache and are recycled
HISTOGRAM_SHIFT = 50  # float64 bits dropped to bin |error|: exponent and 2 mantissa bits, 4 bins per octave
HISTOGRAM_BINS = 1 << (63 - HISTOGRAM_SHIFT)


def histogram_edges() -> Tensor:
    """The ``HISTOGRAM_BINS + 1`` bin edges of the error histograms (bin ``i`` holds the errors whose float64
    bits shifted right by ``HISTOGRAM_SHIFT`` are ``i``; 0 and subnormals in the first bins)."""
    bits = torch.arange(HISTOGRAM_BINS + 1, dtype=torch.int64) << HISTOGRAM_SHIFT
    return bits.clamp_(max=0x7FF0000000000000).view(torch.float64)


@dataclass
class _Totals:
    """Sums of one tensor's errors against the benchmark over some chunks; added in a fixed order."""

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

    def add(self, other: "_Totals") -> None:
        for name in ("count", "dot", "norm_a", "norm_b", "err_sq", "below_1e3", "below_5e3", "large", "rel_sum",
                     "small_off"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.err_max, self.rel_max = max(self.err_max, other.err_max), max(self.rel_max, other.rel_max)
        if other.histogram is not None:
            self.histogram = other.histogram if self.histogram is None else self.histogram + other.histogram

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


def _chunk_totals(a: Tensor, b: Tensor, b_abs: Tensor, rel_den: Tensor, re_den: Tensor, large: Tensor,
                  c: DtypeConstants) -> _Totals:
    """The sums of one chunk (finite elements only, float64)."""
    err = (a - b).abs_()
    rel = torch.where(large, err / rel_den, 0.0)
    re_all = err / re_den
    return _Totals(
        count=err.numel(), dot=float(a @ b), norm_a=float(a @ a), norm_b=float(b @ b), err_sq=float(err @ err),
        err_max=float(err.max()) if err.numel() else 0.0, below_1e3=int((re_all < 0.001).sum()),
        below_5e3=int((re_all < 0.005).sum()), large=int(large.sum()), rel_sum=float(rel.sum()),
        rel_max=float(rel.max()) if rel.numel() else 0.0, small_off=int(((err > c.small_value_atol) & ~large).sum()),
        histogram=torch.bincount(err.view(torch.int64) >> HISTOGRAM_SHIFT, minlength=HISTOGRAM_BINS))


def _chunk(b_all: Tensor, a_all: list[Tensor], at: int, c: DtypeConstants) -> list[_Totals]:
    """The sums of chunk ``at`` for every tensor of ``a_all`` against ``b_all`` (flat)."""
    b_full = b_all[at:at + CHUNK].to(torch.float64)
    b_abs = b_full.abs()
    shared = (b_full, b_abs, b_abs + c.eps, torch.where(b_full == 0, c.eps, b_abs), b_abs > c.small_value)
    out = []
    for a_flat in a_all:
        a = a_flat[at:at + CHUNK].to(torch.float64)
        if math.isfinite(float(a @ a)) and math.isfinite(float(b_full @ b_full)):  # every element finite
            out.append(_chunk_totals(a, *shared, c))
        else:
            finite = torch.isfinite(a) & torch.isfinite(b_full)
            out.append(_chunk_totals(a[finite], *(x[finite] for x in shared), c))
    return out


def metrics_against(bench: Tensor, actuals: list[Tensor], dtype: torch.dtype
                    ) -> list[tuple[Metrics, Tensor | None]]:
    """Per tensor of ``actuals`` (each ``bench``'s shape): its metrics against ``bench`` with the constants of
    ``dtype`` (the output dtype), and the histogram of its non-zero ``|actual - bench|`` (counts per bin of
    :func:`histogram_edges`; None without such errors). Computed in float64 chunks of ``CHUNK`` elements on the
    single-threaded workers of :mod:`attnops._core.parallel` (the benchmark's part of a chunk shared by the tensors),
    and summed in chunk order: the result does not depend on the thread count."""
    c = constants_for(dtype)
    b_all = bench.detach().reshape(-1)
    a_all = [a.detach().reshape(-1) for a in actuals]
    starts = range(0, b_all.numel(), CHUNK)
    parts: list[list[_Totals]] = [[] for _ in starts]
    run_jobs(lambda i: parts[i].extend(_chunk(b_all, a_all, starts[i], c)), range(len(starts)), bench.device)
    totals = [_Totals() for _ in actuals]
    for part in parts:
        for t, p in zip(totals, part):
            t.add(p)
    out = []
    for t in totals:
        hist = None if t.histogram is None else t.histogram.clone()
        if hist is not None:
            hist[0] = 0  # exact zeros are no error
            hist = hist if bool(hist.any()) else None
        out.append((t.metrics(), hist))
    return out


def compute_metrics(actual: Tensor, bench: Tensor, dtype: torch.dtype) -> Metrics:
    """Metrics of ``actual`` against ``bench`` (same shape) with the constants of ``dtype`` (the output dtype)."""
    return metrics_against(bench, [actual], dtype)[0][0]
