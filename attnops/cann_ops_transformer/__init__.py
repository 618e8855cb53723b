"""ops-transformer's ``cann_ops_transformer`` DeepSeek-V4 attention ops on attnops' core, with their schemas:
``sparse_flash_mla`` (+ ``_metadata``), ``sparse_flash_mla_grad`` (+ ``_metadata``), ``compressor``,
``lightning_indexer`` (+ ``_metadata``).

Use them directly (``from attnops import cann_ops_transformer``), or after :func:`attnops.torch_npu.install` as
``import cann_ops_transformer`` and ``torch.ops.cann_ops_transformer.<op>``. See ``docs/dsv4.md``.
"""
from .attention import (sparse_flash_mla, sparse_flash_mla_grad, sparse_flash_mla_grad_metadata,
                        sparse_flash_mla_metadata)
from .compressor import compressor
from .indexer import lightning_indexer, lightning_indexer_metadata

__all__ = ["compressor", "lightning_indexer", "lightning_indexer_metadata", "sparse_flash_mla",
           "sparse_flash_mla_grad", "sparse_flash_mla_grad_metadata", "sparse_flash_mla_metadata"]

OPS = tuple(__all__)  # the names torch.ops.cann_ops_transformer resolves once the shim is installed
