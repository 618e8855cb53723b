"""DeepSeek-V4 attention operators: the KV compressor (C4A / C4Li / C128A) and the lightning indexer v2 over
compressed keys (also over int8 / fp8 per-token-head quantised inputs)."""
from .compressor_api import compressor
from .indexer_v2_api import LightningIndexerV2Result, lightning_indexer_v2, quant_lightning_indexer_v2

__all__ = ["LightningIndexerV2Result", "compressor", "lightning_indexer_v2", "quant_lightning_indexer_v2"]
