"""DSA kernels as ``torch.library`` custom ops (namespace ``attnops``) with fake kernels and autograd.

Sparse flash attention is differentiable in query, key, value and the rope parts (``sinks`` and the indices are
not); the indexer's outputs are integer positions (not differentiable: its training signal is the KL loss,
:func:`dsa_indexer_kl_loss_grad`, differentiable in the indexer's inputs through the gradients it computes with the
loss). Lengths are int tensors and, with block tables, host metadata read once per call.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ..._core.custom_ops import call, register_dry_run_meta
from ..._core.torch_compat import schema_arguments
from . import backends
from .quant_cache import NOPE_DIM
from .validate import (indexer_call, kl_loss_call, quant_sparse_attention_call, sparse_attention_call,
                       stats_shape)

DEVICE_TYPES = ("cpu", "cuda")


@functools.cache
def _schema_names(op) -> tuple[str, ...]:
    return tuple(a.name for a in schema_arguments(op))


def _indices_shape(query: Tensor, count: int) -> tuple[int, ...]:
    return (*query.shape[:-2], 1, count)


def _stats(query: Tensor, layout_query: str) -> tuple[Tensor, Tensor]:
    dt = torch.float64 if query.dtype == torch.float64 else torch.float32
    shape = stats_shape(query, layout_query)
    return query.new_empty(shape, dtype=dt), query.new_empty(shape, dtype=dt)


# ---------------------------------------------------------------- lightning indexer
@torch.library.custom_op("attnops::dsa_lightning_indexer", mutates_args=(), device_types=DEVICE_TYPES)
def dsa_lightning_indexer(query: Tensor, key: Tensor, weights: Tensor, actual_seq_lengths_query: Optional[Tensor],
                          actual_seq_lengths_key: Optional[Tensor], block_table: Optional[Tensor], layout_query: str,
                          layout_key: str, sparse_count: int, sparse_mode: int, return_value: bool
                          ) -> tuple[Tensor, Tensor]:
    dsa_call = indexer_call(query, key, weights, actual_seq_lengths_query=actual_seq_lengths_query,
                            actual_seq_lengths_key=actual_seq_lengths_key, block_table=block_table,
                            layout_query=layout_query, layout_key=layout_key, sparse_count=sparse_count,
                            sparse_mode=sparse_mode, return_value=return_value)
    indices, values = backends.lightning_indexer(dsa_call, query, key, weights, sparse_count, return_value)
    shape = _indices_shape(query, sparse_count)
    return indices.view(shape), values.view(shape) if return_value else values


@dsa_lightning_indexer.register_fake
def _(query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table, layout_query, layout_key,
      sparse_count, sparse_mode, return_value):
    shape = _indices_shape(query, sparse_count)
    return (query.new_empty(shape, dtype=torch.int32), query.new_empty(shape if return_value else (0,)))


# ---------------------------------------------------------------- sparse flash attention
@torch.library.custom_op("attnops::dsa_sparse_flash_attention", mutates_args=(), device_types=DEVICE_TYPES)
def dsa_sparse_flash_attention(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor,
                               query_rope: Optional[Tensor], key_rope: Optional[Tensor], sinks: Optional[Tensor],
                               block_table: Optional[Tensor], actual_seq_lengths_query: Optional[Tensor],
                               actual_seq_lengths_kv: Optional[Tensor], scale_value: float, sparse_block_size: int,
                               layout_query: str, layout_kv: str, sparse_mode: int) -> tuple[Tensor, Tensor, Tensor]:
    dsa_call = sparse_attention_call(
        query, key, value, sparse_indices, query_rope=query_rope, key_rope=key_rope, sinks=sinks,
        block_table=block_table, actual_seq_lengths_query=actual_seq_lengths_query,
        actual_seq_lengths_kv=actual_seq_lengths_kv, layout_query=layout_query, layout_kv=layout_kv,
        sparse_mode=sparse_mode, sparse_block_size=sparse_block_size)
    out, m, l = backends.sparse_attention(dsa_call, query, key, value, sparse_indices, query_rope, key_rope, sinks,
                                          scale_value, sparse_block_size)
    shape = stats_shape(query, layout_query)
    return out.view(*query.shape[:-1], value.shape[-1]), m.view(shape), l.view(shape)


@dsa_sparse_flash_attention.register_fake
def _(query, key, value, sparse_indices, query_rope, key_rope, sinks, block_table, actual_seq_lengths_query,
      actual_seq_lengths_kv, scale_value, sparse_block_size, layout_query, layout_kv, sparse_mode):
    return (query.new_empty((*query.shape[:-1], value.shape[-1])), *_stats(query, layout_query))


@torch.library.custom_op("attnops::dsa_sparse_flash_attention_grad", mutates_args=(), device_types=DEVICE_TYPES)
def dsa_sparse_flash_attention_grad(grad: Tensor, query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor,
                                    query_rope: Optional[Tensor], key_rope: Optional[Tensor],
                                    block_table: Optional[Tensor], actual_seq_lengths_query: Optional[Tensor],
                                    actual_seq_lengths_kv: Optional[Tensor], attention_out: Tensor,
                                    softmax_max: Tensor, softmax_sum: Tensor, scale_value: float,
                                    sparse_block_size: int, layout_query: str, layout_kv: str, sparse_mode: int
                                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dq_rope, dk_rope)``; the rope gradients are empty ``[0]`` tensors without rope."""
    dsa_call = sparse_attention_call(
        query, key, value, sparse_indices, query_rope=query_rope, key_rope=key_rope, sinks=None,
        block_table=block_table, actual_seq_lengths_query=actual_seq_lengths_query,
        actual_seq_lengths_kv=actual_seq_lengths_kv, layout_query=layout_query, layout_kv=layout_kv,
        sparse_mode=sparse_mode, sparse_block_size=sparse_block_size)
    rows = query.shape[0] * query.shape[1] if layout_query == "BSND" else query.shape[0]
    dq, dk, dv, dqr, dkr = backends.sparse_attention_grad(
        dsa_call, grad, query, key, value, sparse_indices, query_rope, key_rope, attention_out,
        softmax_max.reshape(rows, -1), softmax_sum.reshape(rows, -1), scale_value, sparse_block_size)
    empty = query.new_empty((0,))
    return dq, dk, dv, empty if dqr is None else dqr, empty if dkr is None else dkr


