"""Exception types.

Every validation error raised by attnops is an :class:`AclnnError` carrying the aclnn status code of the
seeds (161001 for a missing required input, 161002 for an invalid one). They also subclass the usual Python
types, so Pythonic callers can catch ``ValueError`` / ``TypeError``.
"""
from __future__ import annotations

ACLNN_ERR_PARAM_NULLPTR = 161001
ACLNN_ERR_PARAM_INVALID = 161002


class AclnnError(Exception):
    """Base of all attnops validation errors; ``status`` is the aclnn status code."""

    status: int = ACLNN_ERR_PARAM_INVALID


class ParamNullptrError(AclnnError, TypeError):
    """A required input, output or attribute is None (ACLNN_ERR_PARAM_NULLPTR, 161001)."""

    status = ACLNN_ERR_PARAM_NULLPTR


class ParamInvalidError(AclnnError, ValueError):
    """A shape, value, layout or combination is out of the supported range (ACLNN_ERR_PARAM_INVALID, 161002)."""

    status = ACLNN_ERR_PARAM_INVALID


class ParamDtypeError(ParamInvalidError, TypeError):
    """A dtype is not supported (ACLNN_ERR_PARAM_INVALID, 161002); also a ``TypeError``."""


class PrecisionNotEmulatedError(ParamInvalidError):
    """``precision="npu"`` on a route whose NPU rounding attnops does not emulate (ACLNN_ERR_PARAM_INVALID, 161002);
    the message names the route and says to use ``precision="exact"``."""


class InferenceOnlyError(RuntimeError):
    """A backward through an inference-only operator (FusedInferAttention, the NSA ``*_infer`` operators); the
    message names the training operator to use instead."""


class PerformanceWarning(UserWarning):
    """A call on a GPU runs a slow path: ``backend="auto"`` could not use the Triton kernels and computes on the
    reference instead (correct, but orders of magnitude slower). Issued once per reason; the message says why and
    how to reach the kernels."""


class TorchFeatureMissing(RuntimeError):
    """The installed PyTorch lacks a (private) PyTorch feature attnops needs; the message names it and the PyTorch
    versions attnops is tested on."""
