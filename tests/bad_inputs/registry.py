"""One small valid call per public entry point of every dialect (tiny shapes on the CPU, fp32 where the operator
takes it, else its fp16/bf16/int8), and where an independent fp64 golden exists, the golden of that call.

A :class:`Case` is built fresh by its factory (cache operators write into their arguments). ``args`` are passed as
keywords, under the names the caller of that dialect uses, so an error message can be checked for that name.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

import attnops
import attnops.flash_attn as flash_attn
from attnops import aclnn, cann_ops_transformer, nn, torch_npu
from attnops.ops.dsa.quant_cache import quantize
from attnops.testing import (golden, golden_compressor, golden_dsa, golden_dsv4, golden_fia, golden_indexer_v2,
                             golden_nsa)
from tests.aclnn import fa_params
from tests.ops.fused_infer_attention.fia_helpers import aclnn_args
from tests.ops.nsa import nsa_aclnn_params

F32, BF16, I32, I64 = torch.float32, torch.bfloat16, torch.int32, torch.int64
INT_MAX, INT64_MAX = 2147483647, 2**63 - 1


@dataclass
class Case:
    """A valid call ``fn(**args)``; ``golden(args)`` gives the fp64 outputs (a tuple, compared with the first
    outputs of the call) or is None where no independent golden exists."""

    fn: Callable[..., Any]
    args: dict
    golden: Callable[[dict], tuple] | None = None


def r(*shape, seed=0, scale=1.0, dtype=F32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def ints(values, dtype=I32):
    return torch.tensor(values, dtype=dtype)


# --- FlashAttention --------------------------------------------------------------------------------------------

def _fa_qkv(b=1, n1=2, n2=1, sq=3, skv=4, d=8):
    return r(b, n1, sq, d, seed=1), r(b, n2, skv, d, seed=2), r(b, n2, skv, d, seed=3)


def fa_pythonic():
    q, k, v = _fa_qkv()
    return Case(attnops.flash_attention, dict(query=q, key=k, value=v, scale=0.3),
                lambda a: golden.fa_forward(a["query"], a["key"], a["value"], head_num=a["query"].shape[1],
                                            input_layout="BNSD", scale=a["scale"])[:1])


def fa_pythonic_backward():
    q, k, v = _fa_qkv()
    res = attnops.flash_attention(q, k, v, scale=0.3, return_stats=True)
    return Case(attnops.flash_attention_backward,
                dict(dy=r(*res.out.shape, seed=4), query=q, key=k, value=v, attention_out=res.out,
                     softmax_max=res.softmax_max, softmax_sum=res.softmax_sum, scale=0.3),
                lambda a: golden.fa_backward_given_stats(
                    a["dy"], a["query"], a["key"], a["value"], a["attention_out"], a["softmax_max"], a["softmax_sum"],
                    head_num=a["query"].shape[1], input_layout="BNSD", scale=a["scale"]))


def _npu_fa_golden(a):
    return golden.fa_forward(a["query"], a["key"], a["value"], head_num=a["head_num"],
                             input_layout=a["input_layout"], scale=a["scale"])[:1]


def npu_fusion_attention(fn):
    def factory():
        q, k, v = _fa_qkv()
        return Case(fn, dict(query=q, key=k, value=v, head_num=2, input_layout="BNSD", scale=0.3), _npu_fa_golden)
    return factory


def npu_fusion_attention_grad(fn, **extra):
    def factory():
        q, k, v = _fa_qkv()
        out, smax, ssum, *_ = torch_npu.npu_fusion_attention(q, k, v, 2, "BNSD", scale=0.3)
        return Case(fn, dict(query=q, key=k, value=v, dy=r(*out.shape, seed=4), head_num=2, input_layout="BNSD",
                             softmax_max=smax, softmax_sum=ssum, attention_in=out, scale_value=0.3, **extra),
                    lambda a: golden.fa_backward_given_stats(
                        a["dy"], a["query"], a["key"], a["value"], a["attention_in"], a["softmax_max"],
                        a["softmax_sum"], head_num=2, input_layout="BNSD", scale=0.3))
    return factory


def aclnn_fa(op):
    def factory():
        return Case(fa_params.OPS[op][0], fa_params.base_params(op))
    return factory


def flash_attn_func():
    q, k, v = (x.transpose(1, 2).contiguous() for x in _fa_qkv(n2=2))
    return Case(flash_attn.flash_attn_func, dict(q=q, k=k, v=v, softmax_scale=0.3),
                lambda a: golden.fa_forward(a["q"], a["k"], a["v"], head_num=2, input_layout="BSND",
                                            scale=a["softmax_scale"])[:1])


def flash_attn_kvpacked_func():
    q, k, v = (x.transpose(1, 2).contiguous() for x in _fa_qkv(n2=2))
    return Case(flash_attn.flash_attn_kvpacked_func, dict(q=q, kv=torch.stack([k, v], 2), softmax_scale=0.3),
                lambda a: golden.fa_forward(a["q"], a["kv"][:, :, 0], a["kv"][:, :, 1], head_num=2,
                                            input_layout="BSND", scale=a["softmax_scale"])[:1])


def flash_attn_qkvpacked_func():
    qkv = r(1, 4, 3, 2, 8, seed=5)
    return Case(flash_attn.flash_attn_qkvpacked_func, dict(qkv=qkv, softmax_scale=0.3),
                lambda a: golden.fa_forward(a["qkv"][:, :, 0], a["qkv"][:, :, 1], a["qkv"][:, :, 2], head_num=2,
                                            input_layout="BSND", scale=a["softmax_scale"])[:1])


def _varlen_golden(q, k, v, cu_q, cu_k, scale):
    return golden.fa_forward(q, k, v, head_num=q.shape[1], input_layout="TND", scale=scale,
                             actual_seq_qlen=cu_q[1:].tolist(), actual_seq_kvlen=cu_k[1:].tolist())[:1]


def flash_attn_varlen_func():
    return Case(flash_attn.flash_attn_varlen_func,
                dict(q=r(5, 2, 8, seed=1), k=r(6, 2, 8, seed=2), v=r(6, 2, 8, seed=3), cu_seqlens_q=ints([0, 2, 5]),
                     cu_seqlens_k=ints([0, 3, 6]), max_seqlen_q=3, max_seqlen_k=3, softmax_scale=0.3),
                lambda a: _varlen_golden(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                                         a["softmax_scale"]))


def flash_attn_varlen_kvpacked_func():
    return Case(flash_attn.flash_attn_varlen_kvpacked_func,
                dict(q=r(5, 2, 8, seed=1), kv=r(6, 2, 2, 8, seed=2), cu_seqlens_q=ints([0, 2, 5]),
                     cu_seqlens_k=ints([0, 3, 6]), max_seqlen_q=3, max_seqlen_k=3, softmax_scale=0.3),
                lambda a: _varlen_golden(a["q"], a["kv"][:, 0], a["kv"][:, 1], a["cu_seqlens_q"],
                                         a["cu_seqlens_k"], a["softmax_scale"]))


def flash_attn_varlen_qkvpacked_func():
    return Case(flash_attn.flash_attn_varlen_qkvpacked_func,
                dict(qkv=r(5, 3, 2, 8, seed=1), cu_seqlens=ints([0, 2, 5]), max_seqlen=3, softmax_scale=0.3),
                lambda a: _varlen_golden(a["qkv"][:, 0], a["qkv"][:, 1], a["qkv"][:, 2], a["cu_seqlens"],
                                         a["cu_seqlens"], a["softmax_scale"]))


def flash_attn_with_kvcache():
    return Case(flash_attn.flash_attn_with_kvcache,
                dict(q=r(2, 1, 2, 8, seed=1), k_cache=r(2, 6, 2, 8, seed=2), v_cache=r(2, 6, 2, 8, seed=3),
                     cache_seqlens=ints([4, 6]), softmax_scale=0.3))


# --- FusedInferAttention ---------------------------------------------------------------------------------------

def _fia_golden(a, **names):
    kw = {g: a[c] for g, c in names.items() if c in a}
    return golden_fia.fia_forward(a["query"], a["key"], a["value"], **kw)[:1]


def fia_pythonic():
    q, k, v = _fa_qkv(n2=2)
    return Case(attnops.fused_infer_attention, dict(query=q, key=k, value=v, num_heads=2, scale=0.3),
                lambda a: golden_fia.fia_forward(a["query"], a["key"], a["value"], num_heads=2, scale_value=0.3,
                                                 input_layout="BNSD")[:1])


def fia_plan():
    q, k, v = _fa_qkv(n2=2)
    return Case(attnops.fused_infer_attention_plan, dict(query=q, key=k, value=v, num_heads=2, scale=0.3))


def npu_fia(fn, scale_name="scale", layout_name="input_layout", lens_kv="actual_seq_lengths_kv",
            heads_name="num_heads"):
    def factory():
        q, k, v = _fa_qkv(b=2, n2=2)
        args = dict(query=q, key=k, value=v, **{heads_name: 2, scale_name: 0.3, layout_name: "BNSD",
                                                              lens_kv: [4, 3]})
        return Case(fn, args, lambda a: _fia_golden(a, num_heads=heads_name, scale_value=scale_name,
                                                    input_layout=layout_name, actual_seq_lengths_kv=lens_kv))
    return factory


def npu_incre_flash_attention():
    q, k, v = _fa_qkv(b=2, n2=2, sq=1)
    return Case(torch_npu.npu_incre_flash_attention,
                dict(query=q, key=k, value=v, num_heads=2, scale_value=0.3, input_layout="BNSD",
                     actual_seq_lengths=[4, 3]),
                lambda a: _fia_golden(a, num_heads="num_heads", scale_value="scale_value",
                                      input_layout="input_layout", actual_seq_lengths_kv="actual_seq_lengths"))


def npu_prompt_flash_attention():
    q, k, v = _fa_qkv(b=2, n2=2)
    return Case(torch_npu.npu_prompt_flash_attention,
                dict(query=q, key=k, value=v, num_heads=2, scale_value=0.3, input_layout="BNSD", next_tokens=INT_MAX),
                lambda a: _fia_golden(a, num_heads="num_heads", scale_value="scale_value",
                                      input_layout="input_layout", next_tokens="next_tokens"))


def aclnn_fia():
    q, k, v = (x.half() for x in _fa_qkv(b=2, n2=2, d=16))
    params = aclnn_args(q, k, v, num_heads=2, scale_value=0.3, input_layout="BNSD")
    names = list(inspect.signature(aclnn.fused_infer_attention_score_v2_get_workspace_size).parameters)
    args = dict(zip(names, params))
    return Case(aclnn.fused_infer_attention_score_v2, args,
                lambda a: golden_fia.fia_forward(**{n: a[n] for n in names})[:1])


# --- NSA -------------------------------------------------------------------------------------------------------

def nsa_compress():
    return Case(attnops.nsa_compress,
                dict(input=r(12, 2, 8, seed=1), weight=r(4, 2, seed=2), block_size=4, stride=2,
                     actual_seq_len=[5, 12]),
                lambda a: (golden_nsa.nsa_compress(a["input"], a["weight"], a["block_size"], a["stride"],
                                                   a["actual_seq_len"]),))


def _nsa_layer_inputs(t=12, n1=2, n2=1):
    return dict(query=r(t, n1, 8, seed=1), key=r(t, n2, 8, seed=2), value=r(t, n2, 4, seed=3),
                gates=torch.sigmoid(r(t, n1, 3, seed=4)), compress_weight_k=r(8, n2, seed=5),
                compress_weight_v=r(8, n2, seed=6))


def native_sparse_attention():
    return Case(attnops.native_sparse_attention,
                dict(**_nsa_layer_inputs(), compress_block_size=8, compress_stride=4, select_block_size=8,
                     select_block_count=2, window_size=5, scale=0.4, actual_seq_len=[5, 12]))


def nsa_compress_attention():
    return Case(attnops.nsa_compress_attention,
                dict(query=r(6, 2, 8, seed=1), key=r(5, 1, 8, seed=2), value=r(5, 1, 4, seed=3),
                     compress_block_size=4, compress_stride=2, select_block_size=4, select_block_count=1,
                     scale=0.3, actual_seq_qlen=[2, 6], actual_cmp_seq_kvlen=[2, 5]))


def _topk(rows, n2, count, blocks, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.stack([torch.randperm(blocks, generator=g)[:count] for _ in range(n2)])
                        for _ in range(rows)]).to(I32)


def nsa_selected_attention():
    return Case(attnops.nsa_selected_attention,
                dict(query=r(5, 2, 8, seed=1), key=r(16, 1, 8, seed=2), value=r(16, 1, 4, seed=3),
                     topk_indices=_topk(5, 1, 2, 2), select_block_size=4, causal=False, scale=0.3,
                     actual_seq_qlen=[2, 5], actual_seq_kvlen=[8, 16]),
                lambda a: golden_nsa.nsa_selected_attention(
                    a["query"], a["key"], a["value"], a["topk_indices"], a["scale"], a["select_block_size"],
                    a["actual_seq_qlen"], a["actual_seq_kvlen"], False)[:1])


def _paged(lens=(11, 9), page=4, n2=1, d=8, dv=4):
    """Caches and a block table with no padding entry for ``lens`` of as many pages each (padding entries are never
    read, -1 or anything: a corrupted one would be no mistake)."""
    pages = [-(-n // page) for n in lens]
    table = torch.full((len(lens), max(pages)), -1, dtype=I32)
    start = 0
    for b, p in enumerate(pages):
        table[b, :p] = torch.arange(start, start + p)
        start += p
    return r(start + 1, page, n2, d, seed=11), r(start + 1, page, n2, dv, seed=12), table


def nsa_selected_attention_infer():
    k, v, table = _paged()
    return Case(attnops.nsa_selected_attention_infer,
                dict(query=r(2, 2, 8, seed=1), key_cache=k, value_cache=v, topk_indices=_topk(2, 1, 2, 2),
                     block_table=table, seq_lens=[11, 9], select_block_size=3, scale=0.3),
                lambda a: (golden_nsa.nsa_select_attention_infer(
                    a["query"], a["key_cache"], a["value_cache"], a["topk_indices"], a["block_table"],
                    a["seq_lens"], a["scale"], a["select_block_size"]),))


def nsa_compress_attention_infer():
    k, v, table = _paged()
    return Case(attnops.nsa_compress_attention_infer,
                dict(query=r(2, 2, 8, seed=1), key_cache=k, value_cache=v, block_table=table, cmp_seq_lens=[11, 9],
                     compress_block_size=4, compress_stride=2, select_block_size=4, select_block_count=3, scale=0.3),
                lambda a: golden_nsa.nsa_compress_attention_infer(
                    a["query"], a["key_cache"], a["value_cache"], a["block_table"], a["cmp_seq_lens"], 0.3, 4, 2, 4,
                    3)[:1])


def aclnn_nsa(op, **kw):
    def factory():
        return Case(nsa_aclnn_params.OPS[op][0], nsa_aclnn_params.base_params(op, **kw))
    return factory


def npu_nsa_compress():
    return Case(torch_npu.npu_nsa_compress,
                dict(input=r(32, 2, 16, seed=1), weight=r(16, 2, seed=2), compress_block_size=16, compress_stride=16,
                     actual_seq_len=[16, 32]))


def npu_nsa_compress_grad():
    return Case(torch_npu.npu_nsa_compress_grad,
                dict(grad=r(2, 2, 16, seed=3), input=r(32, 2, 16, seed=1), weight=r(16, 2, seed=2),
                     compress_block_size=16, compress_stride=16, actual_seq_len=[16, 32]))


def npu_nsa_compress_infer():
    return Case(torch_npu.npu_nsa_compress_infer,
                dict(input=r(6, 16, 2, 16, seed=1), weight=r(16, 2, seed=2), slot_mapping=ints([0, 3], I64),
                     compress_block_size=16, compress_stride=16, page_block_size=16,
                     # every entry in a request's pages: a corrupted entry is one the call reads (entries past a
                     # request's pages are never read, -1 or anything)
                     block_table=ints([[0, 1, 2], [3, 4, 5]]), actual_seq_len=[48, 48],
                     cache=torch.zeros(5, 2, 16)))


def npu_nsa_select_attention():
    p = nsa_aclnn_params.selected_params(dtype=F32, d=16, dv=16)
    return Case(torch_npu.npu_nsa_select_attention,
                dict(query=p["query"], key=p["key"], value=p["value"], topk_indices=p["topk_indices"],
                     scale_value=p["scale_value"], head_num=p["head_num"], select_block_size=16, select_block_count=2,
                     atten_mask=p["atten_mask"], actual_seq_qlen=p["actual_seq_qlen"],
                     actual_seq_kvlen=p["actual_seq_kvlen"]))


def npu_nsa_select_attention_grad():
    p = nsa_aclnn_params.selected_grad_params(forward=True)
    return Case(torch_npu.npu_nsa_select_attention_grad,
                dict(grad=p["attention_out_grad"], query=p["query"], key=p["key"], value=p["value"],
                     attention_out=p["attention_out"], softmax_max=p["softmax_max"], softmax_sum=p["softmax_sum"],
                     topk_indices=p["topk_indices"], scale_value=p["scale_value"], head_num=p["head_num"],
                     select_block_size=16, select_block_count=2, atten_mask=p["atten_mask"],
                     actual_seq_qlen=p["actual_seq_qlen"], actual_seq_kvlen=p["actual_seq_kvlen"]))


def npu_nsa_compress_attention():
    p = nsa_aclnn_params.compress_attention_params(dtype=F32)
    return Case(torch_npu.npu_nsa_compress_attention,
                dict(query=p["query"], key=p["key"], value=p["value"], scale_value=p["scale_value"],
                     head_num=p["head_num"], compress_block_size=p["compress_block_size"],
                     compress_stride=p["compress_stride"], select_block_size=p["select_block_size"],
                     select_block_count=p["select_block_count"], topk_mask=p["topk_mask"], atten_mask=p["atten_mask"],
                     actual_seq_qlen=p["actual_seq_qlen"], actual_cmp_seq_kvlen=p["actual_cmp_seq_kvlen"],
                     actual_sel_seq_kvlen=p["actual_sel_seq_kvlen"]))


def _npu_paged(page=16, d=16):
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(4, page, d, generator=g) for _ in range(2))
    return r(2, 1, 2, d, seed=1), k, v, ints([[0, 1], [2, 3]])


def npu_nsa_select_attention_infer():
    q, k, v, table = _npu_paged()
    return Case(torch_npu.npu_nsa_select_attention_infer,
                dict(query=q, key=k, value=v, topk_indices=ints([[0, 1], [1, 0]]).view(2, 1, 2), scale_value=0.3,
                     head_num=2, key_value_head_num=1, select_block_size=8, select_block_count=2,
                     page_block_size=16, layout="BSND", block_table=table, actual_seq_kvlen=[32, 20]))


def npu_nsa_compress_attention_infer():
    q, k, v, table = _npu_paged()
    return Case(torch_npu.npu_nsa_compress_attention_infer,
                dict(query=q[:, 0], key=k, value=v, scale_value=0.3, head_num=2, key_value_head_num=1,
                     select_block_size=16, select_block_count=3, page_block_size=16, compress_block_size=8,
                     compress_stride=4, layout="TND", block_table=table, actual_cmp_seq_kvlen=[30, 19]))


# --- DSA / MLA -------------------------------------------------------------------------------------------------

def lightning_indexer():
    return Case(attnops.lightning_indexer,
                dict(query=r(1, 4, 2, 128, seed=1), key=r(1, 6, 1, 128, seed=2), weights=r(1, 4, 2, seed=3).abs(),
                     sparse_count=3, sparse_mode=0))


def npu_lightning_indexer():
    return Case(torch_npu.npu_lightning_indexer,
                dict(query=r(1, 4, 2, 128, seed=1), key=r(1, 6, 1, 128, seed=2), weights=r(1, 4, 2, seed=3).abs(),
                     sparse_count=3, sparse_mode=0))


def aclnn_lightning_indexer():
    return Case(aclnn.lightning_indexer,
                dict(query=r(1, 4, 2, 128, seed=1), key=r(1, 6, 1, 128, seed=2), weights=r(1, 4, 2, seed=3).abs(),
                     actual_seq_lengths_query=None, actual_seq_lengths_key=None, block_table=None,
                     layout_query="BSND", layout_key="BSND", sparse_count=3, sparse_mode=0, pre_tokens=INT64_MAX,
                     next_tokens=INT64_MAX, return_values=False))


def _sfa_rows():
    return ints([[[[0, 2, -1]], [[1, 3, 4]], [[5, 0, 2]]]])  # [B=1, S=3, N2=1, count=3]


def _sfa_golden(a, q="query", k="key", v="value", idx="sparse_indices", scale="scale"):
    rows = a[idx][0, :, 0].tolist()
    rope = {} if a.get("query_rope") is None else dict(q_rope=a["query_rope"][0], k_rope=a["key_rope"][0, :, 0])
    return (golden_dsa.sparse_flash_attention(a[q][0], a[k][0, :, 0], a[v][0, :, 0], rows, a[scale], sparse_mode=0,
                                              **rope)[0].unsqueeze(0),)


def sparse_flash_attention():
    return Case(attnops.sparse_flash_attention,
                dict(query=r(1, 3, 2, 16, seed=1), key=r(1, 6, 1, 16, seed=2), value=r(1, 6, 1, 16, seed=2),
                     sparse_indices=_sfa_rows(), scale=0.3, sparse_mode=0),
                _sfa_golden)


def _mla_sfa_inputs():
    """The NPU's MLA-absorb shapes: a 512-wide latent (key = value) and a 64-wide rope part."""
    kv = r(1, 6, 1, 512, seed=2)
    return dict(query=r(1, 3, 2, 512, seed=1), key=kv, value=kv, sparse_indices=_sfa_rows(),
                query_rope=r(1, 3, 2, 64, seed=3), key_rope=r(1, 6, 1, 64, seed=4))


