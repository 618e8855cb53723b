"""torch_npu's inference attention: ``npu_fused_infer_attention_score`` (and its ``.out`` overload),
``npu_prompt_flash_attention`` (PFA) and ``npu_incre_flash_attention`` (IFA), all on the
``attnops::fused_infer_attention`` custom op.

torch_npu specifics kept here: single ``key``/``value`` tensors, ``softmax_lse`` as an empty ``[0]`` tensor unless
requested, PFA's ``next_tokens=0`` default and ``sparse_mode`` 10-14 (modes 0-4 with ``inner_precise=0``), IFA's
``actual_seq_lengths`` meaning the per-batch KV lengths and its ``inner_precise=1`` default. All are inference-only:
a backward through their outputs raises :class:`attnops.InferenceOnlyError` (torch_npu has no autograd formula).
"""
from __future__ import annotations

import inspect
from functools import partial

import torch
from torch import Tensor

from .._core.checks import Described, caller_names, check_int, check_scale, check_tensor, fail, int_list, require
from .._core.inference_only import run_inference_only
from .._core.layouts import bsnd_dims, io_layouts
from ..ops.fused_infer_attention import op as fia_op
from ..ops.fused_infer_attention.inputs import LAYOUTS, output_head_dim
from ._common import INT_MAX, reject_unsupported, with_overloads
from . import fia_layouts
from .out_quant import check_out_dtype, quantize_output
from .rope import append_nz_rope, append_rope, check_nz_rope, check_rope, head_split, rope_given

PFA_HIGH_PRECISION_MODES = range(10, 15)  # PFA sparse_mode 10-14 = modes 0-4 with inner_precise 0


_NOT_WITH_ROPE = ("deq_scale1", "quant_scale1", "deq_scale2", "quant_scale2", "quant_offset2", "antiquant_scale",
                  "antiquant_offset", "key_antiquant_scale", "key_antiquant_offset", "value_antiquant_scale",
                  "value_antiquant_offset", "key_shared_prefix", "value_shared_prefix")

# the shared FIA names of v2's renamed parameters
V2_NAMES = dict(actual_seq_lengths="actual_seq_qlen", actual_seq_lengths_kv="actual_seq_kvlen",
                num_heads="num_query_heads", scale="softmax_scale", quant_scale2="quant_scale_out",
                quant_offset2="quant_offset_out")


def _fia(query, key, value, *, query_rope=None, key_rope=None, pse_shift=None, atten_mask=None,
         actual_seq_lengths=None, actual_seq_lengths_kv=None, deq_scale1=None, quant_scale1=None, deq_scale2=None,
         quant_scale2=None, quant_offset2=None, antiquant_scale=None, antiquant_offset=None, key_antiquant_scale=None,
         key_antiquant_offset=None, value_antiquant_scale=None, value_antiquant_offset=None, block_table=None,
         query_padding_size=None, kv_padding_size=None, key_shared_prefix=None, value_shared_prefix=None,
         actual_shared_prefix_len=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0, pre_tokens=INT_MAX,
         next_tokens=INT_MAX, input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0,
         block_size=0, antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0, learnable_sink=None
         ) -> tuple[Tensor, Tensor]:
    """The custom op with the aclnn parameter names; ``(attention_out, softmax_lse)``. torch_npu-only layouts run in
    a core layout (:mod:`.fia_layouts`), MLA rope as :func:`_mla_operands` says, a learnable sink as
    :func:`_apply_sink` says."""
    reject_unsupported(key_rope_antiquant_scale=key_rope_antiquant_scale)  # int8 rope caches
    require(isinstance(key, Tensor) and isinstance(value, Tensor), "key",
            "single key/value tensors (torch_npu passes one tensor each)", Described(type(key).__name__))
    layouts = fia_layouts.plan(input_layout)
    if layouts.reads is not None:
        query, query_rope = (fia_layouts.to_core(x, layouts.reads) for x in (query, query_rope))
        key_shared_prefix, value_shared_prefix = (fia_layouts.to_core(x, layouts.reads)
                                                  for x in (key_shared_prefix, value_shared_prefix))
        if block_table is None:  # a paged cache has its own layout
            key, value, key_rope = (fia_layouts.to_core(x, layouts.reads) for x in (key, value, key_rope))
    input_layout = layouts.core
    if rope_given(query_rope, key_rope):
        args = locals()
        for name in _NOT_WITH_ROPE:
            if args[name] is not None:
                raise NotImplementedError(f"{name}: attnops.torch_npu does not support it together with "
                                          "query_rope/key_rope (MLA); see docs/porting.md")
        query, key, value, block_table = _mla_operands(
            query, key, value, query_rope, key_rope, block_table, input_layout=input_layout, num_heads=num_heads,
            num_key_value_heads=num_key_value_heads, sparse_mode=sparse_mode, pre_tokens=pre_tokens,
            next_tokens=next_tokens)
    (q_lens, q_lens_tensor), (kv_lens, kv_lens_tensor) = (_lengths(name, x) for name, x in (
        ("actual_seq_lengths", actual_seq_lengths), ("actual_seq_lengths_kv", actual_seq_lengths_kv)))
    out, lse = fia_op.fused_infer_attention(
        query, key, value, pse_shift, atten_mask, q_lens, kv_lens, deq_scale1, quant_scale1, deq_scale2,
        quant_scale2, quant_offset2, antiquant_scale, antiquant_offset, key_antiquant_scale, key_antiquant_offset,
        value_antiquant_scale, value_antiquant_offset, block_table, query_padding_size, kv_padding_size,
        key_shared_prefix, value_shared_prefix, int_list("actual_shared_prefix_len", actual_shared_prefix_len),
        num_heads, check_scale("scale", scale), pre_tokens, next_tokens, input_layout, num_key_value_heads, sparse_mode,
        inner_precise, block_size, antiquant_mode, key_antiquant_mode, value_antiquant_mode,
        actual_seq_lengths_tensor=q_lens_tensor, actual_seq_lengths_kv_tensor=kv_lens_tensor)
    core_out = io_layouts("input_layout", input_layout, LAYOUTS)[1]
    if learnable_sink is not None:  # inference-only in the sink too
        out, lse = run_inference_only(fia_op.INFERENCE_ONLY, partial(_apply_sink, out, lse, learnable_sink, core_out,
                                                                     num_heads), out, lse, learnable_sink)
    return fia_layouts.from_core(out, core_out, layouts.writes, num_heads), lse


