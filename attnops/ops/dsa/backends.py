"""Runs each DSA operator on its backend: the custom ops (``op.py``) call these functions and nothing else, with the
validated :class:`~.call.Call` (the Triton launchers take it as it is; the references its host normal form).

Every operator runs its CPU reference (tensors on another device are copied to the CPU and the results back) unless
a Triton implementation is registered for it and :func:`~attnops._core.dispatch.choose_backend` picks it. A Triton
implementation plugs in by passing its verifier (``() -> reason or None``) and its launcher (same arguments as the
reference) to :func:`_run` in the function below that serves its operator.
"""
from __future__ import annotations

import functools

from ..._core.devices import on_cpu
from ..._core.dispatch import choose_backend
from .indexer import lightning_indexer_forward
from .kl_loss import indexer_kl_loss_grad
from .quant_cache import dequantized_operands
from .sparse_attention import sparse_attention_backward, sparse_attention_forward
from .triton import backward as triton_backward
from .triton import kl_launch as triton_kl
from .triton import launch as triton_launch
from .triton import verify as triton_verify


def _run(device_tensor, verify, triton_fn, reference_fn, call, *args):
    """``triton_fn(call, *args)`` when :func:`choose_backend` picks the Triton kernels for ``device_tensor``'s device
    (``verify``: why they cannot serve the call, or None; both None while an operator has no kernel), else the
    reference on CPU copies with the call's host normal form (device lengths and tables read there)."""
    if choose_backend("auto", device_tensor.device, verify) == "triton":
        return triton_fn(call, *args)
    return on_cpu(reference_fn, call.problem(), *args)


def lightning_indexer(call, query, key, weights, sparse_count, return_value):
    """``(sparse_indices [R, K] int32, sparse_values [R, K] or [0])``."""
    return _run(query, lambda: triton_verify.indexer_reason(query, weights, sparse_count),
                triton_launch.indexer_for, lightning_indexer_forward, call, query, key, weights, sparse_count,
                return_value)


def sparse_attention(call, query, key, value, sparse_indices, query_rope, key_rope, sinks, scale, block):
    """``(out [R, N1, Dv], softmax_max [R, N1], softmax_sum [R, N1])``."""
    return _run(query, lambda: triton_verify.sparse_attention_reason(query, value, query_rope),
                triton_launch.sparse_attention_for, sparse_attention_forward, call, query, key, value,
                sparse_indices, query_rope, key_rope, sinks, scale, block)


def sparse_attention_grad(call, grad, query, key, value, sparse_indices, query_rope, key_rope, out,
                          softmax_max, softmax_sum, scale, block):
    """``(dq, dk, dv, dq_rope, dk_rope)`` (rope gradients None without rope)."""
    return _run(query, lambda: triton_verify.sparse_attention_reason(query, value, query_rope),
                triton_backward.sparse_attention_grad_for, sparse_attention_backward, call, grad, query, key, value,
                sparse_indices, query_rope, key_rope, out, softmax_max, softmax_sum, scale, block)


def quant_sparse_attention(call, query, key, value, sparse_indices, sinks, scale, block, rope_dim, hif8):
    """``(out [R, N1, 512], softmax_max, softmax_sum)`` over a packed int8/fp8/HiFloat8 (``hif8``) cache: the
    reference dequantizes the selected rows' tiles, then runs :func:`sparse_attention_forward`."""

    def reference(problem, query, key, value, sparse_indices, sinks):
        q, q_rope, k, k_rope = dequantized_operands(query, key, rope_dim, hif8)
        return sparse_attention_forward(problem, q, k, k, sparse_indices, q_rope, k_rope, sinks, scale, block)

    def kernel(call, query, key, value, sparse_indices, sinks):
        return triton_launch.quant_sparse_attention_for(call, query, key, sparse_indices, sinks, scale, block,
                                                        rope_dim)

    return _run(query, lambda: triton_verify.quant_sparse_attention_reason(query, hif8), kernel, reference, call,
                query, key, value, sparse_indices, sinks)


def kl_loss_grad(call, query, key, query_index, key_index, weights, sparse_indices, softmax_max, softmax_sum,
                 query_rope, key_rope, *, scale):
    """``(d_query_index, d_key_index, d_weights, loss)`` of the indexer's KL loss."""
    return _run(query, lambda: triton_verify.kl_loss_reason(query, query_index, weights, query_rope),
                functools.partial(triton_kl.kl_loss_for, scale=scale),
                functools.partial(indexer_kl_loss_grad, scale=scale), call, query, key, query_index, key_index,
                weights, sparse_indices, softmax_max, softmax_sum, query_rope, key_rope)
