"""Training FlashAttention: FlashAttentionScore / VarLenScore forward and backward (V1, V2)."""
from .api import FlashAttentionResult, flash_attention, flash_attention_backward
from .probabilities import attention_probabilities

__all__ = ["FlashAttentionResult", "attention_probabilities", "flash_attention", "flash_attention_backward"]
