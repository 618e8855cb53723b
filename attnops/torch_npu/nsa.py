"""torch_npu's NSA ops: compression, compressed attention and selected attention (training, TND only), and
compression, compressed and selected attention for decoding over a paged cache (the ``*_infer`` ops).

The NPU hardcodes the layout ``TND``, cumulative ``actual_*`` lists (no leading 0), ``sparse_mode`` 1 for
compressed attention and 2 for selected attention (the forward is causal only when an ``atten_mask`` is given, the
grad always, as on the NPU, whose grad masks in mode 2 with or without a mask; the mask's content is never read).
So autograd through ``npu_nsa_select_attention(atten_mask=None)`` gives the causally masked gradient of the
unmasked forward, like the NPU. The functions call the ``attnops::nsa_*`` custom ops, whose autograd follows
``derivatives.yaml``; the ``*_infer`` ops are inference-only (a backward raises
:class:`attnops.InferenceOnlyError`).
"""
from __future__ import annotations

from .._core.checks import caller_names, check_scale, check_tensor, fail, int_list, require
from .._core.inference_only import run_inference_only
from ..ops.nsa import op as nsa_op
from ..ops.nsa.decode import lengths_arg
from ._common import reject_unsupported, with_overloads

CUMULATIVE = 0  # act_seq_len_type of the training ops
COMPRESS_ATTENTION_MODE = 1  # allMask (without atten_mask: no masking)
SELECTED_ATTENTION_MODE = 2  # forward: causal iff atten_mask is given; grad: always causal


def _check_heads(query, head_num: int) -> None:
    check_tensor("query", query, ndim=3)
    require(head_num == query.shape[1], "head_num", f"the N of query [T, N, D] ({query.shape[1]})", head_num)


def npu_nsa_compress(input, weight, compress_block_size, compress_stride, *, actual_seq_len=None):
    """``[T, N, D] -> [sum_b n_b, N, D]`` with ``weight [compress_block_size, N]``; differentiable in both."""
    return nsa_op.nsa_compress(input, weight, compress_block_size, compress_stride,
                               int_list("actual_seq_len", actual_seq_len), CUMULATIVE)


def npu_nsa_compress_grad(grad, input, weight, compress_block_size, compress_stride, *, actual_seq_len=None):
    """``(input_grad, weight_grad)`` of :func:`npu_nsa_compress`."""
    with caller_names(output_grad="grad"):
        return nsa_op.nsa_compress_grad(grad, input, weight, compress_block_size, compress_stride,
                                        int_list("actual_seq_len", actual_seq_len), CUMULATIVE)


def npu_nsa_compress_attention(query, key, value, scale_value, head_num, compress_block_size, compress_stride,
                               select_block_size, select_block_count, *, topk_mask=None, atten_mask=None,
                               actual_seq_qlen=None, actual_cmp_seq_kvlen=None, actual_sel_seq_kvlen=None):
    """``(attention_out [T, N1, Dv], topk_indices [T, N2, count] int32, softmax_max, softmax_sum)`` (statistics
    ``[T, N1, 8]`` in the FA per-batch blocked layout); differentiable in q, k, v through the FA backward."""
    _check_heads(query, head_num)
    return nsa_op.nsa_compress_attention(
        query, key, value, topk_mask, atten_mask, check_scale("scale_value", scale_value), head_num,
        compress_block_size, compress_stride, select_block_size, select_block_count,
        int_list("actual_seq_qlen", actual_seq_qlen), int_list("actual_cmp_seq_kvlen", actual_cmp_seq_kvlen),
        int_list("actual_sel_seq_kvlen", actual_sel_seq_kvlen), COMPRESS_ATTENTION_MODE)


def npu_nsa_select_attention(query, key, value, topk_indices, scale_value, head_num, select_block_size,
                             select_block_count, *, atten_mask=None, actual_seq_qlen=None, actual_seq_kvlen=None):
    """``(attention_out [T1, N1, Dv], softmax_max [T1, N1, 8], softmax_sum [T1, N1, 8])`` (token-major
    statistics); differentiable in q, k, v."""
    _check_heads(query, head_num)
    return nsa_op.nsa_selected_attention(
        query, key, value, topk_indices, atten_mask, check_scale("scale_value", scale_value), head_num,
        select_block_size, select_block_count, int_list("actual_seq_qlen", actual_seq_qlen),
        int_list("actual_seq_kvlen", actual_seq_kvlen), SELECTED_ATTENTION_MODE)


