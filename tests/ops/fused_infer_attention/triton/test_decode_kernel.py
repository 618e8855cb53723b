"""The Triton FIA decode kernels vs the fp64 golden (``attnops.testing.golden_fia``) with the project's tolerance
rule: dense and paged KV in every layout, GQA, Dv != D, actual lengths (empty batches included), several KV splits,
a few query rows per batch (causal, TND), masks, pse, left padding, int8/int4 antiquant in every parameter mode,
int8 output. Every test forces ``ATTNOPS_BACKEND=triton`` and checks the kernels ran."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.ops.fused_infer_attention.problem import build_problem
from attnops.ops.fused_infer_attention.triton.verify import decode_reason, unsupported_reason
from attnops.testing.golden_fia import pack_int4
from tests.helpers import randn
from tests.ops.fused_infer_attention.fia_helpers import (TRIU2048, check_fia, int8_output_params, make_inputs,
                                                         rand_mask, randint4, randint8, to_paged)
from tests.ops.fused_infer_attention.test_fia_nz_cache import nz
from tests.triton_backend import DEVICE

F16, F32 = torch.float16, torch.float32
KERNELS = ["split_kernel", "merge_kernel"]


def _dev(x):
    if isinstance(x, torch.Tensor):
        return x.to(DEVICE)
    return x


def run_kernel(launched, kernels, q, k, v, via=None, **kw):
    """check_fia (the Pythonic API for fp32, which aclnn does not take), then check the kernels launched."""
    via = via or ("api" if q.dtype == F32 else "aclnn")
    r = check_fia(_dev(q), _dev(k), _dev(v), via=via, **{name: _dev(x) for name, x in kw.items()})
    assert launched == kernels, launched
    return r


def run(launched, q, k, v, via=None, **kw):
    """check_fia on the decode kernels (one split and one merge launch)."""
    return run_kernel(launched, KERNELS, q, k, v, via, **kw)


@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
@pytest.mark.parametrize("n,nkv,dtype", [(4, 4, F32), (4, 2, F16), (8, 1, F16)])
def test_dense_decode(triton_backend, layout, n, nkv, dtype):
    """Several splits (KV 75 over 32-token splits), one batch shorter, one empty."""
    q, k, v = make_inputs(layout, b=3, n=n, nkv=nkv, sq=1, skv=75, d=16, dtype=dtype)
    r = run(triton_backend, q, k, v, num_heads=n, num_key_value_heads=nkv, input_layout=layout, scale_value=0.25,
            softmax_lse_flag=True, actual_seq_lengths_kv=[75, 20, 0])
    assert bool((r["out"][2] == 0).all()) and bool(torch.isposinf(r["lse"][2]).all())


@pytest.mark.parametrize("via", ["aclnn", "api"])
def test_value_head_dim_differs(triton_backend, via):
    q, k, v = make_inputs("BNSD", b=2, n=4, nkv=2, sq=1, skv=40, d=24, dv=8, dtype=F16)
    run(triton_backend, q, k, v, via=via, num_heads=4, num_key_value_heads=2, input_layout="BNSD",
        scale_value=0.2, softmax_lse_flag=True)


def _paged(layout, cache_layout, *, n, nkv, sq, lens, bs, d=16, dtype=F16, int8=False, seed=0):
    q, _, _ = make_inputs(layout, b=len(lens), n=n, nkv=nkv, sq=sq, skv=1, d=d, dtype=dtype, seed=seed)
    if int8:
        k, v = randint8(len(lens), nkv, max(lens), d, seed=seed + 1), randint8(len(lens), nkv, max(lens), d, seed=2)
    else:
        k = randn(len(lens), nkv, max(lens), d, dtype=dtype, seed=seed + 1)
        v = randn(len(lens), nkv, max(lens), d, dtype=dtype, seed=seed + 2)
    kc, bt = to_paged(k, lens, bs, cache_layout=cache_layout, seed=seed + 3)
    vc, _ = to_paged(v, lens, bs, cache_layout=cache_layout, seed=seed + 3)
    return q, kc, vc, bt


@pytest.mark.parametrize("layout,cache_layout", [("BSH", "BSH"), ("BSND", "BSH"), ("BNSD", "BNSD")])
@pytest.mark.parametrize("bs,lens", [(16, [70, 7]), (32, [64, 33, 0])])
def test_paged_decode(triton_backend, layout, cache_layout, bs, lens):
    q, kc, vc, bt = _paged(layout, cache_layout, n=4, nkv=2, sq=1, lens=lens, bs=bs)
    run(triton_backend, q, kc, vc, block_table=bt, block_size=bs, actual_seq_lengths_kv=lens, num_heads=4,
        num_key_value_heads=2, scale_value=0.25, input_layout=layout, softmax_lse_flag=True)


@pytest.mark.parametrize("int8", [False, True])
def test_nz_paged_decode(triton_backend, int8):
    """NZ caches ``[blocknum, N2, D/x, blocksize, x]`` (x = 16 fp16, 32 int8) through the block table."""
    n, d, bs, lens = 4, 64, 16, [50, 0, 21]
    q, kc, vc, bt = _paged("BNSD", "BNSD", n=n, nkv=2, sq=1, lens=lens, bs=bs, d=d, int8=int8)
    quant = dict(key_antiquant_scale=_param((kc.shape[0], 2, bs), F32, 1),
                 value_antiquant_scale=_param((kc.shape[0], 2, bs), F32, 2), key_antiquant_mode=5,
                 value_antiquant_mode=5) if int8 else {}
    run(triton_backend, q, nz(kc), nz(vc), via="api", block_table=bt, block_size=bs, actual_seq_lengths_kv=lens,
        num_heads=n, num_key_value_heads=2, scale_value=0.25, input_layout="BNSD", softmax_lse_flag=True, **quant)


@pytest.mark.parametrize("sq", [1, 3])
def test_paged_mask_and_pse(triton_backend, sq):
    n, bs, lens = 2, 16, [50, 21]
    q, kc, vc, bt = _paged("BNSD", "BNSD", n=n, nkv=n, sq=sq, lens=lens, bs=bs)
    kv_s = bt.shape[1] * bs
    mask = rand_mask(2, kv_s, seed=1) if sq == 1 else rand_mask(2, 1, sq, kv_s, seed=1)
    pse = randn(2, n, sq, kv_s, dtype=F16, seed=2)
    run(triton_backend, q, kc, vc, via="api" if sq > 1 else "aclnn", block_table=bt, block_size=bs,
        actual_seq_lengths_kv=lens, atten_mask=mask, pse_shift=pse, sparse_mode=0 if sq == 1 else 1, num_heads=n, scale_value=0.25, input_layout="BNSD",
        softmax_lse_flag=True)


@pytest.mark.parametrize("sparse_mode,mask", [(3, TRIU2048), (0, None)])
def test_few_query_rows_causal_and_actual_lengths(triton_backend, sparse_mode, mask):
    """Speculative-decoding shape: 4 query rows, bottom-right causal, one batch with 2 rows."""
    q, k, v = make_inputs("BSND", b=2, n=4, nkv=2, sq=4, skv=45, d=16, dtype=F16)
    run(triton_backend, q, k, v, atten_mask=mask, sparse_mode=sparse_mode, actual_seq_lengths=[4, 2],
        actual_seq_lengths_kv=[45, 30], num_heads=4, num_key_value_heads=2, scale_value=0.25, input_layout="BSND",
        softmax_lse_flag=True)


def test_sliding_window_over_many_units(triton_backend):
    """Three speculative rows with a sliding window (sparse_mode 4) whose first column is no multiple of the tile
    width, and a pse: units start at the window rounded down (the band masks the rest); the long batch's 35 units
    take the merge kernel two steps."""
    q, k, v = make_inputs("BSND", b=2, n=4, nkv=2, sq=3, skv=1300, d=16, dtype=F16)
    pse = randn(2, 4, 3, 1300, dtype=F16, seed=7)
    run(triton_backend, q, k, v, atten_mask=TRIU2048, sparse_mode=4, pre_tokens=1100, next_tokens=0, pse_shift=pse,
        actual_seq_lengths_kv=[1300, 555], num_heads=4, num_key_value_heads=2, scale_value=0.25,
        input_layout="BSND", softmax_lse_flag=True)


def test_bnsd_in_bsnd_out(triton_backend):
    q, k, v = make_inputs("BNSD_BSND", b=2, n=4, nkv=1, sq=3, skv=37, d=16, dtype=F16)
    run(triton_backend, q, k, v, atten_mask=TRIU2048, sparse_mode=3, num_heads=4, num_key_value_heads=1,
        scale_value=0.25, input_layout="BNSD_BSND", softmax_lse_flag=True)


def test_tnd_band(triton_backend):
    """TND with a left-top band (sparse_mode 0, pre/next tokens) and an explicit mask."""
    n = 2
    q = randn(7, n, 16, dtype=F16, seed=1)
    k, v = randn(60, n, 16, dtype=F16, seed=2), randn(60, n, 16, dtype=F16, seed=3)
    run(triton_backend, q, k, v, actual_seq_lengths=[3, 7], actual_seq_lengths_kv=[35, 60],
        atten_mask=rand_mask(4, 35, seed=4), sparse_mode=0, pre_tokens=30, next_tokens=20, num_heads=n,
        scale_value=0.25, input_layout="TND", softmax_lse_flag=True)


def test_kv_left_padding(triton_backend):
    n = 2
    q, k, v = make_inputs("BSND", b=2, n=n, sq=1, skv=40, d=16, dtype=F16)
    run(triton_backend, q, k, v, actual_seq_lengths_kv=[25, 31], kv_padding_size=torch.tensor([3]), num_heads=n,
        scale_value=0.25, input_layout="BSND", softmax_lse_flag=True)


def _param(shape, dtype, seed, offset=False):
    g = torch.Generator().manual_seed(seed)
    if offset:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    return (torch.rand(shape, generator=g) * 0.02 + 0.005).to(dtype)


@pytest.mark.parametrize("kmode,vmode,int4", [(k, v, int4) for k, v in [(0, 0), (1, 1), (2, 2), (3, 3), (0, 1)]
                                              for int4 in (False, True) if not (int4 and k == 2)])
def test_antiquant_modes(triton_backend, kmode, vmode, int4):
    """int8 and int4 (packed in int32) K/V with per-channel, per-token, per-tensor+head and per-token+head scales and
    offsets, K and V separate."""
    b, n, nkv, d, skv = 2, 4, 2, 64 if int4 else 32, 40
    q = make_inputs("BSND", b=b, n=n, sq=1, d=d, dtype=F16)[0]
    if int4:
        k, v = pack_int4(randint4(b, skv, nkv, d, seed=1)), pack_int4(randint4(b, skv, nkv, d, seed=2))
    else:
        k, v = randint8(b, skv, nkv, d, seed=1), randint8(b, skv, nkv, d, seed=2)
    shapes = {0: ((1, nkv, 1, d), F16), 1: ((1, b, skv), F32), 2: ((nkv,), F16), 3: ((b, nkv, skv), F32)}
    p = {}
    for i, (name, mode) in enumerate((("key", kmode), ("value", vmode))):
        shape, dtype = shapes[mode]
        p[f"{name}_antiquant_scale"] = _param(shape, dtype, 3 + i) * (10 if int4 else 1)
        p[f"{name}_antiquant_offset"] = _param(shape, dtype, 5 + i, offset=True)
    run(triton_backend, q, k, v, **p, key_antiquant_mode=kmode, value_antiquant_mode=vmode, num_heads=n,
        num_key_value_heads=nkv, scale_value=0.25, input_layout="BSND", softmax_lse_flag=True,
        actual_seq_lengths_kv=[40, 17])


@pytest.mark.parametrize("mode", [4, 5])
def test_paged_int8_page_managed_scales(triton_backend, mode):
    n, d, bs, lens = 2, 32, 16, [50, 21]
    q, kc, vc, bt = _paged("BNSD", "BNSD", n=n, nkv=n, sq=1, lens=lens, bs=bs, d=d, int8=True)
    shape = (kc.shape[0], bs) if mode == 4 else (kc.shape[0], n, bs)
    run(triton_backend, q, kc, vc, via="api", key_antiquant_scale=_param(shape, F32, 1),
        key_antiquant_offset=_param(shape, F32, 2, True), value_antiquant_scale=_param(shape, F32, 3),
        value_antiquant_offset=_param(shape, F32, 4, True), key_antiquant_mode=mode, value_antiquant_mode=mode,
        block_table=bt, block_size=bs, actual_seq_lengths_kv=lens, num_heads=n, scale_value=0.25,
        input_layout="BNSD", softmax_lse_flag=True)


def test_paged_int8_combined_per_channel(triton_backend):
    n, d, bs, lens = 2, 32, 16, [40, 33]
    q, kc, vc, bt = _paged("BSH", "BSH", n=n, nkv=n, sq=1, lens=lens, bs=bs, d=d, int8=True)
    run(triton_backend, q, kc, vc, via="api", antiquant_scale=_param((2, n, 1, d), F16, 1),
        antiquant_offset=_param((2, n, 1, d), F16, 2, True), block_table=bt, block_size=bs,
        actual_seq_lengths_kv=lens, num_heads=n, scale_value=0.25, input_layout="BSH", softmax_lse_flag=True)


@pytest.mark.parametrize("shape", [(1,), (2, 32)])
def test_int8_output(triton_backend, shape):
    q, k, v = make_inputs("BSND", b=2, n=2, sq=1, skv=40, d=32, dtype=F16)
    run(triton_backend, q, k, v, **int8_output_params(shape), actual_seq_lengths_kv=[40, 0], num_heads=2,
        scale_value=0.25, input_layout="BSND", softmax_lse_flag=True)


def _reasons(q, k, v, **options):
    """(decode kernels' reason, any Triton kernel's reason) for a call."""
    q, k, v = _dev(q), _dev(k), _dev(v)
    options = {name: _dev(x) for name, x in dict(dict(num_heads=2, scale=0.25, input_layout="BSND"), **options).items()}
    p = build_problem(q, k, v, **options)
    return decode_reason(p, q, k, v, options), unsupported_reason(p, q, k, v, options)


def test_verifier_reasons(triton_backend):
    q, k, v = make_inputs("BSND", b=2, n=2, sq=1, skv=8, d=16, dtype=F16)
    assert _reasons(q, k, v) == (None, None)
    long_q = make_inputs("BSND", b=2, n=2, sq=20, skv=8, d=16, dtype=F16)[0]
    assert "at most 16 query rows" in _reasons(long_q, k, v)[0] and _reasons(long_q, k, v)[1] is None
    prefix = randn(1, 3, 2, 16, dtype=F16, seed=9)
    assert "shared prefix" in _reasons(q, k, v, key_shared_prefix=prefix, value_shared_prefix=prefix)[0]
    if DEVICE == "cpu":  # the interpreter has no bf16
        assert "bfloat16" in _reasons(q.bfloat16(), k.bfloat16(), v.bfloat16())[1]
    qi, ki, vi = (randint8(2, 4, 2, 16, seed=i) for i in range(3))
    int8 = dict(deq_scale1=torch.tensor([1e-3]), quant_scale1=torch.tensor([1.0]), deq_scale2=torch.tensor([1e-2]))
    assert "queries (got torch.int8)" in _reasons(qi, ki, vi, **int8)[1]


def test_forced_triton_raises_with_the_reason(triton_backend):
    qi, ki, vi = (_dev(randint8(1, 4, 2, 16, seed=i)) for i in range(3))
    with pytest.raises(attnops.ParamInvalidError, match="got torch.int8"):
        attnops.fused_infer_attention(qi, ki, vi, num_heads=2, layout="BSND", deq_scale1=_dev(torch.tensor([1e-3])),
                                      quant_scale1=_dev(torch.tensor([1.0])), deq_scale2=_dev(torch.tensor([1e-2])))


def test_output_ties_round_away_from_zero(triton_backend):
    """CAST_ROUND in the merge kernel: two equally weighted values one fp16 ulp apart average to an exact tie, which
    rounds to the neighbour of larger magnitude (round-half-to-even would keep the even one)."""
    even = torch.tensor([1.0, -1.0, 2.0, -0.5, 1024.0, 3.0, -6.0, 0.25] * 2, dtype=F16)
    away = torch.nextafter(even, even * 2)
    v = torch.stack([even, away])[None, :, None, :]  # [B=1, KV_S=2, N=1, D=16]
    q, k = randn(1, 1, 1, 16, dtype=F16, seed=1), torch.zeros(1, 2, 1, 16, dtype=F16)
    out = attnops.fused_infer_attention(_dev(q), _dev(k), _dev(v), layout="BSND", scale=1.0)
    assert triton_backend == KERNELS
    assert torch.equal(out.cpu()[0, 0, 0], away)