@dsa_sparse_flash_attention_grad.register_fake
def _(grad, query, key, value, sparse_indices, query_rope, key_rope, *args):
    def like(x):
        return query.new_empty((0,)) if x is None else torch.empty_like(x)

    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), like(query_rope), like(key_rope)


def _sfa_setup(ctx, inputs, output):
    args = dict(zip(_schema_names(dsa_sparse_flash_attention), inputs))
    out, m, l = output
    ctx.save_for_backward(args["query"], args["key"], args["value"], args["sparse_indices"], args["query_rope"],
                          args["key_rope"], out, m, l)
    ctx.tables = (args["block_table"], args["actual_seq_lengths_query"], args["actual_seq_lengths_kv"])
    ctx.attrs = (args["scale_value"], args["sparse_block_size"], args["layout_query"], args["layout_kv"],
                 args["sparse_mode"])
    ctx.has_sinks = args["sinks"] is not None


def _sfa_backward(ctx, grad_out, _grad_max, _grad_sum):
    q, k, v, idx, qr, kr, out, m, l = ctx.saved_tensors
    if ctx.has_sinks:
        raise NotImplementedError("sparse_flash_attention: the backward with sinks is not implemented; call it "
                                  "without sinks (or under torch.no_grad()) to train")
    dq, dk, dv, dqr, dkr = call(dsa_sparse_flash_attention_grad, grad_out.contiguous(), q, k, v, idx, qr, kr,
                                *ctx.tables, out, m, l, *ctx.attrs)
    grads = {"query": dq, "key": dk, "value": dv, "query_rope": None if qr is None else dqr,
             "key_rope": None if kr is None else dkr}
    return tuple(grads.get(name) for name in _schema_names(dsa_sparse_flash_attention))


dsa_sparse_flash_attention.register_autograd(_sfa_backward, setup_context=_sfa_setup)


# ---------------------------------------------------------------- quantized-cache sparse flash attention
@torch.library.custom_op("attnops::dsa_kv_quant_sparse_flash_attention", mutates_args=(),
                         device_types=DEVICE_TYPES)
