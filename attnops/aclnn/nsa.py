"""aclnn NSA operators (NsaCompress, NsaCompressGrad, NsaCompressAttention, NsaSelectedAttention,
NsaSelectedAttentionGrad) in the aclnn parameter order, with the seeds' constraints and status codes.

Outputs: ``nsa_compress -> output``; ``nsa_compress_grad -> (input_grad, weight_grad)``;
``nsa_compress_attention -> (softmax_max, softmax_sum, attention_out, topk_indices)``;
``nsa_selected_attention -> (softmax_max, softmax_sum, attention_out)``;
``nsa_selected_attention_grad -> (dq, dk, dv)``.
"""
from __future__ import annotations

import torch

from .._core.checks import Described, check_int, check_scale, check_tensor, int_list, require, require_not_none
from ..ops.nsa import op as nsa_op
from ..ops.nsa.validate import check_selected_backward_inputs
from ..ops.nsa.compress import build_compress_spec, check_output_grad
from ..ops.nsa.compress_attention import build_compress_attention_spec
from ..ops.nsa.selected import build_selected_spec
from ._two_phase import two_phase

ACLNN_NSA_DTYPES = (torch.float16, torch.bfloat16)
MAX_TOKENS_SELECTED = 2 << 20  # T1, T2: 1 ~ 2M
MAX_SEQ_SELECTED = 128 << 10  # S: 1 ~ 128K
SELECTED_HEAD_DIMS = (128, 192)


def _multiple_of_16(name: str, value: int, hi: int | None = None) -> int:
    v = check_int(name, value, lo=16, hi=hi)
    require(v % 16 == 0, name, "a multiple of 16", v)
    return v


def _check_compress_inputs(input, weight, act_seq_len, compress_block_size, compress_stride, act_seq_len_type,
                           layout, *, strict_stride: bool):
    check_tensor("input", input, ndim=3, dtypes=ACLNN_NSA_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=ACLNN_NSA_DTYPES)
    l_ = _multiple_of_16("compress_block_size", compress_block_size, hi=128)
    d_ = _multiple_of_16("compress_stride", compress_stride)
    if strict_stride:
        require(l_ > d_, "compress_stride", f"less than compress_block_size={l_}", d_)
    else:
        require(d_ <= l_, "compress_stride", f"at most compress_block_size={l_}", d_)
    require(layout is None or layout == "TND", "layout", "'TND'", layout)
    require(input.shape[1] <= 128, "input", "N in [1, 128]", input)
    require(input.shape[2] % 16 == 0 and input.shape[2] <= 256, "input", "D a multiple of 16, at most 256", input)
    lens = int_list("act_seq_len", act_seq_len)
    if lens is not None and act_seq_len_type == 0:
        require(lens[-1] == input.shape[0] or max(lens) == input.shape[0], "act_seq_len",
                f"a cumulative list ending at T={input.shape[0]}", lens)
    spec = build_compress_spec(input, weight, compress_block_size=compress_block_size,
                               compress_stride=compress_stride, actual_seq_len=lens,
                               act_seq_len_type=act_seq_len_type, seq_name="act_seq_len")
    return lens, spec


def _nsa_compress(input, weight, act_seq_len, layout, compress_block_size, compress_stride, act_seq_len_type):
    """aclnnNsaCompress."""
    lens, _ = _check_compress_inputs(input, weight, act_seq_len, compress_block_size, compress_stride,
                                     act_seq_len_type, layout, strict_stride=False)
    return lambda: nsa_op.nsa_compress(input, weight, compress_block_size, compress_stride, lens, act_seq_len_type)


def _nsa_compress_grad(output_grad, input, weight, act_seq_len, compress_block_size, compress_stride,
                       act_seq_len_type, layout):
    """aclnnNsaCompressGrad (seed)."""
    require_not_none(output_grad, "output_grad")
    check_tensor("output_grad", output_grad, ndim=3, dtypes=ACLNN_NSA_DTYPES)
    lens, spec = _check_compress_inputs(input, weight, act_seq_len, compress_block_size, compress_stride,
                                        act_seq_len_type, layout, strict_stride=True)
    check_output_grad(output_grad, spec, input)
    return lambda: nsa_op.nsa_compress_grad(output_grad, input, weight, compress_block_size, compress_stride, lens,
                                            act_seq_len_type)


