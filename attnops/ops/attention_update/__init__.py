"""Merging partial attention results through their softmax statistics: torch_npu's ``npu_ring_attention_update``
and ``npu_attention_update`` (context parallelism, chunked prefill)."""
from .merge import attention_update, blocked_to_tnd, merge_softmax_stats, ring_attention_update, tnd_to_blocked

__all__ = ["ring_attention_update", "attention_update", "merge_softmax_stats", "blocked_to_tnd", "tnd_to_blocked"]
