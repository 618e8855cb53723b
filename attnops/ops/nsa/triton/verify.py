"""Why an NSA call cannot run on the Triton kernels (None when it can), one function per operator. Pure Python: no
Triton import beyond the availability check, so dispatch can ask on any machine."""
from __future__ import annotations

import torch

from ...._core.triton.support import kernel_input_reason
from ...common.triton.verify import unsupported_reason as fa_reason
from ..compress import CompressSpec
from ..compress_attention import CompressAttentionSpec
from ..selected import SelectedSpec
from .family import INTERPRET_TILE, MAX_GRID, SCORE_BLOCK_K

MAX_HEAD_DIM = 256
MAX_GROUP = 64  # query heads per KV head held by one program (padded to a power of two >= 16)
MAX_GRID_X = 2 ** 31 - 1  # CUDA's limit on a grid's first dimension


def _heads_reason(n: int, what: str) -> str | None:
    """Kernels with the heads alone on a grid axis (the others fold batch x heads into two axes)."""
    return f"{what} up to {MAX_GRID} (got {n})" if n > MAX_GRID else None


def selected_reason(spec: SelectedSpec, query: torch.Tensor) -> str | None:
    """``nsa_selected_attention`` (and its grad: the same kernels' limits)."""
    reason = kernel_input_reason(query)
    if reason is not None:
        return reason
    if max(spec.d, spec.dv) > MAX_HEAD_DIM:
        return f"head dims up to {MAX_HEAD_DIM} (got D={spec.d}, Dv={spec.dv})"
    if spec.group > MAX_GROUP:
        return f"query heads per KV head up to {MAX_GROUP} (got {spec.group})"
    return _heads_reason(spec.n2, "KV heads")  # selected_delta_kernel: (token, KV head)


def selected_grad_reason(spec: SelectedSpec, query: torch.Tensor) -> str | None:
    """``nsa_selected_attention_grad``."""
    return selected_reason(spec, query)


def compress_reason(spec: CompressSpec, input: torch.Tensor) -> str | None:
    """``nsa_compress``."""
    reason = kernel_input_reason(input, "input")
    if reason is not None:
        return reason
    if input.shape[2] > MAX_HEAD_DIM:
        return f"head dims up to {MAX_HEAD_DIM} (got D={input.shape[2]})"
    return None


def compress_grad_reason(spec: CompressSpec, input: torch.Tensor) -> str | None:
    """``nsa_compress_grad``."""
    return compress_reason(spec, input)


def compress_attention_reason(spec: CompressAttentionSpec, query: torch.Tensor) -> str | None:
    """``nsa_compress_attention``: the FlashAttention forward's limits (its kernel computes the attention), plus the
    score kernel's: its first grid axis counts row blocks times selection block tiles."""
    reason = fa_reason(spec.fa, query)
    if reason is not None:
        return reason
    rows, sel = spec.fa.seq.max_q, max(spec.sel_lens, default=0)
    if -(-rows // INTERPRET_TILE) * -(-sel // SCORE_BLOCK_K) > MAX_GRID_X:
        return (f"at most {MAX_GRID_X} score programs, {INTERPRET_TILE} query rows x {SCORE_BLOCK_K} selection blocks "
                f"each (got {rows} rows x {sel} selection blocks in the longest batch)")
    return None


def decode_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """``nsa_selected_attention_infer`` and ``nsa_compress_attention_infer``: the decode kernels (one program per
    request and KV head, the GQA group as tile rows)."""
    reason = kernel_input_reason(query)
    if reason is not None:
        return reason
    group = query.shape[1] // key.shape[2]
    reason = _heads_reason(key.shape[2], "KV heads")  # (request, KV head) grids
    if reason is not None:
        return reason
    if group > MAX_GROUP:
        return f"at most {MAX_GROUP} query heads per KV head (got {group})"
    if max(query.shape[-1], value.shape[-1]) > MAX_HEAD_DIM:
        return f"head dims up to {MAX_HEAD_DIM} (got D={query.shape[-1]}, Dv={value.shape[-1]})"
    return None


def compress_cache_reason(input: torch.Tensor) -> str | None:
    """``nsa_compress_infer`` (``compress_cache_kernel``: one program per request and head, a head in registers)."""
    reason = kernel_input_reason(input)
    if reason is not None:
        return reason
    if input.shape[-1] > MAX_HEAD_DIM:
        return f"head dims up to {MAX_HEAD_DIM} (got D={input.shape[-1]})"
    return _heads_reason(input.shape[2], "heads")  # (request, head) grid
