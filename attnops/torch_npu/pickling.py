"""Stand-ins for the two torch_npu globals that NPU-pickled tensor files name: ``torch_npu.utils.storage.
_rebuild_npu_tensor`` (torch_npu's unpickling function) and ``torch_npu.npu._format.Format`` (the device layout some
torch_npu versions pickle). Both rebuild the same tensor on the CPU: the storage holds the logical (ND) values, so
the device layout torch_npu would re-apply on an NPU is not needed.

:data:`NPU_GLOBALS` allow-lists them for ``torch.load(weights_only=True)``; the shim installs them as the modules
``torch_npu.utils.storage`` and ``torch_npu.npu._format``, so such files also load with ``import torch_npu``
resolving to attnops (and msprobe's own allow-listing of ``torch_npu.utils.storage._rebuild_npu_tensor`` works).
"""
from __future__ import annotations

import types

from .._core.torch_compat import rebuild_tensor

__all__ = ["NPU_GLOBALS", "storage_module", "format_module"]

STORAGE_MODULE, FORMAT_MODULE = "torch_npu.utils.storage", "torch_npu.npu._format"


def _rebuild_npu_tensor(storage, storage_offset, size, stride, requires_grad, backward_hooks, npu_format=None):
    """Stand-in for torch_npu's unpickling function: the same tensor on the CPU."""
    return rebuild_tensor(storage, storage_offset, size, stride, requires_grad, backward_hooks)


class Format:
    """Stand-in for ``torch_npu.npu._format.Format``: holds the pickled arguments, used for nothing."""

    def __init__(self, *args):
        self.args = args


_rebuild_npu_tensor.__module__ = STORAGE_MODULE  # the names the pickles refer to (and the allow-list matches)
Format.__module__ = FORMAT_MODULE
NPU_GLOBALS = [_rebuild_npu_tensor, Format]


def storage_module() -> types.ModuleType:
    """``torch_npu.utils.storage`` with :func:`_rebuild_npu_tensor`."""
    module = types.ModuleType(STORAGE_MODULE, "attnops stand-in: NPU-pickled tensors rebuild on the CPU")
    module._rebuild_npu_tensor = _rebuild_npu_tensor
    return module


def format_module() -> types.ModuleType:
    """``torch_npu.npu._format`` with :class:`Format`."""
    module = types.ModuleType(FORMAT_MODULE, "attnops stand-in for torch_npu's device formats")
    module.Format = Format
    return module
