"""``torch.autocast`` for the Pythonic API, as SDPA does it (PyTorch's "lower precision fp" list): when autocast
is on for the tensors' device type, floating-point inputs are cast to the autocast dtype and the operator runs
with autocast off (so its own fp32 work stays fp32)."""
from __future__ import annotations

import contextlib

import torch


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype in force for ``device``'s type, or None when autocast is off there."""
    kind = device.type
    if kind == "meta" or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def cast_inputs(dtype: torch.dtype | None, *tensors):
    """``tensors`` with the floating-point ones (other than fp64) cast to ``dtype`` (None: unchanged)."""
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16,
                                                                            torch.float32) else t for t in tensors)


def autocast_off(device: torch.device):
    """Context that disables autocast for ``device``'s type (a no-op context when it is off)."""
    if autocast_dtype(device) is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)
