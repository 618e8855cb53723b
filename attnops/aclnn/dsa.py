"""aclnn DeepSeek sparse attention and MLA operators (LightningIndexer, SparseFlashAttention,
SparseLightningIndexerGradKLLoss, MlaPrologV3WeightNz, MlaPrologV2WeightNz, KvRmsNormRopeCache, InterleaveRope) in
the aclnn parameter order, outputs as tuples.

They run the torch_npu functions (:mod:`attnops.torch_npu`), which carry the NPU's limits and validation. Phase 1
(``_get_workspace_size``) validates by running the operator (its validation is the operator's own, so an invalid
call fails in phase 1 as in aclnn); the executor returns the outputs. The cache writers therefore update their
caches in phase 1. The logical weight shapes stand for the FRACTAL_NZ weights of the ``WeightNz`` prologs.

Outputs: ``lightning_indexer -> (sparse_indices, sparse_values)``; ``sparse_flash_attention -> (attention_out,
softmax_max, softmax_sum)``; ``sparse_lightning_indexer_grad_kl_loss -> (d_query_index, d_key_index, d_weights,
loss)``; ``mla_prolog_v3_weight_nz -> (query, query_rope, dequant_scale_q_nope, query_norm, dequant_scale_q_norm)``;
``mla_prolog_v2_weight_nz -> (query, query_rope, dequant_scale_q_nope)``; ``kv_rms_norm_rope_cache -> (k_rope,
c_kv)``; ``interleave_rope -> out``.
"""
from __future__ import annotations

from .. import torch_npu
from .._core.checks import caller_names
from ._two_phase import two_phase

CACHE_REF_NAMES = dict(k_cache="k_cache_ref", ckv_cache="ckv_cache_ref", kv_cache="kv_cache_ref",
                       kr_cache="kr_cache_ref")  # torch_npu's names of the caches aclnn updates in place


def _ready(outputs):
    return lambda: outputs


def _lightning_indexer(query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
                       layout_query, layout_key, sparse_count, sparse_mode, pre_tokens, next_tokens, return_values):
    """aclnnLightningIndexer."""
    return _ready(torch_npu.npu_lightning_indexer(
        query, key, weights, actual_seq_lengths_query=actual_seq_lengths_query,
        actual_seq_lengths_key=actual_seq_lengths_key, block_table=block_table, layout_query=layout_query,
        layout_key=layout_key, sparse_count=sparse_count, sparse_mode=sparse_mode, pre_tokens=pre_tokens,
        next_tokens=next_tokens, return_value=return_values))


def _sparse_flash_attention(query, key, value, sparse_indices, block_table, actual_seq_lengths_query,
                            actual_seq_lengths_kv, query_rope, key_rope, scale_value, sparse_block_size,
                            layout_query, layout_kv, sparse_mode, pre_tokens, next_tokens, attention_mode,
                            return_softmax_lse):
    """aclnnSparseFlashAttention."""
    return _ready(torch_npu.npu_sparse_flash_attention(
        query, key, value, sparse_indices, scale_value, block_table=block_table,
        actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_kv=actual_seq_lengths_kv,
        query_rope=query_rope, key_rope=key_rope, sparse_block_size=sparse_block_size, layout_query=layout_query,
        layout_kv=layout_kv, sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens,
        attention_mode=attention_mode, return_softmax_lse=return_softmax_lse))


def _sparse_lightning_indexer_grad_kl_loss(query, key, query_index, key_index, weights, sparse_indices, softmax_max,
                                           softmax_sum, query_rope, key_rope, actual_seq_lengths_query,
                                           actual_seq_lengths_key, scale_value, layout, sparse_mode, pre_tokens,
                                           next_tokens, deterministic):
    """aclnnSparseLightningIndexerGradKLLoss (``deterministic`` is accepted: the reference always is)."""
    return _ready(torch_npu.npu_sparse_lightning_indexer_grad_kl_loss(
        query, key, query_index, key_index, weights, sparse_indices, softmax_max, softmax_sum, scale_value,
        query_rope=query_rope, key_rope=key_rope, actual_seq_qlen=actual_seq_lengths_query,
        actual_seq_klen=actual_seq_lengths_key, layout=layout, sparse_mode=sparse_mode, pre_tokens=pre_tokens,
        next_tokens=next_tokens))


