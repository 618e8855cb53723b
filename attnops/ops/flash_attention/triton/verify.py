"""Why a FlashAttention call cannot run on the Triton kernels (None when it can). Pure Python: no Triton import
beyond the availability check, so dispatch can ask on any machine."""
from __future__ import annotations

import torch

from ...._core.dispatch import triton_unavailable_reason
from ..problem import FAProblem

MAX_HEAD_DIM = 256
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension, where the kernels put batch x heads
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting(device: torch.device) -> bool:
    """True when the kernels run through Triton's CPU interpreter (CPU tensors, ``ATTNOPS_TRITON_INTERPRET=1``)."""
    return device.type != "cuda"


def unsupported_reason(p: FAProblem, query: torch.Tensor, *, backward: bool = False) -> str | None:
    """The reason the Triton kernels cannot serve problem ``p`` on ``query``'s device and dtype, or None."""
    reason = triton_unavailable_reason(query.device)
    if reason is not None:
        return reason
    if query.dtype not in KERNEL_DTYPES:
        return f"the Triton kernels take float16/bfloat16/float32 inputs (got {query.dtype})"
    if query.dtype == torch.bfloat16 and interpreting(query.device):
        return "the Triton CPU interpreter has no bfloat16 (bf16 dots and casts are wrong there); use float16/float32"
    g = p.geom
    if max(g.d, g.dv) > MAX_HEAD_DIM:
        return f"head dims up to {MAX_HEAD_DIM} (got D={g.d}, Dv={g.dv})"
    if p.seq.batch * g.n1 > MAX_GRID_Y:
        return f"batch x query heads up to {MAX_GRID_Y} (got {p.seq.batch} x {g.n1})"
    return None
