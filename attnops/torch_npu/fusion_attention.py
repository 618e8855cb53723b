"""torch_npu's training FlashAttention: ``npu_fusion_attention(_v2)`` and ``npu_fusion_attention_grad(_v2)``.

Translates torch_npu's arguments to the ``attnops::flash_attention_fwd/bwd`` custom ops (whose autograd follows
op-plugin's ``derivatives.yaml``: gradients of q, k, v and pse from the gradient of ``attention_out`` only).
torch_npu specifics kept here: the ``(seed, offset, numels)`` dropout contract, ``softmax_out`` as an empty
tensor, ``dpse=None`` without pse, the attention ``sink`` (:mod:`.sink`; an empty ``dsink`` without it),
``actual_seq_*`` ignored for dense layouts, and the MLA ``query_rope``/``key_rope`` of the v2 ops (appended to
each head's D).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._core import context_parallel
from .._core.checks import check_int, check_scale, check_tensor, int_list, require
from .._core.dropout import check_seed_offset
from .._core.layouts import normalize_layout, parse_geometry
from .._core.varlen import SeqInfo, lengths_from_cumulative, seq_info_varlen
from ..ops.flash_attention import op as fa_op
from ._common import INT_MAX, reject_unsupported, with_overloads
from . import npu_generator, soc
from .rope import append_rope, rope_given, split_head_dim
from .sink import apply_sink, check_sink, sink_grad


def _seq_lists(layout: str, actual_seq_qlen, actual_seq_kvlen):
    """Cumulative lists for TND; dense layouts ignore them (the NPU only forwards them)."""
    if layout != "TND":
        return None, None
    return int_list("actual_seq_qlen", actual_seq_qlen), int_list("actual_seq_kvlen", actual_seq_kvlen)


def _device_lengths(layout: str, actual_seq_qlen, actual_seq_kvlen, graph_friendly: bool) -> tuple | None:
    """``(cu_seqlens_q, cu_seqlens_k)`` (a leading 0 prepended on the device) when the v3 ops get their TND
    cumulative lengths as tensors on a device: passed to the kernels unread. None otherwise (host lists, CPU
    tensors, v1/v2, whose ``numels`` output needs the lengths on the host)."""
    given = (actual_seq_qlen, actual_seq_kvlen)
    if not (graph_friendly and layout == "TND" and all(isinstance(t, Tensor) and t.device.type != "cpu"
                                                         for t in given)):
        return None
    for name, t in zip(("actual_seq_qlen", "actual_seq_kvlen"), given):
        require(t.dim() == 1 and not t.is_floating_point(), name, "a 1-D integer tensor of cumulative lengths", t)
    return tuple(torch.cat([t.new_zeros(1), t]) for t in given)


def _numels(query: Tensor, key: Tensor, value: Tensor, head_num: int, layout: str, qlen, kvlen) -> int:
    """torch_npu's ``numels``: the dropout mask length ``N * sum_b Sq_b * Skv_b`` (``B*N*Sq*Skv`` when dense)."""
    g = parse_geometry(query, key, value, head_num, layout)
    if layout == "TND":
        require(qlen is not None and kvlen is not None, "actual_seq_qlen",
                "cumulative actual_seq_qlen and actual_seq_kvlen lists for input_layout TND", None)
        seq = seq_info_varlen(lengths_from_cumulative("actual_seq_qlen", qlen, query.shape[0]),
                              lengths_from_cumulative("actual_seq_kvlen", kvlen, key.shape[0]))
    else:
        seq = SeqInfo.dense(g.batch, g.sq, g.skv)
    return seq.score_numel(g.n1)


def _start(name: str, value) -> int:
    values = int_list(name, value)
    return values[0] if values else 0


def _with_rope(query: Tensor, key: Tensor, query_rope, key_rope, layout: str, head_num: int):
    """``query``/``key`` with ``query_rope``/``key_rope`` appended to each head's D (MLA: QK^T over both parts)."""
    if not rope_given(query_rope, key_rope):
        return query, key
    packed = layout in ("BSH", "SBH")
    return (append_rope("query_rope", query, query_rope, packed=packed, heads=head_num, like="query"),
            append_rope("key_rope", key, key_rope, packed=packed, heads=_kv_heads(query, key, layout, head_num),
                        like="key"))


