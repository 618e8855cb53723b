"""aclnn DeepSeek-V4 operators (SparseFlashMla, SparseFlashMlaGrad, LightningIndexerV2) in the aclnn parameter order
(snake_case, without the ``Optional`` suffix), outputs as tuples.

They run the ``cann_ops_transformer`` functions (:mod:`attnops.cann_ops_transformer`), whose validation is the
operator's own, so an invalid call fails in phase 1 (``_get_workspace_size``) with a status-coded
:class:`attnops.AclnnError` naming the aclnn parameter. Outputs: ``sparse_flash_mla -> (attn_out, softmax_lse)``;
``sparse_flash_mla_grad -> (d_query, d_ori_kv, d_cmp_kv, d_sinks, ori_softmax_l1_norm, cmp_softmax_l1_norm)``
(None for absent inputs); ``lightning_indexer_v2 -> (sparse_indices, sparse_values)``.
"""
from __future__ import annotations

from .. import cann_ops_transformer as cot
from .._core.checks import caller_names
from ._two_phase import two_phase

_GRAD_NAMES = {"q": "query", "dout": "d_out", "attn_out": "out", "softmax_lse": "lse", "softmax_scale": "scale_value"}


def _ready(outputs):
    return lambda: outputs


def _sparse_flash_mla(q, ori_kv, cmp_kv, ori_sparse_indices, cmp_sparse_indices, ori_block_table, cmp_block_table,
                      cu_seqlens_q, cu_seqlens_ori_kv, cu_seqlens_cmp_kv, seqused_q, seqused_ori_kv, seqused_cmp_kv,
                      cmp_residual_kv, ori_topk_length, cmp_topk_length, sinks, metadata, softmax_scale, cmp_ratio,
                      ori_mask_mode, cmp_mask_mode, ori_win_left, ori_win_right, layout_q, layout_kv,
                      topk_value_mode, return_softmax_lse):
    """aclnnSparseFlashMla."""
    return _ready(cot.sparse_flash_mla(
        q, ori_kv=ori_kv, cmp_kv=cmp_kv, ori_sparse_indices=ori_sparse_indices, cmp_sparse_indices=cmp_sparse_indices,
        ori_block_table=ori_block_table, cmp_block_table=cmp_block_table, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_ori_kv=cu_seqlens_ori_kv, cu_seqlens_cmp_kv=cu_seqlens_cmp_kv, seqused_q=seqused_q,
        seqused_ori_kv=seqused_ori_kv, seqused_cmp_kv=seqused_cmp_kv, cmp_residual_kv=cmp_residual_kv,
        ori_topk_length=ori_topk_length, cmp_topk_length=cmp_topk_length, sinks=sinks, metadata=metadata,
        softmax_scale=softmax_scale, cmp_ratio=cmp_ratio, ori_mask_mode=ori_mask_mode, cmp_mask_mode=cmp_mask_mode,
        ori_win_left=ori_win_left, ori_win_right=ori_win_right, layout_q=layout_q, layout_kv=layout_kv,
        topk_value_mode=topk_value_mode, return_softmax_lse=return_softmax_lse))


def _sparse_flash_mla_grad(query, d_out, out, lse, ori_kv, cmp_kv, ori_sparse_indices, cmp_sparse_indices,
                           cu_seqlens_q, cu_seqlens_ori_kv, cu_seqlens_cmp_kv, seqused_q, seqused_ori_kv,
                           seqused_cmp_kv, cmp_residual_kv, ori_topk_length, cmp_topk_length, sinks, metadata,
                           scale_value, cmp_ratio, ori_mask_mode, cmp_mask_mode, ori_win_left, ori_win_right,
                           layout_q, layout_kv):
    """aclnnSparseFlashMlaGrad."""
    with caller_names(_GRAD_NAMES):
        return _ready(cot.sparse_flash_mla_grad(
            query, d_out, out, lse, ori_kv, cmp_kv, ori_sparse_indices, cmp_sparse_indices, cu_seqlens_q,
            cu_seqlens_ori_kv, cu_seqlens_cmp_kv, seqused_q, seqused_ori_kv, seqused_cmp_kv, cmp_residual_kv,
            ori_topk_length, cmp_topk_length, sinks, metadata, scale_value, cmp_ratio, ori_mask_mode, cmp_mask_mode,
            ori_win_left, ori_win_right, layout_q, layout_kv))


def _lightning_indexer_v2(q, k, w, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, cmp_residual_k, block_table,
                          output_idx_offset, metadata, topk, max_seqlen_q, layout_q, layout_k, mask_mode, cmp_ratio,
                          return_value):
    """aclnnLightningIndexerV2."""
    return _ready(cot.lightning_indexer(
        q, k, w, topk, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
        seqused_k=seqused_k, cmp_residual_k=cmp_residual_k, block_table=block_table,
        output_idx_offset=output_idx_offset, metadata=metadata, max_seqlen_q=max_seqlen_q, layout_q=layout_q,
        layout_k=layout_k, mask_mode=mask_mode, cmp_ratio=cmp_ratio, return_value=return_value))


sparse_flash_mla, sparse_flash_mla_get_workspace_size = two_phase(_sparse_flash_mla)
sparse_flash_mla_grad, sparse_flash_mla_grad_get_workspace_size = two_phase(_sparse_flash_mla_grad)
lightning_indexer_v2, lightning_indexer_v2_get_workspace_size = two_phase(_lightning_indexer_v2)
