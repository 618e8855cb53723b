"""FlashAttention forward/backward as ``torch.library`` custom ops (namespace ``attnops``), with fake kernels and
autograd, so eager mode, ``torch.compile`` and ``torch.library.opcheck`` all work.

The ops take the operator's raw arguments (validated inside by :func:`build_problem`); ``seed`` is always concrete
(the API draws one when the caller gives none). ``dpse`` is returned as an empty tensor when there is no pse
gradient, because custom ops cannot return None. Varlen lengths come as host lists (``actual_seq_qlen/kvlen``) or as
``cu_seqlens_q/k`` tensors with optional ``max_seqlen_q/k`` (the last arguments, flash-attn style): the fake kernels
never depend on their values, so ``torch.compile`` traces a function once for every length set.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..._core.layouts import normalize_layout, parse_geometry, with_head_dim
from ..._core.softmax_stats import STAT_LANES, stats_dtype
from ..._core.custom_ops import register_dry_run_meta
from ..._core.triton import dry_run
from ..._core.varlen import cumulative_from_cu_seqlens
from . import backends
from .api import check_backward_inputs
from .problem import FAProblem, build_problem

_SCALARS = ("head_num", "layout", "scale", "keep_prob", "pre_tokens", "next_tokens", "prefix", "actual_seq_qlen",
            "actual_seq_kvlen", "sparse_mode", "pse_type", "q_start_idx", "kv_start_idx", "softmax_layout", "seed",
            "offset")
_LENGTHS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def _problem(query, key, value, pse, atten_mask, drop_mask, kw: dict, backend: str, backward: bool) -> FAProblem:
    """The call's :class:`FAProblem`; ``cu_seqlens`` tensors become host lists where reading them costs nothing
    (CPU tensors) or the reference runs (it reads every length on the host), else they stay on the device."""
    cu_q, cu_k = kw["cu_seqlens_q"], kw["cu_seqlens_k"]
    given = [t for t in (cu_q, cu_k) if t is not None]
    if given and (all(t.device.type == "cpu" for t in given) or backends.runs_reference(
            query, parse_geometry(query, key, value, kw["head_num"], normalize_layout("input_layout", kw["layout"])),
            backend, backward)):
        kw = dict(kw, cu_seqlens_q=None, cu_seqlens_k=None,
                  actual_seq_qlen=cumulative_from_cu_seqlens("cu_seqlens_q", cu_q),
                  actual_seq_kvlen=cumulative_from_cu_seqlens("cu_seqlens_k", cu_k))
    return build_problem(query, key, value, pse=pse, atten_mask=atten_mask, drop_mask=drop_mask, **kw)


def _direct(tensors) -> bool:
    """Whether a call may run its implementation without the dispatcher (which costs 20-35 us a call): eager mode,
    plain tensors on a device the implementation serves (``meta`` only inside a dry run), and nothing that needs to
    see the op: no compilation or export, no dispatch mode (fake tensors, tracing, the dry run's read guard, FLOP
    counters), no functorch transform, no profiler. Everything else calls the custom op."""
    return (not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and not torch.overrides.has_torch_function(tensors) and not torch._C._are_functorch_transforms_active()
            and not torch.autograd._profiler_enabled()
            and (tensors[0].device.type in ("cpu", "cuda") or dry_run.active() is not None))


def _forward(query: Tensor, key: Tensor, value: Tensor, pse: Optional[Tensor], atten_mask: Optional[Tensor],
             drop_mask: Optional[Tensor], head_num: int, layout: str, scale: float, keep_prob: float, pre_tokens: int,
             next_tokens: int, prefix: Optional[list[int]], actual_seq_qlen: Optional[list[int]],
             actual_seq_kvlen: Optional[list[int]], sparse_mode: int, pse_type: int, q_start_idx: int,
             kv_start_idx: int, softmax_layout: str, seed: int, offset: int, backend: str = "auto",
             cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
             max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Forward: ``(attention_out, softmax_max, softmax_sum)``."""
    kw = dict(zip(_SCALARS + _LENGTHS, (
        head_num, layout, scale, keep_prob, pre_tokens, next_tokens, prefix, actual_seq_qlen, actual_seq_kvlen,
        sparse_mode, pse_type, q_start_idx, kv_start_idx, softmax_layout, seed, offset, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k)))
    p = _problem(query, key, value, pse, atten_mask, drop_mask, kw, backend, backward=False)
    return backends.forward(p, query, key, value, backend)


