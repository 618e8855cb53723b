"""``sparse_flash_mla`` as ``torch.library`` custom ops (namespace ``attnops``) with fake kernels and autograd.

The forward is differentiable in ``q``, ``ori_kv``, ``cmp_kv`` and ``sinks`` (``softmax_lse`` is differentiable
too); lengths, block tables and indices are tensors read inside the op (on the host by the CPU reference, on the
device by the GPU kernels), so ``torch.compile`` traces the op whole whatever their values. Absent gradients of the grad op are empty ``[0]``
tensors.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ..._core.custom_ops import call, register_dry_run_meta
from ..._core.torch_compat import schema_arguments
from . import backends
from .problem import compute_dtype, lse_shape
from .validate import Args, check_grad_inputs

DEVICE_TYPES = ("cpu", "cuda")
_TENSOR_ARGS = ("q", "ori_kv", "cmp_kv", "cmp_sparse_indices", "ori_block_table", "cmp_block_table", "cu_seqlens_q",
                "cu_seqlens_ori_kv", "cu_seqlens_cmp_kv", "seqused_q", "seqused_ori_kv", "seqused_cmp_kv",
                "cmp_residual_kv", "sinks")
_ATTRS = ("scale", "cmp_ratio", "ori_mask_mode", "cmp_mask_mode", "ori_win_left", "ori_win_right", "layout_q",
          "layout_kv")
ARG_NAMES = _TENSOR_ARGS + _ATTRS  # the forward op's arguments, in schema order (the grad op's after its own four)


@functools.cache
def _schema_names(op) -> tuple[str, ...]:
    return tuple(a.name for a in schema_arguments(op))


@torch.library.custom_op("attnops::dsv4_sparse_flash_mla", mutates_args=(), device_types=DEVICE_TYPES)
def dsv4_sparse_flash_mla(q: Tensor, ori_kv: Tensor, cmp_kv: Optional[Tensor], cmp_sparse_indices: Optional[Tensor],
                          ori_block_table: Optional[Tensor], cmp_block_table: Optional[Tensor],
                          cu_seqlens_q: Optional[Tensor], cu_seqlens_ori_kv: Optional[Tensor],
                          cu_seqlens_cmp_kv: Optional[Tensor], seqused_q: Optional[Tensor],
                          seqused_ori_kv: Optional[Tensor], seqused_cmp_kv: Optional[Tensor],
                          cmp_residual_kv: Optional[Tensor], sinks: Optional[Tensor], scale: float, cmp_ratio: int,
                          ori_mask_mode: int, cmp_mask_mode: int, ori_win_left: int, ori_win_right: int,
                          layout_q: str, layout_kv: str) -> tuple[Tensor, Tensor]:
    args = Args(**dict(zip(ARG_NAMES, (q, ori_kv, cmp_kv, cmp_sparse_indices, ori_block_table, cmp_block_table,
                                       cu_seqlens_q, cu_seqlens_ori_kv, cu_seqlens_cmp_kv, seqused_q, seqused_ori_kv,
                                       seqused_cmp_kv, cmp_residual_kv, sinks, scale, cmp_ratio, ori_mask_mode,
                                       cmp_mask_mode, ori_win_left, ori_win_right, layout_q, layout_kv))))
    out, lse = backends.forward(args)
    return out.view(q.shape), lse.view(lse_shape(q, layout_q))  # [R, N1] rows -> [B, 1, S1, N1] / [1, T1, N1]


@dsv4_sparse_flash_mla.register_fake
def _(q, ori_kv, *args):
    layout_q = args[-2]
    return torch.empty_like(q), q.new_empty(lse_shape(q, layout_q), dtype=compute_dtype(q))


@torch.library.custom_op("attnops::dsv4_sparse_flash_mla_grad", mutates_args=(), device_types=DEVICE_TYPES)
def dsv4_sparse_flash_mla_grad(dout: Tensor, dlse: Optional[Tensor], out: Tensor, lse: Tensor, q: Tensor,
                               ori_kv: Tensor, cmp_kv: Optional[Tensor], cmp_sparse_indices: Optional[Tensor],
                               ori_block_table: Optional[Tensor], cmp_block_table: Optional[Tensor],
                               cu_seqlens_q: Optional[Tensor], cu_seqlens_ori_kv: Optional[Tensor],
                               cu_seqlens_cmp_kv: Optional[Tensor], seqused_q: Optional[Tensor],
                               seqused_ori_kv: Optional[Tensor], seqused_cmp_kv: Optional[Tensor],
                               cmp_residual_kv: Optional[Tensor], sinks: Optional[Tensor], scale: float,
                               cmp_ratio: int, ori_mask_mode: int, cmp_mask_mode: int, ori_win_left: int,
                               ori_win_right: int, layout_q: str, layout_kv: str
                               ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, d_ori_kv, d_cmp_kv, d_sinks, ori_softmax_l1_norm, cmp_softmax_l1_norm)``; empty ``[0]`` tensors where
    there is nothing (no cmp_kv, no sinks, no indices; ``ori_softmax_l1_norm`` always: the ori branch takes no
    indices)."""
    args = Args(**dict(zip(ARG_NAMES, (q, ori_kv, cmp_kv, cmp_sparse_indices, ori_block_table, cmp_block_table,
                                       cu_seqlens_q, cu_seqlens_ori_kv, cu_seqlens_cmp_kv, seqused_q, seqused_ori_kv,
                                       seqused_cmp_kv, cmp_residual_kv, sinks, scale, cmp_ratio, ori_mask_mode,
                                       cmp_mask_mode, ori_win_left, ori_win_right, layout_q, layout_kv))))
    check_grad_inputs(dout, dlse, out, lse, args)
    heads = q.shape[-2]
    dq, d_ori, d_cmp, d_sinks, l1 = backends.backward(args, dout, None if dlse is None else dlse.reshape(-1, heads),
                                                       out, lse.reshape(-1, heads))
    return (dq, d_ori, _or_empty(d_cmp, q), _or_empty(d_sinks, q), q.new_empty((0,), dtype=torch.float32),
            _or_empty(l1, q))


