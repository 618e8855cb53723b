"""DeepSeek-V4 attention: sparse flash MLA (sliding window + compressed / compressed-sparse keys under one softmax
with sinks), its backward and the metadata functions; the KV compressor (C4A / C4Li / C128A) and the lightning
indexer v2 over compressed keys (also over int8 / fp8 per-token-head quantised inputs)."""
from . import op  # noqa: F401  (registers the attnops::dsv4_* custom ops)
from .api import SparseFlashMlaGradResult, SparseFlashMlaResult, sparse_flash_mla, sparse_flash_mla_grad
from .compressor_api import compressor
from .indexer_v2_api import LightningIndexerV2Result, lightning_indexer_v2, quant_lightning_indexer_v2
from .metadata import lightning_indexer_v2_metadata, sparse_flash_mla_grad_metadata, sparse_flash_mla_metadata

__all__ = ["LightningIndexerV2Result", "SparseFlashMlaGradResult", "SparseFlashMlaResult", "compressor",
           "lightning_indexer_v2", "lightning_indexer_v2_metadata", "quant_lightning_indexer_v2", "sparse_flash_mla",
           "sparse_flash_mla_grad", "sparse_flash_mla_grad_metadata", "sparse_flash_mla_metadata"]
