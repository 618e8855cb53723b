"""Corruptions of one argument of a valid call, each with the outcome it must have.

Every corruption names the argument it changes (the caller's name) and a kind:

- ``nonfinite``: NaN / +inf / -inf in one element of a float tensor (result judged against the golden);
- ``index``: a negative or far out-of-range value in an integer tensor or length list (an error, or the golden);
- ``dtype``: int or bool where float, float or bool where int (an error), float64 where float (an error, or the
  value of the clean call);
- ``device``: the tensor on ``meta`` while the others stay on the CPU (an error);
- ``empty``: a zero-length first dimension (an error or a result, never a raw error);
- ``view``: the same values in a non-contiguous view (the result of the clean call);
- ``none``: None for a required tensor (an error);
- ``ndim``: one dimension fewer or more (an error).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

KINDS = ("nonfinite", "index", "dtype", "device", "empty", "view", "none", "ndim")


@dataclass(frozen=True)
class Corruption:
    arg: str
    kind: str
    variant: str
    change: Callable[[Any, int], Any]  # (clean value, position) -> corrupted value

    def apply(self, args: dict, position: int) -> dict:
        return {**args, self.arg: self.change(args[self.arg], position)}

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.arg, self.kind, self.variant)


def _first_tensor(value):
    return value[0] if isinstance(value, (list, tuple)) else value


def _on_first(fn):
    """Apply ``fn`` to a tensor, or to the first tensor of a list of tensors."""
    def change(value, position):
        if isinstance(value, (list, tuple)):
            return [fn(value[0], position), *value[1:]]
        return fn(value, position)
    return change


def _set_element(new):
    def fn(x, position):
        y = x.clone()
        y.view(-1)[position % y.numel()] = new
        return y
    return fn


def _set_list_element(new):
    def change(value, position):
        y = list(value)
        y[position % len(y)] = new
        return y
    return change


def transpose_view(x, position):
    perm = list(range(x.dim()))[::-1]
    return x.permute(perm).contiguous().permute(perm)


def strided_view(x, position):
    return torch.stack([x, torch.zeros_like(x)], dim=-1)[..., 0]


def _ndim(x, position):
    return x.reshape(-1) if x.dim() >= 2 else x.unsqueeze(0)


FAR = 10**6


def candidates(args: dict, required: set[str]) -> list[Corruption]:
    """Every corruption of every argument of a valid call."""
    out: list[Corruption] = []
    for name, value in args.items():
        t = _first_tensor(value)
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            out += _tensor_corruptions(name, t, name in required)
        elif isinstance(value, (list, tuple)) and value and all(type(v) is int for v in value):
            out += [Corruption(name, "index", "negative", _set_list_element(-7)),
                    Corruption(name, "index", "far", _set_list_element(FAR))]
    return out


def _tensor_corruptions(name: str, t: torch.Tensor, required: bool) -> list[Corruption]:
    c = []
    if t.is_floating_point():
        c += [Corruption(name, "nonfinite", v, _on_first(_set_element(x)))
              for v, x in (("nan", float("nan")), ("+inf", float("inf")), ("-inf", float("-inf")))]
        c += [Corruption(name, "dtype", "int32", _on_first(lambda x, p: x.to(torch.int32))),
              Corruption(name, "dtype", "bool", _on_first(lambda x, p: x != 0))]
        if t.dtype != torch.float64:
            c.append(Corruption(name, "dtype", "float64", _on_first(lambda x, p: x.double())))
    elif t.dtype in (torch.int32, torch.int64):
        c += [Corruption(name, "index", "negative", _on_first(_set_element(-7))),
              Corruption(name, "index", "far", _on_first(_set_element(FAR))),
              Corruption(name, "dtype", "float32", _on_first(lambda x, p: x.float())),
              Corruption(name, "dtype", "bool", _on_first(lambda x, p: x != 0))]
    c += [Corruption(name, "device", "meta", _on_first(lambda x, p: x.to("meta"))),
          Corruption(name, "empty", "first-dim-0", _on_first(lambda x, p: x[:0])),
          Corruption(name, "ndim", "flattened" if t.dim() >= 2 else "unsqueezed", _on_first(_ndim))]
    if t.dim() >= 2:
        c.append(Corruption(name, "view", "transposed", _on_first(transpose_view)))
    c.append(Corruption(name, "view", "strided", _on_first(strided_view)))
    if required:
        c.append(Corruption(name, "none", "None", lambda v, p: None))
    return c
