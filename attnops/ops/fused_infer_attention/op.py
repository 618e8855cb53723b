"""FusedInferAttentionScore forward as a ``torch.library`` custom op (namespace ``attnops``) with a fake kernel, so
``torch.compile`` and ``torch.library.opcheck`` work. Inference only: a backward through it raises
:class:`~attnops._core.errors.InferenceOnlyError` (:mod:`attnops._core.inference_only`).

The op takes the aclnn parameters with single ``key``/``value`` tensors (dense or a paged cache; the torch_npu
dialect never passes tensor lists) and always returns ``(attention_out, softmax_lse)``; callers that did not ask
for the lse drop it. Lengths given as tensors go in ``actual_seq_lengths_tensor``/``actual_seq_lengths_kv_tensor``
(appended, instead of the ``int[]`` lists): their values are never traced, so ``torch.compile`` keeps one graph
for all lengths, and on CUDA the decode kernels read the KV lengths on the device.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..._core.inference_only import InferenceOnly, register_inference_only
from ..._core.layouts import io_layouts
from ..._core.custom_ops import register_dry_run_meta
from ..._core.torch_compat import schema_arguments
from . import backends
from .inputs import LAYOUTS, output_head_dim

DEVICE_TYPES = ("cpu", "cuda")  # CUDA: the Triton decode kernels when they serve the call, else the reference
INFERENCE_ONLY = InferenceOnly("fused_infer_attention", "npu_fused_infer_attention_score(_v2), "
                               "npu_prompt_flash_attention, npu_incre_flash_attention", "attnops.flash_attention",
                               "npu_fusion_attention")


@torch.library.custom_op("attnops::fused_infer_attention", mutates_args=(), device_types=DEVICE_TYPES)
def fused_infer_attention(query: Tensor, key: Tensor, value: Tensor, pse_shift: Optional[Tensor],
                          atten_mask: Optional[Tensor], actual_seq_lengths: Optional[list[int]],
                          actual_seq_lengths_kv: Optional[list[int]], deq_scale1: Optional[Tensor],
                          quant_scale1: Optional[Tensor], deq_scale2: Optional[Tensor],
                          quant_scale2: Optional[Tensor], quant_offset2: Optional[Tensor],
                          antiquant_scale: Optional[Tensor], antiquant_offset: Optional[Tensor],
                          key_antiquant_scale: Optional[Tensor], key_antiquant_offset: Optional[Tensor],
                          value_antiquant_scale: Optional[Tensor], value_antiquant_offset: Optional[Tensor],
                          block_table: Optional[Tensor], query_padding_size: Optional[Tensor],
                          kv_padding_size: Optional[Tensor], key_shared_prefix: Optional[Tensor],
                          value_shared_prefix: Optional[Tensor], actual_shared_prefix_len: Optional[list[int]],
                          num_heads: int, scale: float, pre_tokens: int, next_tokens: int, input_layout: str,
                          num_key_value_heads: int, sparse_mode: int, inner_precise: int, block_size: int,
                          antiquant_mode: int, key_antiquant_mode: int, value_antiquant_mode: int,
                          actual_seq_lengths_tensor: Optional[Tensor] = None,
                          actual_seq_lengths_kv_tensor: Optional[Tensor] = None,
                          precision: str = "exact") -> tuple[Tensor, Tensor]:
    """``(attention_out, softmax_lse)``: the output in the output layout and the fp32 lse ``[B, N, Q_S, 1]`` /
    ``[T, N, 1]``. A ``*_tensor`` length replaces its list."""
    options = locals()
    for name in ("actual_seq_lengths", "actual_seq_lengths_kv"):
        given = options.pop(f"{name}_tensor")
        if given is not None:
            options[name] = given
    return backends.forward(options.pop("query"), options.pop("key"), options.pop("value"), options)


ARGUMENT_NAMES = tuple(a.name for a in schema_arguments(fused_infer_attention))[3:]  # after q, k, v


@fused_infer_attention.register_fake
def _(query, key, value, pse_shift, atten_mask, actual_seq_lengths, actual_seq_lengths_kv, deq_scale1, quant_scale1,
      deq_scale2, quant_scale2, quant_offset2, antiquant_scale, antiquant_offset, key_antiquant_scale,
      key_antiquant_offset, value_antiquant_scale, value_antiquant_offset, block_table, query_padding_size,
      kv_padding_size, key_shared_prefix, value_shared_prefix, actual_shared_prefix_len, num_heads, scale,
      pre_tokens, next_tokens, input_layout, num_key_value_heads, sparse_mode, inner_precise, block_size,
      antiquant_mode, key_antiquant_mode, value_antiquant_mode, actual_seq_lengths_tensor=None,
      actual_seq_lengths_kv_tensor=None, precision="exact"):
    in_layout, out_layout = io_layouts("input_layout", input_layout, LAYOUTS)
    dv = output_head_dim(value, in_layout, block_table is not None, num_key_value_heads or num_heads)
    shape = (*query.shape[:-1], num_heads * dv if in_layout == "BSH" else dv)
    if out_layout != in_layout:  # BNSD in, BSND out
        shape = (shape[0], shape[2], shape[1], shape[3])
    if quant_scale2 is not None:
        dtype = torch.int8
    elif query.dtype == torch.int8:
        dtype = torch.float16
    else:
        dtype = query.dtype
    if in_layout == "TND":
        lse = (shape[0], num_heads, 1)
    else:
        b, s = (0, 2) if in_layout == "BNSD" else (0, 1)
        lse = (query.shape[b], num_heads, query.shape[s], 1)
    return query.new_empty(shape, dtype=dtype), query.new_empty(lse, dtype=torch.float32)


register_inference_only(fused_infer_attention, INFERENCE_ONLY)

for _op in (fused_infer_attention,):
    register_dry_run_meta(_op)
