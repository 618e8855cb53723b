"""FIA outputs vs the fp64 golden, every feature alone and in the combinations the seed allows, through the aclnn
operator (seed parameter order) and the Pythonic ``attnops.fused_infer_attention``.

Shapes respect the seed's alignment rules (D multiple of 16 for fp16/bf16, 32 for int8, 64 for int4; paged
block sizes 128..512 for Q_S > 1, 16/32-aligned for Q_S = 1).
"""
from __future__ import annotations

import pytest
import torch

from attnops.testing.golden_fia import encode_deq_scale, pack_int4
from tests.ops.fused_infer_attention.fia_helpers import (TRIU2048, bnsd, check_fia, from_bnsd, layout_of,
                                                         make_inputs, rand_mask, randint4, randint8, to_paged)
from tests.helpers import randn

VIA = ["aclnn", "api"]
LOW = [torch.float16, torch.bfloat16]
LAYOUTS = ["BSH", "BSND", "BNSD", "BNSD_BSND"]
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


# ------------------------------------------------------------------------------------------- layouts, GQA, lse
@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,nkv", [(2, 2), (4, 1)])
@pytest.mark.parametrize("sq", [1, 6, 24])  # 24: beyond the implementation's short-query path (16 rows)
def test_layouts_gqa_lse(via, dtype, layout, n, nkv, sq):
    if layout == "BNSD_BSND" and sq == 1:
        pytest.skip("BNSD_BSND needs Q_S > 1 (seed)")
    q, k, v = make_inputs(layout, b=2, n=n, nkv=nkv, sq=sq, skv=9 if sq < 20 else 37, d=16, dtype=dtype,
                          seed=sq + n)
    check_fia(q, k, v, via=via, num_heads=n, num_key_value_heads=nkv, scale_value=0.25, input_layout=layout,
              softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
def test_gqa_ratio_64(via):
    q, k, v = make_inputs("BNSD", b=1, n=64, nkv=1, sq=3, skv=5, d=16, dtype=F16)
    check_fia(q, k, v, via=via, num_heads=64, num_key_value_heads=1, scale_value=0.25, input_layout="BNSD",
              softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("sq", [1, 4])
def test_num_key_value_heads_0_means_num_heads(via, sq):
    q, k, v = make_inputs("BSH", n=4, sq=sq, d=16, dtype=F16)
    check_fia(q, k, v, via=via, num_heads=4, num_key_value_heads=0, scale_value=0.25, input_layout="BSH")


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("mode", [0, 3])
def test_tnd(via, dtype, mode):
    n, nkv, d = 4, 2, 16
    lq, lk = [3, 21, 2], [6, 25, 9]
    q = randn(sum(lq), n, d, dtype=dtype, seed=1)
    k = randn(sum(lk), nkv, d, dtype=dtype, seed=2)
    v = randn(sum(lk), nkv, d, dtype=dtype, seed=3)
    kw = dict(actual_seq_lengths=[3, 24, 26], actual_seq_lengths_kv=[6, 31, 40], num_heads=n,
              num_key_value_heads=nkv, scale_value=0.25, input_layout="TND", sparse_mode=mode,
              softmax_lse_flag=True)
    if mode == 3:
        kw["atten_mask"] = TRIU2048
    check_fia(q, k, v, via=via, **kw)


# ------------------------------------------------------------------------------------------- tensor lists
@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
@pytest.mark.parametrize("sq", [1, 4, 18])
def test_tensor_list(via, layout, sq):
    n, d, lens = 2, 16, [7, 3, 11]
    q, _, _ = make_inputs(layout, b=3, n=n, sq=sq, d=16, dtype=F16)
    ks = [layout_of(randn(1, s, n, d, dtype=F16, seed=10 + i), layout) for i, s in enumerate(lens)]
    vs = [layout_of(randn(1, s, n, d, dtype=F16, seed=20 + i), layout) for i, s in enumerate(lens)]
    check_fia(q, ks, vs, via=via, num_heads=n, scale_value=0.25, input_layout=layout, softmax_lse_flag=True)
    check_fia(q, ks, vs, via=via, num_heads=n, scale_value=0.25, input_layout=layout,
              actual_seq_lengths_kv=[5, 3, 1], softmax_lse_flag=True)


# ------------------------------------------------------------------------------------------- masks
PREFILL_MASKS = {"SS": lambda m: m[0], "BSS": lambda m: m, "1SS": lambda m: m[:1], "B1SS": lambda m: m[:, None],
                 "11SS": lambda m: m[:1, None]}
DECODE_MASKS = {"B,KV_S": lambda m: m, "B,1,KV_S": lambda m: m[:, None], "B,1,1,KV_S": lambda m: m[:, None, None]}
MASK_DTYPES = [torch.bool, torch.int8, torch.uint8]


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("mdtype", MASK_DTYPES, ids=str)
@pytest.mark.parametrize("shape", list(PREFILL_MASKS))
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("sq,skv", [(5, 9), (19, 26)])
def test_prefill_mask_shapes(via, mdtype, shape, mode, aligned, sq, skv):
    b, n = 2, 2
    q, k, v = make_inputs("BSND", b=b, n=n, sq=sq, skv=skv, d=16, dtype=F16)
    rs, cs = (-(-sq // 16) * 16, -(-skv // 16) * 16) if aligned else (sq, skv)  # "may be rounded up to aligned S"
    m = rand_mask(b, rs, cs, seed=3, dtype=mdtype)
    check_fia(q, k, v, via=via, atten_mask=PREFILL_MASKS[shape](m), sparse_mode=mode, num_heads=n,
              scale_value=0.25, input_layout="BSND", softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("mdtype", MASK_DTYPES, ids=str)
@pytest.mark.parametrize("shape", list(DECODE_MASKS))
def test_decode_mask_shapes(via, mdtype, shape):
    b, n, skv = 3, 2, 9
    q, k, v = make_inputs("BSH", b=b, n=n, sq=1, skv=skv, d=16, dtype=F16)
    m = rand_mask(b, 16, seed=4, dtype=mdtype)
    check_fia(q, k, v, via=via, atten_mask=DECODE_MASKS[shape](m), num_heads=n, scale_value=0.25,
              input_layout="BSH", softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
def test_decode_ignores_sparse_mode_and_tokens(via):
    b, n, skv = 2, 2, 9
    q, k, v = make_inputs("BNSD", b=b, n=n, sq=1, skv=skv, d=16, dtype=F16)
    m = rand_mask(b, skv, seed=4)
    for mode, pre, nxt in ((0, 0, 0), (1, 1, -3), (4, 0, 0)):
        r = check_fia(q, k, v, via=via, atten_mask=m, sparse_mode=mode, pre_tokens=pre, next_tokens=nxt,
                      num_heads=n, scale_value=0.25, input_layout="BNSD")
        assert bool((r["out"] != 0).any())


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("sq,skv", [(6, 6), (4, 11), (9, 5), (21, 40), (30, 17)])
@pytest.mark.parametrize("mode,pre,nxt", [(0, 2, 1), (0, 10, 0), (0, 3, -1), (0, -1, 3), (1, 0, 0), (2, 0, 0),
                                          (3, 0, 0), (4, 2, 0), (4, 1, 2), (4, 4, -2)])
def test_sparse_modes(via, sq, skv, mode, pre, nxt):
    n = 2
    q, k, v = make_inputs("BSH", b=2, n=n, sq=sq, skv=skv, d=16, dtype=F16, seed=sq)
    mask = TRIU2048 if mode in (2, 3, 4) else rand_mask(2, sq, skv, seed=7, p=0.2)
    check_fia(q, k, v, via=via, atten_mask=mask, sparse_mode=mode, pre_tokens=pre, next_tokens=nxt, num_heads=n,
              scale_value=0.25, input_layout="BSH", inner_precise=2, softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("mode", [2, 3, 4])
@pytest.mark.parametrize("mshape", ["2048", "1,2048", "1,1,2048"])
def test_compressed_mask_shapes(via, mode, mshape):
    n = 2
    q, k, v = make_inputs("BNSD", b=2, n=n, sq=5, skv=8, d=16, dtype=F16)
    m = {"2048": TRIU2048, "1,2048": TRIU2048[None], "1,1,2048": TRIU2048[None, None]}[mshape]
    check_fia(q, k, v, via=via, atten_mask=m.to(torch.uint8), sparse_mode=mode, pre_tokens=3, next_tokens=1,
              num_heads=n, scale_value=0.25, input_layout="BNSD", softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("mode", [0, 3, 4])
@pytest.mark.parametrize("sq,skv,aq,akv", [(7, 10, [7, 3, 5], [10, 8, 2]), (30, 28, [30, 17, 25], [28, 26, 3])])
def test_sparse_modes_use_actual_lengths(via, mode, sq, skv, aq, akv):
    """delta = actual KV length - actual query length, per batch."""
    n = 2
    q, k, v = make_inputs("BSND", b=3, n=n, sq=sq, skv=skv, d=16, dtype=F16)
    mask = TRIU2048 if mode else rand_mask(3, sq, skv, seed=2, p=0.1)
    check_fia(q, k, v, via=via, atten_mask=mask, sparse_mode=mode, pre_tokens=2, next_tokens=1,
              actual_seq_lengths=aq, actual_seq_lengths_kv=akv, num_heads=n, scale_value=0.25,
              input_layout="BSND", inner_precise=2, softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("inner_precise", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("sq,skv", [(6, 8), (20, 24)])
def test_inner_precise_and_fully_masked_rows(via, inner_precise, dtype, sq, skv):
    """Rows masked everywhere: output 0 and lse +inf whatever inner_precise says (DECISIONS.md)."""
    n = 2
    q, k, v = make_inputs("BNSD", b=2, n=n, sq=sq, skv=skv, d=16, dtype=dtype)
    m = rand_mask(2, sq, skv, seed=5)
    m[0, 2] = True
    m[1, 0] = True
    m[1, 5] = True
    r = check_fia(q, k, v, via=via, atten_mask=m, sparse_mode=1, num_heads=n, scale_value=0.25,
                  input_layout="BNSD", inner_precise=inner_precise, softmax_lse_flag=True)
    assert bool((r["out"][0, :, 2] == 0).all()) and bool(torch.isposinf(r["lse"][0, :, 2]).all())
    assert bool((r["out"][1, :, [0, 5]] == 0).all()) and bool(torch.isposinf(r["lse"][1, :, [0, 5]]).all())


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("inner_precise", [0, 1])
def test_inner_precise_decode(via, inner_precise):
    q, k, v = make_inputs("BSH", b=2, n=2, sq=1, skv=9, d=16, dtype=F16)
    check_fia(q, k, v, via=via, num_heads=2, scale_value=0.25, input_layout="BSH", inner_precise=inner_precise,
              softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
def test_sparse3_with_sq_over_skv_has_invalid_rows(via):
    n = 2
    q, k, v = make_inputs("BSH", b=1, n=n, sq=8, skv=5, d=16, dtype=F16)
    r = check_fia(q, k, v, via=via, atten_mask=TRIU2048, sparse_mode=3, num_heads=n, scale_value=0.25,
                  input_layout="BSH", softmax_lse_flag=True)
    assert bool((r["out"][0, :3] == 0).all()) and bool(torch.isposinf(r["lse"][0, :, :3]).all())


# ------------------------------------------------------------------------------------------- pse
@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("pb", ["B", "1"])
@pytest.mark.parametrize("sq", [1, 5, 21])
def test_pse(via, dtype, pb, sq):
    b, n, skv = 2, 2, 9 if sq < 20 else 30
    q, k, v = make_inputs("BNSD", b=b, n=n, sq=sq, skv=skv, d=16, dtype=dtype)
    rows = sq if sq == 1 else sq + 3  # Q_S > 1: may be larger than S
    pse = randn(b if pb == "B" else 1, n, rows, 32, dtype=dtype, seed=9)
    check_fia(q, k, v, via=via, pse_shift=pse, num_heads=n, scale_value=0.25, input_layout="BNSD",
              softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
def test_pse_with_mask_and_gqa(via):
    b, n, nkv, sq, skv = 2, 4, 2, 6, 10
    q, k, v = make_inputs("BSND", b=b, n=n, nkv=nkv, sq=sq, skv=skv, d=16, dtype=BF16)
    pse = randn(1, n, sq, skv, dtype=BF16, seed=9)
    check_fia(q, k, v, via=via, pse_shift=pse, atten_mask=TRIU2048, sparse_mode=3, num_heads=n,
              num_key_value_heads=nkv, scale_value=0.25, input_layout="BSND", softmax_lse_flag=True)


# ------------------------------------------------------------------------------------------- actual lengths
@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("aq,akv", [([3], [4]), ([5, 2], [1, 9]), ([2, 4, 3], [7, 3, 0, 5]), (None, [0]),
                                    ([1, 1], None), ([0, 4], [3, 3])])
def test_actual_lengths_broadcast(via, aq, akv):
    """Length 1: shared by all batches; length >= B: the first B values. Padded rows are judged separately."""
    n = 2
    q, k, v = make_inputs("BSH", b=2, n=n, sq=5, skv=9, d=16, dtype=F16)
    check_fia(q, k, v, via=via, actual_seq_lengths=aq, actual_seq_lengths_kv=akv, num_heads=n, scale_value=0.25,
              input_layout="BSH", softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
def test_decode_ignores_actual_seq_lengths(via):
    q, k, v = make_inputs("BSH", b=2, n=2, sq=1, skv=9, d=16, dtype=F16)
    check_fia(q, k, v, via=via, actual_seq_lengths=[0, 0], actual_seq_lengths_kv=[4, 9], num_heads=2,
              scale_value=0.25, input_layout="BSH", softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("sq", [1, 4])
def test_empty_kv_gives_zeros_and_inf_lse(via, sq):
    q, k, v = make_inputs("BNSD", b=2, n=2, sq=sq, skv=0, d=16, dtype=F16)
    r = check_fia(q, k, v, via=via, num_heads=2, scale_value=0.25, input_layout="BNSD", softmax_lse_flag=True)
    assert bool((r["out"] == 0).all()) and bool(torch.isposinf(r["lse"]).all())


# ------------------------------------------------------------------------------------------- paged KV
def _paged(layout, *, b=2, n=2, nkv=2, sq, lens, d=16, bs, cache_layout, dtype=F16, seed=0):
    q, _, _ = make_inputs(layout, b=b, n=n, nkv=nkv, sq=sq, skv=1, d=d, dtype=dtype, seed=seed)
    smax = max(lens)
    k = randn(b, nkv, smax, d, dtype=dtype, seed=seed + 1)
    v = randn(b, nkv, smax, d, dtype=dtype, seed=seed + 2)
    kc, bt = to_paged(k, lens, bs, cache_layout=cache_layout, seed=seed + 3)
    vc, _ = to_paged(v, lens, bs, cache_layout=cache_layout, seed=seed + 3)
    return q, k, v, kc, vc, bt


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("layout,cache_layout", [("BSH", "BSH"), ("BSND", "BSH"), ("BNSD", "BSH"),
                                                 ("BNSD", "BNSD")])
@pytest.mark.parametrize("sq,bs,lens", [(1, 16, [40, 7]), (1, 32, [64, 33]), (4, 128, [200, 130]),
                                       (20, 256, [300, 21])])
def test_paged(via, layout, cache_layout, sq, bs, lens):
    n, nkv = 4, 2
    q, _, _, kc, vc, bt = _paged(layout, n=n, nkv=nkv, sq=sq, lens=lens, bs=bs, cache_layout=cache_layout)
    check_fia(q, kc, vc, via=via, block_table=bt, block_size=bs, actual_seq_lengths_kv=lens, num_heads=n,
              num_key_value_heads=nkv, scale_value=0.25, input_layout=layout, softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("sq", [1, 3, 18])
def test_paged_with_mask_and_pse(via, sq):
    n, bs, lens = 2, 128, [150, 60]
    q, _, _, kc, vc, bt = _paged("BNSD", n=n, nkv=n, sq=sq, lens=lens, bs=bs, cache_layout="BNSD")
    kv_s = bt.shape[1] * bs  # >= maxBlockNumPerSeq * blockSize
    mask = rand_mask(2, kv_s, seed=1) if sq == 1 else rand_mask(2, 1, sq, kv_s, seed=1)
    pse = randn(2, n, sq, kv_s, dtype=F16, seed=2)
    check_fia(q, kc, vc, via=via, block_table=bt, block_size=bs, actual_seq_lengths_kv=lens, atten_mask=mask,
              pse_shift=pse, sparse_mode=0 if sq == 1 else 1, num_heads=n, scale_value=0.25, input_layout="BNSD",
              softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("sq", [6, 40])
def test_paged_prefill_causal(via, sq):
    n, bs, lens = 2, 128, [140, 131]
    q, _, _, kc, vc, bt = _paged("BSH", n=n, nkv=1, sq=sq, lens=lens, bs=bs, cache_layout="BSH")
    check_fia(q, kc, vc, via=via, block_table=bt, block_size=bs, actual_seq_lengths_kv=lens,
              actual_seq_lengths=[sq, sq - 2], atten_mask=TRIU2048, sparse_mode=3, num_heads=n, num_key_value_heads=1,
              scale_value=0.25, input_layout="BSH", softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("cache_layout", ["BSH", "BNSD"])
def test_paged_int8_antiquant_decode(via, cache_layout):
    n, d, bs, lens = 2, 32, 32, [70, 33]
    q = randn(2, n, 1, d, dtype=F16, seed=1)
    k, v = randint8(2, n, 70, d, seed=2), randint8(2, n, 70, d, seed=3)
    kc, bt = to_paged(k, lens, bs, cache_layout=cache_layout, seed=4)
    vc, _ = to_paged(v, lens, bs, cache_layout=cache_layout, seed=4)
    sc = (torch.rand(2, n, 1, d) * 0.02 + 0.005).to(F16)
    off = randn(2, n, 1, d, dtype=F16, seed=5)
    check_fia(q, kc, vc, via=via, antiquant_scale=sc, antiquant_offset=off, block_table=bt, block_size=bs,
              actual_seq_lengths_kv=lens, num_heads=n, scale_value=0.25, input_layout="BNSD",
              softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("mode", [4, 5])
def test_paged_managed_antiquant_scales(via, mode):
    n, d, bs, lens = 2, 32, 32, [70, 33]
    q = randn(2, n, 1, d, dtype=BF16, seed=1)
    k, v = randint8(2, n, 70, d, seed=2), randint8(2, n, 70, d, seed=3)
    kc, bt = to_paged(k, lens, bs, cache_layout="BNSD", seed=4)
    vc, _ = to_paged(v, lens, bs, cache_layout="BNSD", seed=4)
    shape = (kc.shape[0], bs) if mode == 4 else (kc.shape[0], n, bs)
    g = torch.Generator().manual_seed(6)
    sk, sv = (torch.rand(*shape, generator=g) * 0.02 + 0.005 for _ in range(2))
    ok, ov = (torch.randn(*shape, generator=g) for _ in range(2))
    check_fia(q, kc, vc, via=via, key_antiquant_scale=sk, key_antiquant_offset=ok, value_antiquant_scale=sv,
              value_antiquant_offset=ov, key_antiquant_mode=mode, value_antiquant_mode=mode, block_table=bt,
              block_size=bs, actual_seq_lengths_kv=lens, num_heads=n, scale_value=0.25, input_layout="BNSD",
              softmax_lse_flag=True)


# ------------------------------------------------------------------------------------------- int8 full quant
def _int8_qkv(layout, *, b=2, n=2, sq=5, skv=9, d=32, seed=0):
    q = layout_of(randint8(b, sq, n, d, seed=seed), layout)
    k = layout_of(randint8(b, skv, n, d, seed=seed + 1), layout)
    v = layout_of(randint8(b, skv, n, d, seed=seed + 2), layout)
    return q, k, v


def _deq(x, kind):
    return encode_deq_scale(x) if kind == "uint64" else torch.tensor([x], dtype=F32)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD", "BNSD_BSND"])
@pytest.mark.parametrize("deq", ["uint64", "float32"])
def test_int8_in_fp16_out(via, layout, deq):
    q, k, v = _int8_qkv(layout)
    check_fia(q, k, v, via=via, deq_scale1=_deq(7.3e-5, deq), quant_scale1=torch.tensor([127.0]),
              deq_scale2=_deq(1 / 127, deq), num_heads=2, scale_value=0.7, input_layout=layout,
              softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("sparse", [0, 3])
@pytest.mark.parametrize("sq,skv", [(6, 8), (24, 30)])
def test_int8_in_int8_out(via, offset, sparse, sq, skv):
    q, k, v = _int8_qkv("BSH", sq=sq, skv=skv)
    check_fia(q, k, v, via=via, deq_scale1=encode_deq_scale(7.3e-5), quant_scale1=torch.tensor([127.0]),
              deq_scale2=encode_deq_scale(1 / 127), quant_scale2=torch.tensor([0.6]),
              quant_offset2=torch.tensor([2.0]) if offset else None, num_heads=2, scale_value=0.7,
              input_layout="BSH", atten_mask=TRIU2048 if sparse else None, sparse_mode=sparse,
              softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
def test_int8_with_pse_and_mask(via):
    q, k, v = _int8_qkv("BNSD", sq=6, skv=8)
    pse = randn(2, 2, 6, 8, dtype=F16, seed=3)
    check_fia(q, k, v, via=via, deq_scale1=torch.tensor([7.3e-5]), quant_scale1=torch.tensor([127.0]),
              deq_scale2=torch.tensor([1 / 127]), pse_shift=pse, atten_mask=rand_mask(2, 6, 8, seed=1),
              sparse_mode=1, num_heads=2, scale_value=0.7, input_layout="BNSD", softmax_lse_flag=True)


QS2_SHAPES = {"BSH": [(1,), (64,), (1, 1, 64)], "BSND": [(1,), (2, 32), (1, 1, 2, 32)],
              "BNSD": [(1,), (2, 32), (1, 2, 1, 32)]}


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("layout,shape", [(lay, s) for lay, ss in QS2_SHAPES.items() for s in ss])
@pytest.mark.parametrize("dtype,qdtype", [(F16, F32), (BF16, F32), (BF16, BF16)], ids=str)
@pytest.mark.parametrize("sq", [1, 5, 20])
def test_float_in_int8_out(via, layout, shape, dtype, qdtype, sq):
    n, d = 2, 32  # int8 attention_out: D 32-aligned
    q, k, v = make_inputs(layout, b=2, n=n, sq=sq, skv=9, d=d, dtype=dtype, seed=sq)
    g = torch.Generator().manual_seed(3)
    qs2 = (torch.rand(shape, generator=g) * 40 + 20).to(qdtype)
    qo2 = (torch.randn(shape, generator=g) * 3).to(qdtype)
    check_fia(q, k, v, via=via, quant_scale2=qs2, quant_offset2=qo2, num_heads=n, scale_value=0.25,
              input_layout=layout, softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
def test_int8_output_saturates(via):
    q, k, v = make_inputs("BSH", b=2, n=2, sq=1, skv=9, d=32, dtype=F16)
    r = check_fia(q, k, v, via=via, quant_scale2=torch.tensor([1000.0]), num_heads=2, scale_value=0.25,
                  input_layout="BSH")
    assert int(r["out"].max()) == 127 and int(r["out"].min()) == -128


# ------------------------------------------------------------------------------------------- antiquant
ANTI_COMBINED = {"(2,N,1,D)": lambda n, d: (2, n, 1, d), "(2,N,D)": lambda n, d: (2, n, d),
                 "(2,H)": lambda n, d: (2, n * d), "(2)": lambda n, d: (2,)}


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("shape", list(ANTI_COMBINED))
@pytest.mark.parametrize("sq,dtype", [(1, F16), (1, BF16), (4, F16), (20, F16)], ids=str)
@pytest.mark.parametrize("offset", [True, False])
def test_antiquant_combined_per_channel_and_tensor(via, shape, sq, dtype, offset):
    b, n, nkv, d, skv = 2, 4, 2, 32, 9
    q = make_inputs("BSH", b=b, n=n, sq=sq, d=d, dtype=dtype)[0]
    k = randint8(b, skv, nkv * d, seed=1)
    v = randint8(b, skv, nkv * d, seed=2)
    g = torch.Generator().manual_seed(3)
    shp = ANTI_COMBINED[shape](nkv, d)
    sc = (torch.rand(shp, generator=g) * 0.02 + 0.005).to(dtype)
    off = (torch.randn(shp, generator=g) * 4).to(dtype) if offset else None
    check_fia(q, k, v, via=via, antiquant_scale=sc, antiquant_offset=off, num_heads=n, num_key_value_heads=nkv,
              scale_value=0.25, input_layout="BSH", softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("sq", [1])  # Q_S >= 2: antiquant_mode has no effect and the scales are fp16 only
def test_antiquant_combined_per_token(via, sq):
    b, n, d, skv = 2, 2, 32, 9
    dtype = F16
    q = make_inputs("BNSD", b=b, n=n, sq=sq, d=d, dtype=dtype)[0]
    k, v = randint8(b, n, skv, d, seed=1), randint8(b, n, skv, d, seed=2)
    g = torch.Generator().manual_seed(3)
    sc = torch.rand(2, b, skv, generator=g) * 0.02 + 0.005
    off = torch.randn(2, b, skv, generator=g) * 4
    check_fia(q, k, v, via=via, antiquant_scale=sc, antiquant_offset=off, antiquant_mode=1, num_heads=n,
              scale_value=0.25, input_layout="BNSD", actual_seq_lengths_kv=[9, 6], softmax_lse_flag=True)


def _sep_params(mode, *, b, nkv, d, skv, dtype, g, sq):
    """(shape, dtype) of the separate antiquant parameters per mode (seed tables, Q_S = 1 and Q_S > 1)."""
    if mode == 0:
        return ((1, nkv, 1, d) if sq == 1 else (nkv, d)), dtype
    if mode == 1:
        return ((1, b, skv) if sq == 1 else (b, skv)), F32
    if mode == 2:
        return (nkv,), dtype
    if mode == 3:
        return (b, nkv, skv), F32
    raise ValueError(mode)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("kmode,vmode", [(0, 0), (1, 1), (2, 2), (3, 3), (0, 1)])
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("offset", [True, False])
def test_antiquant_separate_decode(via, kmode, vmode, dtype, offset):
    b, n, nkv, d, skv = 2, 4, 2, 32, 9
    if (kmode, vmode) == (0, 1) and dtype == BF16:
        pytest.skip("key per-channel + value per-token with int8 KV: fp16 query only (seed)")
    q = make_inputs("BSND", b=b, n=n, sq=1, d=d, dtype=dtype)[0]
    k, v = randint8(b, skv, nkv, d, seed=1), randint8(b, skv, nkv, d, seed=2)
    g = torch.Generator().manual_seed(3)
    p = {}
    for name, mode in (("key", kmode), ("value", vmode)):
        shape, pdt = _sep_params(mode, b=b, nkv=nkv, d=d, skv=skv, dtype=dtype, g=g, sq=1)
        p[f"{name}_antiquant_scale"] = (torch.rand(shape, generator=g) * 0.02 + 0.005).to(pdt)
        if offset:
            p[f"{name}_antiquant_offset"] = (torch.randn(shape, generator=g) * 4).to(pdt)
    check_fia(q, k, v, via=via, **p, key_antiquant_mode=kmode, value_antiquant_mode=vmode, num_heads=n,
              num_key_value_heads=nkv, scale_value=0.25, input_layout="BSND", softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("pshape", ["a", "b", "c"])
def test_antiquant_separate_prefill_bf16(via, mode, pshape):
    """Q_S > 1: per-channel (N,D)/(N,1,D)/(H) bf16 or per-token (B,S) fp32; bf16 query, int8 KV, Q_S <= 16."""
    b, n, nkv, d, skv, sq = 2, 2, 2, 32, 9, 16
    if mode == 1 and pshape != "a":
        pytest.skip("per-token has one shape")
    q = make_inputs("BSH", b=b, n=n, sq=sq, d=d, dtype=BF16)[0]
    k, v = randint8(b, skv, nkv * d, seed=1), randint8(b, skv, nkv * d, seed=2)
    g = torch.Generator().manual_seed(3)
    if mode == 0:
        shape, pdt = {"a": (nkv, d), "b": (nkv, 1, d), "c": (nkv * d,)}[pshape], BF16
    else:
        shape, pdt = (b, skv), F32
    sk, sv = ((torch.rand(shape, generator=g) * 0.02 + 0.005).to(pdt) for _ in range(2))
    ok, ov = ((torch.randn(shape, generator=g) * 4).to(pdt) for _ in range(2))
    check_fia(q, k, v, via=via, key_antiquant_scale=sk, key_antiquant_offset=ok, value_antiquant_scale=sv,
              value_antiquant_offset=ov, key_antiquant_mode=mode, value_antiquant_mode=mode, num_heads=n,
              scale_value=0.25, input_layout="BSH", atten_mask=TRIU2048, sparse_mode=3, softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
def test_separate_antiquant_wins_over_combined(via):
    b, n, d, skv = 2, 2, 32, 9
    q = make_inputs("BSH", b=b, n=n, sq=1, d=d, dtype=F16)[0]
    k, v = randint8(b, skv, n * d, seed=1), randint8(b, skv, n * d, seed=2)
    sep = torch.full((1, n, 1, d), 0.01, dtype=F16)
    comb = torch.full((2, n, 1, d), 0.5, dtype=F16)
    check_fia(q, k, v, via=via, antiquant_scale=comb, key_antiquant_scale=sep, value_antiquant_scale=sep * 2,
              num_heads=n, scale_value=0.25, input_layout="BSH", softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("kmode,vmode", [(0, 0), (1, 1), (3, 3), (0, 1)])
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_int4_decode(via, kmode, vmode, dtype, layout):
    b, n, nkv, d, skv = 2, 2, 1, 64, 9
    q = make_inputs(layout, b=b, n=n, sq=1, d=d, dtype=dtype)[0]
    k4 = layout_of(randint4(b, skv, nkv, d, seed=1), layout)
    v4 = layout_of(randint4(b, skv, nkv, d, seed=2), layout)
    k, v = pack_int4(k4), pack_int4(v4)  # last dim / 8
    g = torch.Generator().manual_seed(3)
    p = {}
    for name, mode in (("key", kmode), ("value", vmode)):
        shape, pdt = _sep_params(mode, b=b, nkv=nkv, d=d, skv=skv, dtype=dtype, g=g, sq=1)
        p[f"{name}_antiquant_scale"] = (torch.rand(shape, generator=g) * 0.2 + 0.05).to(pdt)
        p[f"{name}_antiquant_offset"] = torch.randn(shape, generator=g).to(pdt)
    check_fia(q, k, v, via=via, **p, key_antiquant_mode=kmode, value_antiquant_mode=vmode, num_heads=n,
              num_key_value_heads=nkv, scale_value=0.25, input_layout=layout, softmax_lse_flag=True)


# ------------------------------------------------------------------------------------------- left padding
@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("qpad,kvpad", [(0, 0), (2, 1), (-3, 3)])
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("sq,skv,aq,akv", [(8, 11, [4, 6], [5, 7]), (28, 30, [17, 25], [20, 26])])
def test_left_padding_prefill(via, qpad, kvpad, with_mask, sq, skv, aq, akv):
    n = 2
    q, k, v = make_inputs("BSND", b=2, n=n, sq=sq, skv=skv, d=16, dtype=F16)
    kw = dict(actual_seq_lengths=aq, actual_seq_lengths_kv=akv, query_padding_size=torch.tensor([qpad]),
              kv_padding_size=torch.tensor([kvpad]), num_heads=n, scale_value=0.25, input_layout="BSND",
              softmax_lse_flag=True)
    if with_mask:  # physical coordinates; pre/next ignored in the left-padding scenario
        kw.update(atten_mask=rand_mask(2, sq, skv, seed=3, keep_col0=False, p=0.2), pre_tokens=0, next_tokens=0,
                  inner_precise=2)
    check_fia(q, k, v, via=via, **kw)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("with_extras", [False, True])
def test_left_padding_decode(via, with_extras):
    n, skv = 2, 12
    q, k, v = make_inputs("BNSD", b=2, n=n, sq=1, skv=skv, d=16, dtype=F16)
    kw = dict(actual_seq_lengths_kv=[5, 9], kv_padding_size=torch.tensor([2]), num_heads=n, scale_value=0.25,
              input_layout="BNSD", softmax_lse_flag=True)
    if with_extras:
        kw.update(atten_mask=rand_mask(2, skv, seed=1, keep_col0=False, p=0.2),
                  pse_shift=randn(2, n, 1, skv, dtype=F16, seed=2))
    check_fia(q, k, v, via=via, **kw)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("sq,skv,aq,akv", [(7, 9, [3, 5], [6, 8]), (26, 30, [18, 24], [25, 29])])
def test_left_padding_with_pse_and_causal(via, sq, skv, aq, akv):
    n = 2
    q, k, v = make_inputs("BSH", b=2, n=n, sq=sq, skv=skv, d=16, dtype=BF16)
    check_fia(q, k, v, via=via, actual_seq_lengths=aq, actual_seq_lengths_kv=akv,
              query_padding_size=torch.tensor([1]), kv_padding_size=torch.tensor([1]),
              pse_shift=randn(2, n, sq, skv, dtype=BF16, seed=5), atten_mask=TRIU2048, sparse_mode=3, num_heads=n,
              scale_value=0.25, input_layout="BSH", softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
def test_padding_size_without_actual_lengths_is_right_padding(via):
    q, k, v = make_inputs("BSH", b=2, n=2, sq=5, skv=9, d=16, dtype=F16)
    check_fia(q, k, v, via=via, query_padding_size=torch.tensor([2]), kv_padding_size=torch.tensor([3]),
              num_heads=2, scale_value=0.25, input_layout="BSH", softmax_lse_flag=True)


# ------------------------------------------------------------------------------------------- shared prefix
@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
@pytest.mark.parametrize("sq", [1, 4, 20])
@pytest.mark.parametrize("plen", [None, 3])
def test_shared_prefix(via, layout, sq, plen):
    n, nkv, d = 4, 2, 16
    q, k, v = make_inputs(layout, b=2, n=n, nkv=nkv, sq=sq, skv=6, d=d, dtype=F16)
    kp = layout_of(randn(1, 5, nkv, d, dtype=F16, seed=11), layout)
    vp = layout_of(randn(1, 5, nkv, d, dtype=F16, seed=12), layout)
    check_fia(q, k, v, via=via, key_shared_prefix=kp, value_shared_prefix=vp,
              actual_shared_prefix_len=None if plen is None else [plen], actual_seq_lengths_kv=[6, 2],
              num_heads=n, num_key_value_heads=nkv, scale_value=0.25, input_layout=layout, softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("mode", [0, 3, 4])
@pytest.mark.parametrize("sq", [5, 20])
def test_shared_prefix_with_masks(via, mode, sq):
    """Masks see [prefix | keys]: S2 >= prefix + key S; sparse 3/4 delta includes the prefix length."""
    n, skv, plen = 2, 6, 4
    q, k, v = make_inputs("BSH", b=2, n=n, sq=sq, skv=skv, d=16, dtype=F16)
    kp, vp, _ = make_inputs("BSH", b=1, n=n, sq=plen, skv=plen, d=16, dtype=F16, seed=9)
    mask = TRIU2048 if mode else rand_mask(2, sq, plen + skv, seed=3, p=0.3)
    check_fia(q, k, v, via=via, key_shared_prefix=kp, value_shared_prefix=vp, atten_mask=mask, sparse_mode=mode,
              pre_tokens=3, next_tokens=0, actual_seq_lengths_kv=[6, 3], num_heads=n, scale_value=0.25,
              input_layout="BSH", softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
def test_shared_prefix_decode_with_mask_and_antiquant(via):
    n, d, skv, plen = 2, 32, 7, 5
    q = make_inputs("BNSD", b=2, n=n, sq=1, d=d, dtype=F16)[0]
    k, v = randint8(2, n, skv, d, seed=1), randint8(2, n, skv, d, seed=2)
    kp, vp = randint8(1, n, plen, d, seed=3), randint8(1, n, plen, d, seed=4)
    sc = torch.full((2, n, 1, d), 0.01, dtype=F16)
    check_fia(q, k, v, via=via, key_shared_prefix=kp, value_shared_prefix=vp, actual_shared_prefix_len=[4],
              antiquant_scale=sc, atten_mask=rand_mask(2, plen + skv, seed=5), num_heads=n, scale_value=0.25,
              input_layout="BNSD", softmax_lse_flag=True)


# ------------------------------------------------------------------------------------------- combinations
@pytest.mark.parametrize("via", VIA)
def test_everything_prefill_fp16(via):
    """GQA + actual lengths + pse + user mask with pre/next + int8 output per-channel + lse."""
    b, n, nkv, sq, skv, d = 3, 4, 2, 22, 30, 32
    q, k, v = make_inputs("BNSD", b=b, n=n, nkv=nkv, sq=sq, skv=skv, d=d, dtype=F16)
    check_fia(q, k, v, via=via, pse_shift=randn(b, n, sq, skv, dtype=F16, seed=4),
              atten_mask=rand_mask(b, 1, sq, skv, seed=5, p=0.2), actual_seq_lengths=[22, 2, 17],
              actual_seq_lengths_kv=[30, 4, 19], quant_scale2=torch.rand(1, n, 1, d) * 30 + 10,
              pre_tokens=4, next_tokens=2, num_heads=n, num_key_value_heads=nkv, scale_value=0.25,
              input_layout="BNSD", softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
def test_everything_decode_bf16(via):
    """Paged (BnNBsD) + GQA + mask + pse + separate per-token antiquant + lse."""
    n, nkv, d, bs, lens = 4, 2, 32, 32, [70, 5]
    q = randn(2, n, 1, d, dtype=BF16, seed=1)
    k, v = randint8(2, nkv, 70, d, seed=2), randint8(2, nkv, 70, d, seed=3)
    kc, bt = to_paged(k, lens, bs, cache_layout="BNSD", seed=4)
    vc, _ = to_paged(v, lens, bs, cache_layout="BNSD", seed=4)
    kv_s = bt.shape[1] * bs
    g = torch.Generator().manual_seed(5)
    sk, sv = (torch.rand(1, 2, kv_s, generator=g) * 0.02 + 0.005 for _ in range(2))
    check_fia(q, kc, vc, via=via, key_antiquant_scale=sk, value_antiquant_scale=sv, key_antiquant_mode=1,
              value_antiquant_mode=1, block_table=bt, block_size=bs, actual_seq_lengths_kv=lens,
              atten_mask=rand_mask(2, kv_s, seed=6), pse_shift=randn(2, n, 1, kv_s, dtype=BF16, seed=7),
              num_heads=n, num_key_value_heads=nkv, scale_value=0.25, input_layout="BNSD", softmax_lse_flag=True)


# ------------------------------------------------------------------------------------------- slow matrix
@pytest.mark.slow
@pytest.mark.parametrize("seed", range(60))
def test_random_configurations(seed):
    g = torch.Generator().manual_seed(seed)

    def pick(xs):
        return xs[int(torch.randint(len(xs), (1,), generator=g))]

    layout = pick(LAYOUTS)
    dtype = pick(LOW)
    nkv = pick([1, 2])
    n = nkv * pick([1, 2, 4])
    b = pick([1, 2, 3])
    sq = pick([1, 2, 7, 17]) if layout != "BNSD_BSND" else pick([2, 7, 17])
    skv = pick([1, 9, 33, 70])
    q, k, v = make_inputs(layout, b=b, n=n, nkv=nkv, sq=sq, skv=skv, d=pick([16, 32, 64]), dtype=dtype,
                          seed=seed)
    kw = dict(num_heads=n, num_key_value_heads=nkv, scale_value=0.125, input_layout=layout, softmax_lse_flag=True,
              actual_seq_lengths_kv=[int(x) for x in torch.randint(0, skv + 1, (b,), generator=g)])
    if sq > 1:
        kw["actual_seq_lengths"] = [int(x) for x in torch.randint(1, sq + 1, (b,), generator=g)]
        mode = pick([0, 1, 2, 3, 4])
        kw.update(sparse_mode=mode, pre_tokens=pick([0, 3, 100]), next_tokens=pick([0, 2, 100]), inner_precise=2)
        if mode in (2, 3, 4):
            kw["atten_mask"] = TRIU2048
        elif mode == 1 or pick([True, False]):
            kw["atten_mask"] = rand_mask(b, sq, skv, seed=seed, p=0.2)
    elif pick([True, False]):
        kw["atten_mask"] = rand_mask(b, skv, seed=seed, p=0.2)
    for via in VIA:
        check_fia(q, k, v, via=via, **kw)


def test_helpers_roundtrip():
    x = randn(2, 5, 3, 16, seed=1)
    for lay in ("BSH", "BSND", "BNSD"):
        assert torch.equal(from_bnsd(bnsd(layout_of(x, lay), lay, 3), lay), layout_of(x, lay))


# ------------------------------------------------------------------------------------------- more combinations
@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("sq", [1, 5, 20])
def test_pse_and_mask_with_shared_prefix(via, sq):
    """pse / mask columns: [0, L) the prefix, then L + key position."""
    n, skv, plen = 2, 7, 4
    q, k, v = make_inputs("BNSD", b=2, n=n, sq=sq, skv=skv, d=16, dtype=F16)
    kp, vp, _ = make_inputs("BNSD", b=1, n=n, sq=6, skv=6, d=16, dtype=F16, seed=3)
    cols = plen + skv + 5
    mask = rand_mask(2, cols, seed=1) if sq == 1 else rand_mask(2, sq, cols, seed=1, p=0.2)
    check_fia(q, k, v, via=via, key_shared_prefix=kp, value_shared_prefix=vp, actual_shared_prefix_len=[plen],
              pse_shift=randn(2, n, sq, cols, dtype=F16, seed=2), atten_mask=mask, sparse_mode=0 if sq == 1 else 1,
              actual_seq_lengths_kv=[7, 4], num_heads=n, scale_value=0.25, input_layout="BNSD",
              softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("combined", [True, False])
def test_per_token_antiquant_with_kv_left_padding(via, combined):
    """Per-token scales are read at the physical KV position (left-padding offset included)."""
    b, n, d, skv = 2, 2, 32, 10
    q = make_inputs("BSND", b=b, n=n, sq=1, d=d, dtype=F16)[0]
    k, v = randint8(b, skv, n, d, seed=1), randint8(b, skv, n, d, seed=2)
    g = torch.Generator().manual_seed(3)
    sc = torch.rand(2, b, skv, generator=g) * 0.02 + 0.005
    off = torch.randn(2, b, skv, generator=g) * 4
    p = (dict(antiquant_scale=sc, antiquant_offset=off, antiquant_mode=1) if combined else
         dict(key_antiquant_scale=sc[:1], key_antiquant_offset=off[:1], value_antiquant_scale=sc[1:],
              value_antiquant_offset=off[1:], key_antiquant_mode=1, value_antiquant_mode=1))
    check_fia(q, k, v, via=via, **p, actual_seq_lengths_kv=[5, 7], kv_padding_size=torch.tensor([2]), num_heads=n,
              scale_value=0.25, input_layout="BSND", softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
def test_per_token_antiquant_with_shared_prefix(via):
    """Per-token scale positions with a prefix: [0, L) the prefix tokens, then L + key position."""
    b, n, d, skv, plen = 2, 2, 32, 6, 3
    q = make_inputs("BSH", b=b, n=n, sq=1, d=d, dtype=F16)[0]
    k, v = randint8(b, skv, n * d, seed=1), randint8(b, skv, n * d, seed=2)
    kp, vp = randint8(1, plen, n * d, seed=3), randint8(1, plen, n * d, seed=4)
    g = torch.Generator().manual_seed(5)
    sc = torch.rand(2, b, plen + skv, generator=g) * 0.02 + 0.005
    check_fia(q, k, v, via=via, key_shared_prefix=kp, value_shared_prefix=vp, antiquant_scale=sc, antiquant_mode=1,
              num_heads=n, scale_value=0.25, input_layout="BSH", softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
def test_decode_kv_left_padding_start_before_0_gives_zero_batch(via):
    """Seed (Q_S = 1): a KV start or end before 0 returns all zeros for that batch."""
    q, k, v = make_inputs("BSH", b=2, n=2, sq=1, skv=8, d=16, dtype=F16)
    r = check_fia(q, k, v, via=via, actual_seq_lengths_kv=[3, 7], kv_padding_size=torch.tensor([2]), num_heads=2,
                  scale_value=0.25, input_layout="BSH", softmax_lse_flag=True)
    assert bool((r["out"][1] == 0).all()) and bool(torch.isposinf(r["lse"][1]).all())
    assert bool((r["out"][0] != 0).any())


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("sq", [4, 20])
def test_tnd_with_mask_and_pse(via, sq):
    """TND, sparse 1: each batch reads the top-left [Sq_b, Skv_b] of a [maxSq, maxSkv] mask and pse."""
    n, d = 2, 16
    lq, lk = [sq, 3], [sq + 4, 9]
    q = randn(sum(lq), n, d, dtype=F16, seed=1)
    k, v = randn(sum(lk), n, d, dtype=F16, seed=2), randn(sum(lk), n, d, dtype=F16, seed=3)
    mask = rand_mask(max(lq), max(lk), seed=4, p=0.2)
    check_fia(q, k, v, via=via, actual_seq_lengths=[lq[0], sum(lq)], actual_seq_lengths_kv=[lk[0], sum(lk)],
              atten_mask=mask, sparse_mode=1, pse_shift=randn(1, n, max(lq), max(lk), dtype=F16, seed=5),
              num_heads=n, scale_value=0.25, input_layout="TND", softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("sq", [1, 4, 20])
def test_tensor_list_with_mask_and_pse(via, sq):
    n, d, lens = 2, 16, [9, 4]
    q = make_inputs("BSH", b=2, n=n, sq=sq, d=d, dtype=F16)[0]
    ks = [randn(1, s, n * d, dtype=F16, seed=10 + s) for s in lens]
    vs = [randn(1, s, n * d, dtype=F16, seed=20 + s) for s in lens]
    mask = rand_mask(2, 9, seed=1) if sq == 1 else rand_mask(2, sq, 9, seed=1, p=0.2)
    check_fia(q, ks, vs, via=via, atten_mask=mask, sparse_mode=0, pse_shift=randn(2, n, sq, 9, dtype=F16, seed=2),
              num_heads=n, scale_value=0.25, input_layout="BSH", softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("sq", [5, 20])
def test_int8_chain_with_gqa_lengths_and_left_padding(via, sq):
    b, n, nkv, d, skv = 2, 4, 2, 32, 24
    q = layout_of(randint8(b, sq, n, d, seed=1), "BNSD")
    k = layout_of(randint8(b, skv, nkv, d, seed=2), "BNSD")
    v = layout_of(randint8(b, skv, nkv, d, seed=3), "BNSD")
    common = dict(deq_scale1=encode_deq_scale(7.3e-5), quant_scale1=torch.tensor([127.0]),
                  deq_scale2=encode_deq_scale(1 / 127), num_heads=n, num_key_value_heads=nkv, scale_value=0.7,
                  input_layout="BNSD", softmax_lse_flag=True)
    check_fia(q, k, v, via=via, actual_seq_lengths=[sq, sq - 2], actual_seq_lengths_kv=[skv, 11], **common)
    check_fia(q, k, v, via=via, actual_seq_lengths=[sq - 1, sq - 3], actual_seq_lengths_kv=[20, 11],
              query_padding_size=torch.tensor([1]), kv_padding_size=torch.tensor([2]), **common)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("sq", [4, 20])
def test_bnsd_bsnd_with_everything(via, sq):
    n, nkv, skv = 4, 2, 25
    q, k, v = make_inputs("BNSD_BSND", b=2, n=n, nkv=nkv, sq=sq, skv=skv, d=32, dtype=BF16)
    check_fia(q, k, v, via=via, pse_shift=randn(1, n, sq, skv, dtype=BF16, seed=3),
              atten_mask=rand_mask(2, sq, skv, seed=4, p=0.2), sparse_mode=0, pre_tokens=10, next_tokens=3,
              actual_seq_lengths=[sq, sq - 1], actual_seq_lengths_kv=[25, 20],
              quant_scale2=torch.full((1, 1, n, 32), 30.0), num_heads=n, num_key_value_heads=nkv, scale_value=0.25,
              input_layout="BNSD_BSND", softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
def test_paged_decode_per_token_combined_antiquant(via):
    """Per-token scales (2, B, S) with paged KV are indexed by the logical token position."""
    n, d, bs, lens = 2, 32, 32, [70, 20]
    q = randn(2, n, 1, d, dtype=F16, seed=1)
    k, v = randint8(2, n, 70, d, seed=2), randint8(2, n, 70, d, seed=3)
    kc, bt = to_paged(k, lens, bs, cache_layout="BSH", seed=4)
    vc, _ = to_paged(v, lens, bs, cache_layout="BSH", seed=4)
    kv_s = bt.shape[1] * bs
    g = torch.Generator().manual_seed(5)
    check_fia(q, kc, vc, via=via, antiquant_scale=torch.rand(2, 2, kv_s, generator=g) * 0.02 + 0.005,
              antiquant_offset=torch.randn(2, 2, kv_s, generator=g), antiquant_mode=1, block_table=bt,
              block_size=bs, actual_seq_lengths_kv=lens, num_heads=n, scale_value=0.25, input_layout="BNSD",
              softmax_lse_flag=True)


def test_api_defaults_scale_and_layout():
    """Pythonic defaults: layout BNSD, scale 1/sqrt(D); return_lse False returns the tensor alone."""
    import attnops
    from attnops.testing.compare import assert_close_to_golden, fia_reduction
    from tests.ops.fused_infer_attention.fia_helpers import golden
    q, k, v = make_inputs("BNSD", b=2, n=4, nkv=2, sq=3, skv=7, d=64, dtype=F16)
    out = attnops.fused_infer_attention(q, k, v, num_key_value_heads=2)
    assert isinstance(out, torch.Tensor)
    kw = dict(num_heads=4, num_key_value_heads=2, scale_value=0.125, input_layout="BNSD")
    assert_close_to_golden("out", out, golden(q, k, v, **kw).out, golden(q, k, v, dtype=F16, **kw).out,
                           reduction=fia_reduction(q, k, **kw))
    res = attnops.fused_infer_attention(q, k, v, num_key_value_heads=2, return_lse=True)
    assert torch.equal(res[0], out) and res[1].shape == (2, 4, 3, 1)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("sq,skv", [(9, 9), (7, 12)])
def test_prefill_full_masks_that_are_bands(via, mode, sq, skv):
    """A causal triu mask (and a sliding window) given in full: run as the band it is, same golden."""
    n = 2
    q, k, v = make_inputs("BSND", b=2, n=n, sq=sq, skv=skv, d=16, dtype=F16, seed=11)
    diff = torch.arange(skv).unsqueeze(0) - torch.arange(sq).unsqueeze(1)
    for mask in (diff > 0, (diff > 1) | (diff < -3)):
        check_fia(q, k, v, via=via, atten_mask=mask.expand(2, sq, skv), sparse_mode=mode, num_heads=n,
                  scale_value=0.25, input_layout="BSND", softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
def test_decode_padding_masks_run_as_bands(via):
    """Decode masks that mask each batch's tail (padding) are per-batch bands: same golden."""
    b, n, skv = 3, 2, 20
    q, k, v = make_inputs("BSH", b=b, n=n, sq=1, skv=skv, d=16, dtype=F16, seed=12)
    mask = torch.arange(skv).unsqueeze(0) >= torch.tensor([[20], [7], [13]])
    check_fia(q, k, v, via=via, atten_mask=mask, num_heads=n, scale_value=0.25, input_layout="BSH",
              softmax_lse_flag=True)
