"""The validation table of the aclnn NSA operators: one case per documented constraint (seeds
aclnnNsaCompressGrad.md / aclnnNsaSelectedAttentionGrad.md "约束说明" and parameter tables, and
cann_semantics.md §7 for the forward operators).

aclnn reports these errors from phase 1 (``*GetWorkspaceSize``), so every rejected call must raise the
status-coded exception already from ``*_get_workspace_size``: ParamNullptrError (161001) for a missing required
input, ParamInvalidError / ParamDtypeError (161002) otherwise, with a message that starts with the argument's
name. ``test_rejected_by_direct_call`` checks the one-call form; ``test_rejected_in_phase_1`` the two-phase form.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from attnops import AclnnError, ParamDtypeError, ParamInvalidError, ParamNullptrError
from tests.ops.nsa.nsa_aclnn_params import OPS, base_params

NULL, INVALID, DTYPE = ParamNullptrError, ParamInvalidError, ParamDtypeError
SEL = ("nsa_selected_attention", "nsa_selected_attention_grad")
CMP = ("nsa_compress", "nsa_compress_grad")
F32 = torch.float32


@dataclass
class Case:
    ops: tuple[str, ...]
    id: str
    mutate: Callable[[dict, str], dict | None]  # returns a new dict, or None to use base_params(op, **kw)
    exc: type
    names: tuple[str, ...]
    kw: dict = field(default_factory=dict)


def setp(**changes):
    def f(p, op):
        for k_, v_ in changes.items():
            p[k_] = v_(p) if callable(v_) and not isinstance(v_, type) else v_
        return p
    return f


def none_of(name):
    return setp(**{name: None})


def cast(name, dtype):
    return setp(**{name: lambda p: p[name].to(dtype)})


def _same(p, op):
    return p


CASES: list[Case] = []


def case(ops, id_, mutate, exc, names, kw=None):
    ops = (ops,) if isinstance(ops, str) else tuple(ops)
    names = (names,) if isinstance(names, str) else tuple(names)
    CASES.append(Case(ops, id_, mutate, exc, names, kw or {}))


# ------------------------------------------------------------------------------------------- NsaCompress(+Grad)
for name in ("input", "weight"):
    case(CMP, f"{name}-none", none_of(name), NULL, name)
    case(CMP, f"{name}-fp32", cast(name, F32), DTYPE, name)
case("nsa_compress_grad", "output_grad-none", none_of("output_grad"), NULL, "output_grad")
case("nsa_compress_grad", "output_grad-fp32", cast("output_grad", F32), DTYPE, "output_grad")
case(CMP, "weight-dtype-differs-from-input", cast("weight", torch.bfloat16), INVALID, "weight")
case(CMP, "weight-not-broadcastable", setp(weight=lambda p: p["weight"][:, :1].contiguous()), INVALID, "weight")
case("nsa_compress", "block-not-multiple-of-16", _same, INVALID, "compress_block_size", kw=dict(block=24, stride=8))
case("nsa_compress_grad", "block-not-multiple-of-16", _same, INVALID, "compress_block_size",
     kw=dict(block=40, stride=16))
case("nsa_compress", "block-over-128", _same, INVALID, "compress_block_size", kw=dict(block=144, stride=16,
                                                                                       lens=(144,)))
case(CMP, "stride-not-multiple-of-16", _same, INVALID, "compress_stride", kw=dict(block=32, stride=8))
case("nsa_compress", "stride-over-block", _same, INVALID, "compress_stride", kw=dict(block=16, stride=32))
case("nsa_compress_grad", "block-equal-stride (l > d)", _same, INVALID, ("compress_stride", "compress_block_size"),
     kw=dict(block=32, stride=32))
case("nsa_compress_grad", "block-less-than-stride", _same, INVALID, ("compress_stride", "compress_block_size"),
     kw=dict(block=16, stride=32, lens=(32, 48)))
case(CMP, "D-not-multiple-of-16", _same, INVALID, "input", kw=dict(d=24))
case(CMP, "D-over-256", _same, INVALID, "input", kw=dict(d=272))
case(CMP, "N-over-128", _same, INVALID, "input", kw=dict(n=129))
case(CMP, "input-not-3d", setp(input=lambda p: p["input"].unsqueeze(0)), INVALID, "input")
case(CMP, "layout-BSND", setp(layout="BSND"), INVALID, "layout")
case(CMP, "act_seq_len-not-ending-at-T", setp(act_seq_len=[16, 40]), INVALID, "act_seq_len")
case(CMP, "act_seq_len-decreasing", setp(act_seq_len=lambda p: [p["input"].shape[0] - 8, 16, p["input"].shape[0]]),
     INVALID, "act_seq_len")
case(CMP, "act_seq_len_type-2", setp(act_seq_len_type=2), INVALID, "act_seq_len_type")
case("nsa_compress_grad", "output_grad-wrong-rows", setp(output_grad=lambda p: p["output_grad"][:-1]), INVALID,
     "output_grad")

# ------------------------------------------------------------------------------------------- NsaSelectedAttention(+Grad)
for name in ("query", "key", "value", "topk_indices"):
    case(SEL, f"{name}-none", none_of(name), NULL, name)
for name in ("attention_out", "attention_out_grad", "softmax_max", "softmax_sum"):
    case("nsa_selected_attention_grad", f"{name}-none", none_of(name), NULL, name)
case(SEL, "actual_seq_qlen-none", none_of("actual_seq_qlen"), NULL, "actual_seq_qlen")
case(SEL, "actual_seq_kvlen-none", none_of("actual_seq_kvlen"), NULL, "actual_seq_kvlen")
for name in ("query", "key", "value"):
    case(SEL, f"{name}-fp32", cast(name, F32), DTYPE, name)
case(SEL, "key-dtype-differs-from-query", cast("key", torch.bfloat16), INVALID, "key")
case(SEL, "topk_indices-int64", cast("topk_indices", torch.int64), DTYPE, "topk_indices")
case(SEL, "atten_mask-float", setp(atten_mask=lambda p: p["atten_mask"].to(torch.float16)), DTYPE, "atten_mask")
case(SEL, "atten_mask-3d", setp(atten_mask=lambda p: p["atten_mask"].unsqueeze(0)), INVALID, "atten_mask")
case(SEL, "input_layout-BSND", setp(input_layout="BSND"), INVALID, "input_layout")
case(SEL, "sparse_mode-1", setp(sparse_mode=1), INVALID, "sparse_mode")
case(SEL, "sparse_mode-3", setp(sparse_mode=3), INVALID, "sparse_mode")
case(SEL, "block-not-multiple-of-16", _same, INVALID, "selected_block_size", kw=dict(bs=24, kv_lens=(48, 72)))
case(SEL, "block-over-128", _same, INVALID, "selected_block_size", kw=dict(bs=144, count=1, kv_lens=(144, 288)))
case(SEL, "count-0", setp(selected_block_count=0, topk_indices=lambda p: p["topk_indices"][..., :0]), INVALID,
     "selected_block_count")
case(SEL, "count-over-128", _same, INVALID, "selected_block_count", kw=dict(count=129, kv_lens=(16 * 129,) * 2))
case(SEL, "count-times-size-8192", _same, INVALID, ("selected_block_count", "selected_block_size"),
     kw=dict(bs=128, count=64, q_lens=(1,), kv_lens=(8192,)))
case(SEL, "kv-shorter-than-size-times-count", _same, INVALID, "actual_seq_kvlen", kw=dict(kv_lens=(16, 48)))
case(SEL, "kv-not-multiple-of-size", setp(actual_seq_kvlen=[40, 80]), INVALID, "actual_seq_kvlen")
case(SEL, "batch-count-differs", setp(actual_seq_kvlen=[32, 48, 80]), INVALID,
     ("actual_seq_kvlen", "actual_seq_qlen"))
case(SEL, "N1-over-128", _same, INVALID, ("head_num", "query"), kw=dict(n1=132, n2=33))
case(SEL, "N2-over-128", _same, INVALID, ("key", "head_num", "query"), kw=dict(n1=129, n2=129))
case(SEL, "G-over-32", _same, INVALID, ("query", "head_num"), kw=dict(n1=66, n2=2))
case(SEL, "N1-not-multiple-of-N2", _same, INVALID, ("query", "key"), kw=dict(n1=3, n2=2))
case(SEL, "head_num-differs-from-N1", setp(head_num=4), INVALID, "head_num")
case(SEL, "D-not-128-or-192", _same, INVALID, "query", kw=dict(d=64))
case(SEL, "Dv-not-128-or-192", _same, INVALID, "value", kw=dict(dv=96))
case(SEL, "key-D-differs-from-query", setp(key=lambda p: p["key"][..., :128].contiguous()), INVALID, "key")
case(SEL, "key-value-N-differ", setp(value=lambda p: p["value"].repeat(1, 2, 1)), INVALID, "value")
case(SEL, "topk-wrong-shape", setp(topk_indices=lambda p: p["topk_indices"][:, :, :1].contiguous()), INVALID,
     "topk_indices")
case(SEL, "topk-out-of-range", setp(topk_indices=lambda p: p["topk_indices"].clone().index_fill_(0, torch.tensor(
    [0]), 2)), INVALID, "topk_indices")
case(SEL, "topk-negative", setp(topk_indices=lambda p: p["topk_indices"].clone().index_fill_(0, torch.tensor([3]),
                                                                                             -1)),
     INVALID, "topk_indices")
case(SEL, "T1-over-2M", setp(query=lambda p: p["query"][:1].expand((2 << 20) + 1, -1, -1)), INVALID,
     ("query", "actual_seq_qlen", "topk_indices"))
for name in ("softmax_max", "softmax_sum"):
    case("nsa_selected_attention_grad", f"{name}-wrong-shape", setp(**{name: lambda p, n=name: p[n][..., :4]}),
         INVALID, name)
    case("nsa_selected_attention_grad", f"{name}-fp16", setp(**{name: lambda p, n=name: p[n].half()}), DTYPE,
         name)
case("nsa_selected_attention_grad", "attention_out-wrong-D",
     setp(attention_out=lambda p: p["attention_out"][..., :64].contiguous()), INVALID, "attention_out")
case("nsa_selected_attention_grad", "attention_out_grad-wrong-N",
     setp(attention_out_grad=lambda p: p["attention_out_grad"][:, :1].contiguous()), INVALID, "attention_out_grad")
case("nsa_selected_attention_grad", "attention_out_grad-fp32", cast("attention_out_grad", F32), DTYPE,
     "attention_out_grad")

# ------------------------------------------------------------------------------------------- NsaCompressAttention
CA = "nsa_compress_attention"
for name in ("query", "key", "value"):
    case(CA, f"{name}-none", none_of(name), NULL, name)
    case(CA, f"{name}-fp32", cast(name, F32), DTYPE, name)
case(CA, "actual_cmp_seq_kvlen-none", none_of("actual_cmp_seq_kvlen"), NULL, "actual_cmp_seq_kvlen")
for name in ("actual_seq_qlen", "actual_sel_seq_kvlen"):
    case(CA, f"{name}-none", none_of(name), NULL, name)
case(CA, "input_layout-BSND", setp(input_layout="BSND"), INVALID, "input_layout")
case(CA, "sparse_mode-2", setp(sparse_mode=2), INVALID, "sparse_mode")
case(CA, "block-not-multiple-of-16", _same, INVALID, "compress_block_size", kw=dict(block=40, sel_block=48,
                                                                                    stride=16))
case(CA, "block-over-128", _same, INVALID, ("compress_block_size", "select_block_size"),
     kw=dict(block=144, sel_block=144, stride=16))
case(CA, "stride-not-multiple-of-16", _same, INVALID, "compress_stride", kw=dict(stride=8))
case(CA, "stride-over-64", _same, INVALID, "compress_stride", kw=dict(block=80, stride=80, sel_block=80))
case(CA, "select-block-over-128", _same, INVALID, "select_block_size", kw=dict(sel_block=144))
case(CA, "select-block-not-multiple-of-16", _same, INVALID, "select_block_size", kw=dict(sel_block=40))
case(CA, "block-less-than-stride", _same, INVALID, ("compress_stride", "compress_block_size"),
     kw=dict(block=16, stride=32, sel_block=32))
case(CA, "select-block-less-than-block", _same, INVALID, "select_block_size",
     kw=dict(block=64, stride=16, sel_block=48))
case(CA, "select-block-not-multiple-of-stride", _same, INVALID, "select_block_size",
     kw=dict(block=32, stride=32, sel_block=48))
case(CA, "count-0", setp(select_block_count=0), INVALID, "select_block_count")
case(CA, "count-over-32", _same, INVALID, "select_block_count", kw=dict(count=33, cmp_lens=(66, 70)))
case(CA, "count-over-selection-length", setp(select_block_count=4), INVALID, "select_block_count")
case(CA, "G-not-dividing-128", _same, INVALID, ("head_num", "query"), kw=dict(n1=3, n2=1))
case(CA, "G-128", _same, INVALID, ("head_num", "query"), kw=dict(n1=128, n2=1))
case(CA, "head_num-differs-from-N1", setp(head_num=4), INVALID, "head_num")
case(CA, "key-D-differs-from-query", setp(key=lambda p: p["key"][..., :16].contiguous()), INVALID, "key")
case(CA, "Dv-over-D", _same, INVALID, "value", kw=dict(d=16, dv=32))
case(CA, "cmp-kv-over-14000", setp(key=lambda p: p["key"][:1].expand(14001, -1, -1),
                                   value=lambda p: p["value"][:1].expand(14001, -1, -1),
                                   actual_cmp_seq_kvlen=[14001, 14001], actual_sel_seq_kvlen=[7001, 7001],
                                   atten_mask=None, topk_mask=None, sparse_mode=0),
     INVALID, "actual_cmp_seq_kvlen")
case(CA, "sel-lengths-inconsistent", setp(actual_sel_seq_kvlen=[3, 8]), INVALID, "actual_sel_seq_kvlen")
case(CA, "batch-count-differs", setp(actual_cmp_seq_kvlen=[5, 12, 12], actual_sel_seq_kvlen=[3, 7, 7]), INVALID,
     ("actual_cmp_seq_kvlen", "actual_seq_qlen", "actual_sel_seq_kvlen", "actual_seq_kvlen"))
case(CA, "atten_mask-float", setp(atten_mask=lambda p: p["atten_mask"].half()), DTYPE, "atten_mask")
case(CA, "atten_mask-too-small", setp(atten_mask=lambda p: p["atten_mask"][:3]), INVALID, "atten_mask")
case(CA, "topk_mask-float", setp(topk_mask=lambda p: p["topk_mask"].half()), DTYPE, "topk_mask")
case(CA, "topk_mask-too-small", setp(topk_mask=lambda p: p["topk_mask"][:, :2]), INVALID, "topk_mask")


def _params(c: Case, op: str) -> dict:
    p = base_params(op, **c.kw) if c.kw else base_params(op)
    out = c.mutate(p, op)
    return p if out is None else out


def _check(err, c: Case):
    assert isinstance(err, AclnnError)
    assert err.status == (161001 if c.exc is ParamNullptrError else 161002)
    names = "|".join(re.escape(n) for n in c.names)
    assert re.match(rf"^({names})(\[\d+\])?: ", str(err)), str(err)


def _params_of(c: Case, op: str):
    try:
        return _params(c, op)
    except AclnnError as e:  # the base forward call inside the grad params already rejected the configuration
        pytest.fail(f"building the parameters raised {e!r}")


ALL = [pytest.param(c, op, id=f"{op}:{c.id}") for c in CASES for op in c.ops]


@pytest.mark.parametrize("c,op", ALL)
def test_rejected_by_direct_call(c, op):
    p = _params_of(c, op)
    with pytest.raises(c.exc) as info:
        OPS[op][0](*p.values())
    _check(info.value, c)


@pytest.mark.parametrize("c,op", ALL)
def test_rejected_in_phase_1(c, op):
    p = _params_of(c, op)
    with pytest.raises(c.exc) as info:
        OPS[op][1](*p.values())
    _check(info.value, c)


@pytest.mark.parametrize("op", list(OPS))
def test_base_parameters_are_valid(op):
    ws, executor = OPS[op][1](*base_params(op).values())
    assert isinstance(ws, int) and ws >= 0
    executor()
