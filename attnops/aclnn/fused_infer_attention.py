"""aclnnFusedInferAttentionScoreV2 under its aclnn name (snake_case), in the seed's parameter order.

``fused_infer_attention_score_v2(...) -> (attention_out, softmax_lse)``; ``key``/``value`` are a tensor or a list of
per-batch tensors (the aclnn TensorList). ``softmax_lse`` is fp32 ``[B, N, Q_S, 1]`` (``[T, N, 1]`` for TND) with
``softmax_lse_flag``, else the ``[1]`` zero tensor the seed returns for a null softmaxLse. The two-phase
``_get_workspace_size`` twin validates first. Errors: 161001 for a missing query/key/value, 161002 otherwise.
Inference only: a backward through the outputs raises :class:`attnops.InferenceOnlyError`.
"""
from __future__ import annotations

import torch

from .._core.checks import require, require_not_none
from .._core.inference_only import run_inference_only
from ..ops.fused_infer_attention import backends
from ..ops.fused_infer_attention.api import check_devices
from ..ops.fused_infer_attention.op import INFERENCE_ONLY
from ..ops.fused_infer_attention.problem import OPTION_NAMES, build_problem
from ._two_phase import two_phase


def _fused_infer_attention_score_v2(query, key, value, pse_shift, atten_mask, actual_seq_lengths,
                                    actual_seq_lengths_kv, deq_scale1, quant_scale1, deq_scale2, quant_scale2,
                                    quant_offset2, antiquant_scale, antiquant_offset, block_table, query_padding_size,
                                    kv_padding_size, key_antiquant_scale, key_antiquant_offset, value_antiquant_scale,
                                    value_antiquant_offset, key_shared_prefix, value_shared_prefix,
                                    actual_shared_prefix_len, num_heads, scale_value, pre_tokens, next_tokens,
                                    input_layout, num_key_value_heads, sparse_mode, inner_precise, block_size,
                                    antiquant_mode, softmax_lse_flag, key_antiquant_mode, value_antiquant_mode):
    """aclnnFusedInferAttentionScoreV2 (seed): PromptFlashAttention (Q_S > 1) and IncreFlashAttention (Q_S = 1)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        require_not_none(x, name)
    check_devices(query, key, value, locals())
    require(isinstance(softmax_lse_flag, bool), "softmax_lse_flag", "a bool", softmax_lse_flag)
    options = {name: value_ for name, value_ in locals().items() if name in OPTION_NAMES}
    options.update(scale=scale_value, strict=True)
    build_problem(query, key, value, **options)  # validates every argument before anything runs

    def run():
        out, lse = run_inference_only(INFERENCE_ONLY, lambda: backends.forward(query, key, value, options), query,
                                      key, value, options)
        return out, (lse if softmax_lse_flag else torch.zeros(1, dtype=torch.float32, device=out.device))

    return run


fused_infer_attention_score_v2, fused_infer_attention_score_v2_get_workspace_size = two_phase(
    _fused_infer_attention_score_v2)
