"""attnops: Huawei CANN's fused-attention operators on PyTorch (CPU reference, Triton on NVIDIA GPUs).

Three dialects share one core: this Pythonic API, :mod:`attnops.aclnn` (the seeds' aclnn operators) and, later,
:mod:`attnops.torch_npu`.
"""
from ._core.errors import AclnnError, ParamDtypeError, ParamInvalidError, ParamNullptrError
from .ops.flash_attention import FlashAttentionResult, flash_attention, flash_attention_backward

__version__ = "0.1.0"

__all__ = [
    "AclnnError",
    "FlashAttentionResult",
    "ParamDtypeError",
    "ParamInvalidError",
    "ParamNullptrError",
    "flash_attention",
    "flash_attention_backward",
]
