"""What a ``python -m attnops check`` case is made of (:class:`CheckCase`, :class:`Comparison`) and the helpers the
operators' case modules share: where a backend's inputs live, moving tensors there and back."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

REFERENCE_ONLY = ("reference",)


@dataclass
class Comparison:
    """One output of a case: backend result, fp64 golden and the low-precision baseline; ``factor`` 2 or 3;
    ``reduction``: terms summed into one element (the tolerance floor's, :mod:`attnops.testing.compare`)."""

    name: str
    actual: torch.Tensor | None
    golden: torch.Tensor | None
    baseline: torch.Tensor | None
    factor: float = 2.0
    reduction: int = 1


@dataclass
class CheckCase:
    """One row per backend in ``backends`` that is available; operators without Triton kernels: the reference."""

    operator: str
    name: str
    run: Callable[[str], list[Comparison]]  # backend -> comparisons
    backends: tuple[str, ...] = REFERENCE_ONLY


def triton_runs_on_cuda() -> bool:
    return torch.cuda.is_available()


def input_device(backend: str) -> torch.device:
    """Where a case's inputs live: CUDA for the Triton kernels when a GPU is present, else the CPU."""
    return torch.device("cuda" if backend == "triton" and triton_runs_on_cuda() else "cpu")


def moved(device: torch.device, x):
    """``x`` on ``device`` when it is a tensor (lists of tensors too), else ``x``."""
    if isinstance(x, (list, tuple)):
        return type(x)(moved(device, t) for t in x)
    return x.to(device) if isinstance(x, torch.Tensor) else x


def on_cpu(xs) -> list:
    """Results back on the CPU for the comparisons (None stays None)."""
    return [None if x is None else x.cpu() for x in xs]
