"""``native_sparse_attention``, the NSA layer's entry (its body: :mod:`.layer`), and the layer as one custom op,
for ``torch.compile`` with sequence lengths in a tensor.

The layer's shapes (padded keys, compressed rows, selection blocks) follow from the sequence lengths, so a traced
function cannot read a ``cu_seqlens`` tensor's values; under compilation :func:`native_sparse_attention`
with a ``cu_seqlens`` (or ``actual_seq_len``) tensor calls ``attnops::native_sparse_attention`` instead, whose fake
kernel needs only the shapes: one graph serves every length set. The op's implementation is the eager layer (it
reads the lengths: free for a CPU tensor, one synchronisation for a GPU one). Its backward recomputes the layer's
forward and differentiates it (activation checkpointing: one more forward per training step under compilation).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..._core.autocast import autocast_off
from ..._core.checks import Described, check_tensor, require
from ..._core.custom_ops import autograd_inside_op, register_dry_run_meta
from ..._core.torch_compat import schema_arguments
from .api import _prepared
from .layer import FLOAT_DTYPES, _native_sparse_attention

DIFFERENTIABLE = ("query", "key", "value", "gates", "compress_weight_k", "compress_weight_v", "g_cmp", "g_slc",
                  "g_swa")


def _layer(args: dict) -> Tensor:
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


_NAMES = tuple(a.name for a in schema_arguments(native_sparse_attention_op))


def _setup_context(ctx, inputs, output):
    ctx.inputs = inputs


def _backward(ctx, grad):
    needs = [bool(n) for n in ctx.needs_input_grad[:len(DIFFERENTIABLE)]]
    grads = native_sparse_attention_backward(grad, needs, *ctx.inputs)
    return (*(g if need else None for g, need in zip(grads, needs)), *(None,) * (len(_NAMES) - len(DIFFERENTIABLE)))


native_sparse_attention_op.register_autograd(_backward, setup_context=_setup_context)
for _op in (native_sparse_attention_op, native_sparse_attention_backward):
    register_dry_run_meta(_op)


def native_sparse_attention(query: Tensor, key: Tensor, value: Tensor, gates: Tensor | None = None,
                            compress_weight_k: Tensor | None = None, compress_weight_v: Tensor | None = None, *,
                            g_cmp: Tensor | None = None, g_slc: Tensor | None = None, g_swa: Tensor | None = None,
                            cu_seqlens=None, actual_seq_len=None, layout: str = "TND",
                            compress_block_size: int = 32, compress_stride: int = 16, select_block_size: int = 64,
                            select_block_count: int = 16, window_size: int = 512, local_blocks: int = 2,
                            block_indices: Tensor | None = None, block_counts=None, compress: str = "weighted",
                            scale: float | None = None) -> Tensor:
    """Native Sparse Attention (DeepSeek, arXiv 2502.11089): causal self-attention as the gated sum of three branches.

    * compression: keys/values pooled by :func:`nsa_compress` over blocks of ``compress_block_size`` tokens every
      ``compress_stride`` tokens, with the learnable ``compress_weight_k/v [compress_block_size, N2]``
      (``compress="weighted"``) or the plain mean (``compress="mean"``, weights omitted); a query attends to the
      complete compressed blocks that end at or before it (none yet: the branch gives 0);
    * selection: per query token and KV head, up to ``select_block_count`` blocks of ``select_block_size`` tokens at
      or before the token's own block, attended causally (positions ``<=`` the token's). By default the top blocks by
      the compression branch's importance (block 0 and the ``local_blocks`` most recent blocks forced; a token with
      fewer candidate blocks uses fewer); or given by ``block_indices [T, N2, S]`` (local block ids, ``-1`` =
      unused), which skips the top-k. ``block_counts`` (int or per token ``[T, N2]``) keeps only the first slots;
    * sliding window: each token attends to the ``window_size`` most recent tokens (itself included); ``0`` = off.

    Shapes: ``layout="TND"``: ``query [T, N1, D]``, ``key [T, N2, D]``, ``value [T, N2, Dv]`` packed with
    ``cu_seqlens`` (leading 0) or ``actual_seq_len`` (cumulative), one sequence by default; ``layout="BSND"``:
    ``[B, S, N, D]``, every row a sequence. Any sequence length >= 1. Gates: ``gates [..., N1, 3]``
    (compression, selection, window) or, with ``gates=None``, ``g_cmp``/``g_slc``/``g_swa`` ``[..., N1]``; a None
    gate turns its branch off. Strictly causal: a sequence's prefix gets the same outputs as the whole sequence on
    that prefix. Returns ``[..., N1, Dv]``; differentiable in q, k, v, the compression weights and the gates.
    """
    check_tensor("query", query, ndim=(3, 4))  # TND or [B, S, N, D]
    for name, t in (("key", key), ("value", value)):
        check_tensor(name, t, ndim=query.dim())
    for name, t in (("gates", gates), ("compress_weight_k", compress_weight_k),
                    ("compress_weight_v", compress_weight_v), ("g_cmp", g_cmp), ("g_slc", g_slc), ("g_swa", g_swa)):
        if t is not None:
            check_tensor(name, t, dtypes=FLOAT_DTYPES)
    count_tensor = block_counts if isinstance(block_counts, Tensor) else None  # an int count has no device
    query, key, value, gates, compress_weight_k, compress_weight_v, g_cmp, g_slc, g_swa, block_indices, _ = _prepared(
        "query", query, key=key, value=value, gates=gates, compress_weight_k=compress_weight_k,
        compress_weight_v=compress_weight_v, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, block_indices=block_indices,
        block_counts=count_tensor)
    with autocast_off(query.device):
        if torch.compiler.is_compiling() and layout == "TND" and isinstance(
                cu_seqlens if cu_seqlens is not None else actual_seq_len, Tensor):
            return _compiled_with_tensor_lengths(
                query, key, value, gates, compress_weight_k, compress_weight_v, g_cmp, g_slc, g_swa, cu_seqlens,
                actual_seq_len, block_indices, block_counts, compress_block_size, compress_stride, select_block_size,
                select_block_count, window_size, local_blocks, compress, scale)
        return _native_sparse_attention(
            query, key, value, gates, compress_weight_k, compress_weight_v, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa,
            cu_seqlens=cu_seqlens, actual_seq_len=actual_seq_len, layout=layout,
            compress_block_size=compress_block_size, compress_stride=compress_stride,
            select_block_size=select_block_size, select_block_count=select_block_count, window_size=window_size,
            local_blocks=local_blocks, block_indices=block_indices, block_counts=block_counts, compress=compress,
            scale=scale)


def _compiled_with_tensor_lengths(query, key, value, gates, wk, wv, g_cmp, g_slc, g_swa, cu_seqlens, actual_seq_len,
                                  block_indices, block_counts, *sizes_and_options):
    """Under ``torch.compile``: the layer as one op (:func:`native_sparse_attention_op`) taking the lengths as a
    tensor, so the traced graph never reads them and serves every length set."""
    if cu_seqlens is None:  # CANN's cumulative lengths: cu_seqlens without its leading 0
        require(isinstance(actual_seq_len, Tensor) and actual_seq_len.dim() == 1, "actual_seq_len",
                "a 1-D tensor of cumulative lengths", actual_seq_len)
        cu_seqlens = torch.cat([actual_seq_len.new_zeros(1), actual_seq_len])
    else:
        require(actual_seq_len is None, "cu_seqlens", "either cu_seqlens or actual lengths, not both",
                Described("both"))
    counts = block_counts if isinstance(block_counts, Tensor) else None
    return native_sparse_attention_op(query, key, value, gates, wk, wv, g_cmp, g_slc, g_swa, cu_seqlens,
                                      block_indices, counts, None if counts is not None else block_counts,
                                      *sizes_and_options)
