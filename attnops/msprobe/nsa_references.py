"""G and E of the torch_npu NSA operators: each re-run on the ``attnops::nsa_*`` operator its torch_npu function
calls (the same mode constants and argument translation), with the reference's dtype and ``precision``; a
``.backward`` entry by autograd from the dumped gradient of ``attention_out``."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._core.checks import int_list
from ..ops.nsa import op as nsa_op
from ..ops.nsa.decode import lengths_arg
from ..torch_npu.nsa import COMPRESS_ATTENTION_MODE, CUMULATIVE, SELECTED_ATTENTION_MODE, decode_operands
from ._reference import Reference, unsupported_if
from .rebuild import Call, Unsupported

__all__ = ["FAMILIES", "NOT_EMULATED"]

_ATTENTION_GRADS = ("dq", "dk", "dv")
NOT_EMULATED = {api: "E is attnops' exact result (fp32 accumulation, one cast): NSA compression is a weighted sum "
                     "whose NPU rounding is not emulated" for api in ("npu_nsa_compress", "npu_nsa_compress_grad")}


def _tensors(call: Call, ref: Reference, *names: str, grad: bool = False) -> list[Tensor]:
    """The named arguments in the reference's dtype; differentiable leaves for a ``.backward`` with ``grad``."""
    out = [ref.cast(call.arguments[n]) for n in names]
    return [t.detach().requires_grad_() for t in out] if grad else out


def _backward_of(call: Call, ref: Reference, result: Tensor, leaves: list[Tensor]) -> list[Tensor]:
    """Gradients of ``leaves`` from the dumped gradient of ``result`` (the backward's ``input.0``)."""
    dy = call.grads[0] if call.grads else None
    if not isinstance(dy, Tensor):
        raise Unsupported("the backward's input.0 (the gradient of the first output) is not a tensor")
    return list(torch.autograd.grad(result, leaves, ref.cast(dy)))


def _lens(call: Call, *names: str) -> list[list[int] | None]:
    return [int_list(n, call.arguments[n]) for n in names]


def _compress(call: Call, ref: Reference) -> list[Tensor]:
    """``npu_nsa_compress`` (forward, and ``.backward``: ``(input_grad, weight_grad)``)."""
    a = call.arguments
    backward = call.direction == "backward"
    x, w = _tensors(call, ref, "input", "weight", grad=backward)
    out = nsa_op.nsa_compress(x, w, a["compress_block_size"], a["compress_stride"], *_lens(call, "actual_seq_len"),
                              CUMULATIVE)
    return _backward_of(call, ref, out, [x, w]) if backward else [out]


def _compress_grad(call: Call, ref: Reference) -> list[Tensor]:
    a = call.arguments
    return list(nsa_op.nsa_compress_grad(*_tensors(call, ref, "grad", "input", "weight"), a["compress_block_size"],
                                         a["compress_stride"], *_lens(call, "actual_seq_len"), CUMULATIVE))


def _compress_attention(call: Call, ref: Reference) -> list[Tensor]:
    """``npu_nsa_compress_attention``: ``(out, topk_indices, softmax_max, softmax_sum)``; ``.backward``: dq, dk,
    dv (the top-k output is not differentiable)."""
    a = call.arguments
    backward = call.direction == "backward"
    q, k, v = _tensors(call, ref, "query", "key", "value", grad=backward)
    result = nsa_op.nsa_compress_attention(
        q, k, v, a["topk_mask"], a["atten_mask"], float(a["scale_value"]), a["head_num"], a["compress_block_size"],
        a["compress_stride"], a["select_block_size"], a["select_block_count"],
        *_lens(call, "actual_seq_qlen", "actual_cmp_seq_kvlen", "actual_sel_seq_kvlen"), COMPRESS_ATTENTION_MODE,
        precision=ref.precision)
    return _backward_of(call, ref, result[0], [q, k, v]) if backward else list(result)


def _select(call: Call, ref: Reference) -> list[Tensor]:
    """``npu_nsa_select_attention``: ``(out, softmax_max, softmax_sum)``; ``.backward``: dq, dk, dv."""
    a = call.arguments
    backward = call.direction == "backward"
    q, k, v = _tensors(call, ref, "query", "key", "value", grad=backward)
    result = nsa_op.nsa_selected_attention(
        q, k, v, a["topk_indices"], a["atten_mask"], float(a["scale_value"]), a["head_num"], a["select_block_size"],
        a["select_block_count"], *_lens(call, "actual_seq_qlen", "actual_seq_kvlen"), SELECTED_ATTENTION_MODE,
        precision=ref.precision)
    return _backward_of(call, ref, result[0], [q, k, v]) if backward else list(result)