def _lengths(name: str, value) -> tuple[list[int] | None, Tensor | None]:
    """``(list, tensor)``: per-batch lengths for the op's ``int[]`` argument, or a tensor passed on as it is (its
    values are read by the kernels, or on the host for CPU tensors, and never traced by ``torch.compile``)."""
    if isinstance(value, Tensor):
        return None, value
    return int_list(name, value), None


def _mla_operands(query, key, value, query_rope, key_rope, block_table, *, input_layout, num_heads,
                  num_key_value_heads, sparse_mode, pre_tokens, next_tokens):
    """MLA: ``query``/``key`` with their rope parts appended to each head's D, so the operator (whose output takes
    the value's head dim) computes ``softmax(scale * (q k^T + q_rope k_rope^T)) v``; returns them, the value and the
    block table (paged caches are first cut down to the pages it names, see :func:`_referenced_pages`)."""
    in_layout = io_layouts("input_layout", input_layout, LAYOUTS)[0]
    paged = block_table is not None
    require(query.is_floating_point(), "query", "a float16/bfloat16/float32 query with query_rope/key_rope (int8 "
            "queries with rope are not supported by attnops.torch_npu)", query)
    require(key.is_floating_point(), "key", "a float key with query_rope/key_rope (int8/int4 antiquant caches with "
            "rope are not supported by attnops.torch_npu)", key)
    require(key.dtype == query.dtype, "key", f"dtype {query.dtype} (same as query)", key)
    kv_heads = check_int("num_key_value_heads", num_key_value_heads, lo=0) or num_heads
    q_packed = in_layout == "BSH"
    kv_packed = key.dim() == 3 if paged else q_packed
    if in_layout != "TND" and bsnd_dims(query, in_layout, num_heads)[1] == 1:
        require(sparse_mode == 0 and pre_tokens == INT_MAX and next_tokens == INT_MAX, "sparse_mode",
                "sparse_mode 0 and no pre_tokens/next_tokens with query_rope at Q_S = 1 (the NPU applies them there; "
                "attnops' decode path does not)", Described(f"sparse_mode={sparse_mode}, pre_tokens={pre_tokens}, "
                f"next_tokens={next_tokens}"))
    per_head = kv_heads if kv_packed else 1
    q = append_rope("query_rope", query, query_rope, packed=q_packed, heads=num_heads, like="query")
    nz = paged and key.dim() == 5
    dr = head_split(query_rope, q_packed, num_heads).shape[-1]
    if paged:
        if nz:
            check_nz_rope(key, key_rope, dr)
        else:
            check_rope("key_rope", key, key_rope, packed=kv_packed, heads=kv_heads, like="key")
        require(value.shape[0] == key.shape[0], "value", f"{key.shape[0]} blocks like key", value)
        block_table, (key, value, key_rope) = _referenced_pages(block_table, key, value, key_rope)
    k = append_nz_rope(key, key_rope, dr) if nz else append_rope("key_rope", key, key_rope, packed=kv_packed,
                                                              heads=kv_heads, like="key")
    dk, dv = (output_head_dim(x, in_layout, paged, kv_heads) for x in (k, value))
    require(dv <= dk and value.shape[-1] % per_head == 0, "value", f"a head dim of at most D + Dr = {dk} (key and "
            "key_rope)", value)
    return q, k, value, block_table


