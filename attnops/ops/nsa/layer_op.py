"""The NSA layer as one custom op, for ``torch.compile`` with sequence lengths in a tensor.

The layer's shapes (padded keys, compressed rows, selection blocks) follow from the sequence lengths, so a traced
function cannot read a ``cu_seqlens`` tensor's values; under compilation :func:`~.layer.native_sparse_attention`
with a ``cu_seqlens`` (or ``actual_seq_len``) tensor calls ``attnops::native_sparse_attention`` instead, whose fake
kernel needs only the shapes: one graph serves every length set. The op's implementation is the eager layer (it
reads the lengths: free for a CPU tensor, one synchronisation for a GPU one). Its backward recomputes the layer's
forward and differentiates it (activation checkpointing: one more forward per training step under compilation).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..._core.custom_ops import autograd_inside_op, register_dry_run_meta

DIFFERENTIABLE = ("query", "key", "value", "gates", "compress_weight_k", "compress_weight_v", "g_cmp", "g_slc",
                  "g_swa")


def _layer(args: dict) -> Tensor:
    from .layer import _native_sparse_attention

    counts, count = args.pop("block_counts"), args.pop("block_count")
    positional = [args.pop(name) for name in DIFFERENTIABLE[:6]]
    return _native_sparse_attention(*positional, **args, layout="TND", actual_seq_len=None,
                                    block_counts=counts if counts is not None else count)


@torch.library.custom_op("attnops::native_sparse_attention", mutates_args=(), device_types=("cpu", "cuda"))
def native_sparse_attention_op(query: Tensor, key: Tensor, value: Tensor, gates: Optional[Tensor],
                               compress_weight_k: Optional[Tensor], compress_weight_v: Optional[Tensor],
                               g_cmp: Optional[Tensor], g_slc: Optional[Tensor], g_swa: Optional[Tensor],
                               cu_seqlens: Tensor, block_indices: Optional[Tensor], block_counts: Optional[Tensor],
                               block_count: Optional[int], compress_block_size: int, compress_stride: int,
                               select_block_size: int, select_block_count: int, window_size: int, local_blocks: int,
                               compress: str, scale: Optional[float]) -> Tensor:
    """:func:`attnops.native_sparse_attention` on packed ``[T, N, D]`` tensors with a ``cu_seqlens`` tensor."""
    args = dict(locals())
    with torch.no_grad():  # the op's own autograd formula differentiates it
        return _layer(args)


@native_sparse_attention_op.register_fake
def _(query, key, value, *args):
    return query.new_empty(query.shape[0], query.shape[1], value.shape[-1])


@torch.library.custom_op("attnops::native_sparse_attention_backward", mutates_args=(),
                         device_types=("cpu", "cuda"))
def native_sparse_attention_backward(grad: Tensor, needs: list[bool], query: Tensor, key: Tensor, value: Tensor,
                                     gates: Optional[Tensor], compress_weight_k: Optional[Tensor],
                                     compress_weight_v: Optional[Tensor], g_cmp: Optional[Tensor],
                                     g_slc: Optional[Tensor], g_swa: Optional[Tensor], cu_seqlens: Tensor,
                                     block_indices: Optional[Tensor], block_counts: Optional[Tensor],
                                     block_count: Optional[int], compress_block_size: int, compress_stride: int,
                                     select_block_size: int, select_block_count: int, window_size: int,
                                     local_blocks: int, compress: str, scale: Optional[float]) -> list[Tensor]:
    """Gradients of the differentiable inputs flagged in ``needs`` (the others: empty tensors), by recomputing the
    forward."""
    args = dict(locals())
    grad, needs = args.pop("grad"), args.pop("needs")
    leaves = {}
    with autograd_inside_op():
        for name, need in zip(DIFFERENTIABLE, needs):
            if need:
                args[name] = leaves[name] = args[name].detach().requires_grad_()
        out = _layer(args)
        grads = dict(zip(leaves, torch.autograd.grad(out, list(leaves.values()), grad, allow_unused=True)))
    return [_grad_or_empty(grads.get(name), x) for name, x in zip(DIFFERENTIABLE, (query, key, value, gates,
            compress_weight_k, compress_weight_v, g_cmp, g_slc, g_swa))]


def _grad_or_empty(grad: Tensor | None, like: Tensor | None) -> Tensor:
    if grad is not None:
        return grad
    return torch.zeros_like(like) if like is not None else torch.empty(0)


@native_sparse_attention_backward.register_fake
def _(grad, needs, *args):
    return [torch.empty_like(x) if x is not None else grad.new_empty(0) for x in args[:len(DIFFERENTIABLE)]]


_NAMES = tuple(a.name for a in native_sparse_attention_op._opoverload._schema.arguments)


def _setup_context(ctx, inputs, output):
    ctx.inputs = inputs


def _backward(ctx, grad):
    needs = [bool(n) for n in ctx.needs_input_grad[:len(DIFFERENTIABLE)]]
    grads = native_sparse_attention_backward(grad, needs, *ctx.inputs)
    return (*(g if need else None for g, need in zip(grads, needs)), *(None,) * (len(_NAMES) - len(DIFFERENTIABLE)))


native_sparse_attention_op.register_autograd(_backward, setup_context=_setup_context)
for _op in (native_sparse_attention_op, native_sparse_attention_backward):
    register_dry_run_meta(_op)
