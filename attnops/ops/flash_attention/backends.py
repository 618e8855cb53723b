"""Runs a validated FlashAttention problem on the backend :func:`choose_backend` picks for it.

The custom ops (``op.py``) call these two functions and nothing else, so a new backend plugs in here once.
"""
from __future__ import annotations

import torch

from ..._core.dispatch import choose_backend
from . import reference
from .problem import FAProblem


def forward(p: FAProblem, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, backend: str = "auto"):
    """``(attention_out, softmax_max, softmax_sum)`` of problem ``p``."""
    choose_backend(backend, query.device)
    return reference.forward(p, query, key, value)


def backward(p: FAProblem, query, key, value, dy, attention_in, softmax_max, softmax_sum, backend: str = "auto"):
    """``(dq, dk, dv, dpse)`` of problem ``p`` from the given forward results (``dpse`` None without a pse grad)."""
    choose_backend(backend, query.device)
    return reference.backward(p, query, key, value, dy, attention_in, softmax_max, softmax_sum)
