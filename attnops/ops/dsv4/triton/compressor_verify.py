"""Why a compressor call cannot run on the Triton kernels (None when it can). Pure Python: no Triton import beyond
the availability check, so dispatch can ask on any machine. Arguments are validated first."""
from __future__ import annotations

import torch

from ...._core.triton.support import kernel_input_reason

MAX_DIM = 1024  # D held as one row by a pool program
STATE_DTYPES = (torch.float32,)


def compressor_reason(x: torch.Tensor, state_cache: torch.Tensor, ape: torch.Tensor, dim: int) -> str | None:
    reason = kernel_input_reason(x, "x")
    if reason is not None:
        return reason
    for name, t in (("state_cache", state_cache), ("ape", ape)):
        if t.dtype not in STATE_DTYPES:
            return f"a float32 {name} (got {t.dtype})"
    if dim > MAX_DIM:
        return f"compressed rows up to D={MAX_DIM} wide (got {dim})"
    return None