def npu_sparse_flash_attention():
    return Case(torch_npu.npu_sparse_flash_attention,
                dict(**_mla_sfa_inputs(), scale_value=0.05, sparse_mode=0, attention_mode=2),
                lambda a: _sfa_golden(a, scale="scale_value"))


def aclnn_sparse_flash_attention():
    return Case(aclnn.sparse_flash_attention,
                dict(**_mla_sfa_inputs(), block_table=None, actual_seq_lengths_query=None,
                     actual_seq_lengths_kv=None, scale_value=0.05, sparse_block_size=1, layout_query="BSND",
                     layout_kv="BSND", sparse_mode=0, pre_tokens=INT64_MAX, next_tokens=INT64_MAX, attention_mode=2,
                     return_softmax_lse=False),
                lambda a: _sfa_golden(a, scale="scale_value"))


def _kl_inputs(mla=False):
    if mla:
        p = _mla_sfa_inputs()
        _, smax, ssum = torch_npu.npu_sparse_flash_attention(**p, scale_value=0.05, sparse_mode=0, attention_mode=2,
                                                             return_softmax_lse=True)
        q, k, rope = p["query"], p["key"], dict(query_rope=p["query_rope"], key_rope=p["key_rope"])
    else:
        q, k, rope = r(1, 3, 2, 16, seed=1), r(1, 6, 1, 16, seed=2), {}
        smax, ssum = torch.zeros(1, 1, 3, 2), torch.ones(1, 1, 3, 2)
    return dict(query=q, key=k, query_index=r(1, 3, 2, 128, seed=3), key_index=r(1, 6, 1, 128, seed=4),
                weights=r(1, 3, 2, seed=5).abs(), sparse_indices=_sfa_rows(), softmax_max=smax, softmax_sum=ssum,
                **rope)


