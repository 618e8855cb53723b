"""FlashAttention forward/backward as ``torch.library`` custom ops (namespace ``attnops``), with fake kernels and
autograd, so eager mode, ``torch.compile`` and ``torch.library.opcheck`` all work.

The ops take the operator's raw arguments (validated inside by :func:`build_problem`); ``seed`` is always concrete
(the API draws one when the caller gives none). ``dpse`` is returned as an empty tensor when there is no pse
gradient, because custom ops cannot return None. Varlen lengths come as host lists (``actual_seq_qlen/kvlen``) or as
``cu_seqlens_q/k`` tensors with optional ``max_seqlen_q/k`` (the last arguments, flash-attn style): the fake kernels
never depend on their values, so ``torch.compile`` traces a function once for every length set.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from ..._core import context_parallel
from ..._core.layouts import normalize_layout, parse_geometry, with_head_dim
from ..._core.softmax_stats import STAT_LANES, stats_dtype
from ..common.npu_rounding import npu_rounding
from ..._core.custom_ops import register_dry_run_meta, runs_directly
from ..._core.torch_compat import schema_arguments
from ..._core.varlen import cumulative_pair_from_cu_seqlens
from ..common import backends
from ..common.problem import FAProblem, build_problem
from .validate import check_backward_inputs

_SCALARS = ("head_num", "layout", "scale", "keep_prob", "pre_tokens", "next_tokens", "prefix", "actual_seq_qlen",
            "actual_seq_kvlen", "sparse_mode", "pse_type", "q_start_idx", "kv_start_idx", "softmax_layout", "seed",
            "offset")


def _problem(inputs: tuple, backward: bool) -> FAProblem:
    """The :class:`FAProblem` of the forward op's arguments ``inputs`` (in schema order; the backward's too, less
    its own tensors). ``cu_seqlens`` tensors become host lists where reading them costs nothing (CPU tensors) or
    the reference runs (it reads every length on the host), else they stay on the device."""
    query, key, value, pse, atten_mask, drop_mask = inputs[:_N_TENSORS]
    kw = dict(zip(_SCHEMA[_N_TENSORS:], inputs[_N_TENSORS:]))
    backend = kw.pop("backend", "auto")
    rounding = npu_rounding(kw.pop("precision", "exact"), query.dtype)
    cu_q, cu_k = kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k")
    given = [t for t in (cu_q, cu_k) if t is not None]
    if given and (all(t.device.type == "cpu" for t in given) or backends.runs_reference(
            query, parse_geometry(query, key, value, kw["head_num"], normalize_layout("input_layout", kw["layout"])),
            backend, backward)):
        qlen, kvlen = cumulative_pair_from_cu_seqlens(cu_q, cu_k, query.shape[0], key.shape[0])
        kw.update(cu_seqlens_q=None, cu_seqlens_k=None, actual_seq_qlen=qlen, actual_seq_kvlen=kvlen)
    p = build_problem(query, key, value, pse=pse, atten_mask=atten_mask, drop_mask=drop_mask, **kw)
    return p if rounding is None else dataclasses.replace(p, rounding=rounding)


def _run_forward(inputs: tuple) -> tuple[tuple[Tensor, Tensor, Tensor], FAProblem]:
    """The forward of the op's arguments ``inputs``, and its problem."""
    p = _problem(inputs, backward=False)
    return backends.forward(p, *inputs[:3], inputs[_BACKEND] if len(inputs) > _BACKEND else "auto"), p


def _run_backward(p: FAProblem, backend: str, dy, query, key, value, attention_in, softmax_max, softmax_sum,
                  checked: bool = False):
    """``(dq, dk, dv, dpse)`` of problem ``p`` (``dpse`` empty without a pse gradient); ``checked``: the forward
    results are the forward's own and ``dy`` comes from autograd (its shape and dtype are the output's)."""
    if not checked:
        attention_in, softmax_max, softmax_sum = check_backward_inputs(p, query, dy, attention_in, softmax_max,
                                                                       softmax_sum)
    dq, dk, dv, dpse = backends.backward(p, query, key, value, dy, attention_in, softmax_max, softmax_sum,
                                        backend)
    return dq, dk, dv, dpse if dpse is not None else torch.empty(0, dtype=query.dtype, device=query.device)


def _forward(query: Tensor, key: Tensor, value: Tensor, pse: Optional[Tensor], atten_mask: Optional[Tensor],
             drop_mask: Optional[Tensor], head_num: int, layout: str, scale: float, keep_prob: float, pre_tokens: int,
             next_tokens: int, prefix: Optional[list[int]], actual_seq_qlen: Optional[list[int]],
             actual_seq_kvlen: Optional[list[int]], sparse_mode: int, pse_type: int, q_start_idx: int,
             kv_start_idx: int, softmax_layout: str, seed: int, offset: int, backend: str = "auto",
             cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
             max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
             precision: str = "exact", softcap: float = 0.0,
             pse_bottom_right: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Forward: ``(attention_out, softmax_max, softmax_sum)``."""
    return _run_forward(tuple(locals().values()))[0]  # the arguments, in schema order


flash_attention_fwd = torch.library.custom_op("attnops::flash_attention_fwd", _forward, mutates_args=(),
                                              device_types=("cpu", "cuda"))


@flash_attention_fwd.register_fake
def _(query, key, value, pse, atten_mask, drop_mask, head_num, layout, scale, keep_prob, pre_tokens, next_tokens,
      prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, pse_type, q_start_idx, kv_start_idx, softmax_layout,
      seed, offset, backend="auto", cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
      precision="exact", softcap=0.0, pse_bottom_right=False):
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
                    max_seqlen_k: Optional[int] = None, precision: str = "exact", softcap: float = 0.0,
                    pse_bottom_right: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward: ``(dq, dk, dv, dpse)`` with ``dpse`` empty when there is no pse tensor gradient."""
    inputs = tuple(locals().values())  # the arguments, in schema order
    forward_inputs = (*inputs[1:4], *inputs[7:])  # query, key, value, then pse onwards
    return _run_backward(_problem(forward_inputs, backward=True), backend, *inputs[:7])


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
      max_seqlen_q=None, max_seqlen_k=None, precision="exact", softcap=0.0, pse_bottom_right=False):
    dpse = torch.empty_like(pse) if has_pse_grad(pse, pse_type) else query.new_empty(0)
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), dpse




