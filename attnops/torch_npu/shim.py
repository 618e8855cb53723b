"""The shim: ``import torch_npu`` returns :mod:`attnops.torch_npu`, ``torch.ops.npu.<op>`` resolves to the same
functions (``torch.ops._C_ascend.<op>`` to vllm-ascend's DSA and DeepSeek-V4 ops; ``import cann_ops_transformer``
and ``torch.ops.cann_ops_transformer.<op>`` to :mod:`attnops.cann_ops_transformer`), ``torch.npu`` offers the
device, stream, event and graph-capture calls Ascend scripts make (:mod:`attnops.torch_npu.npu_device`), and
PyTorch takes ``"npu"`` devices and ``pin_memory`` as on the NPU (:mod:`attnops.torch_npu.tensor_patch`); tensor
files an NPU pickled load (:mod:`attnops.torch_npu.pickling`).

Only when the real torch_npu is absent; nothing happens on import, only when :func:`attnops.torch_npu.install` is
called.
"""
from __future__ import annotations

import sys
import types

import torch

from .._core.checks import check_choice
from .._core.module_alias import real_package_present
from . import pickling, soc, tensor_patch
from ._common import with_overloads
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


def _install_pickling_modules(package: types.ModuleType, npu: types.ModuleType) -> None:
    """``torch_npu.utils.storage`` and ``torch_npu.npu._format`` (:mod:`.pickling`): NPU-pickled tensor files load,
    on the CPU, and msprobe's allow-listing of torch_npu's unpickling function finds it."""
    utils = types.ModuleType("torch_npu.utils", "attnops stand-in for torch_npu.utils")
    utils.storage = pickling.storage_module()
    utils.get_cann_version = npu.utils.get_cann_version
    package.utils = utils
    npu._format = pickling.format_module()
    sys.modules.update({"torch_npu.utils": utils, "torch_npu.utils.storage": utils.storage,
                        "torch_npu.npu._format": npu._format, "torch_npu.npu.utils": npu.utils})


def _install_testing_modules(package: types.ModuleType) -> None:
    """``torch_npu.testing`` and its ``testcase``, ``common_utils`` and ``common_distributed`` modules."""
    from .testing import common_distributed, common_utils, testcase

    sys.modules["torch_npu.testing"] = package.testing
    for module in (common_distributed, common_utils, testcase):
        sys.modules["torch_npu.testing." + module.__name__.rsplit(".", 1)[1]] = module


def _install_batch_invariant_ops(package: types.ModuleType) -> None:
    """vllm-ascend's batch-invariant kernels: ``torch.ops.batch_invariant_ops.
    npu_fused_infer_attention_score_batch_invariant`` is :func:`npu_fused_infer_attention_score` itself, whose rows
    never depend on the other rows of the batch (each batch row and head is computed on its own, in one order)."""
    torch.ops.batch_invariant_ops.npu_fused_infer_attention_score_batch_invariant = (
        package.npu_fused_infer_attention_score)


def _add_accelerator_current_device() -> None:
    """``torch.accelerator.current_device``, where this PyTorch only has ``current_device_index``."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and not hasattr(accelerator, "current_device"):
        accelerator.current_device = accelerator.current_device_index


def _install_cann_ops_transformer(module: types.ModuleType) -> None:
    """``import cann_ops_transformer``, ``from cann_ops_transformer.ops import <op>`` (the extension's own layout) and
    ``torch.ops.cann_ops_transformer.<op>`` (:mod:`attnops.cann_ops_transformer`), unless the real ops-transformer
    extension is importable."""
    if real_package_present("cann_ops_transformer"):
        return
    ops = types.ModuleType("cann_ops_transformer.ops", "attnops stand-in for cann_ops_transformer.ops")
    for name in module.OPS:
        setattr(ops, name, getattr(module, name))
    sys.modules["cann_ops_transformer"] = module
    sys.modules["cann_ops_transformer.ops"] = ops
    for name in module.OPS:
        setattr(torch.ops.cann_ops_transformer, name, with_overloads(getattr(module, name)))


def install_package(package: types.ModuleType, ops: tuple[str, ...], atb_ops: tuple[str, ...], c_ascend_ops: dict,
                    device: str | torch.device | None, *, patch_tensor_npu: bool, patch_pin_memory: bool,
                    soc_name: str | None = None, cann_version: str | None = None) -> bool:
    """:func:`attnops.torch_npu.install`: ``package`` (:mod:`attnops.torch_npu`) becomes ``torch_npu``, its functions
    named in ``ops`` / ``atb_ops`` become ``torch.ops.npu.<op>`` / ``torch.ops.atb.<op>``, and ``c_ascend_ops``
    (name: function) ``torch.ops._C_ascend.<op>``."""
    from .. import cann_ops_transformer

    if sys.modules.get("torch_npu") is package:
        if soc_name is not None or cann_version is not None:
            soc.configure(soc_name, cann_version)
        tensor_patch.patch(torch.npu.device, devices=patch_tensor_npu, pin_memory=patch_pin_memory)
        return True
    if real_package_present("torch_npu"):
        return False
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    check_choice("device", device.type, ("cpu", "cuda"))
    soc.configure(soc_name, cann_version)
    sys.modules["torch_npu"] = package
    for name in ops:
        setattr(torch.ops.npu, name, getattr(package, name))
    for name in atb_ops:  # torch_npu.atb.<op> too: the ATB namespace holds every ATB op
        setattr(torch.ops.atb, name, getattr(package, name))
        setattr(package.atb, name, getattr(package, name))
    for name, fn in c_ascend_ops.items():  # vllm-ascend's own ops
        setattr(torch.ops._C_ascend, name, fn)
    _install_cann_ops_transformer(cann_ops_transformer)
    npu = npu_device_module(device)
    torch.npu = npu
    package.npu = npu
    sys.modules["torch.npu"] = npu
    sys.modules["torch_npu.npu"] = npu
    contrib = _transfer_to_npu_module(package)
    sys.modules["torch_npu.contrib"] = contrib
    sys.modules["torch_npu.contrib.transfer_to_npu"] = contrib.transfer_to_npu
    _install_pickling_modules(package, npu)
    _install_testing_modules(package)
    _install_batch_invariant_ops(package)
    _add_accelerator_current_device()
    tensor_patch.patch(device, devices=patch_tensor_npu, pin_memory=patch_pin_memory)
    return True
