"""Argument validation helpers: every failure names the argument, what was expected and what was received."""
from __future__ import annotations

import contextlib
import math
import numbers
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from .errors import AclnnError, ParamDtypeError, ParamInvalidError, ParamNullptrError


def describe(x: Any) -> str:
    """Short description of a value for error messages (never a tensor dump)."""
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={list(x.shape)}, dtype={x.dtype}, device={x.device})"
    if isinstance(x, (list, tuple)) and len(x) > 8:
        return f"{type(x).__name__} of length {len(x)} starting {list(x[:4])}"
    return repr(x)


class Described(str):
    """A ready-made description of what was received (``Described(f"length {n}")``), shown as it is; any other
    received value, a plain ``str`` included, is shown by :func:`describe`."""


def _message(name: str, expected: str, received: str, hint: str | None) -> str:
    return f"{name}: expected {expected}, got {received}" + (f". {hint}" if hint else "")


def fail(name: str, expected: str, got: Any, hint: str | None = None, *, error=ParamInvalidError):
    """Raise ``error`` with the standard message ``name: expected ..., got ...`` (``got``: the received value, or a
    :class:`Described` description of it); the parts stay on the error for :func:`caller_names`."""
    received = got if isinstance(got, Described) else describe(got)
    exc = error(_message(name, expected, received, hint))
    exc.parts = (name, expected, received, hint)
    raise exc


@contextlib.contextmanager
def caller_names(names: dict[str, str] | None = None, /, **more: str) -> Iterator[None]:
    """Errors raised inside name the arguments as the caller wrote them: ``names`` (and keywords) map the core's
    argument names to a dialect's (flash-attn's ``q`` for ``query``, aclnn's ``key_in`` for ``key``). An error made
    by :func:`fail` is renamed in its argument and in the references of its expectation ("like key", "as query",
    "query's"); any other attnops error whose message starts with a mapped name (``key: ...``, ``key[0]: ...``)
    is renamed at its start. The error keeps its type."""
    names = {**(names or {}), **more}
    try:
        yield
    except AclnnError as exc:
        parts = getattr(exc, "parts", None)
        if parts is None:
            match = re.match(r"([A-Za-z_]\w*)(?=[:\[])", str(exc))
            if match and match.group(1) in names:
                exc.args = (names[match.group(1)] + str(exc)[match.end():], *exc.args[1:])
            raise
        name, expected, received, hint = parts
        base, element = re.fullmatch(r"([A-Za-z_]\w*)(.*)", name, re.DOTALL).groups()  # element: "[0]" or ""
        if base not in names:
            raise
        refs = "|".join(re.escape(n) for n in names)
        expected = re.sub(rf"\b(like|as|of) ({refs})\b", lambda m: f"{m[1]} {names[m[2]]}", expected)
        expected = re.sub(rf"\b({refs})'s\b", lambda m: f"{names[m[1]]}'s", expected)
        name = names[base] + element
        renamed = type(exc)(_message(name, expected, received, hint))
        renamed.parts = (name, expected, received, hint)
        raise renamed.with_traceback(exc.__traceback__) from None


def require(cond: bool, name: str, expected: str, got: Any, hint: str | None = None) -> None:
    """Raise :class:`ParamInvalidError` unless ``cond``."""
    if not cond:
        fail(name, expected, got, hint)


def require_not_none(x: Any, name: str) -> None:
    if x is None:
        fail(name, "a tensor (required input)", None, error=ParamNullptrError)


