"""torch_npu's NSA training ops (TND only): compression, compressed attention and selected attention.

The NPU hardcodes the layout ``TND``, cumulative ``actual_*`` lists (no leading 0), ``sparse_mode`` 1 for
compressed attention and 2 for selected attention (causal only when an ``atten_mask`` is given; the NPU then
ignores the mask's content). The functions call the ``attnops::nsa_*`` custom ops, whose autograd follows
``derivatives.yaml``.
"""
from __future__ import annotations

from .._core.checks import int_list, require
from ..ops.nsa import op as nsa_op
from ._common import with_overloads

CUMULATIVE = 0  # act_seq_len_type of the training ops
COMPRESS_ATTENTION_MODE = 1  # allMask (without atten_mask: no masking)
SELECTED_ATTENTION_MODE = 2  # causal when atten_mask is given, else no masking


def _check_heads(query, head_num: int) -> None:
    require(head_num == query.shape[1], "head_num", f"the N of query [T, N, D] ({query.shape[1]})", head_num)


def npu_nsa_compress(input, weight, compress_block_size, compress_stride, *, actual_seq_len=None):
    """``[T, N, D] -> [sum_b n_b, N, D]`` with ``weight [compress_block_size, N]``; differentiable in both."""
    return nsa_op.nsa_compress(input, weight, compress_block_size, compress_stride,
                               int_list("actual_seq_len", actual_seq_len), CUMULATIVE)


def npu_nsa_compress_grad(grad, input, weight, compress_block_size, compress_stride, *, actual_seq_len=None):
    """``(input_grad, weight_grad)`` of :func:`npu_nsa_compress`."""
    return nsa_op.nsa_compress_grad(grad, input, weight, compress_block_size, compress_stride,
                                    int_list("actual_seq_len", actual_seq_len), CUMULATIVE)


def npu_nsa_compress_attention(query, key, value, scale_value, head_num, compress_block_size, compress_stride,
                               select_block_size, select_block_count, *, topk_mask=None, atten_mask=None,
                               actual_seq_qlen=None, actual_cmp_seq_kvlen=None, actual_sel_seq_kvlen=None):
    """``(attention_out [T, N1, Dv], topk_indices [T, N2, count] int32, softmax_max, softmax_sum)`` (statistics
    ``[T, N1, 8]`` in the FA per-batch blocked layout); differentiable in q, k, v through the FA backward."""
    _check_heads(query, head_num)
    return nsa_op.nsa_compress_attention(
        query, key, value, topk_mask, atten_mask, float(scale_value), head_num, compress_block_size,
        compress_stride, select_block_size, select_block_count, int_list("actual_seq_qlen", actual_seq_qlen),
        int_list("actual_cmp_seq_kvlen", actual_cmp_seq_kvlen),
        int_list("actual_sel_seq_kvlen", actual_sel_seq_kvlen), COMPRESS_ATTENTION_MODE)


def npu_nsa_select_attention(query, key, value, topk_indices, scale_value, head_num, select_block_size,
                             select_block_count, *, atten_mask=None, actual_seq_qlen=None, actual_seq_kvlen=None):
    """``(attention_out [T1, N1, Dv], softmax_max [T1, N1, 8], softmax_sum [T1, N1, 8])`` (token-major
    statistics); differentiable in q, k, v."""
    _check_heads(query, head_num)
    return nsa_op.nsa_selected_attention(
        query, key, value, topk_indices, atten_mask, float(scale_value), head_num, select_block_size,
        select_block_count, int_list("actual_seq_qlen", actual_seq_qlen),
        int_list("actual_seq_kvlen", actual_seq_kvlen), SELECTED_ATTENTION_MODE)


def npu_nsa_select_attention_grad(grad, query, key, value, attention_out, softmax_max, softmax_sum, topk_indices,
                                  scale_value, head_num, select_block_size, select_block_count, *, atten_mask=None,
                                  actual_seq_qlen=None, actual_seq_kvlen=None):
    """``(dq, dk, dv)`` of :func:`npu_nsa_select_attention` from its outputs (note: ``grad`` comes first)."""
    _check_heads(query, head_num)
    return nsa_op.nsa_selected_attention_grad(
        grad, query, key, value, attention_out, softmax_max, softmax_sum, topk_indices, atten_mask,
        float(scale_value), head_num, select_block_size, select_block_count,
        int_list("actual_seq_qlen", actual_seq_qlen), int_list("actual_seq_kvlen", actual_seq_kvlen),
        SELECTED_ATTENTION_MODE)


for _fn in (npu_nsa_compress, npu_nsa_compress_grad, npu_nsa_compress_attention, npu_nsa_select_attention,
            npu_nsa_select_attention_grad):
    with_overloads(_fn)