def _check_selected(query, key, value, topk_indices, atten_mask, actual_seq_qlen, actual_seq_kvlen, scale_value,
                    head_num, input_layout, sparse_mode, selected_block_size, selected_block_count):
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t, ndim=3, dtypes=ACLNN_NSA_DTYPES)
    check_tensor("topk_indices", topk_indices, dtypes=(torch.int32,))
    require(input_layout == "TND", "input_layout", "'TND'", input_layout)
    check_int("head_num", head_num, lo=1, hi=128)
    require(1 <= key.shape[1] <= 128, "key", "N2 in [1, 128]", key)
    require(query.shape[1] % max(key.shape[1], 1) == 0 and query.shape[1] // max(key.shape[1], 1) <= 32, "query",
            "N1 a multiple of N2 with G = N1/N2 in [1, 32]", query)
    for name, t in (("query", query), ("value", value)):
        require(t.shape[2] in SELECTED_HEAD_DIMS, name, f"head dim D in {list(SELECTED_HEAD_DIMS)}", t)
    for name, t in (("query", query), ("key", key)):
        require(1 <= t.shape[0] <= MAX_TOKENS_SELECTED, name, f"T in [1, {MAX_TOKENS_SELECTED}]", t)
    size = _multiple_of_16("selected_block_size", selected_block_size, hi=128)
    count = check_int("selected_block_count", selected_block_count, lo=1, hi=128)
    require(size * count < 8192, "selected_block_count", f"selected_block_size * selected_block_count < 8192",
            Described(f"{size} * {count}"))
    require(sparse_mode in (0, 2), "sparse_mode", "0 or 2", sparse_mode)
    qlen, kvlen = int_list("actual_seq_qlen", actual_seq_qlen), int_list("actual_seq_kvlen", actual_seq_kvlen)
    require_not_none(qlen, "actual_seq_qlen")
    require_not_none(kvlen, "actual_seq_kvlen")
    prev = 0
    for v in kvlen:
        if v:
            require(v - prev <= MAX_SEQ_SELECTED, "actual_seq_kvlen", f"sequence lengths <= {MAX_SEQ_SELECTED}",
                    kvlen)
            prev = v
    spec = build_selected_spec(query, key, value, topk_indices, scale_value=scale_value, head_num=head_num,
                               select_block_size=size, select_block_count=count, atten_mask=atten_mask,
                               actual_seq_qlen=qlen, actual_seq_kvlen=kvlen, sparse_mode=sparse_mode)
    return qlen, kvlen, spec


def _nsa_selected_attention(query, key, value, topk_indices, atten_mask, actual_seq_qlen, actual_seq_kvlen,
                            scale_value, head_num, input_layout, sparse_mode, selected_block_size,
                            selected_block_count):
    """aclnnNsaSelectedAttention."""
    qlen, kvlen, _ = _check_selected(query, key, value, topk_indices, atten_mask, actual_seq_qlen, actual_seq_kvlen,
                                     scale_value, head_num, input_layout, sparse_mode, selected_block_size,
                                     selected_block_count)
    args = (check_scale("scale_value", scale_value), head_num, selected_block_size, selected_block_count, qlen, kvlen,
            sparse_mode)

    def run():
        out, smax, ssum = nsa_op.nsa_selected_attention(query, key, value, topk_indices, atten_mask, *args)
        return smax, ssum, out
    return run


