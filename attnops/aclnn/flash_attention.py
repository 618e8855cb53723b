"""aclnn FlashAttention operators under their aclnn names (snake_case), in the seeds' parameter order.

Forward: ``flash_attention_score`` (dense layouts), ``flash_attention_var_len_score`` / ``_v2`` (TND), returning
``(softmax_max, softmax_sum, softmax_out, attention_out)``. Backward: ``flash_attention_score_grad`` (dense),
``flash_attention_unpadding_score_grad`` / ``_v2`` (TND), returning ``(dq, dk, dv, dpse)``; ``dpse`` is None
without a pse tensor. Each has a ``_get_workspace_size`` twin (two-phase form). Validation raises
:class:`attnops.AclnnError` subclasses with the seeds' status codes (161001 / 161002).
"""
from __future__ import annotations

import torch

from .._core.checks import (Described, caller_names, check_int, check_scale, check_tensor, int_list, require,
                            require_not_none)
from .._core.layouts import normalize_layout
from ..ops.flash_attention import op as fa_op
from ..ops.flash_attention.validate import check_backward_inputs
from ..ops.common.problem import build_problem
from ._two_phase import two_phase

ACLNN_FA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_TOKENS = 1 << 20  # T: 1 ~ 1M
MAX_HEADS = 256
MAX_BATCH, MAX_BATCH_WITH_PREFIX = 2048, 1024
DENSE_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD")


def _start_idx(name: str, value) -> int:
    values = int_list(name, value)
    return values[0] if values else 0


FORWARD_NAMES = {"pse": "real_shift"}  # the seeds' names of the shared validation's arguments
BACKWARD_NAMES = {"key": "key_in", "pse": "pse_shift"}


def _validate(*, names: dict, **arguments):
    """:func:`_checked` with errors naming the operator's parameters (``names``: shared name -> seed name)."""
    with caller_names(**names):
        return _checked(**arguments)


def _checked(*, query, key, value, dy=None, layouts, max_d, padding_mask, keep_prob, drop_mask, head_num,
              input_layout, prefix, actual_seq_qlen=None, actual_seq_kvlen=None, pse, atten_mask, scale_value,
              pre_tokens, next_tokens, sparse_mode, pse_type, q_start_idx=None, kv_start_idx=None, inner_precise):
    """Seed constraints on top of the shared FlashAttention validation; returns (problem, op arguments)."""
    for name, t in (("query", query), ("key", key), ("value", value)) + ((("dy", dy),) if dy is not None else ()):
        check_tensor(name, t, dtypes=ACLNN_FA_DTYPES)
    layout = normalize_layout("input_layout", input_layout)
    require(layout in layouts, "input_layout", f"one of {list(layouts)} for this operator", input_layout)
    require(padding_mask is None, "padding_mask", "None (reserved parameter)", padding_mask)
    check_int("head_num", head_num, lo=1, hi=MAX_HEADS)
    check_int("inner_precise", inner_precise)
    require(isinstance(keep_prob, (int, float)) and 0.0 < keep_prob <= 1.0, "keep_prob", "a value in (0, 1]",
            keep_prob)
    if keep_prob < 1.0:
        require_not_none(drop_mask, "drop_mask")
    if sparse_mode == 4:
        require(pre_tokens + next_tokens >= 0, "next_tokens", "a band that intersects: pre_tokens + next_tokens >= 0",
                Described(f"pre_tokens={pre_tokens}, next_tokens={next_tokens}"))
    qlen = int_list("actual_seq_qlen", actual_seq_qlen)
    prefix_list = int_list("prefix", prefix)
    if layout == "TND":
        require(qlen is not None and 1 <= len(qlen) <= MAX_BATCH, "actual_seq_qlen",
                f"1 to {MAX_BATCH} cumulative lengths (one per batch)", actual_seq_qlen)
        if prefix_list is not None and sparse_mode in (5, 6):
            require(len(qlen) <= MAX_BATCH_WITH_PREFIX, "actual_seq_qlen",
                    f"at most {MAX_BATCH_WITH_PREFIX} batches with prefix", Described(f"{len(qlen)} batches"))
        for name, t in (("query", query), ("key", key)):
            require(1 <= t.shape[0] <= MAX_TOKENS, name, f"T in [1, {MAX_TOKENS}]", t)
    scale_value = check_scale("scale_value", scale_value)
    p = build_problem(query, key, value, head_num=head_num, layout=layout, scale=scale_value, pse=pse,
                      atten_mask=atten_mask, keep_prob=keep_prob, drop_mask=drop_mask, seed=0,
                      pre_tokens=pre_tokens, next_tokens=next_tokens, prefix=prefix_list, actual_seq_qlen=qlen,
                      actual_seq_kvlen=int_list("actual_seq_kvlen", actual_seq_kvlen), sparse_mode=sparse_mode,
                      pse_type=pse_type, q_start_idx=q_start_idx, kv_start_idx=kv_start_idx)
    g = p.geom
    require(g.n2 <= MAX_HEADS, "key", f"at most {MAX_HEADS} heads", Described(f"N={g.n2}"))
    require(g.d <= max_d, "query", f"head dim D in [1, {max_d}]", Described(f"D={g.d}"))
    tnd = layout == "TND"
    args = [pse, atten_mask, drop_mask, g.n1, layout, scale_value, float(keep_prob), pre_tokens,
            next_tokens, prefix_list, qlen if tnd else None,
            int_list("actual_seq_kvlen", actual_seq_kvlen) if tnd else None, sparse_mode, pse_type,
            _start_idx("q_start_idx", q_start_idx), _start_idx("kv_start_idx", kv_start_idx), "", 0, 0]
    return p, args


