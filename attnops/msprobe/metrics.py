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


def _share(mask: Tensor, of: Tensor) -> float:
    count = int(of.sum())
    return float((mask & of).sum()) / count if count else 0.0


def compute_metrics(actual: Tensor, bench: Tensor, dtype: torch.dtype) -> Metrics:
    """Metrics of ``actual`` against ``bench`` (same shape) with the constants of ``dtype`` (the output dtype)."""
    a, b = actual.detach().to(torch.float64).reshape(-1), bench.detach().to(torch.float64).reshape(-1)
    finite = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[finite], b[finite]
    if a.numel() == 0:
        return Metrics(1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0)
    c = constants_for(dtype)
    err = (a - b).abs()
    norms = float(a.norm()) * float(b.norm())
    cosine = float(a @ b) / norms if norms else (1.0 if float(err.max()) == 0 else 0.0)
    re_all = err / torch.where(b == 0, torch.full_like(b, c.eps), b.abs())
    every = torch.ones_like(err, dtype=torch.bool)
    large = b.abs() > c.small_value
    rel = err[large] / (b[large].abs() + c.eps)
    return Metrics(
        cosine=cosine, max_abs_err=float(err.max()),
        max_rel_err=float(rel.max()) if rel.numel() else 0.0,
        one_thousandth_ratio=_share(re_all < 0.001, every), five_thousandths_ratio=_share(re_all < 0.005, every),
        rmse=math.sqrt(float((err * err).mean())),
        mean_rel_err=float(rel.mean()) if rel.numel() else 0.0,
        small_value_err_ratio=_share(err > c.small_value_atol, ~large))
