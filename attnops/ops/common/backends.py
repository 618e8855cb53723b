"""Runs a validated FlashAttention problem on the backend :func:`choose_backend` picks for it.

The custom ops (``op.py``) call these two functions and nothing else, so a new backend plugs in here once.
The Triton verifier (``triton/verify.py``) states why a call cannot run on the kernels; ``auto`` then runs the
reference (a PerformanceWarning names the reason), an explicit ``backend="triton"`` raises with it. The reference computes on the
CPU: tensors on another device are copied there and the results copied back. A problem with an NPU rounding
(``precision="npu"``) always runs the reference.
"""
from __future__ import annotations

import dataclasses

import torch

from ..._core.devices import on_cpu
from ..._core.dispatch import choose_backend
from ..._core.layouts import Geometry
from . import reference, reference_backward
from .problem import FAProblem
from .triton import launch
from .triton.verify import geometry_reason


def _choose(geom: Geometry, query: torch.Tensor, backend: str, backward: bool) -> str:
    return choose_backend(backend, query.device, lambda: geometry_reason(geom, query, backward=backward))


def runs_reference(query: torch.Tensor, geom: Geometry, backend: str, backward: bool) -> bool:
    """Whether a call of geometry ``geom`` on ``query`` runs the reference (which reads every length on the host)."""
    return _choose(geom, query, backend, backward) == "reference"


def _cpu_problem(p: FAProblem) -> FAProblem:
    """``p`` with its tensors (explicit mask, pse, packed dropout mask) on the CPU, for the reference."""
    mask = p.mask if p.mask.explicit is None else dataclasses.replace(p.mask, explicit=p.mask.explicit.cpu())
    pse = p.pse if p.pse is None else dataclasses.replace(p.pse, tensor=p.pse.tensor.cpu())
    drop = p.dropout
    if drop is not None and drop.packed is not None:
        drop = dataclasses.replace(drop, packed=drop.packed.cpu())
    return dataclasses.replace(p, mask=mask, pse=pse, dropout=drop)


def _reference(fn, p: FAProblem, *tensors: torch.Tensor):
    return on_cpu(fn, p if tensors[0].device.type == "cpu" else _cpu_problem(p), *tensors)


def forward(p: FAProblem, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, backend: str = "auto"):
    """``(attention_out, softmax_max, softmax_sum)`` of problem ``p``."""
    if p.rounding is None and _choose(p.geom, query, backend, backward=False) == "triton":
        return launch.forward(p, query, key, value)
    return _reference(reference.forward, p, query, key, value)


def backward(p: FAProblem, query, key, value, dy, attention_in, softmax_max, softmax_sum, backend: str = "auto"):
    """``(dq, dk, dv, dpse)`` of problem ``p`` from the given forward results (``dpse`` None without a pse grad)."""
    if p.rounding is None and _choose(p.geom, query, backend, backward=True) == "triton":
        return launch.backward(p, query, key, value, dy, attention_in, softmax_max, softmax_sum)
    return _reference(reference_backward.backward, p, query, key, value, dy, attention_in, softmax_max, softmax_sum)
