"""The Ascend SoC and CANN version the stand-in reports (``torch.npu.get_device_name``,
``torch_npu.npu.utils.get_soc_version``, ``get_cann_version``): chosen by ``install(soc=..., cann_version=...)`` or the
environment variables ``ATTNOPS_NPU_SOC`` and ``ATTNOPS_CANN_VERSION``; an Atlas A2 (``Ascend910B1``) with CANN 9.0.0
by default. Code that selects by SoC (``torch_npu.testing.common_utils.SupportedDevices``) runs what that SoC runs."""
from __future__ import annotations

import os
import re

from .._core.checks import fail, require

SOC_ENV = "ATTNOPS_NPU_SOC"
CANN_ENV = "ATTNOPS_CANN_VERSION"
DEFAULT_SOC = "Ascend910B1"
DEFAULT_CANN_VERSION = "9.0.0"

# torch_npu's SocVersion numbering: each family starts at a fixed number, its members count up from there
_FAMILIES = {
    200: ("Ascend310P1", "Ascend310P2", "Ascend310P3", "Ascend310P4", "Ascend310P5", "Ascend310P7"),
    220: ("Ascend910B1", "Ascend910B2", "Ascend910B2C", "Ascend910B3", "Ascend910B4", "Ascend910B4-1"),
    240: ("Ascend310B1", "Ascend310B2", "Ascend310B3", "Ascend310B4"),
    250: ("Ascend910_9391", "Ascend910_9392", "Ascend910_9381", "Ascend910_9382", "Ascend910_9372",
          "Ascend910_9362", "Ascend910_9363"),
}
SOC_VERSIONS = {name: start + i for start, names in _FAMILIES.items() for i, name in enumerate(names)}
ASCEND950 = 260  # every "Ascend950*" name

_chosen: dict[str, str] = {}


def _check_soc(soc: str) -> str:
    require(isinstance(soc, str) and (soc in SOC_VERSIONS or soc.startswith("Ascend950")), "soc",
            f"an Ascend SoC name ({', '.join(SOC_VERSIONS)} or Ascend950*)", soc)
    return soc


def _parse_cann(version: str, name: str = "cann_version") -> tuple[int, ...]:
    """``"8.5.0"`` → (8, 5, 0, 99); ``"8.1.RC1"`` → (8, 1, 0, 1): a release candidate sorts before its release."""
    match = re.fullmatch(r"(\d+)\.(\d+)\.(?:(\d+)|RC(\d+))(?:\.\w+)?", str(version))
    if match is None:
        fail(name, 'a CANN version like "8.5.0" or "8.1.RC1"', version)
    major, minor, patch, rc = match.groups()
    return (int(major), int(minor), int(patch or 0), int(rc) if rc else 99)


def configure(soc: str | None = None, cann_version: str | None = None) -> None:
    """Choose the SoC and CANN version the stand-in reports (None: the environment variable, else the default)."""
    _chosen["soc"] = _check_soc(soc if soc is not None else os.environ.get(SOC_ENV, DEFAULT_SOC))
    cann = cann_version if cann_version is not None else os.environ.get(CANN_ENV, DEFAULT_CANN_VERSION)
    _parse_cann(cann)
    _chosen["cann"] = cann


def soc_name() -> str:
    """The SoC name, as ``torch.npu.get_device_name()`` gives it on that NPU."""
    if "soc" not in _chosen:
        configure()
    return _chosen["soc"]


def soc_version() -> int:
    """torch_npu's SocVersion number of :func:`soc_name` (``torch_npu.npu.utils.get_soc_version()``)."""
    name = soc_name()
    return ASCEND950 if name.startswith("Ascend950") else SOC_VERSIONS[name]


def cann_version(module: str = "CANN") -> str:
    """The CANN version reported for every CANN module."""
    if "cann" not in _chosen:
        configure()
    return _chosen["cann"]


def is_gte_cann_version(version: str, module: str = "CANN") -> bool:
    """Whether the reported CANN version is ``version`` or later."""
    return _parse_cann(cann_version(module)) >= _parse_cann(version, "version")
