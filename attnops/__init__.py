"""attnops: Huawei CANN's fused-attention operators on PyTorch (CPU reference, Triton on NVIDIA GPUs).

Three dialects share one core: this Pythonic API, :mod:`attnops.aclnn` (the seeds' aclnn operators) and
:mod:`attnops.torch_npu` (torch_npu's Python functions). Modules for model builders: :mod:`attnops.nn`.
"""
from . import nn, testing
from ._core.errors import (AclnnError, InferenceOnlyError, ParamDtypeError, ParamInvalidError, ParamNullptrError,
                           PerformanceWarning)
from .ops.dsa import (LightningIndexerResult, SparseAttentionResult, lightning_indexer, lightning_indexer_kl_loss,
                      sparse_flash_attention)
from .ops.dsv4 import (LightningIndexerV2Result, SparseFlashMlaGradResult, SparseFlashMlaResult, compressor,
                       lightning_indexer_v2, quant_lightning_indexer_v2, sparse_flash_mla, sparse_flash_mla_grad,
                       sparse_flash_mla_grad_metadata, sparse_flash_mla_metadata)
from .ops.flash_attention import FlashAttentionResult, flash_attention, flash_attention_backward
from .ops.fused_infer_attention import (FusedInferAttentionPlan, FusedInferAttentionResult, PagedKVCache,
                                        fused_infer_attention, fused_infer_attention_plan)
from .ops.nsa import (
    CompressAttentionResult,
    native_sparse_attention,
    nsa_compress,
    nsa_compress_attention,
    nsa_compress_attention_infer,
    nsa_selected_attention,
    nsa_selected_attention_infer,
)

__version__ = "0.1.0"

__all__ = [
    "AclnnError",
    "CompressAttentionResult",
    "FlashAttentionResult",
    "FusedInferAttentionPlan",
    "FusedInferAttentionResult",
    "InferenceOnlyError",
    "LightningIndexerResult",
    "LightningIndexerV2Result",
    "PagedKVCache",
    "ParamDtypeError",
    "ParamInvalidError",
    "ParamNullptrError",
    "PerformanceWarning",
    "compressor",
    "SparseAttentionResult",
    "SparseFlashMlaGradResult",
    "SparseFlashMlaResult",
    "flash_attention",
    "flash_attention_backward",
    "fused_infer_attention",
    "fused_infer_attention_plan",
    "lightning_indexer",
    "lightning_indexer_kl_loss",
    "lightning_indexer_v2",
    "native_sparse_attention",
    "nsa_compress",
    "nsa_compress_attention",
    "nsa_compress_attention_infer",
    "nsa_selected_attention",
    "nsa_selected_attention_infer",
    "quant_lightning_indexer_v2",
    "sparse_flash_attention",
    "sparse_flash_mla",
    "sparse_flash_mla_grad",
    "sparse_flash_mla_grad_metadata",
    "sparse_flash_mla_metadata",
]