def _kv_heads(query: Tensor, key: Tensor, layout: str, head_num: int) -> int:
    """KV heads of a packed (BSH/SBH) key, H_kv / D; 0 for the other layouts (not needed there)."""
    return key.shape[-1] * head_num // query.shape[-1] if layout in ("BSH", "SBH") else 0


def _split_rope(grad: Tensor, like: Tensor, layout: str, heads: int) -> tuple[Tensor, Tensor]:
    """Split a gradient of a rope-extended tensor into the parts of ``like`` and of its rope."""
    packed = layout in ("BSH", "SBH")
    return split_head_dim(grad, like.shape[-1] // heads if packed else like.shape[-1], packed=packed, heads=heads)


def _q_lens(layout: str, qlen, query: Tensor) -> list[int] | None:
    return lengths_from_cumulative("actual_seq_qlen", qlen, query.shape[0]) if layout == "TND" else None


class _SinkAttention(torch.autograd.Function):
    """The core forward plus the sink (:mod:`.sink`); backward through the core backward plus ``dsink``, from the
    sink-including statistics (as torch_npu's autograd passes the forward's outputs to the grad op)."""

    @staticmethod
    def forward(ctx, q, k, v, pse, sink, atten_mask, drop_mask, scalars, sink_kw):
        out, smax, ssum = fa_op.flash_attention_fwd(q, k, v, pse, atten_mask, drop_mask, *scalars)
        out, smax, ssum = apply_sink(out, smax, ssum, sink, **sink_kw)
        ctx.save_for_backward(q, k, v, pse, sink, atten_mask, drop_mask, out, smax, ssum)
        ctx.scalars, ctx.sink_kw = scalars, sink_kw
        ctx.mark_non_differentiable(smax, ssum)
        return out, smax, ssum

    @staticmethod
    def backward(ctx, dout, _dmax, _dsum):
        q, k, v, pse, sink, atten_mask, drop_mask, out, smax, ssum = ctx.saved_tensors
        dq, dk, dv, dpse = fa_op.flash_attention_bwd(dout, q, k, v, out, smax, ssum, pse, atten_mask, drop_mask,
                                                     *ctx.scalars)
        dsink = sink_grad(dout, out, smax, ssum, sink, **ctx.sink_kw)
        pse_type = dict(zip(fa_op._SCALARS, ctx.scalars))["pse_type"]
        return dq, dk, dv, fa_op.pse_grad(dpse, pse, pse_type), dsink, None, None, None, None


def _forward(query, key, value, head_num, input_layout, *, pse, padding_mask, atten_mask, query_rope, key_rope, scale,
             keep_prob, pre_tokens, next_tokens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen,
             sparse_mode, pse_type, q_start_idx, kv_start_idx, softmax_layout, sink, dropout_mask, seed, offset,
             graph_friendly=False):
    check_tensor("query", query)
    reject_unsupported(padding_mask=padding_mask)
    check_int("inner_precise", inner_precise)  # accepted: the invalid-row rule is always on
    layout = normalize_layout("input_layout", input_layout)
    cu = None if sink is not None else _device_lengths(layout, actual_seq_qlen, actual_seq_kvlen, graph_friendly)
    qlen, kvlen = _seq_lists(layout, actual_seq_qlen, actual_seq_kvlen) if cu is None else (None, None)
    q, k = _with_rope(query, key, query_rope, key_rope, layout, head_num)
    numels = None if graph_friendly else _numels(q, k, value, head_num, layout, qlen, kvlen)
    seed, offset = check_seed_offset(seed, offset)
    if keep_prob < 1.0 and dropout_mask is None and soc.soc_version() < soc.ASCEND950:
        seed, offset = npu_generator.philox_inputs(10)  # before Ascend950: from the NPU's generator, as torch_npu
    drop_mask = dropout_mask if keep_prob < 1.0 else None
    scalars = (head_num, layout, check_scale("scale", scale), float(keep_prob), pre_tokens, next_tokens,
               int_list("prefix", prefix), qlen, kvlen, sparse_mode, pse_type, _start("q_start_idx", q_start_idx),
               _start("kv_start_idx", kv_start_idx), softmax_layout, seed, offset)
    if sink is None:
        lengths = () if cu is None else ("auto", *cu)  # the ops' trailing arguments: backend, cu_seqlens_q/k
        out, smax, ssum = fa_op.flash_attention(q, k, value, pse, atten_mask, drop_mask, *scalars, *lengths)
    else:
        context_parallel.reject_in_region("sink", sink)
        check_sink(sink, head_num)
        sink_kw = dict(layout=layout, softmax_layout=softmax_layout, q_lens=_q_lens(layout, qlen, query),
                       head_num=head_num)
        out, smax, ssum = _SinkAttention.apply(q, k, value, pse, sink, atten_mask, drop_mask, scalars, sink_kw)
    return out, smax, ssum, query.new_empty(0), seed, offset, numels


def _backward(query, key, value, dy, head_num, input_layout, *, pse, padding_mask, atten_mask, softmax_max,
              softmax_sum, attention_in, query_rope, key_rope, scale_value, keep_prob, pre_tokens, next_tokens,
              inner_precise, seed, offset, numels, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode, pse_type,
              q_start_idx, kv_start_idx, softmax_layout, sink):
    """``(dq, dk, dv, dpse, dq_rope, dk_rope, dsink)`` with None for the absent pse and rope, an empty fp32
    ``dsink`` without sink."""
    check_tensor("query", query)
    reject_unsupported(padding_mask=padding_mask)
    check_int("inner_precise", inner_precise)
    layout = normalize_layout("input_layout", input_layout)
    cu = None if sink is not None else _device_lengths(layout, actual_seq_qlen, actual_seq_kvlen, numels is None)
    qlen, kvlen = _seq_lists(layout, actual_seq_qlen, actual_seq_kvlen) if cu is None else (None, None)
    q, k = _with_rope(query, key, query_rope, key_rope, layout, head_num)
    seed, offset = check_seed_offset(seed, offset)
    if keep_prob < 1.0 and numels is not None:  # v3 passes no numels
        expected = _numels(q, k, value, head_num, layout, qlen, kvlen)
        require(numels == expected, "numels", f"the forward's numels = N*sum(Sq_b*Skv_b) = {expected}", numels)
    dq, dk, dv, dpse = fa_op.flash_attention_backward(
        dy, q, k, value, attention_in, softmax_max, softmax_sum, pse, atten_mask, None, head_num, layout,
        check_scale("scale_value", scale_value), float(keep_prob), pre_tokens, next_tokens, int_list("prefix", prefix),
        qlen, kvlen, sparse_mode, pse_type, _start("q_start_idx", q_start_idx), _start("kv_start_idx", kv_start_idx),
        softmax_layout, seed, offset, *(() if cu is None else ("auto", *cu)))
    dq_rope = dk_rope = None
    if query_rope is not None:
        dq, dq_rope = _split_rope(dq, query, layout, head_num)
        dk, dk_rope = _split_rope(dk, key, layout, _kv_heads(query, key, layout, head_num))
    if sink is None:
        dsink = torch.empty([0], dtype=torch.float32, device=query.device)
    else:
        context_parallel.reject_in_region("sink", sink)
        check_sink(sink, head_num)
        dsink = sink_grad(dy, attention_in, softmax_max, softmax_sum, sink, layout=layout,
                          softmax_layout=softmax_layout, q_lens=_q_lens(layout, qlen, query), head_num=head_num)
    return dq, dk, dv, fa_op.pse_grad(dpse, pse, pse_type), dq_rope, dk_rope, dsink


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1., keep_prob=1., pre_tockens=INT_MAX, next_tockens=INT_MAX, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False, softmax_layout="", sink=None, dropout_mask=None, seed=0,
                         offset=0):
    """``torch_npu.npu_fusion_attention``: ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset,
    numels)``; differentiable w.r.t. query, key, value, pse and sink through ``attention_out``.

    ``sink`` (fp32 ``[head_num]``): one extra logit per head in the softmax denominator; ``softmax_max``/``_sum``
    then include it (``max(m, sink)``, see :mod:`.sink`). ``scale`` defaults to 1.0 as on the NPU. With
    ``0 < keep_prob < 1`` and no ``dropout_mask`` the seed and offset come from the NPU generator
    (:mod:`.npu_generator`) and are returned, as on SoCs before Ascend950; on an Ascend950 (:mod:`.soc`) the given ``seed``/``offset`` drive the dropout and are returned. Pass
    ``seed``/``offset``/``numels`` to :func:`npu_fusion_attention_grad` to regenerate the same mask.
    ``gen_mask_parallel``/``sync`` have no numerical effect (as on the NPU).
    """
    return _forward(query, key, value, head_num, input_layout, pse=pse, padding_mask=padding_mask,
                    atten_mask=atten_mask, query_rope=None, key_rope=None, scale=scale, keep_prob=keep_prob,
                    pre_tokens=pre_tockens, next_tokens=next_tockens, inner_precise=inner_precise, prefix=prefix,
                    actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode,
                    pse_type=1, q_start_idx=None, kv_start_idx=None, softmax_layout=softmax_layout, sink=sink,
                    dropout_mask=dropout_mask, seed=seed, offset=offset)