def lightning_indexer_kl_loss():
    return Case(attnops.lightning_indexer_kl_loss, dict(**_kl_inputs(), scale=0.3))


def npu_sparse_lightning_indexer_grad_kl_loss():
    return Case(torch_npu.npu_sparse_lightning_indexer_grad_kl_loss, dict(**_kl_inputs(mla=True), scale_value=0.05))


def aclnn_kl_loss():
    return Case(aclnn.sparse_lightning_indexer_grad_kl_loss,
                dict(**_kl_inputs(mla=True), actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                     scale_value=0.05, layout="BSND", sparse_mode=3, pre_tokens=INT64_MAX, next_tokens=INT64_MAX,
                     deterministic=False))


def _rope_inputs():
    return dict(x=r(2, 3, 4, 64, seed=8), cos=r(2, 1, 4, 64, seed=9), sin=r(2, 1, 4, 64, seed=10))


def _rope_golden(a):
    return (golden_dsa.interleave_rope(a["x"], a["cos"], a["sin"]),)


def npu_interleave_rope():
    return Case(torch_npu.npu_interleave_rope, _rope_inputs(), _rope_golden)


def aclnn_interleave_rope():
    return Case(aclnn.interleave_rope, _rope_inputs(), _rope_golden)


def _kv_rms_inputs():
    return dict(kv=r(2, 1, 1, 576, seed=4), gamma=r(512, seed=5), cos=r(2, 1, 1, 64, seed=6),
                sin=r(2, 1, 1, 64, seed=7), index=ints([5, 9], I64))


