"""``torch_npu.npu.utils``: the SoC and CANN-version queries (:mod:`.soc`) next to the device calls of
``torch.npu``."""
from __future__ import annotations

import types

from . import soc

_DEVICE_CALLS = ("synchronize", "set_device", "current_device", "device_count", "stream", "set_stream",
                 "current_stream", "default_stream", "get_device_name", "get_device_properties", "is_bf16_supported")


def _is_gte_cann_version(version: str, module: str = "CANN") -> bool:
    """Whether the reported CANN version is ``version`` or later."""
    return soc.is_gte_cann_version(version, module)


def utils_module(npu: types.ModuleType) -> types.ModuleType:
    """The ``torch_npu.npu.utils`` module for the ``torch.npu`` stand-in ``npu``."""
    utils = types.ModuleType("torch_npu.npu.utils", "attnops stand-in for torch_npu.npu.utils")
    for name in _DEVICE_CALLS:
        setattr(utils, name, getattr(npu, name))
    utils.get_soc_version = soc.soc_version
    utils.get_cann_version = soc.cann_version
    utils._is_gte_cann_version = _is_gte_cann_version
    return utils