def _referenced_pages(block_table: Tensor, *caches: Tensor) -> tuple[Tensor, list[Tensor]]:
    """The caches cut down to the pages ``block_table`` names, and the table renumbered to match, so the rope
    concatenation copies what the call reads rather than the whole cache. Zero pages keep the block count at
    ``min(blocks, table entries)`` (requests may share pages, and the operator checks that the cache holds as many
    blocks as they need); negative entries (padding) stay. A table naming an id past the cache is left as it is,
    for the operator to report in the caller's terms."""
    blocks = caches[0].shape[0]
    ids = block_table.long()
    if bool((ids >= blocks).any()):
        return block_table, list(caches)
    valid = ids >= 0
    used = torch.unique(ids[valid])
    kept = min(blocks, max(used.numel(), ids.numel()))
    renumber = torch.full((blocks,), -1, dtype=torch.long, device=ids.device)
    renumber[used] = torch.arange(used.numel(), device=ids.device)
    table = torch.where(valid, renumber[ids.clamp(min=0)], ids).to(block_table.dtype)
    pad = kept - used.numel()
    return table, [torch.cat([c[used], c.new_zeros(pad, *c.shape[1:])]) for c in caches]


def _fia_score(query, key, value, *, dequant_scale1, dequant_scale2, softmax_lse_flag, **kw) -> tuple[Tensor, Tensor]:
    check_tensor("query", query)
    require(isinstance(softmax_lse_flag, bool), "softmax_lse_flag", "a bool", softmax_lse_flag)
    out, lse = _fia(query, key, value, deq_scale1=dequant_scale1, deq_scale2=dequant_scale2, **kw)
    return out, (lse if softmax_lse_flag else torch.empty([0], dtype=torch.float32, device=query.device))


def npu_fused_infer_attention_score(
        query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
        dequant_scale1=None, quant_scale1=None, dequant_scale2=None, quant_scale2=None, quant_offset2=None,
        antiquant_scale=None, antiquant_offset=None, key_antiquant_scale=None, key_antiquant_offset=None,
        value_antiquant_scale=None, value_antiquant_offset=None, block_table=None, query_padding_size=None,
        kv_padding_size=None, key_shared_prefix=None, value_shared_prefix=None, actual_shared_prefix_len=None,
        query_rope=None, key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0, pre_tokens=INT_MAX,
        next_tokens=INT_MAX, input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0,
        block_size=0, antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0, softmax_lse_flag=False):
    """``torch_npu.npu_fused_infer_attention_score``: ``(attention_out, softmax_lse)``, inference only.

    ``actual_seq_lengths(_kv)`` are per-batch for dense layouts and cumulative for TND, except the KV lengths of a
    paged cache (``block_table``), which are per request. ``softmax_lse`` is fp32 ``[B, N, Q_S, 1]`` /
    ``[T, N, 1]`` with ``softmax_lse_flag``, else an empty ``[0]`` tensor. ``num_key_value_heads=0`` means
    ``num_heads``. MLA ``query_rope``/``key_rope`` (float, not with quantization, antiquant or a shared prefix)
    are appended to each head's D of query and key: ``softmax(scale * (q k^T + q_rope k_rope^T)) v``.
    """
    return _fia_score(**locals())


