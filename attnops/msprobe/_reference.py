"""How a reference re-runs a call: the dtype its floating-point inputs take and attnops' ``precision``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from .rebuild import Unsupported

__all__ = ["Reference", "GOLDEN", "EMULATION", "unsupported_if"]


@dataclass(frozen=True)
class Reference:
    """``cast`` applies to every floating-point tensor argument; ``precision`` is passed to attnops' operator."""

    name: str
    cast: Callable[[Any], Any]
    precision: str


def _float64(x: Any) -> Any:
    return x.to(torch.float64) if isinstance(x, Tensor) and x.is_floating_point() else x


GOLDEN = Reference("golden", _float64, "exact")  # float64 inputs, exact
EMULATION = Reference("emulation", lambda x: x, "npu")  # the dumped inputs, the NPU's rounding


def unsupported_if(**given: Any) -> None:
    """Raise :class:`Unsupported` naming the first argument that is given (not None, not an empty tensor)."""
    for name, value in given.items():
        if value is not None and not (isinstance(value, Tensor) and value.numel() == 0):
            raise Unsupported(f"{name} is given: not re-run by attnops compare")
