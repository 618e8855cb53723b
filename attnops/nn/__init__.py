"""PyTorch modules built on the attnops operators."""
from .dsa import DeepSeekSparseAttention
from .dsa_cache import DSACache
from .nsa import NativeSparseAttention
from .nsa_cache import NSACache

__all__ = ["DSACache", "DeepSeekSparseAttention", "NativeSparseAttention", "NSACache"]