def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                              atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                              attention_in=None, scale_value=1., keep_prob=1., pre_tockens=INT_MAX,
                              next_tockens=INT_MAX, inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
                              actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                              sync=False, softmax_layout="", sink=None):
    """``torch_npu.npu_fusion_attention_grad``: ``(dq, dk, dv, dpse, dsink)``.

    Uses the given ``softmax_max``/``softmax_sum``/``attention_in`` as they are (context-parallel callers pass
    merged ones); the dropout mask is regenerated from ``seed``/``offset``. ``dpse`` is None without ``pse``;
    ``dsink`` is fp32 ``[head_num]`` with ``sink``, else an empty fp32 tensor. ``softmax_in`` is the reserved empty
    ``softmax_out`` and is not read.
    """
    dq, dk, dv, dpse, _, _, dsink = _backward(
        query, key, value, dy, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        softmax_max=softmax_max, softmax_sum=softmax_sum, attention_in=attention_in, query_rope=None, key_rope=None,
        scale_value=scale_value, keep_prob=keep_prob, pre_tokens=pre_tockens, next_tokens=next_tockens,
        inner_precise=inner_precise, seed=seed, offset=offset, numels=numels, prefix=prefix,
        actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, pse_type=1,
        q_start_idx=None, kv_start_idx=None, softmax_layout=softmax_layout, sink=sink)
    return dq, dk, dv, dpse, dsink


