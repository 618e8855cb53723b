"""Why a lightning indexer v2 call cannot run on the Triton kernel (None when it can). Pure Python: no Triton import
beyond the availability check, so dispatch can ask on any machine. Arguments are validated first."""
from __future__ import annotations

import torch

from ...._core.triton.support import kernel_input_reason

MAX_HEADS = 128  # query heads held by one program
MAX_DIM = 256


def indexer_v2_reason(query: torch.Tensor, weights: torch.Tensor) -> str | None:
    reason = kernel_input_reason(query) or kernel_input_reason(weights, "weights")
    if reason is not None:
        return reason
    if query.shape[-2] > MAX_HEADS:
        return f"indexer query heads up to {MAX_HEADS} (got {query.shape[-2]})"
    if query.shape[-1] > MAX_DIM:
        return f"indexer head dims up to {MAX_DIM} (got {query.shape[-1]})"
    return None
