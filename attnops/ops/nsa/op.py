"""NSA kernels as ``torch.library`` custom ops (namespace ``attnops``) with fake kernels and autograd.

Derivatives follow op-plugin's ``derivatives.yaml``: compression w.r.t. input and weight; selected attention
w.r.t. q, k, v; compressed attention through the FlashAttention backward (its top-k output is not
differentiable). The decoding (``*_infer``) ops are inference-only: a backward through them raises
:class:`~attnops._core.errors.InferenceOnlyError` naming the training op (:mod:`attnops._core.inference_only`).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ..._core.inference_only import InferenceOnly, register_inference_only
from ..._core.softmax_stats import STAT_LANES, stats_dtype
from ..._core.varlen import lengths_from_cumulative
from ..._core.custom_ops import call, register_dry_run_meta
from ..._core.torch_compat import schema_arguments
from . import backends
from .compress import build_compress_spec, check_output_grad, compress_block_count
from .selected import build_selected_spec
from .validate import check_selected_backward_inputs
from .decode import check_compress_cache, check_compress_selection, check_paged, check_selected_topk

DEVICE_TYPES = ("cpu", "cuda")  # CUDA tensors: the reference on CPU copies (no GPU kernel yet)


@functools.cache
def _schema_names(op) -> tuple[str, ...]:
    """The op's argument names (read once: every schema access builds new argument objects)."""
    return tuple(a.name for a in schema_arguments(op))


def _grads_for(op, **grads):
    """Gradient tuple in the op's argument order (None for non-differentiable arguments)."""
    return tuple(grads.get(name) for name in _schema_names(op))


# ---------------------------------------------------------------- compression
@torch.library.custom_op("attnops::nsa_compress", mutates_args=(), device_types=DEVICE_TYPES)
def nsa_compress(input: Tensor, weight: Tensor, compress_block_size: int, compress_stride: int,
                 actual_seq_len: Optional[list[int]], act_seq_len_type: int) -> Tensor:
    spec = build_compress_spec(input, weight, compress_block_size=compress_block_size,
                               compress_stride=compress_stride, actual_seq_len=actual_seq_len,
                               act_seq_len_type=act_seq_len_type)
    return backends.compress(spec, input, weight)


@nsa_compress.register_fake
def _(input, weight, compress_block_size, compress_stride, actual_seq_len, act_seq_len_type):
    if actual_seq_len is None:
        lengths = [input.shape[0]]
    elif act_seq_len_type == 0:
        lengths = lengths_from_cumulative("actual_seq_len", actual_seq_len)
    else:
        lengths = list(actual_seq_len)
    rows = sum(compress_block_count(n, compress_block_size, compress_stride) for n in lengths)
    return input.new_empty((rows, input.shape[1], input.shape[2]))


@torch.library.custom_op("attnops::nsa_compress_grad", mutates_args=(), device_types=DEVICE_TYPES)
def nsa_compress_grad(output_grad: Tensor, input: Tensor, weight: Tensor, compress_block_size: int,
                      compress_stride: int, actual_seq_len: Optional[list[int]], act_seq_len_type: int
                      ) -> tuple[Tensor, Tensor]:
    spec = build_compress_spec(input, weight, compress_block_size=compress_block_size,
                               compress_stride=compress_stride, actual_seq_len=actual_seq_len,
                               act_seq_len_type=act_seq_len_type)
    check_output_grad(output_grad, spec, input)
    return backends.compress_grad(spec, output_grad, input, weight)


@nsa_compress_grad.register_fake
def _(output_grad, input, weight, compress_block_size, compress_stride, actual_seq_len, act_seq_len_type):
    return torch.empty_like(input), torch.empty_like(weight)


def _compress_setup(ctx, inputs, output):
    args = dict(zip(_schema_names(nsa_compress), inputs))
    ctx.save_for_backward(args["input"], args["weight"])
    ctx.args = (args["compress_block_size"], args["compress_stride"], args["actual_seq_len"],
                args["act_seq_len_type"])


def _compress_backward(ctx, grad):
    input, weight = ctx.saved_tensors
    gi, gw = call(nsa_compress_grad, grad.contiguous(), input, weight, *ctx.args)
    return _grads_for(nsa_compress, input=gi, weight=gw)


nsa_compress.register_autograd(_compress_backward, setup_context=_compress_setup)


