"""Opt-in shim: ``import torch_npu`` returns :mod:`attnops.torch_npu`, ``torch.ops.npu.<op>`` resolves to the same
functions, and ``torch.npu`` offers the device, stream, event and graph-capture calls Ascend scripts make
(:mod:`attnops.torch_npu.npu_device`).

Only when the real torch_npu is absent; nothing happens on import, only when :func:`install` is called.
"""
from __future__ import annotations

import importlib.util
import sys
import types

import torch

from .._core.checks import check_choice
from . import tensor_patch
from .npu_device import npu_device_module

def _transfer_to_npu_module(package: types.ModuleType) -> types.ModuleType:
    """``torch_npu.contrib.transfer_to_npu``: on the NPU it redirects ``cuda`` calls to the NPU; on the stand-in
    device there is nothing to transfer (``cuda`` already is the device, or the CPU stands in), so importing it
    changes nothing."""
    contrib = types.ModuleType("torch_npu.contrib", "attnops stand-in for torch_npu.contrib")
    transfer = types.ModuleType("torch_npu.contrib.transfer_to_npu",
                                "attnops stand-in: nothing to transfer on the stand-in device")
    contrib.transfer_to_npu = transfer
    package.contrib = contrib
    return contrib


def install(device: str | torch.device | None = None, *, patch_tensor_npu: bool = False) -> bool:
    """Make ``import torch_npu``, ``torch.ops.npu.<op>`` and ``torch.npu`` work without an NPU.

    ``device``: the device that stands in for the NPU (``"cuda"`` when available by default, else ``"cpu"``);
    ``torch.npu.device`` holds it, so a ported script replaces ``.npu()`` by ``.to(torch.npu.device)``.
    ``patch_tensor_npu``: also make ``Tensor.npu()``, ``Tensor.to("npu")`` and ``device="npu"`` in the common
    factories mean that device (patches PyTorch for the whole process; see :mod:`attnops.torch_npu.tensor_patch`).
    Returns False, changing nothing, when the real torch_npu is importable; True once installed (idempotent).
    """
    from . import ATB_OPS, OPS
    from . import __name__ as package_name

    package = sys.modules[package_name]
    if sys.modules.get("torch_npu") is package:
        if patch_tensor_npu:
            tensor_patch.patch(torch.npu.device)
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
    for name in ATB_OPS:
        setattr(torch.ops.atb, name, getattr(package, name))
    npu = npu_device_module(device)
    torch.npu = npu
    package.npu = npu
    sys.modules["torch.npu"] = npu
    sys.modules["torch_npu.npu"] = npu
    contrib = _transfer_to_npu_module(package)
    sys.modules["torch_npu.contrib"] = contrib
    sys.modules["torch_npu.contrib.transfer_to_npu"] = contrib.transfer_to_npu
    if patch_tensor_npu:
        tensor_patch.patch(device)
    return True