def npu_kv_rmsnorm_rope_cache():
    return Case(torch_npu.npu_kv_rmsnorm_rope_cache,
                dict(**_kv_rms_inputs(), k_cache=torch.zeros(1, 16, 1, 64), ckv_cache=torch.zeros(1, 16, 1, 512),
                     cache_mode="PA", is_output_kv=True))


def aclnn_kv_rms_norm_rope_cache():
    return Case(aclnn.kv_rms_norm_rope_cache,
                dict(**_kv_rms_inputs(), k_cache_ref=torch.zeros(1, 16, 1, 64),
                     ckv_cache_ref=torch.zeros(1, 16, 1, 512), k_rope_scale=None, ckv_scale=None, k_rope_offset=None,
                     c_kv_offset=None, epsilon=1e-5, cache_mode="PA", is_output_kv=True))


def _mla_inputs():
    he, hcq, n, d, hckv, dr, t = 32, 16, 2, 8, 16, 8, 3
    return dict(token_x=r(t, he, seed=18), weight_dq=r(he, hcq, seed=10), weight_uq_qr=r(hcq, n * (d + dr), seed=11),
                weight_uk=r(n, d, hckv, seed=12), weight_dkv_kr=r(he, hckv + dr, seed=13),
                rmsnorm_gamma_cq=r(hcq, seed=14), rmsnorm_gamma_ckv=r(hckv, seed=15), rope_sin=r(t, dr, seed=16),
                rope_cos=r(t, dr, seed=17))


def _mla_caches():
    return dict(kv_cache=torch.zeros(2, 16, 1, 16), kr_cache=torch.zeros(2, 16, 1, 8))


def npu_mla_prolog_v2():
    return Case(torch_npu.npu_mla_prolog_v2, dict(**_mla_inputs(), cache_index=ints([0, 17, -1], I64),
                                                  **_mla_caches()))


