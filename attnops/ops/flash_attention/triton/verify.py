"""Why a FlashAttention call cannot run on the Triton kernels (None when it can). Pure Python: no Triton import
beyond the availability check, so dispatch can ask on any machine."""
from __future__ import annotations

import torch

from ...._core.triton.support import kernel_input_reason
from ..problem import FAProblem

MAX_HEAD_DIM = 256
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension, where the kernels put batch x heads


def unsupported_reason(p: FAProblem, query: torch.Tensor, *, backward: bool = False) -> str | None:
    """The reason the Triton kernels cannot serve problem ``p`` on ``query``'s device and dtype, or None."""
    reason = kernel_input_reason(query)
    if reason is not None:
        return reason
    g = p.geom
    if max(g.d, g.dv) > MAX_HEAD_DIM:
        return f"head dims up to {MAX_HEAD_DIM} (got D={g.d}, Dv={g.dv})"
    if p.seq.batch * g.n1 > MAX_GRID_Y:
        return f"batch x query heads up to {MAX_GRID_Y} (got {p.seq.batch} x {g.n1})"
    return None