def _forward(query, key, value, args):
    out, smax, ssum = fa_op.flash_attention_fwd(query, key, value, *args)
    return smax, ssum, query.new_empty(0), out


def _backward(p, query, key, value, dy, softmax_max, softmax_sum, attention_in, args):
    attention_in, softmax_max, softmax_sum = check_backward_inputs(p, query, dy, attention_in, softmax_max,
                                                                   softmax_sum)
    dq, dk, dv, dpse = fa_op.flash_attention_bwd(dy, query, key, value, attention_in, softmax_max, softmax_sum,
                                                 *args)
    return dq, dk, dv, (dpse if p.pse is not None and p.pse.has_grad else None)


def _flash_attention_score(query, key, value, real_shift, drop_mask, padding_mask, atten_mask, prefix,
                           scale_value, keep_prob, pre_tokens, next_tokens, head_num, input_layout, inner_precise,
                           sparse_mode):
    """aclnnFlashAttentionScore: dense layouts BSH/SBH/BSND/BNSD."""
    _, args = _validate(names=FORWARD_NAMES, query=query, key=key, value=value,
                        layouts=DENSE_LAYOUTS, max_d=512,
                        padding_mask=padding_mask, keep_prob=keep_prob, drop_mask=drop_mask, head_num=head_num,
                        input_layout=input_layout, prefix=prefix, pse=real_shift, atten_mask=atten_mask,
                        scale_value=scale_value, pre_tokens=pre_tokens, next_tokens=next_tokens,
                        sparse_mode=sparse_mode, pse_type=1, inner_precise=inner_precise)
    return lambda: _forward(query, key, value, args)


def _flash_attention_var_len_score(query, key, value, real_shift, drop_mask, padding_mask, atten_mask, prefix,
                                   actual_seq_qlen, actual_seq_kvlen, scale_value, keep_prob, pre_tokens,
                                   next_tokens, head_num, input_layout, inner_precise, sparse_mode):
    """aclnnFlashAttentionVarLenScore: layout TND, cumulative actual sequence lengths."""
    _, args = _validate(names=FORWARD_NAMES, query=query, key=key, value=value,
                        layouts=("TND",), max_d=512, padding_mask=padding_mask,
                        keep_prob=keep_prob, drop_mask=drop_mask, head_num=head_num, input_layout=input_layout,
                        prefix=prefix, actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
                        pse=real_shift, atten_mask=atten_mask, scale_value=scale_value, pre_tokens=pre_tokens,
                        next_tokens=next_tokens, sparse_mode=sparse_mode, pse_type=1, inner_precise=inner_precise)
    return lambda: _forward(query, key, value, args)


def _flash_attention_var_len_score_v2(query, key, value, real_shift, drop_mask, padding_mask, atten_mask, prefix,
                                      actual_seq_qlen, actual_seq_kvlen, q_start_idx, kv_start_idx, scale_value,
                                      keep_prob, pre_tokens, next_tokens, head_num, input_layout, inner_precise,
                                      sparse_mode, pse_type):
    """aclnnFlashAttentionVarLenScoreV2: VarLenScore plus ``pse_type`` 0-3 and ``q/kv_start_idx``."""
    _, args = _validate(names=FORWARD_NAMES, query=query, key=key, value=value,
                        layouts=("TND",), max_d=768, padding_mask=padding_mask,
                        keep_prob=keep_prob, drop_mask=drop_mask, head_num=head_num, input_layout=input_layout,
                        prefix=prefix, actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
                        pse=real_shift, atten_mask=atten_mask, scale_value=scale_value, pre_tokens=pre_tokens,
                        next_tokens=next_tokens, sparse_mode=sparse_mode, pse_type=pse_type,
                        q_start_idx=q_start_idx, kv_start_idx=kv_start_idx, inner_precise=inner_precise)
    return lambda: _forward(query, key, value, args)


