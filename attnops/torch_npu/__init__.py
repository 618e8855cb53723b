"""torch_npu-compatible attention functions on attnops' core, with torch_npu's exact signatures and outputs.

Use them directly (``from attnops import torch_npu``) or call :func:`install` so that unmodified Ascend code that
does ``import torch_npu`` and ``torch.ops.npu.<op>`` runs on the CPU or a CUDA GPU. See ``docs/porting.md``.
"""
from __future__ import annotations

import sys

import torch

from .atb import (
    _npu_flash_attention_qlens,
    _npu_paged_attention,
    _npu_paged_attention_get_workspace,
    _npu_paged_attention_mla,
    _npu_paged_attention_splitfuse,
    _npu_paged_attention_splitfuse_v2,
)
from .atb_alibi_attention import (
    _npu_flash_attention_prefix_v2,
    _npu_flash_attention_v2,
    _npu_paged_attention_v2,
    _npu_paged_attention_v2_get_workspace,
)
from .atb_mla import _npu_multi_head_latent_attention_get_workspace, npu_multi_head_latent_attention
from .atb_paged_quant import _npu_paged_attention_quant
from .atb_self_attention import (
    _npu_flash_attention,
    _npu_flash_attention_unpad,
    _npu_flash_attention_unpad_v2,
    _npu_flash_attention_v3,
)
from .._core.hifloat8 import HIFLOAT8 as hifloat8
from .attention_update import npu_attention_update, npu_ring_attention_update
from .block_sparse import npu_block_sparse_attention, npu_block_sparse_attention_backward
from .dsa import (
    C_ASCEND_OPS,
    npu_kv_quant_sparse_flash_attention,
    npu_lightning_indexer,
    npu_sparse_flash_attention,
    npu_sparse_lightning_indexer_grad_kl_loss,
)
from .fusion_attention import (
    npu_fusion_attention,
    npu_fusion_attention_grad,
    npu_fusion_attention_grad_v2,
    npu_fusion_attention_grad_v3,
    npu_fusion_attention_v2,
    npu_fusion_attention_v3,
)
from .infer_attention import (
    _npu_fused_infer_attention_score_get_max_workspace,
    _npu_fused_infer_attention_score_v2_get_max_workspace,
    npu_fused_infer_attention_score,
    npu_fused_infer_attention_score_v2,
    npu_incre_flash_attention,
    npu_prompt_flash_attention,
)
from .dropout_mask import _npu_dropout_gen_mask
from .formats import get_npu_format, npu_format_cast, npu_format_cast_
from .kv_cache import (
    _npu_reshape_and_cache,
    _npu_reshape_and_cache_siso,
    npu_gather_pa_kv_cache,
    npu_gather_pa_kv_cache_functional,
    npu_paged_cache_load,
    npu_scatter_pa_kv_cache,
    npu_scatter_pa_kv_cache_functional,
)
from .mla import (
    npu_interleave_rope,
    npu_kv_rmsnorm_rope_cache,
    npu_mla_prolog_v2,
    npu_mla_prolog_v3,
    npu_mla_prolog_v3_functional,
)
from .nsa import (
    npu_nsa_compress,
    npu_nsa_compress_attention,
    npu_nsa_compress_attention_infer,
    npu_nsa_compress_grad,
    npu_nsa_compress_infer,
    npu_nsa_select_attention,
    npu_nsa_select_attention_grad,
    npu_nsa_select_attention_infer,
)
from .dsv4 import C_ASCEND_DSV4_OPS
from .quant_fusion_attention import npu_quant_fusion_attention
from .scatter_nd import C_ASCEND_SCATTER_OPS, npu_scatter_nd_update, npu_scatter_nd_update_
from .shim import install_package

npu_fused_infer_attention_v2 = npu_fused_infer_attention_score_v2  # the op's newer name, v2's arguments