def _npu_fused_infer_attention_score_out(
        query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
        dequant_scale1=None, quant_scale1=None, dequant_scale2=None, quant_scale2=None, quant_offset2=None,
        antiquant_scale=None, antiquant_offset=None, key_antiquant_scale=None, key_antiquant_offset=None,
        value_antiquant_scale=None, value_antiquant_offset=None, block_table=None, query_padding_size=None,
        kv_padding_size=None, key_shared_prefix=None, value_shared_prefix=None, actual_shared_prefix_len=None,
        query_rope=None, key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0, pre_tokens=INT_MAX,
        next_tokens=INT_MAX, input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0,
        block_size=0, antiquant_mode=0, key_antiquant_mode=0, value_antiquant_mode=0, softmax_lse_flag=False,
        workspace=None, out):
    """``npu_fused_infer_attention_score.out``: writes into ``out=[attention_out, softmax_lse]`` (resized when their
    shapes differ) and returns them. ``workspace`` is accepted and unused (attnops needs no workspace)."""
    kw = {name: v for name, v in locals().items() if name not in ("workspace", "out")}
    return _write_out(out, _fia_score(**kw))


def _write_out(out, results: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Copy ``results`` into ``out=[attention_out, softmax_lse]`` (resized when their shapes differ)."""
    require(isinstance(out, (list, tuple)) and len(out) == 2, "out", "a list [attention_out, softmax_lse]", out)
    for target, result in zip(out, results):
        if target.shape != result.shape:
            target.resize_(result.shape)
        target.copy_(result)
    return out[0], out[1]


def _npu_fused_infer_attention_score_get_max_workspace(query, key, value, **kwargs) -> Tensor:
    """The graph-mode workspace vllm-ascend allocates for ``.out``: empty, attnops needs none."""
    return torch.empty([0], dtype=torch.uint8, device=query.device)


_npu_fused_infer_attention_score_v2_get_max_workspace = _npu_fused_infer_attention_score_get_max_workspace


def _apply_sink(out: Tensor, lse: Tensor, sink: Tensor, out_layout: str, heads: int) -> tuple[Tensor, Tensor]:
    """``learnable_sink [Q_N]``, one extra logit per head in the softmax denominator: ``out * sigmoid(lse - sink)``
    and ``logaddexp(lse, sink)`` (rows with nothing to attend to keep output 0 and lse +inf)."""
    out = (out.float() * _sink_weights(lse, sink, out_layout, heads, out)).to(out.dtype)
    return out, torch.logaddexp(lse, _per_head(sink, lse))


def _per_head(sink: Tensor, lse: Tensor) -> Tensor:
    """``sink [N]`` broadcastable over ``lse`` (``[B, N, S, 1]`` or ``[T, N, 1]``)."""
    return sink.float().view([-1] + [1] * (lse.dim() - 2))


def _sink_weights(lse: Tensor, sink: Tensor, out_layout: str, heads: int, out: Tensor) -> Tensor:
    """``sigmoid(lse - sink[n])`` (the key share of each row's softmax mass) broadcastable over ``out``."""
    w = torch.sigmoid(lse - _per_head(sink, lse)).squeeze(-1)  # [B, N, S] or [T, N]
    if out_layout in ("BSH", "BSND"):
        w = w.transpose(1, 2)
    w = w.unsqueeze(-1)
    return w.flatten(-2).repeat_interleave(out.shape[-1] // heads, -1) if out_layout == "BSH" else w


def npu_fused_infer_attention_score_v2(
        query, key, value, *, query_rope=None, key_rope=None, pse_shift=None, atten_mask=None, actual_seq_qlen=None,
        actual_seq_kvlen=None, block_table=None, dequant_scale_query=None, dequant_scale_key=None,
        dequant_offset_key=None, dequant_scale_value=None, dequant_offset_value=None, dequant_scale_key_rope=None,
        quant_scale_out=None, quant_offset_out=None, quant_scale_p=None, learnable_sink=None, num_query_heads=1,
        num_key_value_heads=0, softmax_scale=1.0, pre_tokens=INT_MAX, next_tokens=INT_MAX, input_layout="BSH",
        sparse_mode=0, block_size=0, query_quant_mode=0, key_quant_mode=0, value_quant_mode=0, inner_precise=0,
        return_softmax_lse=False, query_dtype=None, key_dtype=None, value_dtype=None, query_rope_dtype=None,
        key_rope_dtype=None, key_shared_prefix_dtype=None, value_shared_prefix_dtype=None,
        dequant_scale_query_dtype=None, dequant_scale_key_dtype=None, dequant_scale_value_dtype=None,
        dequant_scale_key_rope_dtype=None, out_dtype=None):
    """``torch_npu.npu_fused_infer_attention_score_v2``: the v1 op with renamed arguments (``actual_seq_qlen`` /
    ``actual_seq_kvlen``, ``num_query_heads``, ``softmax_scale``, ``return_softmax_lse``, ``quant_scale_out`` /
    ``quant_offset_out``) plus ``learnable_sink``.

    ``learnable_sink [Q_N]`` is one extra logit per head, compared with the scaled scores, that enters only the
    softmax denominator: ``attention_out = out * sigmoid(lse - sink)`` and ``softmax_lse = logaddexp(lse, sink)``
    (rows with nothing to attend to keep output 0 and lse +inf). MLA ``query_rope``/``key_rope`` as in v1. The
    quantized inputs and the hif8/fp4 ``*_dtype`` reinterpretations raise :class:`NotImplementedError`.
    ``out_dtype`` with ``quant_scale_out``: int8 (the default) or an 8-bit float output (:mod:`.out_quant`).
    """
    reject_unsupported(dequant_scale_query=dequant_scale_query,
                       dequant_scale_key=dequant_scale_key, dequant_offset_key=dequant_offset_key,
                       dequant_scale_value=dequant_scale_value, dequant_offset_value=dequant_offset_value,
                       dequant_scale_key_rope=dequant_scale_key_rope, quant_scale_p=quant_scale_p,
                       query_dtype=query_dtype, key_dtype=key_dtype, value_dtype=value_dtype,
                       query_rope_dtype=query_rope_dtype, key_rope_dtype=key_rope_dtype,
                       key_shared_prefix_dtype=key_shared_prefix_dtype,
                       value_shared_prefix_dtype=value_shared_prefix_dtype,
                       dequant_scale_query_dtype=dequant_scale_query_dtype,
                       dequant_scale_key_dtype=dequant_scale_key_dtype,
                       dequant_scale_value_dtype=dequant_scale_value_dtype,
                       dequant_scale_key_rope_dtype=dequant_scale_key_rope_dtype)
    check_tensor("query", query)
    check_out_dtype(out_dtype, quant_scale_out)
    float_out = quant_scale_out is not None and out_dtype not in (None, torch.int8)
    for name, mode in (("query_quant_mode", query_quant_mode), ("key_quant_mode", key_quant_mode),
                       ("value_quant_mode", value_quant_mode)):
        require(mode == 0, name, "0 (quantized inputs are not supported by attnops.torch_npu)", mode)
    require(isinstance(return_softmax_lse, bool), "return_softmax_lse", "a bool", return_softmax_lse)
    if learnable_sink is not None:
        require(quant_scale_out is None, "learnable_sink", "no learnable_sink with an int8 output (quant_scale_out)",
                learnable_sink)
        require(isinstance(learnable_sink, Tensor) and tuple(learnable_sink.shape) == (num_query_heads,),
                "learnable_sink", f"a tensor of shape [num_query_heads] = [{num_query_heads}]", learnable_sink)
    with caller_names(**V2_NAMES):
        out, lse = _fia(query, key, value, query_rope=query_rope, key_rope=key_rope, pse_shift=pse_shift,
                        atten_mask=atten_mask, actual_seq_lengths=actual_seq_qlen,
                        actual_seq_lengths_kv=actual_seq_kvlen, block_table=block_table,
                        quant_scale2=None if float_out else quant_scale_out,
                        quant_offset2=None if float_out else quant_offset_out, num_heads=num_query_heads,
                        scale=softmax_scale,
                        pre_tokens=pre_tokens, next_tokens=next_tokens, input_layout=input_layout,
                        num_key_value_heads=num_key_value_heads, sparse_mode=sparse_mode, inner_precise=inner_precise,
                        block_size=block_size, learnable_sink=learnable_sink)
    if float_out:
        out = quantize_output(out, quant_scale_out, quant_offset_out, out_dtype, input_layout, num_query_heads)
    return out, (lse if return_softmax_lse else torch.empty([0], dtype=torch.float32, device=query.device))


def _npu_fused_infer_attention_score_v2_out(query, key, value, *, workspace=None, out, **kwargs):
    """``npu_fused_infer_attention_score_v2.out``: as :func:`npu_fused_infer_attention_score_v2`, written into
    ``out=[attention_out, softmax_lse]``; ``workspace`` is accepted and unused."""
    return _write_out(out, npu_fused_infer_attention_score_v2(query, key, value, **kwargs))


def npu_prompt_flash_attention(query, key, value, *, padding_mask=None, atten_mask=None, pse_shift=None,
                               actual_seq_lengths=None, deq_scale1=None, quant_scale1=None, deq_scale2=None,
                               quant_scale2=None, quant_offset2=None, num_heads=1, scale_value=1.0,
                               pre_tokens=INT_MAX, next_tokens=0, input_layout="BSH", num_key_value_heads=0,
                               actual_seq_lengths_kv=None, sparse_mode=0):
    """``torch_npu.npu_prompt_flash_attention`` (prefill): the attention output only.

    ``next_tokens`` defaults to 0 (used with a mask in sparse modes 0/4). ``sparse_mode`` 10-14 are modes 0-4 in
    high-precision mode (``inner_precise=0``); attnops always computes in fp32, so only the mode matters.
    """
    reject_unsupported(padding_mask=padding_mask)
    check_tensor("query", query)
    high_precision = sparse_mode in PFA_HIGH_PRECISION_MODES
    out, _ = _fia(query, key, value, pse_shift=pse_shift, atten_mask=atten_mask,
                  actual_seq_lengths=actual_seq_lengths, actual_seq_lengths_kv=actual_seq_lengths_kv,
                  deq_scale1=deq_scale1, quant_scale1=quant_scale1, deq_scale2=deq_scale2, quant_scale2=quant_scale2,
                  quant_offset2=quant_offset2, num_heads=num_heads, scale=scale_value, pre_tokens=pre_tokens,
                  next_tokens=next_tokens, input_layout=input_layout, num_key_value_heads=num_key_value_heads,
                  sparse_mode=sparse_mode - 10 if high_precision else sparse_mode,
                  inner_precise=0 if high_precision else 1)
    return out


def npu_incre_flash_attention(query, key, value, *, padding_mask=None, atten_mask=None, pse_shift=None,
                              actual_seq_lengths=None, antiquant_scale=None, antiquant_offset=None, block_table=None,
                              dequant_scale1=None, quant_scale1=None, dequant_scale2=None, quant_scale2=None,
                              quant_offset2=None, kv_padding_size=None, num_heads=1, scale_value=1.0,
                              input_layout="BSH", num_key_value_heads=0, block_size=0, inner_precise=1):
    """``torch_npu.npu_incre_flash_attention`` (decode, query S = 1): the attention output only.

    ``actual_seq_lengths`` holds the per-batch **KV** lengths (shape (B,) or (1,)).
    """
    reject_unsupported(padding_mask=padding_mask)
    check_tensor("query", query, ndim=(3, 4))
    if not isinstance(input_layout, str) or input_layout.upper() not in ("BSH", "BSND", "BNSD"):
        fail("input_layout", "one of ['BSH', 'BSND', 'BNSD'] (incremental attention)", input_layout)
    q_s = bsnd_dims(query, input_layout.upper(), num_heads)[1]
    require(q_s == 1, "query", "a query sequence length of 1 (incremental decoding)", query)
    with caller_names(actual_seq_lengths_kv="actual_seq_lengths", scale="scale_value"):
        out, _ = _fia(query, key, value, pse_shift=pse_shift, atten_mask=atten_mask,
                      actual_seq_lengths_kv=actual_seq_lengths, antiquant_scale=antiquant_scale,
                      antiquant_offset=antiquant_offset, block_table=block_table, deq_scale1=dequant_scale1,
                      quant_scale1=quant_scale1, deq_scale2=dequant_scale2, quant_scale2=quant_scale2,
                      quant_offset2=quant_offset2, kv_padding_size=kv_padding_size, num_heads=num_heads,
                      scale=scale_value, input_layout=input_layout, num_key_value_heads=num_key_value_heads,
                      block_size=block_size, inner_precise=inner_precise)
    return out


npu_fused_infer_attention_score = with_overloads(npu_fused_infer_attention_score,
                                                 out=_npu_fused_infer_attention_score_out)
npu_fused_infer_attention_score_v2 = with_overloads(npu_fused_infer_attention_score_v2,
                                                    out=_npu_fused_infer_attention_score_v2_out)
_npu_fused_infer_attention_score_v2_out.__signature__ = inspect.signature(npu_fused_infer_attention_score_v2).replace(
    parameters=[*inspect.signature(npu_fused_infer_attention_score_v2).parameters.values(),
                inspect.Parameter("workspace", inspect.Parameter.KEYWORD_ONLY, default=None),
                inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY)])
npu_prompt_flash_attention = with_overloads(npu_prompt_flash_attention)
npu_incre_flash_attention = with_overloads(npu_incre_flash_attention)
