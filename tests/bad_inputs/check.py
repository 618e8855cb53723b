"""Run one corrupted call of an entry point and judge it (``judge.py``)."""
from __future__ import annotations

from typing import Callable

import torch

from .corruptions import Corruption
from .judge import MUST_RAISE, assert_matches, bounds, call, check_error, observed, tensors
from .registry import Case


def _shape_only(c: Corruption, args: dict) -> bool:
    """Moving the call's only data tensor to ``meta`` makes a consistent shape-only call (every float tensor on
    ``meta``, integer metadata may stay on the host): attnops runs those by design (fake kernels,
    ``attnops.testing.gpu_dry_run``), so there is no mixed-device mistake for the call to name."""
    data = [t for v in args.values() for t in tensors(v) if t.is_floating_point()]
    return c.key[1:] == ("device", "meta") and bool(data) and all(t.device.type == "meta" for t in data)


def _same_shapes_on_meta(c: Corruption, result, clean_result) -> None:
    got, want = tensors(result), tensors(clean_result)
    if [(tuple(t.shape), t.dtype, t.device.type) for t in got] != [(tuple(t.shape), t.dtype, "meta") for t in want]:
        raise AssertionError(f"{c.key}: the shape-only call's outputs differ from the clean call's in shape, dtype "
                             f"or device")


def _must_raise(c: Corruption) -> bool:
    return c.kind in MUST_RAISE or c.kind == "index" or (c.kind == "dtype" and c.variant != "float64")


def _same_as_clean(c: Corruption, result, args: dict, clean_result, clean_args: dict) -> None:
    got, want = observed(result, args), observed(clean_result, clean_args)
    if len(got) != len(want):
        raise AssertionError(f"{c.key}: {len(got)} tensors produced, the clean call {len(want)}")
    for i, (a, w) in enumerate(zip(got, want)):
        if w.is_floating_point():
            bound = 1e-5 * float(w.detach().double().abs().nan_to_num(0, 0, 0).max()) if w.numel() else 0.0
            assert_matches(f"{c.key} output {i} vs the clean call", a, w,
                           bound=bound + default_floor_of(w), nan_allowed=False)
        elif not torch.equal(a, w):
            raise AssertionError(f"{c.key} output {i}: differs from the clean call")


def default_floor_of(w: torch.Tensor) -> float:
    from attnops.testing.compare import default_floor
    return default_floor(w.detach().double(), w.dtype)


def run_corrupted(factory: Callable[[], Case], c: Corruption, position: int) -> None:
    clean = factory()
    clean_result, error = call(clean, clean.args)
    assert error is None, f"the valid call raised {error!r}"
    case = factory()
    args = c.apply(case.args, position)
    result, error = call(case, args)
    if error is not None:
        check_error(c, error, args)
        return
    if _shape_only(c, args):
        _same_shapes_on_meta(c, result, clean_result)
        return
    if _must_raise(c):
        raise AssertionError(f"{c.key}: accepted silently (returned instead of raising an attnops error naming "
                             f"{c.arg!r})")
    if c.kind == "empty":
        return
    if c.kind in ("view", "dtype"):
        _same_as_clean(c, result, args, clean_result, clean.args)
        return
    if case.golden is None:  # a non-finite input: no raw error is all that can be judged without a golden
        return
    golden = case.golden(args)
    clean_golden = clean.golden(clean.args)
    outputs = tensors(result)
    for i, (actual, gold, bound) in enumerate(zip(outputs, golden, bounds(tensors(clean_result), clean_golden))):
        assert_matches(f"{c.key} output {i}", actual, gold, bound=bound, nan_allowed=True)
