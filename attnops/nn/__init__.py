"""PyTorch modules built on the attnops operators."""
from .nsa import NativeSparseAttention
from .nsa_cache import NSACache

__all__ = ["NativeSparseAttention", "NSACache"]