def npu_fusion_attention_v2(query, key, value, head_num, input_layout, *, pse=None, padding_mask=None,
                            atten_mask=None, query_rope=None, key_rope=None, scale=1., keep_prob=1.,
                            pre_tokens=INT_MAX, next_tokens=INT_MAX, inner_precise=0, prefix=None,
                            actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                            sync=False, pse_type=1, q_start_idx=None, kv_start_idx=None, softmax_layout="",
                            sink=None, dropout_mask=None, seed=0, offset=0):
    """``torch_npu.npu_fusion_attention_v2``: :func:`npu_fusion_attention` plus ``pse_type`` 0-3 (2/3: ALiBi from
    fp32 slopes with ``q_start_idx``/``kv_start_idx``) and MLA ``query_rope``/``key_rope``; same outputs."""
    return _forward(query, key, value, head_num, input_layout, pse=pse, padding_mask=padding_mask,
                    atten_mask=atten_mask, query_rope=query_rope, key_rope=key_rope, scale=scale,
                    keep_prob=keep_prob, pre_tokens=pre_tokens, next_tokens=next_tokens, inner_precise=inner_precise,
                    prefix=prefix, actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
                    sparse_mode=sparse_mode, pse_type=pse_type, q_start_idx=q_start_idx, kv_start_idx=kv_start_idx,
                    softmax_layout=softmax_layout, sink=sink, dropout_mask=dropout_mask, seed=seed, offset=offset)


def npu_fusion_attention_grad_v2(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                                 atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                                 attention_in=None, query_rope=None, key_rope=None, scale_value=1., keep_prob=1.,
                                 pre_tokens=INT_MAX, next_tokens=INT_MAX, inner_precise=0, seed=0, offset=0,
                                 numels=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                                 gen_mask_parallel=True, sync=False, pse_type=1, q_start_idx=None,
                                 kv_start_idx=None, softmax_layout="", sink=None):
    """``torch_npu.npu_fusion_attention_grad_v2``: ``(dq, dk, dv, dpse, dq_rope, dk_rope, dsink)``; the rope
    gradients are None without rope inputs."""
    return _backward(
        query, key, value, dy, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        softmax_max=softmax_max, softmax_sum=softmax_sum, attention_in=attention_in, query_rope=query_rope,
        key_rope=key_rope, scale_value=scale_value, keep_prob=keep_prob, pre_tokens=pre_tokens,
        next_tokens=next_tokens, inner_precise=inner_precise, seed=seed, offset=offset, numels=numels,
        prefix=prefix, actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode,
        pse_type=pse_type, q_start_idx=q_start_idx, kv_start_idx=kv_start_idx, softmax_layout=softmax_layout,
        sink=sink)


