"""``torch_npu.testing.common_utils``: the device helpers and test decorators of torch_npu's test utilities, on the
stand-in device. ``SupportedDevices`` compares the SoC the stand-in reports (:mod:`attnops.torch_npu.soc`)."""
from __future__ import annotations

import functools
import os
import unittest

import numpy as np
import torch

from .. import soc


def get_npu_device() -> str:
    """``"npu:<SET_NPU_DEVICE>"`` (``"npu:0"`` when unset)."""
    index = os.environ.get("SET_NPU_DEVICE")
    return "npu:0" if index is None else f"npu:{index}"


def set_npu_device() -> str:
    """Make :func:`get_npu_device` the current device and return it."""
    device = get_npu_device()
    torch.npu.set_device(device)
    return device


def create_common_tensor(item, min_value, max_value, device=None):
    """``item = (numpy dtype, npu format, shape)``: the same uniform(min, max) values as a CPU tensor and as a tensor
    on ``device`` (:func:`get_npu_device` by default) in that format (-1: keep the format)."""
    dtype, npu_format, shape = item
    values = np.random.uniform(min_value, max_value, shape).astype(dtype)
    npu_input = torch.from_numpy(values).to(device or get_npu_device())
    if npu_format != -1:
        import torch_npu
        npu_input = torch_npu.npu_format_cast(npu_input, npu_format)
    return torch.from_numpy(values), npu_input


def device_family(name: str) -> str:
    """The prefix of an SoC name that ``SupportedDevices`` lists compare: ``"Ascend910B"`` for ``"Ascend910B3"``,
    ``"Ascend910_93"`` for ``"Ascend910_9391"``, ``"Ascend950"`` for any Ascend950."""
    if name.startswith("Ascend950"):
        return name[:9]
    return name[:12] if name[:10] == "Ascend910_" else name[:10]


class SupportedDevices:
    """Skip the decorated test unless the stand-in's SoC family is one of ``supported_devices``."""

    def __init__(self, supported_devices: list[str]) -> None:
        self.supported_devices = supported_devices

    def __call__(self, fn):
        @functools.wraps(fn)
        def run_if_supported(test, *args, **kwargs):
            family = device_family(soc.soc_name())
            if family not in self.supported_devices:
                raise unittest.SkipTest(f"Only run on {self.supported_devices!r}, current device is {family}.")
            return fn(test, *args, **kwargs)
        return run_if_supported


class SkipIfNotGteCANNVersion:
    """Skip the decorated test unless the reported CANN version is ``base_version`` or later."""

    def __init__(self, base_version: str, module: str = "CANN") -> None:
        self.base_version = base_version
        self.module = module

    def __call__(self, fn):
        @functools.wraps(fn)
        def run_if_recent(test, *args, **kwargs):
            if not soc.is_gte_cann_version(self.base_version, self.module):
                raise unittest.SkipTest(f"Only run on {self.base_version} or greater, current cann version is "
                                        f"{soc.cann_version(self.module)}.")
            return fn(test, *args, **kwargs)
        return run_if_recent