def npu_nsa_select_attention_grad(grad, query, key, value, attention_out, softmax_max, softmax_sum, topk_indices,
                                  scale_value, head_num, select_block_size, select_block_count, *, atten_mask=None,
                                  actual_seq_qlen=None, actual_seq_kvlen=None):
    """``(dq, dk, dv)`` of :func:`npu_nsa_select_attention` from its outputs (note: ``grad`` comes first)."""
    _check_heads(query, head_num)
    with caller_names(attention_out_grad="grad"):
        return nsa_op.nsa_selected_attention_grad(
            grad, query, key, value, attention_out, softmax_max, softmax_sum, topk_indices, atten_mask,
            check_scale("scale_value", scale_value), head_num, select_block_size, select_block_count,
            int_list("actual_seq_qlen", actual_seq_qlen), int_list("actual_seq_kvlen", actual_seq_kvlen),
            SELECTED_ATTENTION_MODE)


def decode_operands(query, key, value, *, layout, allowed, head_num, key_value_head_num, block_table):
    """``(query [B, N, D], key, value [blocks, page, KV_N, D])`` from a decode call in ``layout`` (one token per
    request) and ``(blocknum, page, KV_N*D)`` or ``(blocknum, page, KV_N, D)`` caches; returns the layout too."""
    if not isinstance(layout, str) or layout.upper() not in allowed:
        fail("layout", f"one of {list(allowed)}", layout)
    layout = layout.upper()
    require(block_table is not None, "block_table", "the paged cache's block table [B, maxBlocks]", None)
    check_tensor("query", query, ndim=3 if layout in ("BSH", "TND") else 4)
    if layout != "TND":
        require(query.shape[1] == 1, "query", "one token per request (S = 1)", query)
    q = query.reshape(query.shape[0], head_num, -1) if layout == "BSH" else query.reshape(query.shape[0],
                                                                                          *query.shape[-2:])
    caches = []
    for name, t in (("key", key), ("value", value)):
        check_tensor(name, t, ndim=(3, 4))
        if t.dim() == 3:
            require(key_value_head_num > 0 and t.shape[-1] % key_value_head_num == 0, name,
                    f"a last dim KV_N*D divisible by key_value_head_num={key_value_head_num}", t)
            t = t.unflatten(-1, (key_value_head_num, -1))
        caches.append(t)
    return q, caches[0], caches[1], layout


def npu_nsa_select_attention_infer(query, key, value, topk_indices, scale_value, head_num, key_value_head_num,
                                   select_block_size, select_block_count, page_block_size, *, layout="BSND",
                                   atten_mask=None, block_table=None, actual_seq_qlen=None, actual_seq_kvlen=None):
    """Selected attention of one new token per request over a paged KV cache: ``attention_out`` shaped like the
    query with Dv (BSH ``[B, 1, N*Dv]``, BSND ``[B, 1, N, Dv]``, TND ``[B, N, Dv]``).

    ``key``/``value`` are ``(block_num, page_block_size, KV_N*D)`` or ``(block_num, page_block_size, KV_N, D)``
    caches read through ``block_table [B, maxBlocks]``; ``topk_indices [B, KV_N, count]`` names blocks of
    ``select_block_size`` keys, ``-1`` for padding; ``actual_seq_kvlen`` holds per-request KV lengths (a tensor on
    the device is read by the kernels only: no synchronisation, capturable in a CUDA graph).
    ``atten_mask`` and ``actual_seq_qlen`` are not supported (by the NPU either).
    """
    reject_unsupported(atten_mask=atten_mask, actual_seq_qlen=actual_seq_qlen)
    q, k, v, layout = decode_operands(query, key, value, layout=layout, allowed=("BSH", "BSND", "TND"),
                                       head_num=head_num, key_value_head_num=key_value_head_num,
                                       block_table=block_table)
    out = nsa_op.nsa_selected_attention_infer(
        q, k, v, topk_indices, block_table, check_scale("scale_value", scale_value), head_num, key_value_head_num,
        select_block_size, select_block_count, page_block_size,
        *lengths_arg("actual_seq_kvlen", actual_seq_kvlen))
    if layout == "BSH":
        return out.flatten(-2).unsqueeze(1)
    return out.unsqueeze(1) if layout == "BSND" else out