def npu_mla_prolog_v3():
    return Case(torch_npu.npu_mla_prolog_v3, dict(**_mla_inputs(), **_mla_caches(),
                                                  cache_index=ints([0, 17, -1], I64)))


def npu_mla_prolog_v3_functional():
    return Case(torch_npu.npu_mla_prolog_v3_functional, dict(**_mla_inputs(), **_mla_caches(),
                                                             cache_index=ints([0, 17, -1], I64)))


def _aclnn_mla(version):
    def factory():
        phase_one = aclnn.mla_prolog_v2_weight_nz_get_workspace_size if version == 2 else \
            aclnn.mla_prolog_v3_weight_nz_get_workspace_size
        names = list(inspect.signature(phase_one).parameters)
        given = dict(**_mla_inputs(), kv_cache_ref=torch.zeros(2, 16, 1, 16), kr_cache_ref=torch.zeros(2, 16, 1, 8),
                     cache_index=ints([0, 17, -1], I64), rmsnorm_epsilon_cq=1e-5, rmsnorm_epsilon_ckv=1e-5,
                     cache_mode="PA_BSND")
        fn = aclnn.mla_prolog_v2_weight_nz if version == 2 else aclnn.mla_prolog_v3_weight_nz
        defaults = inspect.signature(torch_npu.npu_mla_prolog_v3).parameters
        args = {n: given.get(n, defaults[n].default if n in defaults else None) for n in names}
        return Case(fn, args)
    return factory


def npu_kv_quant_sparse_flash_attention():
    packed = quantize(r(1, 5, 1, 512, seed=21), r(1, 5, 1, 64, seed=22, dtype=BF16))
    return Case(torch_npu.npu_kv_quant_sparse_flash_attention,
                dict(query=r(1, 3, 2, 576, seed=20, dtype=BF16), key=packed, value=packed,
                     sparse_indices=ints([[[[2, 0, -1]], [[3, 1, 0]], [[4, 2, 1]]]]), scale_value=0.05,
                     key_quant_mode=2, value_quant_mode=2, attention_mode=2))


# --- DeepSeek-V4 -----------------------------------------------------------------------------------------------
# One BSND batch: 5 query rows at ori positions 3..7 of 8 ori keys (window of 3 to the left) and 2 compressed keys of
# ratio 4 (rows 0-3 see compressed key 0, row 4 keys 0 and 1); each index row lists one position its row may see, so
# a corrupted entry is one the call reads.

_MLA_MASKS = dict(ori_mask_mode=4, ori_win_left=3, ori_win_right=0, cmp_mask_mode=3)


def _mla_tensors(csa=True):
    tensors = dict(q=r(1, 5, 2, 8, seed=1), ori_kv=r(1, 8, 1, 8, seed=2))
    if csa:
        tensors |= dict(cmp_kv=r(1, 2, 1, 8, seed=3), cmp_sparse_indices=ints([[[[0]], [[0]], [[0]], [[0]], [[1]]]]),
                        sinks=r(2, seed=4))
    return tensors


def _mla_golden(q="q", scale="scale"):
    """``(attn_out [1, S1, N1, D], softmax_lse [1, 1, S1, N1])`` of the one batch."""
    def golden_of(a):
        cmp, idx = a.get("cmp_kv"), a.get("cmp_sparse_indices")
        out, lse = golden_dsv4.sparse_flash_mla(
            a[q][0], a["ori_kv"][0, :, 0], None if cmp is None else cmp[0, :, 0],
            None if idx is None else idx[0, :, 0].tolist(), a.get("sinks"), a[scale], ratio=4,
            win_left=_MLA_MASKS["ori_win_left"], win_right=_MLA_MASKS["ori_win_right"],
            ori_mask_mode=_MLA_MASKS["ori_mask_mode"], cmp_mask_mode=_MLA_MASKS["cmp_mask_mode"])
        return out[None], lse[None, None]
    return golden_of


def sparse_flash_mla():
    return Case(attnops.sparse_flash_mla, dict(**_mla_tensors(), scale=0.4, cmp_ratio=4, **_MLA_MASKS), _mla_golden())


def cot_sparse_flash_mla():
    return Case(cann_ops_transformer.sparse_flash_mla,
                dict(**_mla_tensors(), softmax_scale=0.4, cmp_ratio=4, return_softmax_lse=True, **_MLA_MASKS),
                _mla_golden(scale="softmax_scale"))


def _aclnn_args(phase_one, given: dict) -> dict:
    """Every parameter of an aclnn operator (phase one's order): ``given``, else None."""
    return {n: given.get(n) for n in inspect.signature(phase_one).parameters}


def aclnn_sparse_flash_mla():
    """The sliding window alone: an aclnn operator's every tensor is required by the suite (no null pointer)."""
    given = dict(**_mla_tensors(csa=False), softmax_scale=0.4, cmp_ratio=4, layout_q="BSND", layout_kv="BSND",
                 topk_value_mode=1, return_softmax_lse=True, **_MLA_MASKS)
    return Case(aclnn.sparse_flash_mla, _aclnn_args(aclnn.sparse_flash_mla_get_workspace_size, given),
                _mla_golden(scale="softmax_scale"))


def _mla_grad_inputs(csa=True):
    tensors = _mla_tensors(csa)
    out, lse = attnops.sparse_flash_mla(**tensors, scale=0.4, cmp_ratio=4, **_MLA_MASKS)
    return tensors, dict(d_out=r(*out.shape, seed=5), attn_out=out, softmax_lse=lse)


def sparse_flash_mla_grad():
    tensors, grads = _mla_grad_inputs()
    return Case(attnops.sparse_flash_mla_grad, dict(**tensors, **grads, scale=0.4, cmp_ratio=4, **_MLA_MASKS))


def cot_sparse_flash_mla_grad():
    tensors, grads = _mla_grad_inputs()
    return Case(cann_ops_transformer.sparse_flash_mla_grad,
                dict(**tensors, dout=grads["d_out"], attn_out=grads["attn_out"], softmax_lse=grads["softmax_lse"],
                     softmax_scale=0.4, cmp_ratio=4, **_MLA_MASKS))


def aclnn_sparse_flash_mla_grad():
    tensors, grads = _mla_grad_inputs(csa=False)
    given = dict(query=tensors["q"], ori_kv=tensors["ori_kv"], d_out=grads["d_out"], out=grads["attn_out"],
                 lse=grads["softmax_lse"], scale_value=0.4, cmp_ratio=4, layout_q="BSND", layout_kv="BSND",
                 **_MLA_MASKS)
    return Case(aclnn.sparse_flash_mla_grad, _aclnn_args(aclnn.sparse_flash_mla_grad_get_workspace_size, given))


def mla_metadata(fn):
    return lambda: Case(fn, dict(num_heads_q=2, num_heads_kv=1, head_dim=8, seqused_ori_kv=ints([8]),
                                 seqused_cmp_kv=ints([2]), cmp_residual_kv=ints([0]), cmp_ratio=4,
                                 max_seqlen_ori_kv=8, max_seqlen_cmp_kv=2))