# ---------------------------------------------------------------- selected attention
@torch.library.custom_op("attnops::nsa_selected_attention", mutates_args=(), device_types=DEVICE_TYPES)
def nsa_selected_attention(query: Tensor, key: Tensor, value: Tensor, topk_indices: Tensor,
                           atten_mask: Optional[Tensor], scale_value: float, head_num: int, select_block_size: int,
                           select_block_count: int, actual_seq_qlen: Optional[list[int]],
                           actual_seq_kvlen: Optional[list[int]], sparse_mode: int, precision: str = "exact"
                           ) -> tuple[Tensor, Tensor, Tensor]:
    spec = build_selected_spec(query, key, value, topk_indices, scale_value=scale_value, head_num=head_num,
                               select_block_size=select_block_size, select_block_count=select_block_count,
                               atten_mask=atten_mask, actual_seq_qlen=actual_seq_qlen,
                               actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, precision=precision)
    return backends.selected(spec, query, key, value, topk_indices)


@nsa_selected_attention.register_fake
def _(query, key, value, topk_indices, atten_mask, scale_value, head_num, select_block_size, select_block_count,
      actual_seq_qlen, actual_seq_kvlen, sparse_mode, precision="exact"):
    stat = (query.shape[0], query.shape[1], STAT_LANES)
    dt = stats_dtype(query.dtype)
    return (query.new_empty((query.shape[0], query.shape[1], value.shape[2])), query.new_empty(stat, dtype=dt),
            query.new_empty(stat, dtype=dt))


@torch.library.custom_op("attnops::nsa_selected_attention_grad", mutates_args=(), device_types=DEVICE_TYPES)
def nsa_selected_attention_grad(grad: Tensor, query: Tensor, key: Tensor, value: Tensor, attention_out: Tensor,
                                softmax_max: Tensor, softmax_sum: Tensor, topk_indices: Tensor,
                                atten_mask: Optional[Tensor], scale_value: float, head_num: int,
                                select_block_size: int, select_block_count: int,
                                actual_seq_qlen: Optional[list[int]], actual_seq_kvlen: Optional[list[int]],
                                sparse_mode: int, precision: str = "exact") -> tuple[Tensor, Tensor, Tensor]:
    spec = build_selected_spec(query, key, value, topk_indices, scale_value=scale_value, head_num=head_num,
                               select_block_size=select_block_size, select_block_count=select_block_count,
                               atten_mask=atten_mask, actual_seq_qlen=actual_seq_qlen,
                               actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, grad=True,
                               precision=precision)
    check_selected_backward_inputs(spec, query, grad, attention_out, softmax_max, softmax_sum)
    return backends.selected_grad(spec, query, key, value, attention_out, grad, softmax_max, softmax_sum,
                                  topk_indices)


@nsa_selected_attention_grad.register_fake
def _(grad, query, key, value, attention_out, softmax_max, softmax_sum, topk_indices, atten_mask, scale_value,
      head_num, select_block_size, select_block_count, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
      precision="exact"):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


_SEL_SCALARS = ("scale_value", "head_num", "select_block_size", "select_block_count", "actual_seq_qlen",
                "actual_seq_kvlen", "sparse_mode", "precision")


def _selected_setup(ctx, inputs, output):
    args = dict(zip(_schema_names(nsa_selected_attention), inputs))
    out, smax, ssum = output
    ctx.save_for_backward(args["query"], args["key"], args["value"], args["topk_indices"], args["atten_mask"], out,
                          smax, ssum)
    ctx.scalars = tuple(args.get(n, "exact") for n in _SEL_SCALARS)  # precision: its default when not given


def _selected_backward(ctx, grad_out, _gmax, _gsum):
    query, key, value, topk, mask, out, smax, ssum = ctx.saved_tensors
    dq, dk, dv = call(nsa_selected_attention_grad, grad_out.contiguous(), query, key, value, out, smax, ssum, topk,
                      mask, *ctx.scalars)
    return _grads_for(nsa_selected_attention, query=dq, key=dk, value=dv)


nsa_selected_attention.register_autograd(_selected_backward, setup_context=_selected_setup)


# ---------------------------------------------------------------- decoding over a paged cache
@torch.library.custom_op("attnops::nsa_selected_attention_infer", mutates_args=(), device_types=DEVICE_TYPES)
def nsa_selected_attention_infer(query: Tensor, key: Tensor, value: Tensor, topk_indices: Tensor,
                                 block_table: Tensor, scale_value: float, head_num: int, key_value_head_num: int,
                                 select_block_size: int, select_block_count: int, page_block_size: int,
                                 actual_seq_kvlen: Optional[list[int]],
                                 actual_seq_kvlen_tensor: Optional[Tensor] = None, precision: str = "exact") -> Tensor:
    kv = check_paged(query, key, value, block_table, scale_value=scale_value, head_num=head_num,
                     key_value_head_num=key_value_head_num, page_block_size=page_block_size,
                     seq_lens=actual_seq_kvlen, lens_name="actual_seq_kvlen", lens_tensor=actual_seq_kvlen_tensor,
                     precision=precision)
    block = check_selected_topk(kv, topk_indices, select_block_size=select_block_size,
                                select_block_count=select_block_count)
    return backends.selected_infer(kv, block, query, key, value, topk_indices, block_table, actual_seq_kvlen_tensor)


