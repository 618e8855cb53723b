"""DeepSeek-V4 attention: sparse flash MLA (sliding window + compressed / compressed-sparse keys under one softmax
with sinks), its backward and the metadata functions."""
from . import op  # noqa: F401  (registers the attnops::dsv4_* custom ops)
from .api import SparseFlashMlaGradResult, SparseFlashMlaResult, sparse_flash_mla, sparse_flash_mla_grad
from .metadata import sparse_flash_mla_grad_metadata, sparse_flash_mla_metadata

__all__ = ["SparseFlashMlaGradResult", "SparseFlashMlaResult", "sparse_flash_mla", "sparse_flash_mla_grad",
           "sparse_flash_mla_grad_metadata", "sparse_flash_mla_metadata"]