def _flash_attention_score_grad(query, key_in, value, dy, pse_shift, drop_mask, padding_mask, atten_mask,
                                softmax_max, softmax_sum, softmax_in, attention_in, prefix, scale_value, keep_prob,
                                pre_tokens, next_tokens, head_num, input_layout, inner_precise, sparse_mode):
    """aclnnFlashAttentionScoreGrad: dense layouts."""
    require_not_none(dy, "dy")
    p, args = _validate(names=BACKWARD_NAMES, query=query, key=key_in, value=value, dy=dy,
                        layouts=DENSE_LAYOUTS, max_d=512,
                        padding_mask=padding_mask, keep_prob=keep_prob, drop_mask=drop_mask, head_num=head_num,
                        input_layout=input_layout, prefix=prefix, pse=pse_shift, atten_mask=atten_mask,
                        scale_value=scale_value, pre_tokens=pre_tokens, next_tokens=next_tokens,
                        sparse_mode=sparse_mode, pse_type=1, inner_precise=inner_precise)
    with caller_names(**BACKWARD_NAMES):
        check_backward_inputs(p, query, dy, attention_in, softmax_max, softmax_sum)
    return lambda: _backward(p, query, key_in, value, dy, softmax_max, softmax_sum, attention_in, args)


def _flash_attention_unpadding_score_grad(query, key_in, value, dy, pse_shift, drop_mask, padding_mask, atten_mask,
                                          softmax_max, softmax_sum, softmax_in, attention_in, prefix,
                                          actual_seq_qlen, actual_seq_kvlen, scale_value, keep_prob, pre_tokens,
                                          next_tokens, head_num, input_layout, inner_precise, sparse_mode):
    """aclnnFlashAttentionUnpaddingScoreGrad (seed): backward of VarLenScore, layout TND."""
    require_not_none(dy, "dy")
    p, args = _validate(names=BACKWARD_NAMES, query=query, key=key_in, value=value, dy=dy,
                        layouts=("TND",), max_d=512,
                        padding_mask=padding_mask, keep_prob=keep_prob, drop_mask=drop_mask, head_num=head_num,
                        input_layout=input_layout, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
                        actual_seq_kvlen=actual_seq_kvlen, pse=pse_shift, atten_mask=atten_mask,
                        scale_value=scale_value, pre_tokens=pre_tokens, next_tokens=next_tokens,
                        sparse_mode=sparse_mode, pse_type=1, inner_precise=inner_precise)
    with caller_names(**BACKWARD_NAMES):
        check_backward_inputs(p, query, dy, attention_in, softmax_max, softmax_sum)
    return lambda: _backward(p, query, key_in, value, dy, softmax_max, softmax_sum, attention_in, args)


def _flash_attention_unpadding_score_grad_v2(query, key_in, value, dy, pse_shift, drop_mask, padding_mask,
                                             atten_mask, softmax_max, softmax_sum, softmax_in, attention_in, prefix,
                                             actual_seq_qlen, actual_seq_kvlen, q_start_idx, kv_start_idx,
                                             scale_value, keep_prob, pre_tokens, next_tokens, head_num,
                                             input_layout, inner_precise, sparse_mode, pse_type):
    """aclnnFlashAttentionUnpaddingScoreGradV2 (seed): adds ``pse_type`` 0-3, ``q/kv_start_idx``, D up to 768."""
    require_not_none(dy, "dy")
    p, args = _validate(names=BACKWARD_NAMES, query=query, key=key_in, value=value, dy=dy,
                        layouts=("TND",), max_d=768,
                        padding_mask=padding_mask, keep_prob=keep_prob, drop_mask=drop_mask, head_num=head_num,
                        input_layout=input_layout, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
                        actual_seq_kvlen=actual_seq_kvlen, pse=pse_shift, atten_mask=atten_mask,
                        scale_value=scale_value, pre_tokens=pre_tokens, next_tokens=next_tokens,
                        sparse_mode=sparse_mode, pse_type=pse_type, q_start_idx=q_start_idx,
                        kv_start_idx=kv_start_idx, inner_precise=inner_precise)
    with caller_names(**BACKWARD_NAMES):
        check_backward_inputs(p, query, dy, attention_in, softmax_max, softmax_sum)
    return lambda: _backward(p, query, key_in, value, dy, softmax_max, softmax_sum, attention_in, args)


flash_attention_score, flash_attention_score_get_workspace_size = two_phase(_flash_attention_score)
flash_attention_var_len_score, flash_attention_var_len_score_get_workspace_size = two_phase(
    _flash_attention_var_len_score)
flash_attention_var_len_score_v2, flash_attention_var_len_score_v2_get_workspace_size = two_phase(
    _flash_attention_var_len_score_v2)
flash_attention_score_grad, flash_attention_score_grad_get_workspace_size = two_phase(_flash_attention_score_grad)
flash_attention_unpadding_score_grad, flash_attention_unpadding_score_grad_get_workspace_size = two_phase(
    _flash_attention_unpadding_score_grad)
flash_attention_unpadding_score_grad_v2, flash_attention_unpadding_score_grad_v2_get_workspace_size = two_phase(
    _flash_attention_unpadding_score_grad_v2)
