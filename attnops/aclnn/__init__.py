"""The seeds' aclnn operators under their aclnn names (snake_case): same parameters in the same order, outputs
as tuples, status-coded errors (:class:`attnops.AclnnError`) and the two-phase
``<op>_get_workspace_size(...) -> (workspace_size, executor)`` / ``<op>(workspace, workspace_size, executor, stream)``
form.
"""
from ._two_phase import AclnnExecutor
from .flash_attention import (
    flash_attention_score,
    flash_attention_score_get_workspace_size,
    flash_attention_score_grad,
    flash_attention_score_grad_get_workspace_size,
    flash_attention_unpadding_score_grad,
    flash_attention_unpadding_score_grad_get_workspace_size,
    flash_attention_unpadding_score_grad_v2,
    flash_attention_unpadding_score_grad_v2_get_workspace_size,
    flash_attention_var_len_score,
    flash_attention_var_len_score_get_workspace_size,
    flash_attention_var_len_score_v2,
    flash_attention_var_len_score_v2_get_workspace_size,
)
from .fused_infer_attention import (
    fused_infer_attention_score_v2,
    fused_infer_attention_score_v2_get_workspace_size,
)
from .nsa import (
    nsa_compress,
    nsa_compress_attention,
    nsa_compress_attention_get_workspace_size,
    nsa_compress_get_workspace_size,
    nsa_compress_grad,
    nsa_compress_grad_get_workspace_size,
    nsa_selected_attention,
    nsa_selected_attention_get_workspace_size,
    nsa_selected_attention_grad,
    nsa_selected_attention_grad_get_workspace_size,
)

__all__ = [
    "AclnnExecutor",
    "flash_attention_score",
    "flash_attention_score_get_workspace_size",
    "flash_attention_score_grad",
    "flash_attention_score_grad_get_workspace_size",
    "flash_attention_unpadding_score_grad",
    "flash_attention_unpadding_score_grad_get_workspace_size",
    "flash_attention_unpadding_score_grad_v2",
    "flash_attention_unpadding_score_grad_v2_get_workspace_size",
    "flash_attention_var_len_score",
    "flash_attention_var_len_score_get_workspace_size",
    "flash_attention_var_len_score_v2",
    "flash_attention_var_len_score_v2_get_workspace_size",
    "fused_infer_attention_score_v2",
    "fused_infer_attention_score_v2_get_workspace_size",
    "nsa_compress",
    "nsa_compress_attention",
    "nsa_compress_attention_get_workspace_size",
    "nsa_compress_get_workspace_size",
    "nsa_compress_grad",
    "nsa_compress_grad_get_workspace_size",
    "nsa_selected_attention",
    "nsa_selected_attention_get_workspace_size",
    "nsa_selected_attention_grad",
    "nsa_selected_attention_grad_get_workspace_size",
]