flash_attention_fwd = torch.library.custom_op("attnops::flash_attention_fwd", _forward, mutates_args=(),
                                              device_types=("cpu", "cuda"))


@flash_attention_fwd.register_fake
def _(query, key, value, pse, atten_mask, drop_mask, head_num, layout, scale, keep_prob, pre_tokens, next_tokens,
      prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, pse_type, q_start_idx, kv_start_idx, softmax_layout,
      seed, offset, backend="auto", cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    layout = normalize_layout("input_layout", layout)
    if layout in ("BSH", "SBH"):
        d = query.shape[-1] // head_num
        dv = value.shape[-1] // (key.shape[-1] // d)
    else:
        dv = value.shape[-1]
    out = query.new_empty(with_head_dim(query.shape, layout, head_num, dv))
    if layout == "TND":
        stat = (query.shape[0], head_num, STAT_LANES)
    else:
        b, s = {"BSH": (0, 1), "SBH": (1, 0), "BSND": (0, 1), "BNSD": (0, 2)}[layout]
        stat = (query.shape[b], head_num, query.shape[s], STAT_LANES)
    dtype = stats_dtype(query.dtype)
    return out, query.new_empty(stat, dtype=dtype), query.new_empty(stat, dtype=dtype)


def _backward_grads(dy: Tensor, query: Tensor, key: Tensor, value: Tensor, attention_in: Tensor,
                    softmax_max: Tensor, softmax_sum: Tensor, pse: Optional[Tensor], atten_mask: Optional[Tensor],
                    drop_mask: Optional[Tensor], head_num: int, layout: str, scale: float, keep_prob: float,
                    pre_tokens: int, next_tokens: int, prefix: Optional[list[int]],
                    actual_seq_qlen: Optional[list[int]], actual_seq_kvlen: Optional[list[int]], sparse_mode: int,
                    pse_type: int, q_start_idx: int, kv_start_idx: int, softmax_layout: str, seed: int, offset: int,
                    backend: str = "auto", cu_seqlens_q: Optional[Tensor] = None,
                    cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
                    max_seqlen_k: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward: ``(dq, dk, dv, dpse)`` with ``dpse`` empty when there is no pse tensor gradient."""
    kw = dict(zip(_SCALARS + _LENGTHS, (
        head_num, layout, scale, keep_prob, pre_tokens, next_tokens, prefix, actual_seq_qlen, actual_seq_kvlen,
        sparse_mode, pse_type, q_start_idx, kv_start_idx, softmax_layout, seed, offset, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k)))
    p = _problem(query, key, value, pse, atten_mask, drop_mask, kw, backend, backward=True)
    attention_in, softmax_max, softmax_sum = check_backward_inputs(p, query, dy, attention_in, softmax_max,
                                                                   softmax_sum)
    dq, dk, dv, dpse = backends.backward(p, query, key, value, dy, attention_in, softmax_max, softmax_sum,
                                        backend)
    return dq, dk, dv, dpse if dpse is not None else torch.empty(0, dtype=query.dtype, device=query.device)


flash_attention_bwd = torch.library.custom_op("attnops::flash_attention_bwd", _backward_grads, mutates_args=(),
                                              device_types=("cpu", "cuda"))


def has_pse_grad(pse: Optional[Tensor], pse_type: int) -> bool:
    """Whether the backward has a pse gradient: a pse tensor of type 0/1 (types 2/3 take ALiBi slopes)."""
    return pse is not None and pse_type in (0, 1)


def pse_grad(dpse: Tensor, pse: Optional[Tensor], pse_type: int) -> Optional[Tensor]:
    """The op's ``dpse`` output as callers see it: None without a pse gradient (the op returns an empty tensor then,
    as custom ops cannot return None; a pse with zero elements has an empty gradient, not None)."""
    return dpse if has_pse_grad(pse, pse_type) else None


@flash_attention_bwd.register_fake
def _(dy, query, key, value, attention_in, softmax_max, softmax_sum, pse, atten_mask, drop_mask, head_num, layout,
      scale, keep_prob, pre_tokens, next_tokens, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, pse_type,
      q_start_idx, kv_start_idx, softmax_layout, seed, offset, backend="auto", cu_seqlens_q=None, cu_seqlens_k=None,
      max_seqlen_q=None, max_seqlen_k=None):
    dpse = torch.empty_like(pse) if has_pse_grad(pse, pse_type) else query.new_empty(0)
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), dpse


_FWD_ARGS = tuple(a.name for a in flash_attention_fwd._opoverload._schema.arguments)
_FWD_DEFAULTS = tuple(a.default_value for a in flash_attention_fwd._opoverload._schema.arguments)
_TENSORS = _FWD_ARGS[:_FWD_ARGS.index("head_num")]  # query, key, value, pse, atten_mask, drop_mask; then _ARGS
_PSE_TYPE = _SCALARS.index("pse_type")


def _setup_context(ctx, inputs, output):
    args = inputs[len(_TENSORS):]  # the scalars, backend, cu_seqlens_q/k, max_seqlen_q/k
    ctx.save_for_backward(*inputs[:len(_TENSORS)], *args[-4:-2], *output)
    ctx.scalars, ctx.max_seqlens = args[:-4], args[-2:]


def _input_grads(ctx, grad_out) -> tuple:
    """``(dq, dk, dv, dpse or None)`` from the gradient of attention_out (like torch_npu's derivatives.yaml: the
    statistics' gradients do not flow back)."""
    if grad_out is None:
        return None, None, None, None
    query, key, value, pse, atten_mask, drop_mask, cu_q, cu_k, out, smax, ssum = ctx.saved_tensors
    bwd = _backward_grads if _direct((query, key, value)) else flash_attention_bwd
    dq, dk, dv, dpse = bwd(grad_out.contiguous(), query, key, value, out, smax, ssum, pse, atten_mask, drop_mask,
                           *ctx.scalars, cu_q, cu_k, *ctx.max_seqlens)
    return dq, dk, dv, pse_grad(dpse, pse, ctx.scalars[_PSE_TYPE])


def _backward(ctx, grad_out, _grad_max, _grad_sum):
    return _input_grads(ctx, grad_out) + (None,) * (len(_FWD_ARGS) - 4)


flash_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _FlashAttention(torch.autograd.Function):
    """:func:`flash_attention_fwd` with the same autograd (``_setup_context``, ``_input_grads``), for eager calls:
    through the op's own autograd PyTorch refills the schema's defaults on every forward that needs a gradient, a
    cost quadratic in the number of arguments (about half a millisecond here); here the forward runs below autograd,
    where that step does not exist. Only the differentiable tensors are ``apply``'s own arguments (each one costs
    some microseconds there); the others travel in one tuple."""

    @staticmethod
    def forward(ctx, query, key, value, pse, rest):
        inputs = (query, key, value, pse, *rest)
        output = (_forward if _direct(inputs[:3]) else flash_attention_fwd)(*inputs)
        _setup_context(ctx, inputs, output)
        ctx.mark_non_differentiable(*output[1:])  # the statistics (no zero gradients made for them)
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    def backward(ctx, grad_out, _grad_max, _grad_sum):
        return *_input_grads(ctx, grad_out), None


def flash_attention(*inputs) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`flash_attention_fwd` (same arguments), differentiable: gradients of query, key, value and pse from the
    gradient of ``attention_out``."""
    if (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs[:4])
            and not torch.compiler.is_compiling()):  # traced: the op and its own autograd go into the graph
        return _FlashAttention.apply(*inputs[:4], (*inputs[4:], *_FWD_DEFAULTS[len(inputs):]))
    return (_forward if _direct(inputs[:3]) else flash_attention_fwd)(*inputs)


for _op in (flash_attention_fwd, flash_attention_bwd):
    register_dry_run_meta(_op)
