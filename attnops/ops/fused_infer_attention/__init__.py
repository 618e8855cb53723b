"""FusedInferAttentionScore (FIA): prefill and decode, paged KV, quant/antiquant, shared prefix, left padding, lse."""
from .api import FusedInferAttentionResult, fused_infer_attention
from .paged import PagedKVCache
from .plan import FusedInferAttentionPlan, fused_infer_attention_plan

__all__ = ["FusedInferAttentionPlan", "FusedInferAttentionResult", "PagedKVCache", "fused_infer_attention",
           "fused_infer_attention_plan"]