def _or_empty(x: Tensor | None, q: Tensor) -> Tensor:
    """``x``, or a fresh empty ``[0]`` tensor (outputs must not alias each other)."""
    return q.new_empty((0,)) if x is None else x


@dsv4_sparse_flash_mla_grad.register_fake
def _(dout, dlse, out, lse, q, ori_kv, cmp_kv, cmp_sparse_indices, ori_block_table, cmp_block_table, cu_seqlens_q,
      cu_seqlens_ori_kv, cu_seqlens_cmp_kv, seqused_q, seqused_ori_kv, seqused_cmp_kv, cmp_residual_kv, sinks, *attrs):
    l1 = None if cmp_sparse_indices is None else cmp_sparse_indices.new_empty(cmp_sparse_indices.shape,
                                                                              dtype=compute_dtype(q))
    d_cmp = None if cmp_kv is None else torch.empty_like(cmp_kv)
    return (torch.empty_like(q), torch.empty_like(ori_kv), _or_empty(d_cmp, q),
            _or_empty(None if sinks is None else torch.empty_like(sinks), q), q.new_empty((0,), dtype=torch.float32),
            _or_empty(l1, q))


def _setup(ctx, inputs, output):
    args = dict(zip(_schema_names(dsv4_sparse_flash_mla), inputs))
    out, lse = output
    ctx.save_for_backward(*(args[n] for n in _TENSOR_ARGS), out, lse)
    ctx.attrs = tuple(args[n] for n in _ATTRS)


def _backward(ctx, grad_out, grad_lse):
    *tensors, out, lse = ctx.saved_tensors
    dq, d_ori, d_cmp, d_sinks, _, _ = call(dsv4_sparse_flash_mla_grad, grad_out.contiguous(), grad_lse, out, lse,
                                          *tensors, *ctx.attrs)
    named = dict(zip(_TENSOR_ARGS, tensors))
    grads = {"q": dq, "ori_kv": d_ori, "cmp_kv": None if named["cmp_kv"] is None else d_cmp,
             "sinks": None if named["sinks"] is None else d_sinks}
    return tuple(grads.get(name) for name in _schema_names(dsv4_sparse_flash_mla))


dsv4_sparse_flash_mla.register_autograd(_backward, setup_context=_setup)

for _op in (dsv4_sparse_flash_mla, dsv4_sparse_flash_mla_grad):
    register_dry_run_meta(_op)