@nsa_selected_attention_infer.register_fake
def _(query, key, value, topk_indices, block_table, scale_value, head_num, key_value_head_num, select_block_size,
      select_block_count, page_block_size, actual_seq_kvlen, actual_seq_kvlen_tensor=None, precision="exact"):
    return query.new_empty((query.shape[0], query.shape[1], value.shape[-1]))


register_inference_only(nsa_selected_attention_infer, InferenceOnly(
    "nsa_selected_attention_infer", "npu_nsa_select_attention_infer", "attnops.nsa_selected_attention",
    "npu_nsa_select_attention"))


@torch.library.custom_op("attnops::nsa_compress_attention_infer", mutates_args=(), device_types=DEVICE_TYPES)
def nsa_compress_attention_infer(query: Tensor, key: Tensor, value: Tensor, block_table: Tensor, scale_value: float,
                                 head_num: int, key_value_head_num: int, select_block_size: int,
                                 select_block_count: int, page_block_size: int, compress_block_size: int,
                                 compress_stride: int, actual_cmp_seq_kvlen: Optional[list[int]],
                                 actual_cmp_seq_kvlen_tensor: Optional[Tensor] = None, precision: str = "exact"
                                 ) -> tuple[Tensor, Tensor]:
    kv = check_paged(query, key, value, block_table, scale_value=scale_value, head_num=head_num,
                     key_value_head_num=key_value_head_num, page_block_size=page_block_size,
                     seq_lens=actual_cmp_seq_kvlen, lens_name="actual_cmp_seq_kvlen",
                     lens_tensor=actual_cmp_seq_kvlen_tensor, precision=precision)
    sel = check_compress_selection(kv, compress_block_size=compress_block_size, compress_stride=compress_stride,
                                   select_block_size=select_block_size, select_block_count=select_block_count)
    return backends.compress_attention_infer(kv, sel, query, key, value, block_table, actual_cmp_seq_kvlen_tensor)


@nsa_compress_attention_infer.register_fake
def _(query, key, value, block_table, scale_value, head_num, key_value_head_num, select_block_size,
      select_block_count, page_block_size, compress_block_size, compress_stride, actual_cmp_seq_kvlen,
      actual_cmp_seq_kvlen_tensor=None, precision="exact"):
    return (query.new_empty((query.shape[0], query.shape[1], value.shape[-1])),
            query.new_empty((query.shape[0], key_value_head_num, select_block_count), dtype=torch.int32))


register_inference_only(nsa_compress_attention_infer, InferenceOnly(
    "nsa_compress_attention_infer", "npu_nsa_compress_attention_infer", "attnops.nsa_compress_attention",
    "npu_nsa_compress_attention"))


@torch.library.custom_op("attnops::nsa_compress_infer", mutates_args=("cache",), device_types=DEVICE_TYPES)
def nsa_compress_infer(input: Tensor, weight: Tensor, slot_mapping: Tensor, block_table: Tensor, cache: Tensor,
                       compress_block_size: int, compress_stride: int, page_block_size: int,
                       actual_seq_len: Optional[list[int]], actual_seq_len_tensor: Optional[Tensor] = None) -> None:
    lens, block, stride = check_compress_cache(input, weight, slot_mapping, block_table, cache,
                                               compress_block_size=compress_block_size,
                                               compress_stride=compress_stride, page_block_size=page_block_size,
                                               actual_seq_len=actual_seq_len, lens_tensor=actual_seq_len_tensor)
    backends.compress_infer(input, weight, slot_mapping, block_table, cache, lens, block, stride,
                            actual_seq_len_tensor)


@nsa_compress_infer.register_fake
def _(input, weight, slot_mapping, block_table, cache, compress_block_size, compress_stride, page_block_size,
      actual_seq_len, actual_seq_len_tensor=None):
    return None


# torch.library takes no autograd formula for an op that mutates an input: callers run it through
# run_inference_only(COMPRESS_INFER, ..., dirty=cache)
COMPRESS_INFER = InferenceOnly("nsa_compress_infer", "npu_nsa_compress_infer", "attnops.nsa_compress",
                               "npu_nsa_compress")


