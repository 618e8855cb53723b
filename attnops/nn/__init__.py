"""PyTorch modules built on the attnops operators."""
from .dsa import DeepSeekSparseAttention
from .dsa_cache import DSACache
from .dsv4 import DeepSeekV4Attention
from .dsv4_cache import DSV4Cache
from .nsa import NativeSparseAttention
from .nsa_cache import NSACache

__all__ = ["DSACache", "DSV4Cache", "DeepSeekSparseAttention", "DeepSeekV4Attention", "NativeSparseAttention",
           "NSACache"]
