"""Native Sparse Attention: compression (+grad), compressed attention with top-k, selected attention (+grad), and
compressed and selected attention for decoding over a paged cache."""
from .api import (
    CompressAttentionResult,
    nsa_compress,
    nsa_compress_attention,
    nsa_compress_attention_infer,
    nsa_selected_attention,
    nsa_selected_attention_infer,
)
from .layer_op import native_sparse_attention

__all__ = ["CompressAttentionResult", "native_sparse_attention", "nsa_compress", "nsa_compress_attention",
           "nsa_compress_attention_infer", "nsa_selected_attention", "nsa_selected_attention_infer"]
