"""torch_npu's ``assertRtolEqual`` rule, as a function: ``check_rtol_equal(x, y, prec, prec16)`` returns None when
``x`` and ``y`` agree and the reason ("shape error", "result error", ...) when they do not."""
from __future__ import annotations

from collections.abc import Sequence
from numbers import Number

import numpy as np
import torch

FP16_DENOMINATOR_FLOOR = 6e-8
DENOMINATOR_FLOOR = 1e-9
CHUNK = 1 << 22
_INTEGER_OR_WIDE = (np.float32, np.float64, np.int8, np.uint8, np.uint16, np.int16, np.int32, np.int64)


def _mismatch(x: np.ndarray, y: np.ndarray, prec: float, floor: float) -> str | None:
    """Elements agree when |y - x| <= prec (absolute) or |y - x| / (max(|x|, |y|) + floor) <= prec (relative); the
    arrays agree unless NaNs sit in different places, or more than ``prec * size`` elements fail the absolute test
    and more than ``prec * size`` fail the relative one (and neither test passes everywhere). Counted in chunks,
    so that large caches compare without float64 copies of the whole array."""
    x, y = x.reshape(-1), y.reshape(-1)
    abs_failures = rel_failures = 0
    for start in range(0, x.size, CHUNK):
        xc, yc = x[start:start + CHUNK], y[start:start + CHUNK]
        nan = np.isnan(xc)
        if not np.array_equal(nan, np.isnan(yc)):
            return "NaNs in different places"
        err = np.abs(np.where(nan, 0, yc - xc))
        abs_failures += int(np.count_nonzero(~(err <= prec)))
        with np.errstate(invalid="ignore", divide="ignore"):
            rel_failures += int(np.count_nonzero(~(err / (np.maximum(np.abs(xc), np.abs(yc)) + floor) <= prec)))
    if abs_failures == 0 or rel_failures == 0:
        return None
    allowed = x.size * prec
    if rel_failures > allowed and abs_failures > allowed:
        return "result error"
    return None


def _to_numpy_pair(x, y, auto_trans_dtype: bool):
    """Both operands as numpy arrays, or the bfloat16 pair as tensors (numpy has no bfloat16)."""
    if isinstance(x, torch.Tensor) and isinstance(y, Sequence):
        y = torch.as_tensor(y, dtype=x.dtype, device=x.device)
    elif isinstance(x, Sequence) and isinstance(y, torch.Tensor):
        x = torch.as_tensor(x, dtype=y.dtype, device=y.device)
    if torch.is_tensor(x) and torch.is_tensor(y):
        if auto_trans_dtype:
            x = x.to(y.dtype)
        if x.dtype == torch.bfloat16 and y.dtype == torch.bfloat16:
            return x.detach().cpu(), y.detach().cpu()
        return x.detach().cpu().numpy(), y.detach().cpu().numpy()
    if isinstance(x, Number) and isinstance(y, Number):
        return np.array(x), np.array(y)
    return x, y


def check_rtol_equal(x, y, prec: float = 1e-4, prec16: float = 1e-3, auto_trans_dtype: bool = False) -> str | None:
    """torch_npu's rule: sequences element by element; bfloat16 pairs by ``torch.allclose(rtol=atol=prec16)``; other
    tensors, arrays and numbers by :func:`_mismatch` with ``prec16`` for float16 and ``prec`` for float32/64 and
    integers; bools exactly."""
    if isinstance(x, Sequence) and isinstance(y, Sequence):
        for x_, y_ in zip(x, y):
            reason = check_rtol_equal(x_, y_, prec, prec16, auto_trans_dtype)
            if reason:
                return reason
        return None
    x, y = _to_numpy_pair(x, y, auto_trans_dtype)
    if torch.is_tensor(x):  # the bfloat16 pair
        if x.shape != y.shape:
            return "shape error"
        return None if torch.allclose(x, y, rtol=prec16, atol=prec16) else "result error"
    if x.shape != y.shape:
        return "shape error"
    if x.dtype != y.dtype:
        return "dtype error"
    if x.dtype == np.bool_:
        return None if np.array_equal(x, y) else "result error"
    if x.dtype == np.float16:
        return _mismatch(x, y, prec16, FP16_DENOMINATOR_FLOOR)
    if x.dtype in _INTEGER_OR_WIDE:
        return _mismatch(x, y, prec, DENOMINATOR_FLOOR)
    return f"dtype {x.dtype} is not one assertRtolEqual compares"
