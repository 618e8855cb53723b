"""Why an NSA call cannot run on the Triton kernels of ``compress_attention.py`` / ``decode.py`` (None when it can).
Pure Python: no Triton import beyond the availability check, so dispatch can ask on any machine."""
from __future__ import annotations

import torch

from ...._core.triton.support import kernel_input_reason
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


MAX_GROUP = 64  # query heads per KV head: the rows of a decode program's tiles
MAX_HEAD_DIM = 256


def decode_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """The decode kernels (one program per request and KV head, the GQA group as tile rows)."""
    reason = kernel_input_reason(query)
    if reason is not None:
        return reason
    group = query.shape[1] // key.shape[2]
    if group > MAX_GROUP:
        return f"at most {MAX_GROUP} query heads per KV head (got {group})"
    if max(query.shape[-1], value.shape[-1]) > MAX_HEAD_DIM:
        return f"head dims up to {MAX_HEAD_DIM} (got D={query.shape[-1]}, Dv={value.shape[-1]})"
    return None


def compress_cache_reason(input: torch.Tensor) -> str | None:
    """Compression into the cache (torch on the device): the inputs' device and dtype only."""
    return kernel_input_reason(input)