def _select_grad(call: Call, ref: Reference) -> list[Tensor]:
    a = call.arguments
    return list(nsa_op.nsa_selected_attention_grad(
        *_tensors(call, ref, "grad", "query", "key", "value", "attention_out", "softmax_max", "softmax_sum"),
        a["topk_indices"], a["atten_mask"], float(a["scale_value"]), a["head_num"], a["select_block_size"],
        a["select_block_count"], *_lens(call, "actual_seq_qlen", "actual_seq_kvlen"), SELECTED_ATTENTION_MODE,
        precision=ref.precision))


def _paged(call: Call, ref: Reference, allowed: tuple[str, ...]) -> tuple[Tensor, Tensor, Tensor]:
    a = call.arguments
    q, k, v = _tensors(call, ref, "query", "key", "value")
    q, k, v, _ = decode_operands(q, k, v, layout=a["layout"], allowed=allowed, head_num=a["head_num"],
                                 key_value_head_num=a["key_value_head_num"], block_table=a["block_table"])
    return q, k, v


def _select_infer(call: Call, ref: Reference) -> list[Tensor]:
    """``npu_nsa_select_attention_infer``: ``attention_out`` shaped like the query (BSH, BSND or TND)."""
    a = call.arguments
    unsupported_if(atten_mask=a["atten_mask"], actual_seq_qlen=a["actual_seq_qlen"])
    q, k, v = _paged(call, ref, ("BSH", "BSND", "TND"))
    out = nsa_op.nsa_selected_attention_infer(
        q, k, v, a["topk_indices"], a["block_table"], float(a["scale_value"]), a["head_num"],
        a["key_value_head_num"], a["select_block_size"], a["select_block_count"], a["page_block_size"],
        *lengths_arg("actual_seq_kvlen", a["actual_seq_kvlen"]), precision=ref.precision)
    return [out.reshape(*a["query"].shape[:-1], -1)]


def _compress_attention_infer(call: Call, ref: Reference) -> list[Tensor]:
    """``npu_nsa_compress_attention_infer``: ``(attention_out, topk_indices)`` in the query's layout."""
    a = call.arguments
    unsupported_if(atten_mask=a["atten_mask"], topk_mask=a["topk_mask"], actual_seq_qlen=a["actual_seq_qlen"],
                   actual_sel_seq_kvlen=a["actual_sel_seq_kvlen"])
    q, k, v = _paged(call, ref, ("BSND", "TND"))
    out, topk = nsa_op.nsa_compress_attention_infer(
        q, k, v, a["block_table"], float(a["scale_value"]), a["head_num"], a["key_value_head_num"],
        a["select_block_size"], a["select_block_count"], a["page_block_size"], a["compress_block_size"],
        a["compress_stride"], *lengths_arg("actual_cmp_seq_kvlen", a["actual_cmp_seq_kvlen"]),
        precision=ref.precision)
    lead = a["query"].shape[:-2]
    return [out.reshape(*lead, *out.shape[-2:]), topk.reshape(*lead, *topk.shape[-2:])]


_STATS = ("softmax_max", "softmax_sum")
FAMILIES: dict[str, tuple[Any, dict[str, tuple[str, ...]]]] = {
    "npu_nsa_compress": (_compress, {"forward": ("output",), "backward": ("input_grad", "weight_grad")}),
    "npu_nsa_compress_grad": (_compress_grad, {"forward": ("input_grad", "weight_grad")}),
    "npu_nsa_compress_attention": (_compress_attention, {"forward": ("attention_out", "topk_indices", *_STATS),
                                                         "backward": _ATTENTION_GRADS}),
    "npu_nsa_select_attention": (_select, {"forward": ("attention_out", *_STATS), "backward": _ATTENTION_GRADS}),
    "npu_nsa_select_attention_grad": (_select_grad, {"forward": _ATTENTION_GRADS}),
    "npu_nsa_select_attention_infer": (_select_infer, {"forward": ("attention_out",)}),
    "npu_nsa_compress_attention_infer": (_compress_attention_infer, {"forward": ("attention_out", "topk_indices")}),
}
