"""ops-transformer's ``lightning_indexer`` (LightningIndexerV2) and ``lightning_indexer_metadata`` with the schemas of
``cann_ops_transformer``: arguments translated to :func:`attnops.lightning_indexer_v2`, no math here. Errors name
this dialect's arguments (``q``, ``k``, ``w``)."""
from __future__ import annotations

from torch import Tensor

from .._core.checks import caller_names, check_int
from ..ops.dsv4.indexer_v2_api import lightning_indexer_v2
from ..ops.dsv4.metadata import lightning_indexer_v2_metadata

NAMES = {"query": "q", "key": "k", "weights": "w", "layout": "layout_q", "layout_key": "layout_k"}


def lightning_indexer(q: Tensor, k: Tensor, w: Tensor, topk: int, *, cu_seqlens_q: Tensor | None = None,
                      cu_seqlens_k: Tensor | None = None, seqused_q: Tensor | None = None,
                      seqused_k: Tensor | None = None, cmp_residual_k: Tensor | None = None,
                      block_table: Tensor | None = None, output_idx_offset: Tensor | None = None,
                      metadata: Tensor | None = None, max_seqlen_q: int = -1, layout_q: str = "BSND",
                      layout_k: str = "BSND", mask_mode: int = 0, cmp_ratio: int = 1,
                      return_value: int = 0) -> tuple[Tensor, Tensor]:
    """``(sparse_indices, sparse_values)``: :func:`attnops.lightning_indexer_v2` with ops-transformer's schema.
    ``sparse_values`` is an empty fp32 ``[0]`` unless ``return_value``; ``metadata`` and ``max_seqlen_q`` (a hint)
    are accepted and ignored."""
    check_int("max_seqlen_q", max_seqlen_q, lo=-1)
    check_int("return_value", return_value, lo=0, hi=1)
    with caller_names(NAMES):
        idx, values = lightning_indexer_v2(
            q, k, w, topk=topk, layout=layout_q, layout_key=layout_k, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k, cmp_residual_k=cmp_residual_k,
            block_table=block_table, output_idx_offset=output_idx_offset, mask_mode=mask_mode, cmp_ratio=cmp_ratio)
    return idx, (values if return_value else values.new_empty((0,)))


def lightning_indexer_metadata(num_heads_q: int, num_heads_k: int, head_dim: int, topk: int, *,
                               cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None,
                               seqused_q: Tensor | None = None, seqused_k: Tensor | None = None,
                               cmp_residual_k: Tensor | None = None, batch_size: int | None = None,
                               max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                               layout_q: str | None = None, layout_k: str | None = None,
                               mask_mode: int | None = None, cmp_ratio: int | None = None) -> Tensor:
    """The indexer kernel's metadata: int32 ``[1024]`` zeros after checking the arguments (no math)."""
    return lightning_indexer_v2_metadata(
        num_heads_q, num_heads_k, head_dim, topk, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        seqused_q=seqused_q, seqused_k=seqused_k, cmp_residual_k=cmp_residual_k, batch_size=batch_size,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, layout_q=layout_q, layout_k=layout_k,
        mask_mode=mask_mode, cmp_ratio=cmp_ratio)


__all__ = ["lightning_indexer", "lightning_indexer_metadata"]
