"""The FIA prefill route on the GPU hot path, checked without a GPU inside :func:`attnops.testing.gpu_dry_run` on
``meta`` tensors: every entry (the Pythonic API, aclnn one- and two-phase, torch_npu
``npu_fused_infer_attention_score(_v2)``, ``npu_prompt_flash_attention``, ``npu_incre_flash_attention``) over dense, TND, paged ND/NZ and
tensor-list K/V, int8/int4 antiquant, masks, pse, left padding, the shared prefix, lse and int8 output records prefill
launches with no host read of device values; and the launcher alone (its problem built on the CPU and moved to
``meta``) reads nothing on the host for every feature."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import attnops
import attnops.aclnn
from attnops import torch_npu
from attnops.ops.fused_infer_attention.problem import build_problem
from attnops.ops.fused_infer_attention.triton import prefill, verify
from attnops.testing import gpu_dry_run
from tests.ops.fused_infer_attention.fia_helpers import aclnn_args

pytest.importorskip("triton")  # launches are recorded with the kernels' argument names

META = torch.device("meta")
F16, I8, I32 = torch.float16, torch.int8, torch.int32
B, N, NKV, D, SQ, SKV, BS = 2, 8, 2, 64, 100, 300, 128


def e(*shape, dtype=F16, device=META):
    return torch.empty(shape, dtype=dtype, device=device)


def causal(device=META):
    return torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(1)


def paged(device=META, nz=False, dtype=F16):
    """A ``[blocks, bs, N2*D]`` (or NZ) cache pair and its block table for KV lengths 300 and 200."""
    x = 32 // dtype.itemsize
    shape = (8, NKV, D // x, BS, x) if nz else (8, BS, NKV * D)
    table = torch.arange(8, dtype=I32, device=device).reshape(B, 4) if device.type == "cpu" else e(B, 4, dtype=I32)
    return e(*shape, dtype=dtype, device=device), e(*shape, dtype=dtype, device=device), dict(
        block_table=table, block_size=BS, actual_seq_lengths_kv=[300, 200])


def _api(**kw):
    q, k, v = e(B, N, SQ, D), e(B, NKV, SKV, D), e(B, NKV, SKV, D)
    return lambda: attnops.fused_infer_attention(q, k, v, num_key_value_heads=NKV, return_lse=True, **kw)


def _api_paged(nz=False, layout="BSH"):
    kc, vc, kw = paged(nz=nz)
    q = e(B, SQ, N * D) if layout == "BSH" else e(B, N, SQ, D)
    return lambda: attnops.fused_infer_attention(q, kc, vc, layout=layout, num_heads=N, num_key_value_heads=NKV,
                                                 causal=True, **kw)


def _aclnn(two_phase=False, **kw):
    q, k, v = e(B, SQ, N * D), e(B, SKV, NKV * D), e(B, SKV, NKV * D)
    args = aclnn_args(q, k, v, num_heads=N, num_key_value_heads=NKV, scale_value=0.125, input_layout="BSH",
                      softmax_lse_flag=True, **kw)
    if two_phase:
        def call():
            ws, ex = attnops.aclnn.fused_infer_attention_score_v2_get_workspace_size(*args)
            return attnops.aclnn.fused_infer_attention_score_v2(None, ws, ex, None)
        return call
    return lambda: attnops.aclnn.fused_infer_attention_score_v2(*args)


def _int8_kv():
    q, k, v = e(B, N, SQ, D), e(B, NKV, SKV, D, dtype=I8), e(B, NKV, SKV, D, dtype=I8)
    scale, offset = e(2, NKV, 1, D), e(2, NKV, 1, D)
    return lambda: attnops.fused_infer_attention(q, k, v, num_key_value_heads=NKV, antiquant_scale=scale,
                                                 antiquant_offset=offset, causal=True)


def _int4_list():
    q = e(B, 1, N, D)
    k, v = [e(1, s, NKV, D // 8, dtype=I32) for s in (300, 200)], [e(1, s, NKV, D // 8, dtype=I32) for s in (300, 200)]
    args = aclnn_args(q, k, v, num_heads=N, num_key_value_heads=NKV, scale_value=0.125, input_layout="BSND",
                      key_antiquant_scale=e(B, 300, dtype=torch.float32), key_antiquant_mode=1,
                      value_antiquant_scale=e(B, 300, dtype=torch.float32), value_antiquant_mode=1)
    return lambda: attnops.aclnn.fused_infer_attention_score_v2(*args)


def _nz_int8_decode():
    kc, vc, kw = paged(nz=True, dtype=I8)
    scales = {f"{x}_antiquant_{y}": e(8, NKV, BS, dtype=torch.float32) for x in ("key", "value")
              for y in ("scale", "offset")}
    return lambda: attnops.fused_infer_attention(e(B, N, 1, D), kc, vc, num_heads=N, num_key_value_heads=NKV,
                                                 key_antiquant_mode=5, value_antiquant_mode=5, **scales, **kw)


def _torch_npu(v2=False, **kw):
    q, k, v = e(B, SQ, N * D), e(B, SKV, NKV * D), e(B, SKV, NKV * D)
    if v2:
        return lambda: torch_npu.npu_fused_infer_attention_score_v2(q, k, v, num_query_heads=N, num_key_value_heads=NKV,
                                                                    input_layout="BSH", softmax_scale=0.125, **kw)
    return lambda: torch_npu.npu_fused_infer_attention_score(q, k, v, num_heads=N, num_key_value_heads=NKV,
                                                             input_layout="BSH", scale=0.125, **kw)


def _prompt_flash_attention():
    q, k, v = e(B, SQ, N * D), e(B, SKV, NKV * D), e(B, SKV, NKV * D)
    return lambda: torch_npu.npu_prompt_flash_attention(q, k, v, num_heads=N, num_key_value_heads=NKV,
                                                        input_layout="BSH", scale_value=0.125, atten_mask=causal(),
                                                        sparse_mode=3, actual_seq_lengths=[100, 37])


def _incre_flash_attention_nz():
    kc, vc, kw = paged(nz=True)
    return lambda: torch_npu.npu_incre_flash_attention(e(B, 1, N * D), kc, vc, num_heads=N, num_key_value_heads=NKV,
                                                       input_layout="BSH", scale_value=0.125,
                                                       block_table=kw["block_table"], block_size=BS,
                                                       actual_seq_lengths=kw["actual_seq_lengths_kv"])


CASES = {
    "api-bnsd": _api(),
    "api-causal": _api(causal=True),
    "api-bsnd-explicit-mask-pse": lambda: attnops.fused_infer_attention(
        e(B, SQ, N, D), e(B, SKV, NKV, D), e(B, SKV, NKV, D), layout="BSND", num_key_value_heads=NKV,
        atten_mask=e(B, 1, SQ, SKV, dtype=torch.bool), sparse_mode=1, pse_shift=e(B, N, SQ, SKV)),
    "api-band-lse": _api(atten_mask=causal(), sparse_mode=4, pre_tokens=64, next_tokens=0),
    "api-bnsd-bsnd": _api(layout="BNSD_BSND", causal=True),
    "api-tnd": lambda: attnops.fused_infer_attention(e(150, N, D), e(500, NKV, D), e(500, NKV, D), layout="TND",
                                                     num_key_value_heads=NKV, actual_seq_lengths=[100, 150],
                                                     actual_seq_lengths_kv=[300, 500], causal=True),
    "api-left-padding": _api(actual_seq_lengths=[90, 60], actual_seq_lengths_kv=[250, 200], query_padding_size=3,
                             kv_padding_size=5),
    "api-paged-nd": _api_paged(),
    "api-paged-nz": _api_paged(nz=True, layout="BNSD"),
    "api-int8-kv": _int8_kv(),
    "api-nz-int8-decode": _nz_int8_decode(),
    "api-shared-prefix": _api(key_shared_prefix=e(1, NKV, 64, D), value_shared_prefix=e(1, NKV, 64, D),
                              actual_shared_prefix_len=[50], causal=True),
    "api-int8-out": _api(quant_scale2=e(1, dtype=torch.float32), quant_offset2=e(1, dtype=torch.float32)),
    "aclnn": _aclnn(atten_mask=causal(), sparse_mode=3),
    "aclnn-two-phase": _aclnn(two_phase=True, atten_mask=causal(), sparse_mode=3),
    "aclnn-list": lambda: attnops.aclnn.fused_infer_attention_score_v2(*aclnn_args(
        e(B, SQ, N * D), [e(1, 300, NKV * D), e(1, 200, NKV * D)], [e(1, 300, NKV * D), e(1, 200, NKV * D)],
        num_heads=N, num_key_value_heads=NKV, scale_value=0.125, input_layout="BSH")),
    "aclnn-int4-list": _int4_list(),
    "torch_npu": _torch_npu(atten_mask=causal(), sparse_mode=3, softmax_lse_flag=True),
    "torch_npu-v2": _torch_npu(v2=True, atten_mask=causal(), sparse_mode=3, return_softmax_lse=True),
    "npu_prompt_flash_attention": _prompt_flash_attention(),
    "npu_incre_flash_attention-nz": _incre_flash_attention_nz(),
}


@pytest.mark.parametrize("case", CASES)
def test_entries_record_prefill_launches(case, monkeypatch):
    # one-query-row cases (NZ, int4 list) are about the prefill kernel even once the decode kernels take them
    monkeypatch.setattr(verify, "decode_reason", lambda *args: "the prefill kernel is under test")
    with gpu_dry_run() as launches:
        CASES[case]()
    assert launches and {x.kernel for x in launches} == {"prefill_kernel"}, launches


# ------------------------------------------------------------------------------------------------- the launcher
def _meta_problem(p):
    """Problem ``p`` (built on the CPU, its mask and pse too) with every tensor it holds on ``meta``."""
    p.mask, p.pse  # noqa: B018  (built now, on the CPU, where they are built on first use)
    return dataclasses.replace(_on_meta(p), device=META)


def _on_meta(x):
    """``x`` with every tensor it holds (in dataclasses, tuples, lists, dicts) moved to ``meta``."""
    if isinstance(x, torch.Tensor):
        return x.to(META)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _on_meta(getattr(x, f.name)) for f in dataclasses.fields(x)
                                         if f.init})
    if isinstance(x, (tuple, list)):
        return type(x)(_on_meta(y) for y in x)
    if isinstance(x, dict):
        return {name: _on_meta(y) for name, y in x.items()}
    return x


def _randint(*shape, dtype=I8):
    return torch.randint(-8, 8, shape, dtype=dtype)


LAUNCHER_CASES = {
    "dense-causal": lambda: ((torch.randn(B, N, SQ, D).half(), torch.randn(B, NKV, SKV, D).half(),
                              torch.randn(B, NKV, SKV, D).half()),
                             dict(input_layout="BNSD", sparse_mode=3, atten_mask=causal("cpu"))),
    "tnd-band": lambda: ((torch.randn(150, N, D).half(), torch.randn(500, NKV, D).half(),
                          torch.randn(500, NKV, D).half()),
                         dict(input_layout="TND", actual_seq_lengths=[100, 150], actual_seq_lengths_kv=[300, 500],
                              sparse_mode=4, atten_mask=causal("cpu"), pre_tokens=30, next_tokens=0)),
    "mask-pse-left-padding": lambda: ((torch.randn(B, SQ, N, D).half(), torch.randn(B, SKV, NKV, D).half(),
                                       torch.randn(B, SKV, NKV, D).half()),
                                      dict(input_layout="BSND", actual_seq_lengths=[90, 60],
                                           actual_seq_lengths_kv=[250, 200], query_padding_size=torch.tensor([3]),
                                           kv_padding_size=torch.tensor([5]), sparse_mode=1,
                                           atten_mask=torch.rand(B, 1, SQ, SKV) < 0.3,
                                           pse_shift=torch.randn(B, N, SQ, SKV).half())),
    "paged-nd": lambda: ((torch.randn(B, SQ, N * D).half(), *paged(torch.device("cpu"))[:2]),
                         dict(input_layout="BSH", **paged(torch.device("cpu"))[2])),
    "paged-nz-int8": lambda: ((torch.randn(B, N, 1, D).half(), _randint(8, NKV, D // 32, BS, 32),
                               _randint(8, NKV, D // 32, BS, 32)),
                              dict(input_layout="BNSD", **paged(torch.device("cpu"))[2], key_antiquant_mode=5,
                                   value_antiquant_mode=5, **{f"{x}_antiquant_{y}": torch.rand(8, NKV, BS)
                                                               for x in ("key", "value") for y in ("scale", "offset")})),
    "prefix-int8-out-int8": lambda: ((torch.randn(B, N, SQ, D).half(), _randint(B, NKV, SKV, D),
                                      _randint(B, NKV, SKV, D)),
                                     dict(input_layout="BNSD", key_shared_prefix=_randint(1, NKV, 64, D),
                                          value_shared_prefix=_randint(1, NKV, 64, D), antiquant_scale=torch.rand(
                                              2, NKV, 1, D).half(), quant_scale2=torch.rand(N * D) + 1,
                                          quant_offset2=torch.rand(N * D))),
    "int4-list": lambda: ((torch.randn(B, 1, N, D).half(), [_randint(1, s, NKV, D // 8, dtype=I32) for s in (300, 200)],
                           [_randint(1, s, NKV, D // 8, dtype=I32) for s in (300, 200)]),
                          dict(input_layout="BSND", key_antiquant_mode=1, value_antiquant_mode=1,
                               key_antiquant_scale=torch.rand(B, 300), value_antiquant_scale=torch.rand(B, 300))),
}


@pytest.mark.parametrize("case", LAUNCHER_CASES)
def test_the_launcher_reads_nothing_on_the_host(case):
    (q, k, v), options = LAUNCHER_CASES[case]()
    options = dict(num_heads=N, num_key_value_heads=NKV, scale=0.125, **options)
    p = build_problem(q, k, v, **options)
    q, k, v = _on_meta(q), _on_meta(k), _on_meta(v)
    options, p_meta = {name: _on_meta(x) for name, x in options.items()}, _meta_problem(p)
    with gpu_dry_run() as launches:
        out, lse = prefill.forward(p_meta, q, k, v, options)
    assert len(launches) == (len(k) if isinstance(k, list) else 1)
    assert {x.kernel for x in launches} == {"prefill_kernel"}
    assert out.device == META and tuple(out.shape) == p.out_shape and out.dtype == p.out_dtype
    assert lse.device == META and tuple(lse.shape) == p.lse_shape
