"""Opt-in patch of PyTorch for unmodified Ascend scripts: ``Tensor.npu()``, ``Tensor.to("npu")`` and ``device="npu"``
in the common tensor factories mean the shim's stand-in device.

It changes global PyTorch functions for the whole process (every library sees the wrapped factories), so it is off
by default: ``attnops.torch_npu.install(patch_tensor_npu=True)``. Only the names in :data:`FACTORIES` and the
``Tensor`` methods below are patched; a ``"npu"`` device reaching any other PyTorch call still fails there.
"""
from __future__ import annotations

import functools

import torch

FACTORIES = ("empty", "zeros", "ones", "full", "rand", "randn", "randint", "arange", "tensor", "as_tensor",
             "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "eye", "linspace")


def _is_npu(device) -> bool:
    if isinstance(device, str):
        return device == "npu" or device.startswith("npu:")
    return False


def _map(device, stand_in: torch.device):
    return stand_in if _is_npu(device) else device


def _wrap_factory(fn, stand_in: torch.device):
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _map(kwargs["device"], stand_in)
        return fn(*args, **kwargs)

    factory.__attnops_wrapped__ = fn
    return factory


def patch(stand_in: torch.device) -> None:
    """Install the patch (idempotent)."""
    if getattr(torch.Tensor.npu if hasattr(torch.Tensor, "npu") else None, "__attnops_wrapped__", None):
        return
    for name in FACTORIES:
        setattr(torch, name, _wrap_factory(getattr(torch, name), stand_in))
    original_to = torch.Tensor.to

    def npu(self, device=None, non_blocking: bool = False, **kwargs):
        return original_to(self, stand_in, non_blocking=non_blocking)

    @functools.wraps(original_to)
    def to(self, *args, **kwargs):
        if args and _is_npu(args[0]):
            args = (stand_in,) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _map(kwargs["device"], stand_in)
        return original_to(self, *args, **kwargs)

    npu.__attnops_wrapped__ = True
    to.__attnops_wrapped__ = original_to
    torch.Tensor.npu = npu
    torch.Tensor.to = to
    torch.Tensor.is_npu = property(lambda self: self.device == stand_in or self.device.type == stand_in.type)


def unpatch() -> None:
    """Undo :func:`patch` (tests use it)."""
    for name in FACTORIES:
        original = getattr(getattr(torch, name), "__attnops_wrapped__", None)
        if original is not None:
            setattr(torch, name, original)
    original_to = getattr(torch.Tensor.to, "__attnops_wrapped__", None)
    if original_to is not None:
        torch.Tensor.to = original_to
    for attr in ("npu", "is_npu"):
        if attr in torch.Tensor.__dict__:
            delattr(torch.Tensor, attr)
