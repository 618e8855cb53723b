"""Run a CPU implementation for tensors on any device: copy them to the CPU, compute there, copy results back.

The pure-PyTorch references allocate their work tensors on the CPU. Where a device has no kernel for an
operator (NSA and FusedInferAttention on CUDA, FlashAttention calls the Triton verifier refuses), they run on CPU
copies: correct on every device, only slower.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _map(fn: Callable[[torch.Tensor], torch.Tensor], x: Any) -> Any:
    """``fn`` applied to every tensor in ``x`` (tensors, lists, tuples and dict values; anything else unchanged)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map(fn, item) for item in x)
    if isinstance(x, dict):
        return {key: _map(fn, value) for key, value in x.items()}
    return x


def origin_device(*values: Any) -> torch.device | None:
    """The first non-CPU device among the tensors in ``values``, or None when they are all on the CPU."""
    found = []
    _map(lambda t: found.append(t.device) or t, list(values))
    return next((d for d in found if d.type != "cpu"), None)


def to_cpu(x: Any) -> Any:
    """``x`` with every tensor on the CPU (CPU tensors are not copied)."""
    return _map(lambda t: t.cpu(), x)


def to_device(x: Any, device: torch.device | None) -> Any:
    """``x`` with every tensor moved to ``device`` (unchanged when ``device`` is None)."""
    return x if device is None else _map(lambda t: t.to(device), x)


def on_cpu(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, computed on the CPU when a tensor argument lives elsewhere; tensor results come back
    on that tensor's device."""
    device = origin_device(args, kwargs)
    if device is None:
        return fn(*args, **kwargs)
    return to_device(fn(*to_cpu(args), **to_cpu(kwargs)), device)