def _host_int(name: str, value) -> int:
    """A seed/offset given as an int or a one-element integer tensor (v3)."""
    if isinstance(value, Tensor):
        require(value.numel() == 1 and not value.is_floating_point(), name, "a one-element integer tensor", value)
        return int(value.reshape(-1)[0])
    return check_int(name, value)


def npu_fusion_attention_v3(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                            scale=1., keep_prob=1., pre_tockens=INT_MAX, next_tockens=INT_MAX, inner_precise=0,
                            prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                            gen_mask_parallel=True, sync=False, softmax_layout="", sink=None):
    """``torch_npu.npu_fusion_attention_v3`` (graph-friendly v1): ``(attention_out, softmax_max, softmax_sum,
    softmax_out, seed, offset)`` with ``seed``/``offset`` int64 ``[1]`` CPU tensors and no ``numels``;
    ``actual_seq_qlen``/``actual_seq_kvlen`` may be 1-D int64 tensors (cumulative): on a GPU (without ``sink``) the
    kernels read them, never the host, so the call is capturable in a CUDA graph. Differentiable as v1."""
    out, smax, ssum, softmax_out, seed, offset, _ = _forward(
        query, key, value, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        query_rope=None, key_rope=None, scale=scale, keep_prob=keep_prob, pre_tokens=pre_tockens,
        next_tokens=next_tockens, inner_precise=inner_precise, prefix=prefix, actual_seq_qlen=actual_seq_qlen,
        actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, pse_type=1, q_start_idx=None, kv_start_idx=None,
        softmax_layout=softmax_layout, sink=sink, dropout_mask=None, seed=0, offset=0, graph_friendly=True)
    return out, smax, ssum, softmax_out, torch.tensor([seed]), torch.tensor([offset])


def npu_fusion_attention_grad_v3(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                                 atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                                 attention_in=None, scale_value=1., keep_prob=1., pre_tockens=INT_MAX,
                                 next_tockens=INT_MAX, inner_precise=0, seed=None, offset=None, prefix=None,
                                 actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                                 sync=False, softmax_layout="", sink=None):
    """``torch_npu.npu_fusion_attention_grad_v3``: ``(dq, dk, dv, dpse, dsink)`` from v3's outputs (``seed``/
    ``offset`` tensors, no ``numels``); ``dpse`` is an empty tensor without ``pse`` and ``dsink`` a 0-dim one
    without ``sink``, as op-plugin's fake kernel allocates them."""
    require(keep_prob == 1.0 or (seed is not None and offset is not None), "seed",
            "the forward's seed and offset tensors when keep_prob < 1", seed)
    dq, dk, dv, dpse, _, _, dsink = _backward(
        query, key, value, dy, head_num, input_layout, pse=pse, padding_mask=padding_mask, atten_mask=atten_mask,
        softmax_max=softmax_max, softmax_sum=softmax_sum, attention_in=attention_in, query_rope=None, key_rope=None,
        scale_value=scale_value, keep_prob=keep_prob, pre_tokens=pre_tockens, next_tokens=next_tockens,
        inner_precise=inner_precise, seed=0 if seed is None else _host_int("seed", seed),
        offset=0 if offset is None else _host_int("offset", offset), numels=None, prefix=prefix,
        actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, pse_type=1,
        q_start_idx=None, kv_start_idx=None, softmax_layout=softmax_layout, sink=sink)
    if dpse is None:
        dpse = query.new_empty(0)
    if sink is None:
        dsink = torch.zeros([], device=query.device)
    return dq, dk, dv, dpse, dsink


npu_fusion_attention = with_overloads(npu_fusion_attention)
npu_fusion_attention_grad = with_overloads(npu_fusion_attention_grad)
npu_fusion_attention_v2 = with_overloads(npu_fusion_attention_v2)
npu_fusion_attention_grad_v2 = with_overloads(npu_fusion_attention_grad_v2)
npu_fusion_attention_v3 = with_overloads(npu_fusion_attention_v3)
npu_fusion_attention_grad_v3 = with_overloads(npu_fusion_attention_grad_v3)
