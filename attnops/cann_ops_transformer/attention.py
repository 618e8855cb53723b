"""ops-transformer's ``sparse_flash_mla`` / ``sparse_flash_mla_grad`` and their metadata ops, with the schemas of
``cann_ops_transformer``: arguments translated to :mod:`attnops.ops.dsv4` (``softmax_scale`` is its ``scale``), the
reserved arguments checked, no math here. Errors name this dialect's arguments."""
from __future__ import annotations

import torch
from torch import Tensor

from .._core.checks import Described, caller_names, check_scale, require
from ..ops.dsv4 import api
from ..ops.dsv4.metadata import sparse_flash_mla_metadata

NAMES = {"scale": "softmax_scale"}
TOPK_VALUE_MODES = (1,)


def check_reserved(**tensors: Tensor | None) -> None:
    """Reserved inputs (``ori_sparse_indices``, ``*_topk_length``): None or an empty tensor, as the NPU accepts."""
    for name, x in tensors.items():
        require(x is None or (isinstance(x, Tensor) and x.numel() == 0), name, "None (reserved, not supported)",
                Described("a non-empty tensor") if isinstance(x, Tensor) else x)


def lse_placeholder(q: Tensor) -> Tensor:
    """The 0-d float32 tensor returned for ``softmax_lse`` when it is not requested."""
    return q.new_zeros((), dtype=torch.float32)


def sparse_flash_mla(q: Tensor, *, ori_kv: Tensor | None = None, cmp_kv: Tensor | None = None,
                     ori_sparse_indices: Tensor | None = None, cmp_sparse_indices: Tensor | None = None,
                     ori_block_table: Tensor | None = None, cmp_block_table: Tensor | None = None,
                     cu_seqlens_q: Tensor | None = None, cu_seqlens_ori_kv: Tensor | None = None,
                     cu_seqlens_cmp_kv: Tensor | None = None, seqused_q: Tensor | None = None,
                     seqused_ori_kv: Tensor | None = None, seqused_cmp_kv: Tensor | None = None,
                     cmp_residual_kv: Tensor | None = None, ori_topk_length: Tensor | None = None,
                     cmp_topk_length: Tensor | None = None, sinks: Tensor | None = None,
                     metadata: Tensor | None = None, softmax_scale: float = 1.0, cmp_ratio: int = 1,
                     ori_mask_mode: int = 4, cmp_mask_mode: int = 3, ori_win_left: int = 127,
                     ori_win_right: int = 0, layout_q: str = "BSND", layout_kv: str = "BSND",
                     topk_value_mode: int = 1, return_softmax_lse: bool = False) -> tuple[Tensor, Tensor]:
    """``(attn_out, softmax_lse)``: :func:`attnops.sparse_flash_mla` with ops-transformer's schema. ``softmax_lse``
    is ``[B, 1, S1, N1]`` / ``[1, T1, N1]`` fp32 with ``return_softmax_lse``, else a 0-d fp32 placeholder;
    ``metadata`` is accepted and ignored (it carries no math), so are ``cu_seqlens_ori_kv`` / ``cu_seqlens_cmp_kv``
    with ``layout_kv="PA_BBND"``; ``ori_sparse_indices``, ``ori_topk_length`` and
    ``cmp_topk_length`` are reserved (None); ``topk_value_mode`` must be 1. Differentiable."""
    check_reserved(ori_sparse_indices=ori_sparse_indices, ori_topk_length=ori_topk_length,
                   cmp_topk_length=cmp_topk_length)
    require(topk_value_mode in TOPK_VALUE_MODES, "topk_value_mode", "1 (the only mode)", topk_value_mode)
    if layout_kv == "PA_BBND":  # the paged lengths are seqused_*; the NPU ignores these, as ops-transformer's test shows
        cu_seqlens_ori_kv = cu_seqlens_cmp_kv = None
    with caller_names(NAMES):
        out, lse = api.sparse_flash_mla(
            q, ori_kv, cmp_kv=cmp_kv, cmp_sparse_indices=cmp_sparse_indices, cmp_ratio=cmp_ratio, sinks=sinks,
            scale=check_scale("softmax_scale", softmax_scale), layout_q=layout_q, layout_kv=layout_kv,
            ori_block_table=ori_block_table, cmp_block_table=cmp_block_table, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_ori_kv=cu_seqlens_ori_kv, cu_seqlens_cmp_kv=cu_seqlens_cmp_kv, seqused_q=seqused_q,
            seqused_ori_kv=seqused_ori_kv, seqused_cmp_kv=seqused_cmp_kv, cmp_residual_kv=cmp_residual_kv,
            ori_mask_mode=ori_mask_mode, cmp_mask_mode=cmp_mask_mode, ori_win_left=ori_win_left,
            ori_win_right=ori_win_right)
    return out, (lse if return_softmax_lse else lse_placeholder(q))


