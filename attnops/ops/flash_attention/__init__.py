"""Training FlashAttention: FlashAttentionScore / VarLenScore forward and backward (V1, V2)."""
from .api import FlashAttentionResult, flash_attention, flash_attention_backward

__all__ = ["FlashAttentionResult", "flash_attention", "flash_attention_backward"]
