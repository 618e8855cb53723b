"""The property every corrupted call must have: it raises an attnops error naming the corrupted argument, or it
returns what the fp64 formula returns (NaN-aware), as each corruption kind allows (see ``corruptions.py``)."""
from __future__ import annotations

import inspect
import re

import torch

from attnops._core.errors import AclnnError, InferenceOnlyError
from attnops.testing.compare import default_floor, max_abs_err

from .corruptions import Corruption
from .registry import Case

ATTNOPS_ERRORS = (AclnnError, InferenceOnlyError)
MUST_RAISE = {"device", "none", "ndim"}


# aclnn operators take every parameter positionally; these tensors may be null pointers in the seeds
ACLNN_OPTIONAL = {"atten_mask", "topk_mask"}
# kinds where an error about the pair (``key: expected ... like query`` when query was changed) is right too
PAIRWISE = {"device", "empty"}


def required_args(case: Case) -> set[str]:
    """Tensor arguments the call cannot do without: those without a default (an aclnn operator's all but the
    optional masks; an nn module's input ``x``)."""
    params = inspect.signature(case.fn).parameters
    if case.fn.__module__.startswith("attnops.aclnn"):
        return set(case.args) - ACLNN_OPTIONAL
    if any(p.kind is p.VAR_KEYWORD for p in params.values()) and len(params) == 1:
        return {"x"}
    return {n for n, p in params.items() if p.default is p.empty and p.kind is not p.VAR_KEYWORD}


def tensors(result) -> list[torch.Tensor]:
    """The tensors of a result (a tensor, a named tuple / tuple / list of them, nested), in order."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for item in result for t in tensors(item)]
    return []


def observed(result, args: dict) -> list[torch.Tensor]:
    """What a call produces: its outputs, then every tensor argument after the call (caches written in place)."""
    return tensors(result) + [t for v in args.values() for t in tensors(v)]


def call(case: Case, args: dict):
    """``(result, None)`` or ``(None, exception)``."""
    try:
        return case.fn(**args), None
    except Exception as e:  # judged by the caller
        return None, e


def names(message: str, arg: str) -> bool:
    """``arg`` appears in ``message`` as a whole name (``key`` does not name ``key_in``)."""
    return re.search(rf"(?<![\w.]){re.escape(arg)}(?![\w])", message) is not None


def check_error(c: Corruption, error: Exception, args: dict) -> None:
    if not isinstance(error, ATTNOPS_ERRORS):
        raise AssertionError(f"{c.key}: raw {type(error).__name__} (not an attnops error): {error}") from error
    message = str(error)
    allowed = [c.arg]
    if c.kind in PAIRWISE or c.key[1:] == ("dtype", "float64"):
        allowed = [c.arg, *(n for n in args if n != c.arg)]  # a shape or length that disagrees names either side
    if not any(names(message, a) for a in allowed):
        raise AssertionError(f"{c.key}: the error does not name {' or '.join(map(repr, allowed[:1]))}"
                             f"{' (or another argument)' if len(allowed) > 1 else ''}: "
                             f"{type(error).__name__}: {message}")


def assert_matches(what: str, actual: torch.Tensor, expected: torch.Tensor, *, bound: float,
                   nan_allowed: bool) -> None:
    """NaN where ``expected`` has NaN, the same infinities, finite values within ``bound``; with ``nan_allowed``
    a finite expected value may come back NaN (a non-finite input at a masked key), never another finite value."""
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    a, g = actual.detach().to(torch.float64), expected.detach().to(torch.float64)
    if a.is_floating_point() is False or a.numel() == 0:
        return
    gn, an = torch.isnan(g), torch.isnan(a)
    if bool((gn & ~an).any()):
        raise AssertionError(f"{what}: finite or infinite where the formula gives NaN (NaN not propagated)")
    ginf = torch.isinf(g)
    if bool((ginf & (a != g)).any()):
        raise AssertionError(f"{what}: the formula's infinities not reproduced")
    finite = torch.isfinite(g)
    if not nan_allowed and bool((finite & an).any()):
        raise AssertionError(f"{what}: NaN where the formula is finite")
    if bool((finite & torch.isinf(a)).any()):
        raise AssertionError(f"{what}: infinite where the formula is finite")
    keep = finite & torch.isfinite(a)
    err = max_abs_err(a[keep], g[keep])
    if not err <= bound:
        raise AssertionError(f"{what}: a different finite value, max error {err:.3g} > bound {bound:.3g}")


def bounds(clean_outputs: list[torch.Tensor], clean_golden: list[torch.Tensor]) -> list[float]:
    """Per output, the tolerance rule of ``attnops.testing.compare`` (factor 2 for forward outputs, 3 for
    gradients; 3 here for all) with the clean call's error against the golden as the baseline error, plus the
    floor of the output dtype."""
    out = []
    for actual, gold in zip(clean_outputs, clean_golden):
        finite = torch.isfinite(gold.to(torch.float64))
        base = max_abs_err(actual.to(torch.float64)[finite], gold.to(torch.float64)[finite])
        out.append(3.0 * base + default_floor(gold.to(torch.float64), actual.dtype))
    return out
