"""Why a FlashAttention call cannot run on the Triton kernels (None when it can). Pure Python: no Triton import
beyond the availability check, so dispatch can ask on any machine."""
from __future__ import annotations

import torch

from ...._core.layouts import Geometry
from ...._core.triton.support import kernel_input_reason
from ..problem import FAProblem

MAX_HEAD_DIM = 256
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second (and third) dimension; the launcher folds batch x heads into both


def geometry_reason(g: Geometry, query: torch.Tensor, *, backward: bool = False) -> str | None:
    """The reason the Triton kernels cannot serve a call of geometry ``g`` on ``query``'s device and dtype, or
    None: only the device, the dtype and the head dims matter (batch x heads are folded into two grid axes)."""
    reason = kernel_input_reason(query)
    if reason is not None:
        return reason
    if max(g.d, g.dv) > MAX_HEAD_DIM:
        return f"head dims up to {MAX_HEAD_DIM} (got D={g.d}, Dv={g.dv})"
    return None


def unsupported_reason(p: FAProblem, query: torch.Tensor, *, backward: bool = False) -> str | None:
    """The reason the Triton kernels cannot serve problem ``p`` on ``query``'s device and dtype, or None."""
    return geometry_reason(p.geom, query, backward=backward)