def _nsa_selected_attention_grad(query, key, value, attention_out, attention_out_grad, softmax_max, softmax_sum,
                                 topk_indices, actual_seq_qlen, actual_seq_kvlen, atten_mask, scale_value,
                                 selected_block_size, selected_block_count, head_num, input_layout, sparse_mode):
    """aclnnNsaSelectedAttentionGrad (seed): ``sparse_mode=2`` is causal with or without ``atten_mask``, as on the
    NPU (the forward masks only with one)."""
    for name, t in (("attention_out", attention_out), ("attention_out_grad", attention_out_grad),
                    ("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        require_not_none(t, name)
    qlen, kvlen, spec = _check_selected(query, key, value, topk_indices, atten_mask, actual_seq_qlen,
                                        actual_seq_kvlen, scale_value, head_num, input_layout, sparse_mode,
                                        selected_block_size, selected_block_count)
    check_selected_backward_inputs(spec, query, attention_out_grad, attention_out, softmax_max, softmax_sum)
    args = (check_scale("scale_value", scale_value), head_num, selected_block_size, selected_block_count, qlen, kvlen,
            sparse_mode)
    return lambda: nsa_op.nsa_selected_attention_grad(attention_out_grad, query, key, value, attention_out,
                                                      softmax_max, softmax_sum, topk_indices, atten_mask, *args)


def _nsa_compress_attention(query, key, value, atten_mask, topk_mask, actual_seq_qlen, actual_cmp_seq_kvlen,
                            actual_sel_seq_kvlen, scale_value, head_num, input_layout, sparse_mode,
                            compress_block_size, compress_stride, select_block_size, select_block_count):
    """aclnnNsaCompressAttention."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t, ndim=3, dtypes=ACLNN_NSA_DTYPES)
    require(input_layout == "TND", "input_layout", "'TND'", input_layout)
    g = query.shape[1] // max(key.shape[1], 1)
    require(g < 128 and 128 % g == 0, "head_num", "N1/N2 < 128 dividing 128", Described(f"G={g}"))
    _multiple_of_16("compress_block_size", compress_block_size, hi=128)
    _multiple_of_16("compress_stride", compress_stride, hi=64)
    _multiple_of_16("select_block_size", select_block_size, hi=128)
    check_int("select_block_count", select_block_count, lo=1, hi=32)
    for name, lens in (("actual_seq_qlen", actual_seq_qlen), ("actual_cmp_seq_kvlen", actual_cmp_seq_kvlen),
                       ("actual_sel_seq_kvlen", actual_sel_seq_kvlen)):
        require_not_none(lens, name)
    cmp = int_list("actual_cmp_seq_kvlen", actual_cmp_seq_kvlen)
    prev = 0
    for v in cmp:
        if v:
            require(v - prev <= 14000, "actual_cmp_seq_kvlen", "compressed KV lengths <= 14000", cmp)
            prev = v
    qlen, sel = int_list("actual_seq_qlen", actual_seq_qlen), int_list("actual_sel_seq_kvlen", actual_sel_seq_kvlen)
    build_compress_attention_spec(query, key, value, scale_value=scale_value, head_num=head_num,
                                  compress_block_size=compress_block_size, compress_stride=compress_stride,
                                  select_block_size=select_block_size, select_block_count=select_block_count,
                                  topk_mask=topk_mask, atten_mask=atten_mask, actual_seq_qlen=qlen,
                                  actual_cmp_seq_kvlen=cmp, actual_sel_seq_kvlen=sel, sparse_mode=sparse_mode)
    args = (check_scale("scale_value", scale_value), head_num, compress_block_size, compress_stride, select_block_size,
            select_block_count, qlen, cmp, sel, sparse_mode)

    def run():
        out, topk, smax, ssum = nsa_op.nsa_compress_attention(query, key, value, topk_mask, atten_mask, *args)
        return smax, ssum, out, topk
    return run


nsa_compress, nsa_compress_get_workspace_size = two_phase(_nsa_compress)
nsa_compress_grad, nsa_compress_grad_get_workspace_size = two_phase(_nsa_compress_grad)
nsa_compress_attention, nsa_compress_attention_get_workspace_size = two_phase(_nsa_compress_attention)
nsa_selected_attention, nsa_selected_attention_get_workspace_size = two_phase(_nsa_selected_attention)
nsa_selected_attention_grad, nsa_selected_attention_grad_get_workspace_size = two_phase(_nsa_selected_attention_grad)
