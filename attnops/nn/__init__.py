"""PyTorch modules built on the attnops operators."""
from .nsa import NativeSparseAttention, NSACache

__all__ = ["NativeSparseAttention", "NSACache"]
