"""Run CUDA test code on the CPU: ``"cuda"`` devices become ``"cpu"`` while :class:`CudaOnCpu` is active.

Mapped: the ``device=`` argument of every PyTorch function (tensor factories, ``*_like``, ``new_*``), ``Tensor.to``,
``Tensor.cuda``, ``Module.to``/``Module.cuda`` (through ``Tensor.to``), and the ``torch.cuda`` queries test files make
at import: ``get_device_capability`` reports :data:`CAPABILITY`, ``get_device_properties`` a device of
:data:`TOTAL_MEMORY`, ``synchronize`` and ``empty_cache`` do nothing. ``torch.cuda.is_available()`` stays False,
so attnops itself runs its CPU reference.
"""
from __future__ import annotations

import types

import torch
from torch.overrides import TorchFunctionMode

CAPABILITY = (8, 0)  # an A100: flash-attn 2 enables every feature there (head dim 256 backward with dropout)
TOTAL_MEMORY = 80 * 2**30
_TORCH_CUDA = {
    "get_device_capability": lambda device=None: CAPABILITY,
    "get_device_properties": lambda device=None: types.SimpleNamespace(
        name="attnops CPU (as sm80)", major=CAPABILITY[0], minor=CAPABILITY[1], total_memory=TOTAL_MEMORY,
        multi_processor_count=108),
    "synchronize": lambda device=None: None,
    "empty_cache": lambda: None,
}

DESCRIPTION = (f"device mapping: 'cuda' and 'cuda:N' -> 'cpu' in device= arguments, Tensor.to, Tensor.cuda and "
               f"Module.to/.cuda; torch.cuda.get_device_capability() -> {CAPABILITY}, get_device_properties()."
               f"total_memory -> {TOTAL_MEMORY // 2**30} GiB, synchronize/empty_cache -> no-ops; "
               f"torch.cuda.is_available() stays False")


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return isinstance(device, torch.device) and device.type == "cuda"


class _DeviceMode(TorchFunctionMode):
    """Rewrites CUDA devices to the CPU in the calls listed in the module docstring."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            kwargs.pop("device", None)
            return args[0].to("cpu", *args[2:], **kwargs)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


class CudaOnCpu:
    """Context manager: the mapping of the module docstring while active; everything is restored on exit."""

    def __init__(self):
        self._mode = _DeviceMode()
        self._saved: dict[str, object] = {}

    def __enter__(self) -> "CudaOnCpu":
        for name, stand_in in _TORCH_CUDA.items():
            self._saved[name] = getattr(torch.cuda, name)
            setattr(torch.cuda, name, stand_in)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for name, original in self._saved.items():
            setattr(torch.cuda, name, original)
        self._saved.clear()