def npu_nsa_compress_attention_infer(query, key, value, scale_value, head_num, key_value_head_num, select_block_size,
                                     select_block_count, page_block_size, compress_block_size, compress_stride, *,
                                     layout="TND", atten_mask=None, block_table=None, topk_mask=None,
                                     actual_seq_qlen=None, actual_cmp_seq_kvlen=None, actual_sel_seq_kvlen=None):
    """Compressed attention of one new token per request over a paged cache of compressed keys/values, and the
    selection blocks for the next step: ``(attention_out, topk_indices int32)``, TND ``[B, N, Dv]`` /
    ``[B, KV_N, count]``, BSND ``[B, 1, N, Dv]`` / ``[B, 1, KV_N, count]``.

    ``actual_cmp_seq_kvlen`` holds per-request compressed lengths. The first and the last two selection blocks are
    always chosen (:mod:`attnops.ops.nsa.decode`). ``atten_mask``, ``topk_mask``, ``actual_seq_qlen`` and
    ``actual_sel_seq_kvlen`` are not supported (by the NPU either).
    """
    reject_unsupported(atten_mask=atten_mask, topk_mask=topk_mask, actual_seq_qlen=actual_seq_qlen,
                       actual_sel_seq_kvlen=actual_sel_seq_kvlen)
    q, k, v, layout = decode_operands(query, key, value, layout=layout, allowed=("BSND", "TND"), head_num=head_num,
                                       key_value_head_num=key_value_head_num, block_table=block_table)
    out, topk = nsa_op.nsa_compress_attention_infer(
        q, k, v, block_table, check_scale("scale_value", scale_value), head_num, key_value_head_num, select_block_size,
        select_block_count, page_block_size, compress_block_size, compress_stride,
        *lengths_arg("actual_cmp_seq_kvlen", actual_cmp_seq_kvlen))
    return (out.unsqueeze(1), topk.unsqueeze(1)) if layout == "BSND" else (out, topk)


def npu_nsa_compress_infer(input, weight, slot_mapping, compress_block_size, compress_stride, page_block_size, *,
                           block_table=None, actual_seq_len=None, cache):
    """``npu_nsa_compress_infer.cache``: for each request whose length completes a compression block, the weighted
    sum of its last ``compress_block_size`` keys (``weight [compress_block_size, N]``), read from the paged
    ``input`` ``(blocks, page_block_size, N, D)`` (or ``N*D``) through ``block_table``, is written to row
    ``slot_mapping[b]`` of ``cache [slots, N, D]``; returns ``cache`` (updated in place)."""
    require(block_table is not None, "block_table", "the paged input's block table [B, maxBlocks]", None)
    check_tensor("weight", weight, ndim=2)
    check_tensor("input", input, ndim=(3, 4))
    if input.dim() == 3:
        require(input.shape[-1] % weight.shape[1] == 0, "input", f"a last dim N*D divisible by N={weight.shape[1]} "
                "(the weight's heads)", input)
        input = input.unflatten(-1, (weight.shape[1], -1))
    lens, lens_tensor = lengths_arg("actual_seq_len", actual_seq_len)

    def update():
        nsa_op.nsa_compress_infer(input, weight, slot_mapping, block_table, cache, compress_block_size,
                                  compress_stride, page_block_size, lens, lens_tensor)
        return cache

    return run_inference_only(nsa_op.COMPRESS_INFER, update, input, weight, cache, dirty=cache)


npu_nsa_compress = with_overloads(npu_nsa_compress)
npu_nsa_compress_grad = with_overloads(npu_nsa_compress_grad)
npu_nsa_compress_attention = with_overloads(npu_nsa_compress_attention)
npu_nsa_select_attention = with_overloads(npu_nsa_select_attention)
npu_nsa_select_attention_grad = with_overloads(npu_nsa_select_attention_grad)
npu_nsa_select_attention_infer = with_overloads(npu_nsa_select_attention_infer)
npu_nsa_compress_attention_infer = with_overloads(npu_nsa_compress_attention_infer)
npu_nsa_compress_infer = with_overloads(npu_nsa_compress_infer)
npu_nsa_compress_infer.cache = npu_nsa_compress_infer
