"""The verdict on one dumped NPU tensor N, by msprobe's benchmark standard with the NPU emulation E in the place
msprobe gives a GPU, both measured against the fp64 golden G.

- FAIL when N's shape or dtype differs from E's, or its inf/NaN positions do.
- Integer outputs (int8 FIA): PASS iff ``max|N - E| <= 1`` (msprobe's rule for quantized outputs).
- Selected block indices (NSA ``topk_indices``, :func:`judge_indices`): PASS iff every row selects the same set
  of blocks as E (the order within a row is free).
- Float outputs: ``ratio = metric(N, G) / max(metric(E, G), minimum_err[dtype])`` must stay within msprobe's L1
  limits (the level it gives npu_fusion_attention and its grad): RMSE 1.5, mean relative error 1.5, max
  relative error 5, small-value error ratio 2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from .metrics import Metrics, constants_for, metrics_against

__all__ = ["RATIO_LIMITS", "TensorVerdict", "judge_tensor", "judge_indices"]

RATIO_LIMITS = {"rmse": 1.5, "mean_rel_err": 1.5, "max_rel_err": 5.0, "small_value_err_ratio": 2.0}


@dataclass
class TensorVerdict:
    """``verdict`` PASS/FAIL/SKIP, the reasons for a FAIL/SKIP, metrics of N and E against G and the ratios."""

    verdict: str
    reasons: list[str] = field(default_factory=list)
    npu: Metrics | None = None
    emulation: Metrics | None = None
    ratios: dict[str, float] = field(default_factory=dict)
    exact: bool = False
    dtype: str = ""
    shape: tuple[int, ...] = ()
    histograms: tuple[Tensor | None, Tensor | None] | None = None  # of log10 |N - G| and |E - G| (see metrics)


def _nonfinite(x: Tensor) -> Tensor:
    x = x.detach()
    return torch.stack([torch.isnan(x), torch.isposinf(x), torch.isneginf(x)]) if x.is_floating_point() else \
        torch.zeros((3, *x.shape), dtype=torch.bool)


def _all_finite(x: Tensor) -> bool:
    """Whether every element of the float tensor ``x`` is finite: its minimum and maximum are (both propagate
    NaN; one reduction, where ``isfinite`` would first write a boolean tensor)."""
    return x.numel() == 0 or all(math.isfinite(float(v)) for v in torch.aminmax(x.detach()))


_SAME_SIZE_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _equal_floats(x: Tensor, y: Tensor, finite: bool) -> bool:
    """``torch.equal`` of two float tensors of one shape and dtype (``finite``: no inf or NaN in either). Identical
    bits, compared as integers by numpy, are equal values when neither holds NaN; other bits (-0.0 against 0.0, or
    values that differ) go to ``torch.equal``."""
    if finite and x.device.type == "cpu" and y.device.type == "cpu":
        bits = _SAME_SIZE_INTEGER[x.element_size()]
        if np.array_equal(x.detach().view(bits).numpy(), y.detach().view(bits).numpy()):
            return True
    return bool(torch.equal(x, y))


def _layout_mismatch(npu: Tensor, emulation: Tensor, result: TensorVerdict) -> TensorVerdict | None:
    if tuple(npu.shape) != tuple(emulation.shape) or npu.dtype != emulation.dtype:
        return TensorVerdict("FAIL", [f"NPU {npu.dtype} {list(npu.shape)} vs emulation {emulation.dtype} "
                                      f"{list(emulation.shape)}"], dtype=result.dtype, shape=result.shape)
    return None


def judge_indices(npu: Tensor, emulation: Tensor) -> TensorVerdict:
    """Judge selected block indices (rows on the last axis): the same set per row as E's."""
    result = TensorVerdict("PASS", dtype=str(npu.dtype).removeprefix("torch."), shape=tuple(npu.shape))
    mismatch = _layout_mismatch(npu, emulation, result)
    if mismatch is not None:
        return mismatch
    result.exact = bool(torch.equal(npu, emulation))
    rows = (npu.sort(-1).values != emulation.sort(-1).values).reshape(-1, npu.shape[-1] if npu.dim() else 1)
    differing = int(rows.any(-1).sum())
    result.ratios = {"rows_selecting_other_blocks": float(differing)}
    if differing:
        result.verdict = "FAIL"
        result.reasons = [f"{differing} of {rows.shape[0]} rows select other blocks than the emulation"]
    return result


def judge_tensor(npu: Tensor, emulation: Tensor, golden: Tensor) -> TensorVerdict:
    """Judge N against E and G (G in float64, E in the NPU's output dtype)."""
    result = TensorVerdict("PASS", dtype=str(npu.dtype).removeprefix("torch."), shape=tuple(npu.shape))
    mismatch = _layout_mismatch(npu, emulation, result)
    if mismatch is not None:
        return mismatch
    if not npu.is_floating_point():
        result.exact = bool(torch.equal(npu, emulation))
        diff = (npu.to(torch.int64) - emulation.to(torch.int64)).abs()
        worst = int(diff.max()) if diff.numel() else 0
        result.ratios = {"max_abs_diff_vs_emulation": float(worst)}
        if worst > 1:
            result.verdict, result.reasons = "FAIL", [f"integer output differs from the emulation by {worst} > 1"]
        return result
    finite = _all_finite(npu) and _all_finite(emulation)
    result.exact = _equal_floats(npu, emulation, finite)
    if not finite and not torch.equal(_nonfinite(npu), _nonfinite(emulation)):
        result.reasons.append("inf/NaN positions differ from the emulation's")
    if result.exact:  # equal values: N's metrics are E's
        (result.emulation, emulation_hist), = metrics_against(golden, [emulation], npu.dtype)
        result.npu, npu_hist = result.emulation, None if emulation_hist is None else emulation_hist.clone()
    else:
        (result.npu, npu_hist), (result.emulation, emulation_hist) = metrics_against(golden, [npu, emulation],
                                                                                     npu.dtype)
    result.histograms = (npu_hist, emulation_hist)
    floor = constants_for(npu.dtype).minimum_err
    for name, limit in RATIO_LIMITS.items():
        ratio = getattr(result.npu, name) / max(getattr(result.emulation, name), floor)
        result.ratios[name] = ratio
        if not ratio <= limit:  # NaN fails
            result.reasons.append(f"{name} ratio {ratio:.3g} > {limit}")
    if result.reasons:
        result.verdict = "FAIL"
    return result
