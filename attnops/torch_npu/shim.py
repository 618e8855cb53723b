"""Opt-in shim: ``import torch_npu`` returns :mod:`attnops.torch_npu`, ``torch.ops.npu.<op>`` resolves to the same
functions, and ``torch.npu`` offers the few device calls Ascend scripts make on the happy path.

Only when the real torch_npu is absent; nothing happens on import, only when :func:`install` is called.
"""
from __future__ import annotations

import importlib.util
import sys
import types

import torch

from .._core.checks import check_choice, require

# The names of torch.npu that the shim provides (docs/porting.md)
NPU_DEVICE_FUNCTIONS = ("is_available", "device_count", "current_device", "set_device", "synchronize",
                        "manual_seed", "manual_seed_all", "empty_cache")


def _npu_device_module(device: torch.device) -> types.ModuleType:
    """``torch.npu`` backed by ``device`` (CUDA calls on a CUDA device, no-ops on the CPU)."""
    cuda = device.type == "cuda"
    mod = types.ModuleType("torch.npu", f"attnops stand-in for torch.npu, backed by {device}")

    def set_device(index) -> None:
        index = torch.device(index).index if isinstance(index, (str, torch.device)) else index
        if cuda:
            torch.cuda.set_device(index)
        else:
            require(index in (None, 0), "device", "device 0 (the CPU stands in for one NPU)", index)

    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)  # also seeds CUDA; attnops draws dropout seeds from the default generator

    mod.is_available = lambda: True
    mod.device_count = lambda: torch.cuda.device_count() if cuda else 1
    mod.current_device = lambda: torch.cuda.current_device() if cuda else 0
    mod.set_device = set_device
    mod.synchronize = lambda device=None: torch.cuda.synchronize(device) if cuda else None
    mod.manual_seed = manual_seed
    mod.manual_seed_all = manual_seed
    mod.empty_cache = lambda: torch.cuda.empty_cache() if cuda else None
    mod.device = device
    return mod


def install(device: str | torch.device | None = None) -> bool:
    """Make ``import torch_npu``, ``torch.ops.npu.<op>`` and ``torch.npu`` work without an NPU.

    ``device``: the device that stands in for the NPU (``"cuda"`` when available by default, else ``"cpu"``);
    ``torch.npu.device`` holds it, so a ported script replaces ``.npu()`` by ``.to(torch.npu.device)``.
    Returns False, changing nothing, when the real torch_npu is importable; True once installed (idempotent).
    """
    from . import OPS
    from . import __name__ as package_name

    package = sys.modules[package_name]
    if sys.modules.get("torch_npu") is package:
        return True
    if "torch_npu" in sys.modules or importlib.util.find_spec("torch_npu") is not None:
        return False
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    check_choice("device", device.type, ("cpu", "cuda"))
    sys.modules["torch_npu"] = package
    for name in OPS:
        setattr(torch.ops.npu, name, getattr(package, name))
    npu = _npu_device_module(device)
    torch.npu = npu
    package.npu = npu
    sys.modules["torch.npu"] = npu
    sys.modules["torch_npu.npu"] = npu
    return True