def sparse_flash_mla_grad(q: Tensor, dout: Tensor, attn_out: Tensor, softmax_lse: Tensor,
                          ori_kv: Tensor | None = None, cmp_kv: Tensor | None = None,
                          ori_sparse_indices: Tensor | None = None, cmp_sparse_indices: Tensor | None = None,
                          cu_seqlens_q: Tensor | None = None, cu_seqlens_ori_kv: Tensor | None = None,
                          cu_seqlens_cmp_kv: Tensor | None = None, seqused_q: Tensor | None = None,
                          seqused_ori_kv: Tensor | None = None, seqused_cmp_kv: Tensor | None = None,
                          cmp_residual_kv: Tensor | None = None, ori_topk_length: Tensor | None = None,
                          cmp_topk_length: Tensor | None = None, sinks: Tensor | None = None,
                          metadata: Tensor | None = None, softmax_scale: float | None = None,
                          cmp_ratio: int | None = None, ori_mask_mode: int = 0, cmp_mask_mode: int = 0,
                          ori_win_left: int = -1, ori_win_right: int = -1, layout_q: str = "BSND",
                          layout_kv: str = "BSND") -> tuple[Tensor | None, ...]:
    """``(d_q, d_ori_kv, d_cmp_kv, d_sinks, ori_softmax_l1_norm, cmp_softmax_l1_norm)`` (None where the input is
    absent; ``ori_softmax_l1_norm`` always None): :func:`attnops.sparse_flash_mla_grad` with ops-transformer's
    schema (no paged layout; ``softmax_scale`` None: ``D ** -0.5``; ``cmp_ratio`` None: 1)."""
    check_reserved(ori_sparse_indices=ori_sparse_indices, ori_topk_length=ori_topk_length,
                   cmp_topk_length=cmp_topk_length)
    scale = None if softmax_scale is None else check_scale("softmax_scale", softmax_scale)
    with caller_names({**NAMES, "d_out": "dout"}):
        return tuple(api.sparse_flash_mla_grad(
            q, ori_kv, dout, attn_out, softmax_lse, cmp_kv=cmp_kv, cmp_sparse_indices=cmp_sparse_indices,
            cmp_ratio=1 if cmp_ratio is None else cmp_ratio, sinks=sinks, scale=scale, layout_q=layout_q,
            layout_kv=layout_kv, cu_seqlens_q=cu_seqlens_q, cu_seqlens_ori_kv=cu_seqlens_ori_kv,
            cu_seqlens_cmp_kv=cu_seqlens_cmp_kv, seqused_q=seqused_q, seqused_ori_kv=seqused_ori_kv,
            seqused_cmp_kv=seqused_cmp_kv, cmp_residual_kv=cmp_residual_kv, ori_mask_mode=ori_mask_mode,
            cmp_mask_mode=cmp_mask_mode, ori_win_left=ori_win_left, ori_win_right=ori_win_right))


def sparse_flash_mla_grad_metadata(num_heads_q: int, num_heads_kv: int, head_dim: int,
                                   cu_seqlens_q: Tensor | None = None, cu_seqlens_ori_kv: Tensor | None = None,
                                   cu_seqlens_cmp_kv: Tensor | None = None, seqused_q: Tensor | None = None,
                                   seqused_ori_kv: Tensor | None = None, seqused_cmp_kv: Tensor | None = None,
                                   cmp_residual_kv: Tensor | None = None, ori_topk_length: Tensor | None = None,
                                   cmp_topk_length: Tensor | None = None, batch_size: int | None = None,
                                   max_seqlen_q: int | None = None, max_seqlen_ori_kv: int | None = None,
                                   max_seqlen_cmp_kv: int | None = None, ori_topk: int | None = None,
                                   cmp_topk: int | None = None, cmp_ratio: int | None = None,
                                   ori_mask_mode: int = 0, cmp_mask_mode: int = 0, ori_win_left: int = -1,
                                   ori_win_right: int = -1, layout_q: str = "BSND", layout_kv: str = "BSND",
                                   has_ori_kv: bool = True, has_cmp_kv: bool = True) -> Tensor:
    """The grad kernel's metadata (int32 ``[1024]`` zeros, no math) with ops-transformer's schema (positional
    arguments, the grad op's defaults)."""
    return sparse_flash_mla_metadata(
        num_heads_q, num_heads_kv, head_dim, cu_seqlens_q=cu_seqlens_q, cu_seqlens_ori_kv=cu_seqlens_ori_kv,
        cu_seqlens_cmp_kv=cu_seqlens_cmp_kv, seqused_q=seqused_q, seqused_ori_kv=seqused_ori_kv,
        seqused_cmp_kv=seqused_cmp_kv, cmp_residual_kv=cmp_residual_kv, ori_topk_length=ori_topk_length,
        cmp_topk_length=cmp_topk_length, batch_size=batch_size, max_seqlen_q=max_seqlen_q,
        max_seqlen_ori_kv=max_seqlen_ori_kv, max_seqlen_cmp_kv=max_seqlen_cmp_kv, ori_topk=ori_topk,
        cmp_topk=cmp_topk, cmp_ratio=cmp_ratio, ori_mask_mode=ori_mask_mode, cmp_mask_mode=cmp_mask_mode,
        ori_win_left=ori_win_left, ori_win_right=ori_win_right, layout_q=layout_q, layout_kv=layout_kv,
        has_ori_kv=has_ori_kv, has_cmp_kv=has_cmp_kv)


__all__ = ["sparse_flash_mla", "sparse_flash_mla_grad", "sparse_flash_mla_grad_metadata",
           "sparse_flash_mla_metadata"]
