"""``torch_npu.npu_format_cast`` / ``npu_format_cast_`` / ``get_npu_format``: the NPU's internal memory formats
(ACL formats, e.g. 29 = FRACTAL_NZ). A tensor on the stand-in device always holds its logical values, so a cast
changes no value; the format is recorded on the tensor, and ``get_npu_format`` reports it (the base format, as
torch_npu gives a fresh tensor, otherwise: NCHW for 4-D, NCDHW for 5-D, ND for the rest). The attention operators
tell a paged cache's layout by its shape, never by the recorded format."""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.checks import check_choice, check_tensor

ACL_FORMATS = {"NCHW": 0, "NHWC": 1, "ND": 2, "NC1HWC0": 3, "FRACTAL_Z": 4, "NC1HWC0_C04": 12, "HWCN": 16,
               "NDHWC": 27, "FRACTAL_NZ": 29, "NCDHW": 30, "NDC1HWC0": 32, "FRACTAL_Z_3D": 33, "NC": 35, "NCL": 47}
_ATTRIBUTE = "_attnops_npu_format"


def _base_format(x: Tensor) -> int:
    return {4: ACL_FORMATS["NCHW"], 5: ACL_FORMATS["NCDHW"]}.get(x.dim(), ACL_FORMATS["ND"])


def get_npu_format(self: Tensor) -> int:
    """The ACL format recorded on ``self`` (its base format if none was cast)."""
    check_tensor("self", self)
    return getattr(self, _ATTRIBUTE, _base_format(self))


def _check_format(acl_format) -> int:
    return check_choice("acl_format", acl_format, ACL_FORMATS.values())


def npu_format_cast(self: Tensor, acl_format: int, customize_dtype: torch.dtype | None = None) -> Tensor:
    """``self`` in the ACL format ``acl_format``: ``self`` itself when it already has it, else a copy carrying the
    format (as the NPU's cast gives a new tensor). ``customize_dtype`` (the NPU's storage dtype) changes nothing."""
    check_tensor("self", self)
    if get_npu_format(self) == _check_format(acl_format):
        return self
    out = self.clone()
    setattr(out, _ATTRIBUTE, acl_format)
    return out


def npu_format_cast_(self: Tensor, acl_format: int | Tensor) -> Tensor:
    """In place: record ``acl_format`` (or the format of the tensor given in its place) on ``self``."""
    check_tensor("self", self)
    fmt = get_npu_format(acl_format) if isinstance(acl_format, Tensor) else _check_format(acl_format)
    setattr(self, _ATTRIBUTE, fmt)
    return self
