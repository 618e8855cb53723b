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

import numpy as np
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
            self.histogram = other.histogram if self.histogram is None else self.histogram.add_(other.histogram)

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


@dataclass(frozen=True)
class _BenchPart:
    """The benchmark's part of one chunk (float64, finite elements), shared by the tensors measured against it.
    The relative errors' denominators carry their element selections: ``rel_den`` is ``|b| + eps`` where
    ``|b| > small_value`` and inf elsewhere (relative error 0 there), ``re_den`` is ``|b|``, eps where ``b = 0``;
    ``small`` marks the elements with ``|b| <= small_value``."""

    b: Tensor
    norm: float
    small: np.ndarray
    rel_den: np.ndarray
    re_den: np.ndarray


def _bench_part(b: Tensor, norm: float, c: DtypeConstants) -> _BenchPart:
    b_abs = b.abs().numpy()
    small = b_abs <= c.small_value
    rel_den, re_den = b_abs + c.eps, b_abs.copy()
    np.copyto(rel_den, np.inf, where=small)
    np.copyto(re_den, c.eps, where=b_abs == 0)
    return _BenchPart(b=b, norm=norm, small=small, rel_den=rel_den, re_den=re_den)


def _chunk_totals(a: Tensor, norm_a: float, bench: _BenchPart, c: DtypeConstants) -> _Totals:
    """The sums of one chunk (finite elements only, float64). The float sums are torch's reductions (their
    summation order fixes the last bits); counts and maxima, exact in any order, are numpy's (vectorised where
    torch's boolean-valued CPU operators are not)."""
    err_t = (a - bench.b).abs_()
    err = err_t.numpy()
    re_all = err / bench.re_den
    rel = err / bench.rel_den
    return _Totals(
        count=err.size, dot=float(a @ bench.b), norm_a=norm_a, norm_b=bench.norm, err_sq=float(err_t @ err_t),
        err_max=float(err.max()) if err.size else 0.0, below_1e3=int(np.count_nonzero(re_all < 0.001)),
        below_5e3=int(np.count_nonzero(re_all < 0.005)), large=err.size - int(np.count_nonzero(bench.small)),
        rel_sum=float(torch.from_numpy(rel).sum()), rel_max=float(rel.max()) if rel.size else 0.0,
        small_off=int(np.count_nonzero((err > c.small_value_atol) & bench.small)),
        histogram=torch.bincount((err_t.view(torch.int64) >> HISTOGRAM_SHIFT).int(), minlength=HISTOGRAM_BINS))


def _chunk(b_all: Tensor, a_all: list[Tensor], at: int, c: DtypeConstants) -> list[_Totals]:
    """The sums of chunk ``at`` for every tensor of ``a_all`` against ``b_all`` (flat)."""
    b_full = b_all[at:at + CHUNK].to("cpu", torch.float64)  # numpy counts on the CPU
    norm_b = float(b_full @ b_full)
    shared = None
    out = []
    for a_flat in a_all:
        a = a_flat[at:at + CHUNK].to("cpu", torch.float64)
        norm_a = float(a @ a)
        if math.isfinite(norm_a) and math.isfinite(norm_b):  # every element finite
            shared = _bench_part(b_full, norm_b, c) if shared is None else shared
            out.append(_chunk_totals(a, norm_a, shared, c))
        else:
            finite = torch.isfinite(a) & torch.isfinite(b_full)
            a, b = a[finite], b_full[finite]
            out.append(_chunk_totals(a, float(a @ a), _bench_part(b, float(b @ b), c), c))
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
