"""Run a CPU implementation for tensors on any device: copy them to the CPU, compute there, copy results back.

The pure-PyTorch references allocate their work tensors on the CPU. Where a device has no kernel for an
operator (NSA and FusedInferAttention on CUDA, FlashAttention calls the Triton verifier refuses), the custom ops
run the reference on CPU copies: correct on every device, only slower.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _map(fn: Callable[[torch.Tensor], torch.Tensor], x: Any) -> Any:
    """``fn`` applied to every tensor in ``x`` (tensors, lists and tuples of them, anything else unchanged)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map(fn, item) for item in x)
    return x


def _device_of(values) -> torch.device | None:
    """The first non-CPU device among the tensors in ``values``, or None."""
    found = []
    _map(lambda t: found.append(t.device) or t, list(values))
    return next((d for d in found if d.type != "cpu"), None)


def on_cpu(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, computed on the CPU when a tensor argument lives elsewhere; tensor results come back
    on that tensor's device."""
    device = _device_of([*args, *kwargs.values()])
    if device is None:
        return fn(*args, **kwargs)
    to_cpu = (lambda t: t.cpu())
    result = fn(*_map(to_cpu, args), **{name: _map(to_cpu, value) for name, value in kwargs.items()})
    return _map(lambda t: t.to(device), result)
