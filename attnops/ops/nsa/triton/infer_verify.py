"""Why an NSA call cannot run on the Triton kernels of ``compress_attention.py`` / ``decode.py`` (None when it can).
Pure Python: no Triton import beyond the availability check, so dispatch can ask on any machine."""
from __future__ import annotations

import torch

from ...flash_attention.triton.verify import unsupported_reason as fa_reason
from ..compress_attention import CompressAttentionSpec

MAX_GRID_Z = 65535  # CUDA's limit on a grid's third dimension, where the score kernel puts selection block tiles


def compress_attention_reason(spec: CompressAttentionSpec, query: torch.Tensor) -> str | None:
    """Compressed attention: the FlashAttention forward's limits (its kernel computes the attention), plus the
    score kernel's (selection blocks of a batch)."""
    reason = fa_reason(spec.fa, query)
    if reason is not None:
        return reason
    if max(spec.sel_lens, default=0) > 16 * MAX_GRID_Z:
        return f"at most {16 * MAX_GRID_Z} selection blocks per batch (got {max(spec.sel_lens)})"
    return None
