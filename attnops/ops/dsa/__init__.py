"""DeepSeek sparse attention: the lightning indexer, sparse flash attention (also over an int8/fp8 packed cache) and
the indexer's KL loss."""
from .api import (LightningIndexerResult, SparseAttentionResult, lightning_indexer, lightning_indexer_kl_loss,
                  sparse_flash_attention)

__all__ = ["LightningIndexerResult", "SparseAttentionResult", "lightning_indexer", "lightning_indexer_kl_loss",
           "sparse_flash_attention"]