def check_tensor(
    name: str,
    x: Any,
    *,
    ndim: int | Iterable[int] | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Validate a required tensor argument; returns it unchanged."""
    require_not_none(x, name)
    _require_tensor_type(name, x)
    if ndim is not None and x.dim() != ndim and (isinstance(ndim, int) or x.dim() not in ndim):
        allowed = {ndim} if isinstance(ndim, int) else set(ndim)
        fail(name, f"a tensor with ndim in {sorted(allowed)}", x)
    if dtypes is not None:
        dts = tuple(dtypes)
        if x.dtype not in dts:
            fail(name, f"dtype in {[str(d) for d in dts]}", x, error=ParamDtypeError)
    if shape is not None and not (x.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, x.shape))):
        fail(name, "shape [" + ", ".join("*" if s is None else str(s) for s in shape) + "]", x)
    if device is not None and x.device != device:
        fail(name, f"a tensor on {device} (same device as query)", x)
    return x


def check_int(name: str, value: Any, *, lo: int | None = None, hi: int | None = None) -> int:
    """Validate an integer attribute in ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_floating_point:
            value = int(value.item())
        else:
            fail(name, "an int", value, error=ParamDtypeError)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        fail(name, f"an int in [{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]", value)
    return value


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    options = list(choices)
    require(value in options, name, f"one of {options}", value)
    return value


def int_list(name: str, value: Any) -> list[int] | None:
    """Normalize an optional host int array to a list of Python ints.

    Accepts what ``torch.ops``' ``int[]`` conversion accepts: a list/tuple of integers (Python ints, NumPy integer
    scalars, 0-d integer tensors), a 1-D integer tensor or a 1-D integer NumPy array.
    """
    if value is None:
        return None
    if isinstance(value, torch.Tensor) or _is_ndarray(value):
        if value.ndim != 1 or not _integer_dtype(value.dtype):
            fail(name, "a 1-D integer tensor or array, or a list of ints", value)
        if torch.compiler.is_compiling():  # its values would be data-dependent: unknown while tracing
            fail(name, "a list of ints under torch.compile (a tensor's values are not known while tracing)", value)
        return [int(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        if all(type(v) is int for v in value):  # plain Python ints (a bool's type is bool): the common case
            return list(value)
        out = []
        for v in value:
            if not _is_integer_scalar(v):
                fail(name, "a list of ints", value, error=ParamDtypeError)
            out.append(int(v))
        return out
    fail(name, "a list of ints or a 1-D integer tensor", value, error=ParamDtypeError)
    return None  # unreachable


def _is_ndarray(value: Any) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"


def _integer_dtype(dtype: Any) -> bool:
    if isinstance(dtype, torch.dtype):
        return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
    return getattr(dtype, "kind", "") in ("i", "u")


def _is_integer_scalar(value: Any) -> bool:
    """A Python int (not bool), a NumPy integer scalar or a 0-d integer tensor."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and _integer_dtype(value.dtype)
    return type(value).__module__ == "numpy" and _integer_dtype(getattr(value, "dtype", None))


def check_scale(name: str, value: Any) -> float:
    """A finite real softmax scale: a Python or NumPy real scalar (``bool``, strings and NaN/Inf are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(name, "a finite float", Described(f"{type(value).__name__} {value!r}"), error=ParamDtypeError)
    require(math.isfinite(value), name, "a finite float", value)
    return float(value)


def _require_tensor_type(name: str, x: Any) -> None:
    """``x`` is a torch.Tensor (a NumPy array or a list is named as such, with the conversion to use)."""
    if not isinstance(x, torch.Tensor):
        kind = f"{type(x).__module__}.{type(x).__name__}" if type(x).__module__ != "builtins" else type(x).__name__
        fail(name, "a torch.Tensor", Described(kind), "convert it with torch.as_tensor(...)" if _is_ndarray(x) or
             isinstance(x, (list, tuple)) else None, error=ParamDtypeError)


def check_same_device(reference: str, ref: torch.Tensor, **tensors: Any) -> None:
    """``ref`` and every given tensor (None skipped) are torch tensors on ``ref``'s device; never copied silently."""
    require_not_none(ref, reference)
    _require_tensor_type(reference, ref)
    for name, t in tensors.items():
        if t is None:
            continue
        _require_tensor_type(name, t)
        if t.device != ref.device:
            fail(name, f"a tensor on {ref.device} (the device of {reference})", t,
                 f"move it with .to({str(ref.device)!r})")


def check_host_or_same_device(reference: str, ref: torch.Tensor, **tensors: Any) -> None:
    """Every given index tensor (tables, slots, positions; None skipped) is on ``ref``'s device or on the CPU, where
    host metadata may live: ``meta`` beside real data, or another device, is the caller's mistake."""
    for name, t in tensors.items():
        if t is None:
            continue
        _require_tensor_type(name, t)
        if t.device != ref.device and t.device.type != "cpu":
            fail(name, f"a tensor on {ref.device} (the device of {reference}) or on the CPU", t,
                 f"move it with .to({str(ref.device)!r})")


def check_head_dim(name: str, x: torch.Tensor, d: int) -> None:
    """A head dim of at least 1 (D = 0 gives an undefined default scale and empty scores)."""
    require(d >= 1, name, "a head dim D >= 1", x)


def softmax_scale(scale: Any, query: torch.Tensor, d: int) -> float:
    """The Pythonic APIs' ``scale``: checked when given, else ``1/sqrt(d)`` (``d``: query's head dim, >= 1)."""
    check_head_dim("query", query, d)
    return d ** -0.5 if scale is None else check_scale("scale", scale)
