"""Why a DSA call cannot run on the Triton kernels (None when it can), one function per operator. Pure Python: no
Triton import beyond the availability check, so dispatch can ask on any machine. Arguments are validated first."""
from __future__ import annotations

import torch

from ...._core.triton.support import kernel_input_reason

MAX_INDEXER_HEADS = 128  # query heads held by one indexer program
MAX_INDEXER_DIM = 256
MAX_LATENT_DIM = 512  # latent (and value) width of one sparse-attention tile
MAX_ROPE_DIM = 128
MAX_TOPK = 8192
MAX_KL_HEADS = 128  # main-attention query heads of one KL-loss program (the M of its score products)
MAX_KL_INDEX_HEADS, MAX_KL_INDEX_DIM = 64, 128  # the index query and its gradient held by one KL-loss program


def indexer_reason(query: torch.Tensor, weights: torch.Tensor, sparse_count: int) -> str | None:
    """``lightning_indexer``."""
    reason = kernel_input_reason(query) or kernel_input_reason(weights, "weights")
    if reason is not None:
        return reason
    if query.shape[-2] > MAX_INDEXER_HEADS:
        return f"indexer query heads up to {MAX_INDEXER_HEADS} (got {query.shape[-2]})"
    if query.shape[-1] > MAX_INDEXER_DIM:
        return f"indexer head dims up to {MAX_INDEXER_DIM} (got {query.shape[-1]})"
    if sparse_count > MAX_TOPK:
        return f"sparse_count up to {MAX_TOPK} (got {sparse_count})"
    return None


def sparse_attention_reason(query: torch.Tensor, value: torch.Tensor, query_rope: torch.Tensor | None
                            ) -> str | None:
    """``sparse_flash_attention``, forward and backward."""
    reason = kernel_input_reason(query)
    if reason is not None:
        return reason
    if max(query.shape[-1], value.shape[-1]) > MAX_LATENT_DIM:
        return f"latent and value widths up to {MAX_LATENT_DIM} (got D={query.shape[-1]}, Dv={value.shape[-1]})"
    if query_rope is not None and query_rope.shape[-1] > MAX_ROPE_DIM:
        return f"rope dims up to {MAX_ROPE_DIM} (got {query_rope.shape[-1]})"
    return None


def quant_sparse_attention_reason(query: torch.Tensor, hif8: bool) -> str | None:
    """``kv_quant_sparse_flash_attention`` (the packed cache's widths are fixed)."""
    if hif8:
        return "a HiFloat8 cache (the kernel decodes int8 and fp8 codes only; the reference decodes HiFloat8)"
    return kernel_input_reason(query)


def kl_loss_reason(query: torch.Tensor, query_index: torch.Tensor, weights: torch.Tensor,
                   query_rope: torch.Tensor | None) -> str | None:
    """``lightning_indexer_kl_loss`` (the fused loss and gradients)."""
    reason = kernel_input_reason(query) or kernel_input_reason(weights, "weights")
    if reason is not None:
        return reason
    if query.shape[-2] > MAX_KL_HEADS:
        return f"query heads up to {MAX_KL_HEADS} (got {query.shape[-2]})"
    if query_index.shape[-2] > MAX_KL_INDEX_HEADS or query_index.shape[-1] > MAX_KL_INDEX_DIM:
        return (f"indexer query heads up to {MAX_KL_INDEX_HEADS} and head dims up to {MAX_KL_INDEX_DIM} (got "
                f"{query_index.shape[-2]} x {query_index.shape[-1]})")
    if query_rope is not None and query_rope.shape[-1] > MAX_ROPE_DIM:
        return f"rope dims up to {MAX_ROPE_DIM} (got {query_rope.shape[-1]})"
    return None
