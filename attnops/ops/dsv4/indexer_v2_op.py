"""Lightning indexer v2 as a ``torch.library`` custom op (namespace ``attnops``) with its fake kernel. Not
differentiable (its outputs are integer positions and their scores). The backend (:mod:`.indexer_v2_backend`) runs
the Triton kernel on CUDA (metadata read by the kernel) or the reference on CPU copies."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..._core.checks import check_tensor
from ..._core.custom_ops import register_dry_run_meta
from .indexer_v2_backend import lightning_indexer_v2
from .indexer_v2_reference import compute_dtype


def _output_shape(query: Tensor, topk: int) -> tuple[int, ...]:
    return (*query.shape[:-2], 1, topk)


@torch.library.custom_op("attnops::dsv4_lightning_indexer_v2", mutates_args=())
def dsv4_lightning_indexer_v2(query: Tensor, key: Tensor, weights: Tensor, cu_seqlens_q: Optional[Tensor],
                              cu_seqlens_k: Optional[Tensor], seqused_q: Optional[Tensor],
                              seqused_k: Optional[Tensor], cmp_residual_k: Optional[Tensor],
                              block_table: Optional[Tensor], output_idx_offset: Optional[Tensor], topk: int,
                              layout_q: str, layout_k: str, mask_mode: int, cmp_ratio: int
                              ) -> tuple[Tensor, Tensor]:
    check_tensor("query", query)
    indices, values = lightning_indexer_v2(
        query, key, weights, topk, output_idx_offset,
        dict(layout_q=layout_q, layout_k=layout_k, mask_mode=mask_mode, cmp_ratio=cmp_ratio),
        dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
             cmp_residual_k=cmp_residual_k, block_table=block_table))
    shape = _output_shape(query, topk)
    return indices.view(shape), values.view(shape)


@dsv4_lightning_indexer_v2.register_fake
def _(query, key, weights, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, cmp_residual_k, block_table,
      output_idx_offset, topk, layout_q, layout_k, mask_mode, cmp_ratio):
    shape = _output_shape(query, topk)
    return query.new_empty(shape, dtype=torch.int32), query.new_empty(shape, dtype=compute_dtype(query))


register_dry_run_meta(dsv4_lightning_indexer_v2)
