"""The NSA layer's sliding-window branch: every token attends causally to its last ``window`` keys, on the shared
attention engine (:mod:`attnops.ops.common`), as custom ops with fake kernels and autograd, so that
``torch.compile`` keeps the branch in its graph and the gradients of query, key and value flow.

The problem is the one FlashAttention builds for ``causal=True, window_size=(window - 1, 0)`` on packed ``[T, N, D]``
tensors (sparse mode 4 over the compressed causal mask), so the branch computes exactly what that call computes.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..._core.checks import softmax_scale
from ..._core.custom_ops import call, register_dry_run_meta
from ..._core.masks import TOKENS_UNBOUNDED, window_sparse_args
from ..._core.softmax_stats import STAT_LANES, stats_dtype
from ..common import backends
from ..common.problem import FAProblem, build_problem

DEVICE_TYPES = ("cpu", "cuda")


def _problem(query: Tensor, key: Tensor, value: Tensor, cum: list[int], window: int, scale: float) -> FAProblem:
    band = window_sparse_args(True, (window - 1, 0), sparse_mode=0, atten_mask=None, pre_tokens=TOKENS_UNBOUNDED,
                              next_tokens=TOKENS_UNBOUNDED, device=query.device)
    return build_problem(query, key, value, head_num=query.shape[1], layout="TND", scale=scale, seed=0,
                         q_start_idx=0, kv_start_idx=0, actual_seq_qlen=cum, actual_seq_kvlen=cum, **band)


@torch.library.custom_op("attnops::nsa_window_attention", mutates_args=(), device_types=DEVICE_TYPES)
def window_attention_fwd(query: Tensor, key: Tensor, value: Tensor, cum: list[int], window: int,
                         scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(attention_out [T, N1, Dv], softmax_max, softmax_sum [T, N1, 8])`` of the window branch."""
    return backends.forward(_problem(query, key, value, cum, window, scale), query, key, value, "auto")


@window_attention_fwd.register_fake
def _(query, key, value, cum, window, scale):
    stat = (query.shape[0], query.shape[1], STAT_LANES)
    dtype = stats_dtype(query.dtype)
    return (query.new_empty((*query.shape[:2], value.shape[-1])), query.new_empty(stat, dtype=dtype),
            query.new_empty(stat, dtype=dtype))


@torch.library.custom_op("attnops::nsa_window_attention_grad", mutates_args=(), device_types=DEVICE_TYPES)
def window_attention_grad(dy: Tensor, query: Tensor, key: Tensor, value: Tensor, attention_out: Tensor,
                          softmax_max: Tensor, softmax_sum: Tensor, cum: list[int], window: int,
                          scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of the window branch from its forward results."""
    p = _problem(query, key, value, cum, window, scale)
    dq, dk, dv, _ = backends.backward(p, query, key, value, dy, attention_out, softmax_max, softmax_sum, "auto")
    return dq, dk, dv


@window_attention_grad.register_fake
def _(dy, query, key, value, attention_out, softmax_max, softmax_sum, cum, window, scale):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output):
    query, key, value, ctx.cum, ctx.window, ctx.scale = inputs
    ctx.save_for_backward(query, key, value, *output)


def _backward(ctx, grad_out, _grad_max, _grad_sum):
    if grad_out is None:
        return None, None, None, None, None, None
    query, key, value, out, smax, ssum = ctx.saved_tensors
    dq, dk, dv = call(window_attention_grad, grad_out.contiguous(), query, key, value, out, smax, ssum, ctx.cum,
                      ctx.window, ctx.scale)
    return dq, dk, dv, None, None, None


window_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
for _op in (window_attention_fwd, window_attention_grad):
    register_dry_run_meta(_op)


def window_attention(query: Tensor, key: Tensor, value: Tensor, cum: list[int], window: int,
                     scale: float | None) -> Tensor:
    """Causal attention of packed ``query [T, N1, D]`` over ``key``/``value [T, N2, D|Dv]`` within each sequence of
    cumulative lengths ``cum``, each token keeping its last ``window`` keys (itself included); ``scale`` defaults to
    ``1/sqrt(D)``. Returns ``[T, N1, Dv]``."""
    scale = float(softmax_scale(scale, query, query.shape[-1]))
    return call(window_attention_fwd, query, key, value, cum, window, scale)[0]
