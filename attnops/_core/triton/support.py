"""What every operator's Triton kernels can serve, in pure Python (no Triton import): dispatch asks on any
machine."""
from __future__ import annotations

import torch

from ..dispatch import triton_unavailable_reason
from . import dry_run

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting(device: torch.device) -> bool:
    """True when kernels run through Triton's CPU interpreter (CPU tensors, ``ATTNOPS_TRITON_INTERPRET=1``); False on
    CUDA and inside :func:`attnops.testing.gpu_dry_run`, which plans every launch as for a GPU."""
    return device.type != "cuda" and dry_run.active() is None


def kernel_input_reason(tensor: torch.Tensor, name: str = "inputs") -> str | None:
    """Why Triton kernels cannot take ``tensor`` (its device and floating dtype) at all, or None."""
    reason = triton_unavailable_reason(tensor.device)
    if reason is not None:
        return reason
    if tensor.dtype not in KERNEL_DTYPES:
        return f"the Triton kernels take float16/bfloat16/float32 {name} (got {tensor.dtype})"
    if tensor.dtype == torch.bfloat16 and interpreting(tensor.device) and tensor.device.type == "cpu":
        return "the Triton CPU interpreter has no bfloat16 (bf16 dots and casts are wrong there); use float16/float32"
    return None


def precision_flags(dtype: torch.dtype, interpret: bool) -> dict:
    """The ``UPCAST`` / ``PRECISION`` constexprs of a kernel's products: fp32 math on loaded tiles for fp32 inputs and
    always in the interpreter (which has no bf16), ``ieee`` products then, else ``tf32`` (16-bit tensor-core dots)."""
    upcast = interpret or dtype == torch.float32
    return dict(UPCAST=upcast, PRECISION="ieee" if upcast else "tf32")
