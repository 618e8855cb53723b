"""FlashAttention's tolerance rule: an implementation may err at most ``factor`` times as much as plain
PyTorch in the same low precision (the baseline), plus a floor of the dtype's rounding error.

    err      = max|actual   - golden|        (float64)
    base_err = max|baseline - golden|
    floor    = 2 * max|(g_low + 0.3 - 0.3) - g_low|  (+1e-6 for fp32), g_low = golden.to(actual.dtype)
    pass iff err <= factor * base_err + floor

Forward outputs use factor 2, gradients factor 3.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["assert_close_to_golden", "max_abs_err", "default_floor"]


def max_abs_err(a: Tensor, b: Tensor) -> float:
    """max|a - b| in float64 (0 for empty tensors; equal infinities count as 0; NaN propagates)."""
    if tuple(a.shape) != tuple(b.shape):
        raise AssertionError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    a64, b64 = a.detach().to(torch.float64), b.detach().to(torch.float64)
    diff = torch.where(a64 == b64, torch.zeros_like(a64), (a64 - b64).abs())
    if bool(torch.isnan(diff).any()):
        return float("nan")
    return float(diff.max())


def default_floor(golden: Tensor, dtype: torch.dtype) -> float:
    """2 * rounding error of ``dtype`` at the golden's magnitude (+1e-6 for fp32)."""
    floor = 0.0
    if golden.numel() > 0:
        g = golden.detach().to(dtype)
        r = ((g + 0.3 - 0.3) - g).abs().to(torch.float64)
        r = torch.where(torch.isfinite(r), r, torch.zeros_like(r))
        floor = 2.0 * float(r.max())
    if dtype == torch.float32:
        floor += 1e-6
    return floor


def assert_close_to_golden(name, actual, golden, baseline, *, factor: float = 2.0, floor=None) -> None:
    """Raise AssertionError unless max|actual-golden| <= factor*max|baseline-golden| + floor."""
    if actual is None or golden is None:
        if actual is None and golden is None:
            return
        raise AssertionError(f"{name}: actual is {'None' if actual is None else 'a tensor'} "
                             f"but golden is {'None' if golden is None else 'a tensor'}")
    err = max_abs_err(actual, golden)
    base_err = 0.0 if baseline is None else max_abs_err(baseline, golden)
    if floor is None:
        floor = default_floor(golden, actual.dtype)
    bound = factor * base_err + floor
    if not err <= bound:  # NaN fails
        raise AssertionError(f"{name}: err={err:.6g} > factor*base_err + floor = {factor}*{base_err:.6g} + "
                             f"{floor:.6g} = {bound:.6g} (err = max|actual-golden|, "
                             f"base_err = max|baseline-golden|, floor={floor:.6g})")