# ---------------------------------------------------------------- compressed attention
@torch.library.custom_op("attnops::nsa_compress_attention", mutates_args=(), device_types=DEVICE_TYPES)
def nsa_compress_attention(query: Tensor, key: Tensor, value: Tensor, topk_mask: Optional[Tensor],
                           atten_mask: Optional[Tensor], scale_value: float, head_num: int, compress_block_size: int,
                           compress_stride: int, select_block_size: int, select_block_count: int,
                           actual_seq_qlen: Optional[list[int]], actual_cmp_seq_kvlen: Optional[list[int]],
                           actual_sel_seq_kvlen: Optional[list[int]], sparse_mode: int, causal: bool = False,
                           local_blocks: int = -1, position_offset: int = 0, precision: str = "exact"
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return backends.compress_attention(
        query, key, value, topk_mask, atten_mask, scale_value=scale_value, head_num=head_num,
        compress_block_size=compress_block_size, compress_stride=compress_stride, select_block_size=select_block_size,
        select_block_count=select_block_count, actual_seq_qlen=actual_seq_qlen,
        actual_cmp_seq_kvlen=actual_cmp_seq_kvlen, actual_sel_seq_kvlen=actual_sel_seq_kvlen,
        sparse_mode=sparse_mode, causal=causal, local_blocks=local_blocks, position_offset=position_offset,
        precision=precision)


@nsa_compress_attention.register_fake
def _(query, key, value, topk_mask, atten_mask, scale_value, head_num, compress_block_size, compress_stride,
      select_block_size, select_block_count, actual_seq_qlen, actual_cmp_seq_kvlen, actual_sel_seq_kvlen,
      sparse_mode, causal=False, local_blocks=-1, position_offset=0, precision="exact"):
    t, n1 = query.shape[0], query.shape[1]
    dt = stats_dtype(query.dtype)
    return (query.new_empty((t, n1, value.shape[2])),
            query.new_empty((t, key.shape[1], select_block_count), dtype=torch.int32),
            query.new_empty((t, n1, STAT_LANES), dtype=dt), query.new_empty((t, n1, STAT_LANES), dtype=dt))


@torch.library.custom_op("attnops::nsa_compress_attention_grad", mutates_args=(), device_types=DEVICE_TYPES)
def nsa_compress_attention_grad(grad: Tensor, query: Tensor, key: Tensor, value: Tensor, attention_out: Tensor,
                                softmax_max: Tensor, softmax_sum: Tensor, atten_mask: Optional[Tensor],
                                scale_value: float, head_num: int, compress_block_size: int, compress_stride: int,
                                actual_seq_qlen: Optional[list[int]], actual_cmp_seq_kvlen: Optional[list[int]],
                                sparse_mode: int, causal: bool = False, position_offset: int = 0,
                                precision: str = "exact") -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of compressed attention: the FlashAttention backward of its problem (causal rule included)."""
    return backends.compress_attention_backward(
        grad, query, key, value, attention_out, softmax_max, softmax_sum, atten_mask, scale_value=scale_value,
        head_num=head_num, compress_block_size=compress_block_size, compress_stride=compress_stride,
        actual_seq_qlen=actual_seq_qlen, actual_cmp_seq_kvlen=actual_cmp_seq_kvlen, sparse_mode=sparse_mode,
        causal=causal, position_offset=position_offset, precision=precision)


@nsa_compress_attention_grad.register_fake
def _(grad, query, key, value, *_args, **_kwargs):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


_CMP_GRAD_SCALARS = ("scale_value", "head_num", "compress_block_size", "compress_stride", "actual_seq_qlen",
                     "actual_cmp_seq_kvlen", "sparse_mode", "causal", "position_offset", "precision")
_CMP_DEFAULTS = {"causal": False, "position_offset": 0, "precision": "exact"}


def _cmp_setup(ctx, inputs, output):
    args = dict(zip(_schema_names(nsa_compress_attention), inputs))
    out, _, smax, ssum = output
    ctx.save_for_backward(args["query"], args["key"], args["value"], args.get("atten_mask"), out, smax, ssum)
    ctx.scalars = tuple(args.get(name, _CMP_DEFAULTS.get(name)) for name in _CMP_GRAD_SCALARS)


def _cmp_backward(ctx, grad_out, _gtopk, _gmax, _gsum):
    query, key, value, mask, out, smax, ssum = ctx.saved_tensors
    dq, dk, dv = call(nsa_compress_attention_grad, grad_out.contiguous(), query, key, value, out, smax, ssum, mask,
                      *ctx.scalars)
    return _grads_for(nsa_compress_attention, query=dq, key=dk, value=dv)


nsa_compress_attention.register_autograd(_cmp_backward, setup_context=_cmp_setup)

for _op in (nsa_compress, nsa_compress_grad, nsa_selected_attention, nsa_selected_attention_grad,
            nsa_selected_attention_infer, nsa_compress_attention_infer, nsa_compress_infer, nsa_compress_attention,
            nsa_compress_attention_grad):
    register_dry_run_meta(_op)
