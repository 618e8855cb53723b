"""The shim: ``import torch_npu`` returns :mod:`attnops.torch_npu`, ``torch.ops.npu.<op>`` resolves to the same
functions (and ``torch.ops._C_ascend.<op>`` to vllm-ascend's twins of the DSA ops), ``torch.npu`` offers the device, stream, event and graph-capture calls Ascend scripts make
(:mod:`attnops.torch_npu.npu_device`), and PyTorch takes ``"npu"`` devices and ``pin_memory`` as on the NPU
(:mod:`attnops.torch_npu.tensor_patch`).

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


def install(device: str | torch.device | None = None, *, patch_tensor_npu: bool = True,
            patch_pin_memory: bool = True) -> bool:
    """Make ``import torch_npu``, ``torch.ops.npu.<op>``, ``torch.npu`` and ``"npu"`` devices work without an NPU.

    ``device``: the device that stands in for the NPU (``"cuda"`` when available by default, else ``"cpu"``);
    ``torch.npu.device`` holds it.
    ``patch_tensor_npu``: ``"npu"`` / ``"npu:N"`` strings (and ``torch.device("npu")`` where no CUDA exists) mean that
    device in the tensor factories, ``Tensor.to/.npu/.new_*``, ``Module.to/.npu``; ``Tensor.is_npu`` is added.
    ``patch_pin_memory``: where no CUDA exists, ``Tensor.pin_memory()`` and ``pin_memory=True`` in the factories are
    no-ops (a CPU-only PyTorch raises). Both patch PyTorch for the whole process
    (:mod:`attnops.torch_npu.tensor_patch`; ``tensor_patch.unpatch()`` undoes them); pass False to leave it alone.
    Returns False, changing nothing, when the real torch_npu is importable; True once installed (idempotent).
    """
    from . import ATB_OPS, C_ASCEND_OPS, OPS
    from . import __name__ as package_name

    package = sys.modules[package_name]
    if sys.modules.get("torch_npu") is package:
        tensor_patch.patch(torch.npu.device, devices=patch_tensor_npu, pin_memory=patch_pin_memory)
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
    for name, fn in C_ASCEND_OPS.items():  # vllm-ascend's own twins of the DSA ops
        setattr(torch.ops._C_ascend, name, fn)
    npu = npu_device_module(device)
    torch.npu = npu
    package.npu = npu
    sys.modules["torch.npu"] = npu
    sys.modules["torch_npu.npu"] = npu
    contrib = _transfer_to_npu_module(package)
    sys.modules["torch_npu.contrib"] = contrib
    sys.modules["torch_npu.contrib.transfer_to_npu"] = contrib.transfer_to_npu
    tensor_patch.patch(device, devices=patch_tensor_npu, pin_memory=patch_pin_memory)
    return True