def _compressor_inputs():
    """11 packed tokens of one batch (2 compressed rows of ratio 4), state in block 1 of the table."""
    return dict(x=r(11, 32, seed=1), wkv=r(16, 32, seed=2, scale=32 ** -0.5), wgate=r(16, 32, seed=3, scale=32 ** -0.5),
                state_cache=torch.zeros(4, 16, 32), ape=r(4, 16, seed=4))


def _compressor_golden(a):
    """The compressed rows then zero padding up to ``min(T, T // 4 + B)`` rows."""
    rows, _ = golden_compressor.compress(a["x"], a["wkv"], a["wgate"], a["ape"], coff=1)
    out = torch.zeros(min(a["x"].shape[0], a["x"].shape[0] // 4 + 1), rows.shape[1], dtype=torch.float64)
    out[:rows.shape[0]] = rows
    return (out,)


def compressor(fn):
    return lambda: Case(fn, dict(**_compressor_inputs(), cmp_ratio=4, state_block_table=ints([[1]]),
                                 cu_seqlens=ints([0, 11])), _compressor_golden)


def _indexer_golden(q="query", k="key", w="weights"):
    """``(sparse_indices, sparse_values)`` ``[1, S1, 1, topk]`` of the one batch (causal, ratio 4, residual 1)."""
    def golden_of(a):
        idx, values = golden_indexer_v2.lightning_indexer_v2(a[q][0], a[k][0, :, 0], a[w][0], 2, mask_mode=3,
                                                             cmp_ratio=4, residual=1)
        return ints(idx)[None, :, None], torch.tensor(values, dtype=torch.float64)[None, :, None]
    return golden_of


def _indexer_tensors():
    """9 query rows over 3 compressed keys of ratio 4 with a residual of 1: rows see 1, 2 or 3 keys."""
    return dict(query=r(1, 9, 3, 16, seed=1), key=r(1, 3, 1, 16, seed=2), weights=r(1, 9, 3, seed=3).abs())


_INDEXER = dict(cmp_residual_k=ints([1]), mask_mode=3, cmp_ratio=4)


def lightning_indexer_v2():
    return Case(attnops.lightning_indexer_v2, dict(**_indexer_tensors(), topk=2, **_INDEXER), _indexer_golden())


def _cot_indexer_args():
    t = _indexer_tensors()
    return dict(q=t["query"], k=t["key"], w=t["weights"], topk=2, return_value=1, **_INDEXER)


def cot_lightning_indexer():
    return Case(cann_ops_transformer.lightning_indexer, _cot_indexer_args(), _indexer_golden("q", "k", "w"))


def aclnn_lightning_indexer_v2():
    given = dict(**_cot_indexer_args(), layout_q="BSND", layout_k="BSND", max_seqlen_q=-1)
    return Case(aclnn.lightning_indexer_v2, _aclnn_args(aclnn.lightning_indexer_v2_get_workspace_size, given),
                _indexer_golden("q", "k", "w"))


def indexer_metadata(fn):
    return lambda: Case(fn, dict(num_heads_q=3, num_heads_k=1, head_dim=16, topk=2, seqused_k=ints([3]),
                                 cmp_residual_k=ints([1]), cmp_ratio=4, mask_mode=3, max_seqlen_k=3))


def quant_lightning_indexer_v2():
    g = torch.Generator().manual_seed(5)
    codes = dict(query=torch.randint(-8, 8, (1, 9, 3, 16), generator=g, dtype=torch.int8),
                 key=torch.randint(-8, 8, (1, 3, 1, 16), generator=g, dtype=torch.int8))
    scales = dict(query_dequant_scale=r(1, 9, 3, seed=6).abs() + 0.5, key_dequant_scale=r(1, 3, 1, seed=7).abs() + 0.5)

    def golden_of(a):
        q = a["query"].double() * a["query_dequant_scale"].double()[..., None]
        k = a["key"].double() * a["key_dequant_scale"].double()[..., None]
        return _indexer_golden()(dict(query=q, key=k, weights=a["weights"]))
    return Case(attnops.quant_lightning_indexer_v2,
                dict(**codes, weights=r(1, 9, 3, seed=3).abs(), **scales, topk=2, **_INDEXER), golden_of)


# --- KV-cache and helper ops -----------------------------------------------------------------------------------

def _scatter_args():
    return dict(key=r(3, 2, 8, seed=1), value=r(3, 2, 4, seed=2), key_cache=torch.zeros(4, 4, 2, 8),
                value_cache=torch.zeros(4, 4, 2, 4), slot_mapping=ints([3, -1, 9]), cache_mode="Norm")


def npu_scatter_pa_kv_cache(fn):
    return lambda: Case(fn, _scatter_args())


def _gather_args():
    # every block-table entry is read (5 and 6 tokens in blocks of 4), so any corrupted entry is a bad input: an
    # unread entry is padding, which torch_npu callers may fill with anything
    return dict(key_cache=r(4, 4, 2, 8, seed=1), value_cache=r(4, 4, 2, 4, seed=2), block_tables=ints([[1, 2], [3, 0]]),
                seq_lens=ints([5, 6]), key=torch.zeros(11, 2, 8), value=torch.zeros(11, 2, 4))


def npu_gather_pa_kv_cache(fn):
    return lambda: Case(fn, _gather_args())


def npu_scatter_nd_update(fn):
    return lambda: Case(fn, dict(input=r(6, 3, 4, seed=40), indices=ints([[4, 1], [0, 2], [5, 0]]),
                                 updates=r(3, 4, seed=41)))


def npu_block_sparse_attention():
    def golden_of(a):
        keep = a["block_sparse_mask"][0].bool().repeat_interleave(2, 1).repeat_interleave(4, 2)[:, :5, :6]
        k, v = (a[name].transpose(0, 1).double().repeat_interleave(2, 0) for name in ("key", "value"))
        s = 0.3 * a["query"].transpose(0, 1).double() @ k.transpose(-1, -2)
        return ((torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v).transpose(0, 1),)

    mask = torch.ones(1, 2, 3, 2, dtype=torch.int8)
    return Case(torch_npu.npu_block_sparse_attention,
                dict(query=r(5, 2, 8, seed=43), key=r(6, 1, 8, seed=44), value=r(6, 1, 8, seed=45),
                     block_sparse_mask=mask, block_shape=[2, 4], num_key_value_heads=1, scale_value=0.3,
                     actual_seq_lengths=[5], actual_seq_lengths_kv=[6]), golden_of)


def npu_block_sparse_attention_backward():
    q, k, v = r(5, 2, 8, seed=43), r(5, 1, 8, seed=44), r(5, 1, 8, seed=45)
    mask = torch.ones(1, 2, 3, 3, dtype=torch.int8)
    out, lse = torch_npu.npu_block_sparse_attention(q, k, v, mask, [2, 2], scale_value=0.3, actual_seq_lengths=[5],
                                                    actual_seq_lengths_kv=[5])
    return Case(torch_npu.npu_block_sparse_attention_backward,
                dict(d_out=r(5, 2, 8, seed=46), query=q, key=k, value=v, attention_out=out, softmax_lse=lse,
                     block_sparse_mask=mask, block_shape=[2, 2], actual_seq_lengths=[5], actual_seq_lengths_kv=[5],
                     q_input_layout="TND", kv_input_layout="TND", num_key_value_heads=1, scale_value=0.3))


def npu_quant_fusion_attention():
    from attnops._core import hifloat8  # HiFloat8 codes: uint8 inputs the suite can do arithmetic on (FP8 it cannot)

    qkv = {name: hifloat8.encode(r(1, 2, 4, 8, seed=47 + i)) for i, name in enumerate(("query", "key", "value"))}
    scales = {f"d_scale_{c}": torch.ones(1, 2, 1, 1) for c in "qkv"}
    return Case(torch_npu.npu_quant_fusion_attention, dict(**qkv, head_num=2, input_layout="BNSD", **scales,
                                                           scale=0.3, query_dtype=torch_npu.hifloat8))


def npu_attention_update():
    outs = [r(3, 8, seed=s) for s in (1, 2)]
    lses = [r(3, seed=s) for s in (3, 4)]
    return Case(torch_npu.npu_attention_update, dict(lse=lses, local_out=outs, update_type=0))


def npu_ring_attention_update():
    q, k, v = r(1, 2, 3, 8, seed=1), r(1, 2, 5, 8, seed=2), r(1, 2, 5, 8, seed=3)
    parts = [attnops.flash_attention(q, k[:, :, a:b], v[:, :, a:b], layout="BNSD", scale=0.3, return_stats=True)
             for a, b in ((0, 2), (2, 5))]
    sbh = [p.out.permute(2, 0, 1, 3).flatten(2).contiguous() for p in parts]
    return Case(torch_npu.npu_ring_attention_update,
                dict(prev_attn_out=sbh[0], prev_softmax_max=parts[0].softmax_max,
                     prev_softmax_sum=parts[0].softmax_sum, cur_attn_out=sbh[1], cur_softmax_max=parts[1].softmax_max,
                     cur_softmax_sum=parts[1].softmax_sum, input_layout="SBH"))


# --- nn modules (forward) --------------------------------------------------------------------------------------

def _module_forward(module, *, decode=False, **args):
    """An nn module's forward as an entry point (under ``torch.no_grad()`` when it decodes into a cache)."""
    def forward(**kw):
        if decode:
            with torch.no_grad():
                return module(**kw)
        return module(**kw)
    forward.__name__ = f"{type(module).__name__}.forward"
    return Case(forward, args)


def native_sparse_attention_module():
    torch.manual_seed(0)
    m = nn.NativeSparseAttention(16, 4, 2, 8, compress_block_size=8, compress_stride=4, select_block_size=16,
                                 select_block_count=4, window_size=16)
    return _module_forward(m, x=r(1, 20, 16, seed=1))


def nsa_cache_forward():
    torch.manual_seed(0)
    m = nn.NativeSparseAttention(16, 4, 2, 8, compress_block_size=8, compress_stride=4, select_block_size=16,
                                 select_block_count=4, window_size=16)
    cache = nn.NSACache(2, compress_block_size=8, compress_stride=4, page_size=16, max_seq_len=64,
                        select_block_size=16, select_block_count=4)
    return _module_forward(m, decode=True, x=r(2, 5, 16, seed=1), cache=cache)


def _dsa_module():
    torch.manual_seed(0)
    return nn.DeepSeekSparseAttention(48, 4, kv_rank=32, qk_nope_dim=16, qk_rope_dim=8, v_head_dim=12, index_heads=4,
                                      index_dim=16, index_topk=5)


def dsa_module():
    return _module_forward(_dsa_module(), x=r(2, 6, 48, seed=1))


def dsa_cache_forward():
    m = _dsa_module()
    return _module_forward(m, x=r(2, 6, 48, seed=1), cache=m.new_cache(2, 16, block_size=16))


def _dsv4_module():
    torch.manual_seed(0)
    return nn.DeepSeekV4Attention(32, 2, head_dim=16, rope_dim=8, window=4, cmp_ratio=4, index_topk=2, index_heads=2,
                                  index_dim=16)


def dsv4_module():
    return _module_forward(_dsv4_module(), x=r(2, 9, 32, seed=1))


def dsv4_cache_forward():
    m = _dsv4_module()
    return _module_forward(m, x=r(2, 9, 32, seed=1), cache=m.new_cache(2, 16, block_size=8))


# --- the table -------------------------------------------------------------------------------------------------

PYTHONIC = {
    "flash_attention": fa_pythonic,
    "flash_attention_backward": fa_pythonic_backward,
    "fused_infer_attention": fia_pythonic,
    "fused_infer_attention_plan": fia_plan,
    "lightning_indexer": lightning_indexer,
    "lightning_indexer_kl_loss": lightning_indexer_kl_loss,
    "native_sparse_attention": native_sparse_attention,
    "nsa_compress": nsa_compress,
    "nsa_compress_attention": nsa_compress_attention,
    "nsa_compress_attention_infer": nsa_compress_attention_infer,
    "nsa_selected_attention": nsa_selected_attention,
    "nsa_selected_attention_infer": nsa_selected_attention_infer,
    "sparse_flash_attention": sparse_flash_attention,
    "compressor": compressor(attnops.compressor),
    "lightning_indexer_v2": lightning_indexer_v2,
    "quant_lightning_indexer_v2": quant_lightning_indexer_v2,
    "sparse_flash_mla": sparse_flash_mla,
    "sparse_flash_mla_grad": sparse_flash_mla_grad,
    "sparse_flash_mla_grad_metadata": mla_metadata(attnops.sparse_flash_mla_grad_metadata),
    "sparse_flash_mla_metadata": mla_metadata(attnops.sparse_flash_mla_metadata),
}

ACLNN = {
    "flash_attention_score": aclnn_fa("score"),
    "flash_attention_score_grad": aclnn_fa("score_grad"),
    "flash_attention_unpadding_score_grad": aclnn_fa("unpad_grad"),
    "flash_attention_unpadding_score_grad_v2": aclnn_fa("unpad_grad_v2"),
    "flash_attention_var_len_score": aclnn_fa("var_len"),
    "flash_attention_var_len_score_v2": aclnn_fa("var_len_v2"),
    "fused_infer_attention_score_v2": aclnn_fia,
    "interleave_rope": aclnn_interleave_rope,
    "kv_rms_norm_rope_cache": aclnn_kv_rms_norm_rope_cache,
    "lightning_indexer": aclnn_lightning_indexer,
    "mla_prolog_v2_weight_nz": _aclnn_mla(2),
    "mla_prolog_v3_weight_nz": _aclnn_mla(3),
    "nsa_compress": aclnn_nsa("nsa_compress"),
    "nsa_compress_attention": aclnn_nsa("nsa_compress_attention"),
    "nsa_compress_grad": aclnn_nsa("nsa_compress_grad"),
    "nsa_selected_attention": aclnn_nsa("nsa_selected_attention"),
    "nsa_selected_attention_grad": aclnn_nsa("nsa_selected_attention_grad"),
    "sparse_flash_attention": aclnn_sparse_flash_attention,
    "sparse_lightning_indexer_grad_kl_loss": aclnn_kl_loss,
    "lightning_indexer_v2": aclnn_lightning_indexer_v2,
    "sparse_flash_mla": aclnn_sparse_flash_mla,
    "sparse_flash_mla_grad": aclnn_sparse_flash_mla_grad,
}

CANN_OPS_TRANSFORMER = {
    "compressor": compressor(cann_ops_transformer.compressor),
    "lightning_indexer": cot_lightning_indexer,
    "lightning_indexer_metadata": indexer_metadata(cann_ops_transformer.lightning_indexer_metadata),
    "sparse_flash_mla": cot_sparse_flash_mla,
    "sparse_flash_mla_grad": cot_sparse_flash_mla_grad,
    "sparse_flash_mla_grad_metadata": mla_metadata(cann_ops_transformer.sparse_flash_mla_grad_metadata),
    "sparse_flash_mla_metadata": mla_metadata(cann_ops_transformer.sparse_flash_mla_metadata),
}

TORCH_NPU = {
    "npu_attention_update": npu_attention_update,
    "npu_fused_infer_attention_score": npu_fia(torch_npu.npu_fused_infer_attention_score, "scale"),
    "npu_fused_infer_attention_score_v2": npu_fia(torch_npu.npu_fused_infer_attention_score_v2, "softmax_scale",
                                                  "input_layout", "actual_seq_kvlen", "num_query_heads"),
    "npu_fused_infer_attention_v2": npu_fia(torch_npu.npu_fused_infer_attention_v2, "softmax_scale", "input_layout",
                                            "actual_seq_kvlen", "num_query_heads"),
    "npu_block_sparse_attention": npu_block_sparse_attention,
    "npu_block_sparse_attention_backward": npu_block_sparse_attention_backward,
    "npu_quant_fusion_attention": npu_quant_fusion_attention,
    "npu_fusion_attention": npu_fusion_attention(torch_npu.npu_fusion_attention),
    "npu_fusion_attention_v2": npu_fusion_attention(torch_npu.npu_fusion_attention_v2),
    "npu_fusion_attention_v3": npu_fusion_attention(torch_npu.npu_fusion_attention_v3),
    "npu_fusion_attention_grad": npu_fusion_attention_grad(torch_npu.npu_fusion_attention_grad),
    "npu_fusion_attention_grad_v2": npu_fusion_attention_grad(torch_npu.npu_fusion_attention_grad_v2),
    "npu_fusion_attention_grad_v3": npu_fusion_attention_grad(torch_npu.npu_fusion_attention_grad_v3),
    "npu_gather_pa_kv_cache": npu_gather_pa_kv_cache(torch_npu.npu_gather_pa_kv_cache),
    "npu_gather_pa_kv_cache_functional": npu_gather_pa_kv_cache(torch_npu.npu_gather_pa_kv_cache_functional),
    "npu_incre_flash_attention": npu_incre_flash_attention,
    "npu_interleave_rope": npu_interleave_rope,
    "npu_kv_quant_sparse_flash_attention": npu_kv_quant_sparse_flash_attention,
    "npu_kv_rmsnorm_rope_cache": npu_kv_rmsnorm_rope_cache,
    "npu_lightning_indexer": npu_lightning_indexer,
    "npu_mla_prolog_v2": npu_mla_prolog_v2,
    "npu_mla_prolog_v3": npu_mla_prolog_v3,
    "npu_mla_prolog_v3_functional": npu_mla_prolog_v3_functional,
    "npu_nsa_compress": npu_nsa_compress,
    "npu_nsa_compress_attention": npu_nsa_compress_attention,
    "npu_nsa_compress_attention_infer": npu_nsa_compress_attention_infer,
    "npu_nsa_compress_grad": npu_nsa_compress_grad,
    "npu_nsa_compress_infer": npu_nsa_compress_infer,
    "npu_nsa_select_attention": npu_nsa_select_attention,
    "npu_nsa_select_attention_grad": npu_nsa_select_attention_grad,
    "npu_nsa_select_attention_infer": npu_nsa_select_attention_infer,
    "npu_prompt_flash_attention": npu_prompt_flash_attention,
    "npu_ring_attention_update": npu_ring_attention_update,
    "npu_scatter_nd_update": npu_scatter_nd_update(torch_npu.npu_scatter_nd_update),
    "npu_scatter_nd_update_": npu_scatter_nd_update(torch_npu.npu_scatter_nd_update_),
    "npu_scatter_pa_kv_cache": npu_scatter_pa_kv_cache(torch_npu.npu_scatter_pa_kv_cache),
    "npu_scatter_pa_kv_cache_functional": npu_scatter_pa_kv_cache(torch_npu.npu_scatter_pa_kv_cache_functional),
    "npu_sparse_flash_attention": npu_sparse_flash_attention,
    "npu_sparse_lightning_indexer_grad_kl_loss": npu_sparse_lightning_indexer_grad_kl_loss,
}

FLASH_ATTN = {
    "flash_attn_func": flash_attn_func,
    "flash_attn_kvpacked_func": flash_attn_kvpacked_func,
    "flash_attn_qkvpacked_func": flash_attn_qkvpacked_func,
    "flash_attn_varlen_func": flash_attn_varlen_func,
    "flash_attn_varlen_kvpacked_func": flash_attn_varlen_kvpacked_func,
    "flash_attn_varlen_qkvpacked_func": flash_attn_varlen_qkvpacked_func,
    "flash_attn_with_kvcache": flash_attn_with_kvcache,
}

NN = {
    "NativeSparseAttention": native_sparse_attention_module,
    "NativeSparseAttention+NSACache": nsa_cache_forward,
    "DeepSeekSparseAttention": dsa_module,
    "DeepSeekSparseAttention+DSACache": dsa_cache_forward,
    "DeepSeekV4Attention": dsv4_module,
    "DeepSeekV4Attention+DSV4Cache": dsv4_cache_forward,
}

DIALECTS = {"attnops": PYTHONIC, "attnops.aclnn": ACLNN, "attnops.torch_npu": TORCH_NPU,
            "attnops.flash_attn": FLASH_ATTN, "attnops.nn": NN, "attnops.cann_ops_transformer": CANN_OPS_TRANSFORMER}