_SCHEMA = tuple(a.name for a in schema_arguments(flash_attention_fwd))  # the forward's arguments
_DEFAULTS = tuple(a.default_value for a in schema_arguments(flash_attention_fwd))
_N_TENSORS = _SCHEMA.index("head_num")  # query, key, value, pse, atten_mask, drop_mask come first
_BACKEND, _PSE_TYPE = _SCHEMA.index("backend"), _SCHEMA.index("pse_type")
_SAVED = (*range(_N_TENSORS), _SCHEMA.index("cu_seqlens_q"), _SCHEMA.index("cu_seqlens_k"))  # tensor arguments


def _setup_context(ctx, inputs, output):
    inputs = (*inputs, *_DEFAULTS[len(inputs):])
    ctx.save_for_backward(*(inputs[i] for i in _SAVED), *output)
    ctx.inputs = tuple(None if i in _SAVED else x for i, x in enumerate(inputs))  # the tensors: saved above
    ctx.problem = None  # the forward's problem, when the backward can run it directly


def _input_grads(ctx, grad_out) -> tuple:
    """``(dq, dk, dv, dpse or None)`` from the gradient of attention_out (like torch_npu's derivatives.yaml: the
    statistics' gradients do not flow back), through the forward's problem when it has one."""
    if grad_out is None:
        return None, None, None, None
    *tensors, out, smax, ssum = ctx.saved_tensors
    inputs = list(ctx.inputs)
    for i, t in zip(_SAVED, tensors):
        inputs[i] = t
    query, key, value, pse = inputs[:4]
    grads = (grad_out.contiguous(), query, key, value, out, smax, ssum)
    if ctx.problem is not None and runs_directly((query, key, value)):
        dq, dk, dv, dpse = _run_backward(ctx.problem, inputs[_BACKEND], *grads, checked=True)
    else:
        bwd = _backward_grads if runs_directly((query, key, value)) else flash_attention_bwd
        dq, dk, dv, dpse = bwd(*grads, *inputs[3:])
    return dq, dk, dv, pse_grad(dpse, pse, inputs[_PSE_TYPE])


def _backward(ctx, grad_out, _grad_max, _grad_sum):
    return _input_grads(ctx, grad_out) + (None,) * (len(_SCHEMA) - 4)


flash_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _FlashAttention(torch.autograd.Function):
    """:func:`flash_attention_fwd` with the same autograd (``_setup_context``, ``_input_grads``), for eager calls:
    through the op's own autograd PyTorch refills the schema's defaults on every forward that needs a gradient, a
    cost quadratic in the number of arguments (about half a millisecond here); here the forward runs below autograd,
    where that step does not exist, and the backward reuses the forward's validated problem. Only the differentiable
    tensors are ``apply``'s own arguments (each one costs some microseconds there); the others travel in one
    tuple."""

    @staticmethod
    def forward(ctx, query, key, value, pse, rest):
        inputs = (query, key, value, pse, *rest)
        if runs_directly(inputs[:3]):
            output, p = _run_forward(inputs)
        else:
            output, p = flash_attention_fwd(*inputs), None
        _setup_context(ctx, inputs, output)
        ctx.problem = p
        ctx.mark_non_differentiable(*output[1:])  # the statistics (no zero gradients made for them)
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    def backward(ctx, grad_out, _grad_max, _grad_sum):
        return *_input_grads(ctx, grad_out), None


def flash_attention(*inputs) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`flash_attention_fwd` (same arguments), differentiable: gradients of query, key, value and pse from the
    gradient of ``attention_out``."""
    runner = context_parallel.active_runner()
    if runner is not None:  # inside torch's context_parallel(): ring attention over its mesh
        return runner.forward(inputs)
    if (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs[:4])
            and not torch.compiler.is_compiling()):  # traced: the op and its own autograd go into the graph
        return _FlashAttention.apply(*inputs[:4], inputs[4:])
    return _run_forward(inputs)[0] if runs_directly(inputs[:3]) else flash_attention_fwd(*inputs)


def flash_attention_backward(*inputs) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """:func:`flash_attention_bwd` (same arguments); inside torch's context_parallel() the ring backward over its
    mesh."""
    runner = context_parallel.active_runner()
    return runner.backward(inputs) if runner is not None else flash_attention_bwd(*inputs)


for _op in (flash_attention_fwd, flash_attention_bwd):
    register_dry_run_meta(_op)