__all__ = [
    "get_npu_format",
    "hifloat8",
    "install",
    "npu_attention_update",
    "npu_block_sparse_attention",
    "npu_block_sparse_attention_backward",
    "npu_format_cast",
    "npu_format_cast_",
    "npu_fused_infer_attention_score",
    "npu_fused_infer_attention_score_v2",
    "npu_fused_infer_attention_v2",
    "npu_fusion_attention",
    "npu_fusion_attention_grad",
    "npu_fusion_attention_grad_v2",
    "npu_fusion_attention_grad_v3",
    "npu_fusion_attention_v2",
    "npu_fusion_attention_v3",
    "npu_gather_pa_kv_cache",
    "npu_gather_pa_kv_cache_functional",
    "npu_incre_flash_attention",
    "npu_interleave_rope",
    "npu_kv_quant_sparse_flash_attention",
    "npu_kv_rmsnorm_rope_cache",
    "npu_lightning_indexer",
    "npu_mla_prolog_v2",
    "npu_mla_prolog_v3",
    "npu_mla_prolog_v3_functional",
    "npu_nsa_compress",
    "npu_nsa_compress_attention",
    "npu_nsa_compress_attention_infer",
    "npu_nsa_compress_grad",
    "npu_nsa_compress_infer",
    "npu_nsa_select_attention",
    "npu_nsa_select_attention_grad",
    "npu_nsa_select_attention_infer",
    "npu_prompt_flash_attention",
    "npu_quant_fusion_attention",
    "npu_ring_attention_update",
    "npu_scatter_nd_update",
    "npu_scatter_nd_update_",
    "npu_scatter_pa_kv_cache",
    "npu_scatter_pa_kv_cache_functional",
    "npu_sparse_flash_attention",
    "npu_sparse_lightning_indexer_grad_kl_loss",
]

# the ops torch.ops.npu resolves to once install() ran
OPS = tuple(name for name in __all__ if name not in ("hifloat8", "install")) + ("_npu_dropout_gen_mask",
    "_npu_fused_infer_attention_score_get_max_workspace", "_npu_fused_infer_attention_score_v2_get_max_workspace")
# ATB ops (torch_npu._npu_*; torch.ops.atb once install() ran)
ATB_OPS = ("_npu_flash_attention", "_npu_flash_attention_qlens", "_npu_flash_attention_unpad",
           "_npu_flash_attention_unpad_v2", "_npu_flash_attention_v3", "_npu_paged_attention",
           "_npu_paged_attention_get_workspace", "_npu_paged_attention_mla", "_npu_paged_attention_splitfuse",
           "_npu_paged_attention_splitfuse_v2", "_npu_reshape_and_cache", "_npu_reshape_and_cache_siso",
           "npu_paged_cache_load", "_npu_flash_attention_v2", "_npu_flash_attention_prefix_v2",
           "_npu_paged_attention_v2", "_npu_paged_attention_v2_get_workspace", "npu_multi_head_latent_attention",
           "_npu_multi_head_latent_attention_get_workspace", "_npu_paged_attention_quant")


def install(device: str | torch.device | None = None, *, patch_tensor_npu: bool = True,
            patch_pin_memory: bool = True, soc: str | None = None, cann_version: str | None = None) -> bool:
    """Make ``import torch_npu``, ``torch.ops.npu.<op>``, ``torch.npu`` and ``"npu"`` devices work without an NPU.

    ``device``: the device that stands in for the NPU (``"cuda"`` when available by default, else ``"cpu"``);
    ``torch.npu.device`` holds it.
    ``patch_tensor_npu``: ``"npu"`` / ``"npu:N"`` strings (and ``torch.device("npu")`` where no CUDA exists) mean that
    device in the tensor factories, ``Tensor.to/.npu/.new_*``, ``Module.to/.npu``; ``Tensor.is_npu`` is added.
    ``patch_pin_memory``: where no CUDA exists, ``Tensor.pin_memory()`` and ``pin_memory=True`` in the factories are
    no-ops (a CPU-only PyTorch raises). Both patch PyTorch for the whole process
    (:mod:`attnops.torch_npu.tensor_patch`; ``tensor_patch.unpatch()`` undoes them); pass False to leave it alone.
    ``soc`` / ``cann_version``: the Ascend SoC (``"Ascend910B1"``, ``"Ascend910_9391"``, ``"Ascend950"``, ...) and
    CANN version the stand-in reports, which ``torch_npu.testing``'s ``SupportedDevices`` and
    ``SkipIfNotGteCANNVersion`` select tests by (default: ``ATTNOPS_NPU_SOC`` / ``ATTNOPS_CANN_VERSION``, else
    ``"Ascend910B1"`` and ``"9.0.0"``; :mod:`attnops.torch_npu.soc`).
    Returns False, changing nothing, when the real torch_npu is importable; True once installed (idempotent).
    """
    c_ascend_ops = {**C_ASCEND_OPS, **C_ASCEND_DSV4_OPS, **C_ASCEND_SCATTER_OPS}
    return install_package(sys.modules[__name__], OPS, ATB_OPS, c_ascend_ops, device,
                           patch_tensor_npu=patch_tensor_npu, patch_pin_memory=patch_pin_memory, soc_name=soc,
                           cann_version=cann_version)