def dsa_kv_quant_sparse_flash_attention(query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor,
                                        sinks: Optional[Tensor], block_table: Optional[Tensor],
                                        actual_seq_lengths_query: Optional[Tensor],
                                        actual_seq_lengths_kv: Optional[Tensor], scale_value: float,
                                        sparse_block_size: int, layout_query: str, layout_kv: str, sparse_mode: int,
                                        rope_head_dim: int, hif8: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    dsa_call = quant_sparse_attention_call(
        query, key, value, sparse_indices, sinks=sinks, block_table=block_table,
        actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_kv=actual_seq_lengths_kv,
        layout_query=layout_query, layout_kv=layout_kv, sparse_mode=sparse_mode, sparse_block_size=sparse_block_size,
        rope_head_dim=rope_head_dim, hif8=hif8)
    out, m, l = backends.quant_sparse_attention(dsa_call, query, key, value, sparse_indices, sinks, scale_value,
                                                sparse_block_size, rope_head_dim, hif8)
    shape = stats_shape(query, layout_query)
    return out.view(*query.shape[:-1], NOPE_DIM), m.view(shape), l.view(shape)


@dsa_kv_quant_sparse_flash_attention.register_fake
def _(query, key, value, sparse_indices, sinks, block_table, actual_seq_lengths_query, actual_seq_lengths_kv,
      scale_value, sparse_block_size, layout_query, layout_kv, sparse_mode, rope_head_dim, hif8=False):
    return (query.new_empty((*query.shape[:-1], NOPE_DIM)), *_stats(query, layout_query))


# ---------------------------------------------------------------- the indexer's KL loss and its gradients
@torch.library.custom_op("attnops::dsa_indexer_kl_loss_grad", mutates_args=(), device_types=DEVICE_TYPES)
def dsa_indexer_kl_loss_grad(query: Tensor, key: Tensor, query_index: Tensor, key_index: Tensor, weights: Tensor,
                             sparse_indices: Tensor, softmax_max: Tensor, softmax_sum: Tensor,
                             query_rope: Optional[Tensor], key_rope: Optional[Tensor], scale_value: float,
                             actual_seq_qlen: Optional[Tensor], actual_seq_klen: Optional[Tensor], layout: str,
                             sparse_mode: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dsa_call = kl_loss_call(query, key, query_index, key_index, weights, sparse_indices, softmax_max, softmax_sum,
                            query_rope=query_rope, key_rope=key_rope, actual_seq_qlen=actual_seq_qlen,
                            actual_seq_klen=actual_seq_klen, layout=layout, sparse_mode=sparse_mode)
    return backends.kl_loss_grad(dsa_call, query, key, query_index, key_index, weights, sparse_indices, softmax_max,
                                 softmax_sum, query_rope, key_rope, scale=scale_value)


@dsa_indexer_kl_loss_grad.register_fake
def _(query, key, query_index, key_index, weights, sparse_indices, softmax_max, softmax_sum, *args):
    loss_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    return (torch.empty_like(query_index), torch.empty_like(key_index), torch.empty_like(weights),
            query.new_empty((1,), dtype=loss_dtype))


def _kl_setup(ctx, inputs, output):
    ctx.save_for_backward(*output[:3])


def _kl_backward(ctx, _grad_dqi, _grad_dki, _grad_dw, grad_loss):
    """The loss's gradients, computed with it by the forward, scaled by the upstream gradient."""
    d_qi, d_ki, d_w = ctx.saved_tensors
    g = grad_loss.reshape(())
    grads = {"query_index": d_qi * g.to(d_qi.dtype), "key_index": d_ki * g.to(d_ki.dtype),
             "weights": d_w * g.to(d_w.dtype)}
    return tuple(grads.get(name) for name in _schema_names(dsa_indexer_kl_loss_grad))


dsa_indexer_kl_loss_grad.register_autograd(_kl_backward, setup_context=_kl_setup)


for _op in (dsa_lightning_indexer, dsa_sparse_flash_attention, dsa_sparse_flash_attention_grad,
            dsa_kv_quant_sparse_flash_attention, dsa_indexer_kl_loss_grad):
    register_dry_run_meta(_op)