def _mla_prolog_v3_weight_nz(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
                             rmsnorm_gamma_ckv, rope_sin, rope_cos, kv_cache_ref, kr_cache_ref, cache_index,
                             dequant_scale_x, dequant_scale_w_dq, dequant_scale_w_uq_qr, dequant_scale_w_dkv_kr,
                             quant_scale_ckv, quant_scale_ckr, smooth_scales_cq, actual_seq_len, k_nope_clip_alpha,
                             rmsnorm_epsilon_cq, rmsnorm_epsilon_ckv, cache_mode, weight_quant_mode,
                             kv_cache_quant_mode, query_quant_mode, ckvkr_repo_mode, quant_scale_repo_mode, tile_size,
                             qc_qr_scale, kc_scale):
    """aclnnMlaPrologV3WeightNz (``query_norm`` always returned: aclnn outputs it when its tensor is given)."""
    with caller_names(**CACHE_REF_NAMES):
        outputs = torch_npu.npu_mla_prolog_v3(
            token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq, rmsnorm_gamma_ckv, rope_sin,
            rope_cos, kv_cache_ref, kr_cache_ref, cache_index=cache_index, dequant_scale_x=dequant_scale_x,
            dequant_scale_w_dq=dequant_scale_w_dq, dequant_scale_w_uq_qr=dequant_scale_w_uq_qr,
            dequant_scale_w_dkv_kr=dequant_scale_w_dkv_kr, quant_scale_ckv=quant_scale_ckv,
            quant_scale_ckr=quant_scale_ckr, smooth_scales_cq=smooth_scales_cq, actual_seq_len=actual_seq_len,
            k_nope_clip_alpha=k_nope_clip_alpha, rmsnorm_epsilon_cq=rmsnorm_epsilon_cq,
            rmsnorm_epsilon_ckv=rmsnorm_epsilon_ckv, cache_mode=cache_mode, query_norm_flag=True,
            weight_quant_mode=weight_quant_mode, kv_cache_quant_mode=kv_cache_quant_mode,
            query_quant_mode=query_quant_mode, ckvkr_repo_mode=ckvkr_repo_mode,
            quant_scale_repo_mode=quant_scale_repo_mode, tile_size=tile_size, qc_qr_scale=qc_qr_scale,
            kc_scale=kc_scale)
    return _ready(outputs)


def _mla_prolog_v2_weight_nz(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq,
                             rmsnorm_gamma_ckv, rope_sin, rope_cos, cache_index, kv_cache_ref, kr_cache_ref,
                             dequant_scale_x, dequant_scale_w_dq, dequant_scale_w_uq_qr, dequant_scale_w_dkv_kr,
                             quant_scale_ckv, quant_scale_ckr, smooth_scales_cq, rmsnorm_epsilon_cq,
                             rmsnorm_epsilon_ckv, cache_mode):
    """aclnnMlaPrologV2WeightNz."""
    with caller_names(**CACHE_REF_NAMES):
        query, query_rope, _, _, scale = torch_npu.npu_mla_prolog_v2(
            token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr, rmsnorm_gamma_cq, rmsnorm_gamma_ckv, rope_sin,
            rope_cos, cache_index, kv_cache_ref, kr_cache_ref, dequant_scale_x=dequant_scale_x,
            dequant_scale_w_dq=dequant_scale_w_dq, dequant_scale_w_uq_qr=dequant_scale_w_uq_qr,
            dequant_scale_w_dkv_kr=dequant_scale_w_dkv_kr, quant_scale_ckv=quant_scale_ckv,
            quant_scale_ckr=quant_scale_ckr, smooth_scales_cq=smooth_scales_cq, rmsnorm_epsilon_cq=rmsnorm_epsilon_cq,
            rmsnorm_epsilon_ckv=rmsnorm_epsilon_ckv, cache_mode=cache_mode)
    return _ready((query, query_rope, scale))


def _kv_rms_norm_rope_cache(kv, gamma, cos, sin, index, k_cache_ref, ckv_cache_ref, k_rope_scale, ckv_scale,
                            k_rope_offset, c_kv_offset, epsilon, cache_mode, is_output_kv):
    """aclnnKvRmsNormRopeCache."""
    with caller_names(**CACHE_REF_NAMES):
        _, _, k_rope, c_kv = torch_npu.npu_kv_rmsnorm_rope_cache(
            kv, gamma, cos, sin, index, k_cache_ref, ckv_cache_ref, k_rope_scale=k_rope_scale, c_kv_scale=ckv_scale,
            k_rope_offset=k_rope_offset, c_kv_offset=c_kv_offset, epsilon=epsilon, cache_mode=cache_mode,
            is_output_kv=is_output_kv)
    return _ready((k_rope, c_kv))


def _interleave_rope(x, cos, sin):
    """aclnnInterleaveRope."""
    return _ready(torch_npu.npu_interleave_rope(x, cos, sin))


lightning_indexer, lightning_indexer_get_workspace_size = two_phase(_lightning_indexer)
sparse_flash_attention, sparse_flash_attention_get_workspace_size = two_phase(_sparse_flash_attention)
sparse_lightning_indexer_grad_kl_loss, sparse_lightning_indexer_grad_kl_loss_get_workspace_size = two_phase(
    _sparse_lightning_indexer_grad_kl_loss)
mla_prolog_v3_weight_nz, mla_prolog_v3_weight_nz_get_workspace_size = two_phase(_mla_prolog_v3_weight_nz)
mla_prolog_v2_weight_nz, mla_prolog_v2_weight_nz_get_workspace_size = two_phase(_mla_prolog_v2_weight_nz)
kv_rms_norm_rope_cache, kv_rms_norm_rope_cache_get_workspace_size = two_phase(_kv_rms_norm_rope_cache)
interleave_rope, interleave_rope_get_workspace_size = two_phase(_interleave_rope)
