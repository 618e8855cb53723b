"""FusedInferAttentionScore (FIA): prefill and decode, paged KV, quant/antiquant, shared prefix, left padding, lse."""
from .api import FusedInferAttentionResult, fused_infer_attention
from .paged import PagedKVCache

__all__ = ["FusedInferAttentionResult", "PagedKVCache", "fused_infer_attention"]
