"""FIA equivalences that need no golden (operator vs operator on rearranged inputs), and small hand-computed int8 /
int4 cases. Both sides are computed by attnops, so they must agree to the output dtype's rounding."""
from __future__ import annotations

import math

import pytest
import torch

from attnops.testing.golden_fia import pack_int4
from tests.helpers import randn
from tests.ops.fused_infer_attention.fia_helpers import (TRIU2048, bnsd, from_bnsd, layout_of, make_inputs,
                                                         rand_mask, randint4, randint8, run, to_paged)

VIA = ["aclnn", "api"]
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def close(a, b, dtype=F16):
    tol = {F16: 2e-3, BF16: 1.6e-2, F32: 1e-5}[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------- paged == contiguous
@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("sq,bs", [(1, 16), (1, 128), (5, 128)])
@pytest.mark.parametrize("cache_layout", ["BSH", "BNSD"])
def test_paged_equals_contiguous(via, sq, bs, cache_layout):
    n, nkv, d, lens = 4, 2, 16, [150, 37]
    q = randn(2, n, sq, d, dtype=F16)
    k, v = randn(2, nkv, 150, d, dtype=F16, seed=1), randn(2, nkv, 150, d, dtype=F16, seed=2)
    kc, bt = to_paged(k, lens, bs, cache_layout=cache_layout, seed=3)
    vc, _ = to_paged(v, lens, bs, cache_layout=cache_layout, seed=3)
    kw = dict(actual_seq_lengths_kv=lens, num_heads=n, num_key_value_heads=nkv, scale_value=0.25,
              input_layout="BNSD", softmax_lse_flag=True)
    if sq > 1:
        kw.update(atten_mask=TRIU2048, sparse_mode=3)
    o_p, l_p = run(via, q, kc, vc, block_table=bt, block_size=bs, **kw)
    o_c, l_c = run(via, q, k, v, **kw)
    close(o_p, o_c)
    close(l_p, l_c, F32)


@pytest.mark.parametrize("via", VIA)
def test_paged_block_table_order_does_not_matter(via):
    n, d, bs, lens = 2, 16, 16, [50, 20]
    q = randn(2, n, 1, d, dtype=F16)
    k, v = randn(2, n, 50, d, dtype=F16, seed=1), randn(2, n, 50, d, dtype=F16, seed=2)
    outs = []
    for seed in (0, 1):
        kc, bt = to_paged(k, lens, bs, cache_layout="BNSD", seed=seed, extra_blocks=3)
        vc, _ = to_paged(v, lens, bs, cache_layout="BNSD", seed=seed, extra_blocks=3)
        outs.append(run(via, q, kc, vc, block_table=bt, block_size=bs, actual_seq_lengths_kv=lens, num_heads=n,
                        input_layout="BNSD")[0])
    close(outs[0], outs[1])


# ------------------------------------------------------------------------------------------- left == right padding
@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("sq", [1, 6])
def test_left_padding_equals_right_padding(via, sq):
    n, skv, qpad, kvpad = 2, 10, 1, 2
    q, k, v = make_inputs("BSND", b=2, n=n, sq=sq, skv=skv, d=16, dtype=F16)
    aq, akv = ([4, 5] if sq > 1 else None), [6, 7]
    ql, kl, vl = q.clone(), torch.zeros_like(k), torch.zeros_like(v)
    for b in range(2):
        if sq > 1:
            ql[b] = 0
            ql[b, sq - qpad - aq[b]:sq - qpad] = q[b, :aq[b]]
        kl[b, skv - kvpad - akv[b]:skv - kvpad] = k[b, :akv[b]]
        vl[b, skv - kvpad - akv[b]:skv - kvpad] = v[b, :akv[b]]
    kw = dict(actual_seq_lengths=aq, actual_seq_lengths_kv=akv, num_heads=n, scale_value=0.25,
              input_layout="BSND", softmax_lse_flag=True)
    o_r, l_r = run(via, q, k, v, **kw)
    o_l, l_l = run(via, ql, kl, vl, query_padding_size=torch.tensor([qpad]) if sq > 1 else None,
                   kv_padding_size=torch.tensor([kvpad]), **kw)
    for b in range(2):
        rs = slice(sq - qpad - aq[b], sq - qpad) if sq > 1 else slice(0, 1)
        rr = slice(0, aq[b]) if sq > 1 else slice(0, 1)
        close(o_l[b, rs], o_r[b, rr])
        close(l_l[b, :, rs], l_r[b, :, rr], F32)


# ------------------------------------------------------------------------------------------- shared prefix
@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_shared_prefix_equals_concatenation(via, sq, layout):
    n, d, skv, ps, plen = 2, 16, 6, 5, 3
    q, k, v = make_inputs(layout, b=2, n=n, sq=sq, skv=skv, d=d, dtype=F16)
    kp4, vp4 = randn(1, ps, n, d, dtype=F16, seed=8), randn(1, ps, n, d, dtype=F16, seed=9)
    kp, vp = layout_of(kp4, layout), layout_of(vp4, layout)
    kw = dict(num_heads=n, scale_value=0.25, input_layout=layout, softmax_lse_flag=True)
    if sq > 1:
        kw.update(atten_mask=TRIU2048, sparse_mode=3)
    o1, l1 = run(via, q, k, v, key_shared_prefix=kp, value_shared_prefix=vp, actual_shared_prefix_len=[plen], **kw)
    k4, v4 = bnsd(k, layout, n), bnsd(v, layout, n)
    kc = torch.cat([bnsd(kp, layout, n)[:, :, :plen].expand(2, -1, -1, -1), k4], dim=2)
    vc = torch.cat([bnsd(vp, layout, n)[:, :, :plen].expand(2, -1, -1, -1), v4], dim=2)
    o2, l2 = run(via, q, from_bnsd(kc, layout), from_bnsd(vc, layout), **kw)
    close(o1, o2)
    close(l1, l2, F32)


# ------------------------------------------------------------------------------------------- decode == prefill row
@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_decode_step_equals_last_prefill_row(via, layout, dtype):
    n, nkv, s, d = 4, 2, 9, 16
    x = randn(2, s, n, d, dtype=dtype)
    k4, v4 = randn(2, s, nkv, d, dtype=dtype, seed=1), randn(2, s, nkv, d, dtype=dtype, seed=2)
    kw = dict(num_heads=n, num_key_value_heads=nkv, scale_value=0.25, input_layout=layout, softmax_lse_flag=True)
    k, v = layout_of(k4, layout), layout_of(v4, layout)
    o_p, l_p = run(via, layout_of(x, layout), k, v, atten_mask=TRIU2048, sparse_mode=3, **kw)
    o_d, l_d = run(via, layout_of(x[:, -1:], layout), k, v, **kw)
    last = bnsd(o_p, layout, n)[:, :, -1:]
    close(bnsd(o_d, layout, n), last, dtype)
    close(l_d, l_p[:, :, -1:], F32)


@pytest.mark.parametrize("via", VIA)
def test_decode_with_lengths_equals_prefill_rows(via):
    """Row i of a causal prefill == a decode step over the first kv_len tokens (per batch, right padding)."""
    n, s, d = 2, 8, 16
    q, k, v = make_inputs("BSH", b=2, n=n, sq=s, skv=s, d=d, dtype=F16)
    o_p, _ = run(via, q, k, v, atten_mask=TRIU2048, sparse_mode=2, num_heads=n, scale_value=0.25)
    rows = [3, 6]
    qd = torch.stack([q[b, rows[b]] for b in range(2)])[:, None]
    o_d, _ = run(via, qd, k, v, actual_seq_lengths_kv=[r + 1 for r in rows], num_heads=n, scale_value=0.25)
    for b in range(2):
        close(o_d[b, 0], o_p[b, rows[b]])


# ------------------------------------------------------------------------------------------- list == padded
@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("sq", [1, 4])
def test_tensor_list_equals_padded_tensor(via, sq):
    n, d, lens = 2, 16, [9, 4, 6]
    q, k, v = make_inputs("BSH", b=3, n=n, sq=sq, skv=9, d=d, dtype=F16)
    ks = [k[b:b + 1, :lens[b]].contiguous() for b in range(3)]
    vs = [v[b:b + 1, :lens[b]].contiguous() for b in range(3)]
    kw = dict(num_heads=n, scale_value=0.25, softmax_lse_flag=True)
    o1, l1 = run(via, q, ks, vs, **kw)
    o2, l2 = run(via, q, k, v, actual_seq_lengths_kv=lens, **kw)
    close(o1, o2)
    close(l1, l2, F32)


# ------------------------------------------------------------------------------------------- layouts and GQA
@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("sq", [1, 5])
def test_layouts_agree(via, sq):
    n, nkv = 4, 2
    q4, k4, v4 = (randn(2, s, h, 16, dtype=F16, seed=i) for i, (s, h) in enumerate(((sq, n), (7, nkv), (7, nkv))))
    outs = {}
    for lay in ("BSH", "BSND", "BNSD"):
        o, _ = run(via, layout_of(q4, lay), layout_of(k4, lay), layout_of(v4, lay), num_heads=n,
                   num_key_value_heads=nkv, scale_value=0.25, input_layout=lay)
        outs[lay] = bnsd(o, lay, n)
    close(outs["BSH"], outs["BNSD"])
    close(outs["BSND"], outs["BNSD"])


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("sq", [1, 5])
def test_gqa_equals_repeated_kv_heads(via, sq):
    n, nkv = 6, 2
    q, k, v = make_inputs("BNSD", b=2, n=n, nkv=nkv, sq=sq, skv=7, d=16, dtype=F16)
    kw = dict(num_heads=n, scale_value=0.25, input_layout="BNSD", softmax_lse_flag=True)
    o1, l1 = run(via, q, k, v, num_key_value_heads=nkv, **kw)
    o2, l2 = run(via, q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), **kw)
    close(o1, o2)
    close(l1, l2, F32)


@pytest.mark.parametrize("via", VIA)
def test_tnd_equals_dense_batches(via):
    n, d = 2, 16
    lq, lk = [3, 5], [6, 8]
    q = randn(8, n, d, dtype=F16)
    k, v = randn(14, n, d, dtype=F16, seed=1), randn(14, n, d, dtype=F16, seed=2)
    o, l = run(via, q, k, v, actual_seq_lengths=[3, 8], actual_seq_lengths_kv=[6, 14], num_heads=n,
               scale_value=0.25, input_layout="TND", atten_mask=TRIU2048, sparse_mode=3, softmax_lse_flag=True)
    oq = ok = 0
    for a, c in zip(lq, lk):
        o1, l1 = run(via, q[None, oq:oq + a], k[None, ok:ok + c], v[None, ok:ok + c], num_heads=n, scale_value=0.25,
                     input_layout="BSND", atten_mask=TRIU2048, sparse_mode=3, softmax_lse_flag=True)
        close(o[oq:oq + a], o1[0])
        close(l[oq:oq + a], l1[0].transpose(0, 1), F32)
        oq, ok = oq + a, ok + c


@pytest.mark.parametrize("via", VIA)
def test_masks_every_shape_and_dtype_agree(via):
    b, n, sq, skv = 2, 2, 5, 8
    q, k, v = make_inputs("BSH", b=b, n=n, sq=sq, skv=skv, d=16, dtype=F16)
    m = rand_mask(b, sq, skv, seed=3)
    kw = dict(num_heads=n, scale_value=0.25, sparse_mode=1)
    ref, _ = run(via, q, k, v, atten_mask=m, **kw)
    for mm in (m.to(torch.int8), m.to(torch.uint8), m[:, None], m.to(torch.uint8)[:, None]):
        close(run(via, q, k, v, atten_mask=mm, **kw)[0], ref)
    shared = rand_mask(sq, skv, seed=4)
    ref2, _ = run(via, q, k, v, atten_mask=shared, **kw)
    for mm in (shared[None], shared[None, None], shared.expand(b, sq, skv).contiguous()):
        close(run(via, q, k, v, atten_mask=mm, **kw)[0], ref2)


# ------------------------------------------------------------------------------------------- hand-computed quant
@pytest.mark.parametrize("via", VIA)
def test_int8_chain_by_hand(via):
    """Q_S=2, N=1, D=32 with one non-zero channel: every quantity can be written down."""
    d = 32
    q = torch.zeros(1, 2, d, dtype=torch.int8)
    k = torch.zeros(1, 2, d, dtype=torch.int8)
    v = torch.zeros(1, 2, d, dtype=torch.int8)
    q[0, :, 0] = torch.tensor([1, 2], dtype=torch.int8)
    k[0, :, 0] = torch.tensor([1, -1], dtype=torch.int8)
    v[0, :, 0] = torch.tensor([10, 20], dtype=torch.int8)
    v[0, :, 1] = torch.tensor([-4, 4], dtype=torch.int8)
    deq1, qs1, deq2, scale = 0.5, 100.0, 0.015625, 2.0
    out, lse = run(via, q, k, v, deq_scale1=torch.tensor([deq1]), quant_scale1=torch.tensor([qs1]),
                   deq_scale2=torch.tensor([deq2]), num_heads=1, scale_value=scale, input_layout="BSH",
                   softmax_lse_flag=True)
    assert out.dtype == F16
    for row, qi in enumerate((1, 2)):
        s = [qi * deq1 * scale, -qi * deq1 * scale]
        e = [math.exp(x - max(s)) for x in s]
        p = [round(x * qs1) for x in e]  # 100, 37 / 100, 14
        o0 = (p[0] * 10 + p[1] * 20) * deq2 / sum(e)
        o1 = (p[0] * -4 + p[1] * 4) * deq2 / sum(e)
        assert abs(float(out[0, row, 0]) - o0) <= 1e-2, (row, float(out[0, row, 0]), o0)
        assert abs(float(out[0, row, 1]) - o1) <= 1e-2, (row, float(out[0, row, 1]), o1)
        assert float(out[0, row, 2:].abs().max()) == 0
        assert abs(float(lse[0, 0, row, 0]) - (max(s) + math.log(sum(e)))) < 1e-5


@pytest.mark.parametrize("via", VIA)
def test_int8_quant_scale1_rounds_half_even_and_saturates(via):
    """S = 0 everywhere: P~ = 1, so P_i8 = sat(round(qs1)) for every key; out = P_i8 * mean(v) * 2 * deq2 / 2."""
    d = 32
    q = torch.zeros(1, 2, d, dtype=torch.int8)
    k = torch.zeros(1, 2, d, dtype=torch.int8)
    v = torch.zeros(1, 2, d, dtype=torch.int8)
    v[0, :, 0] = torch.tensor([1, 3], dtype=torch.int8)
    for qs1, p in ((2.5, 2), (3.5, 4), (200.0, 127)):
        out, _ = run(via, q, k, v, deq_scale1=torch.tensor([1.0]), quant_scale1=torch.tensor([qs1]),
                     deq_scale2=torch.tensor([1.0]), num_heads=1, input_layout="BSH")
        assert float(out[0, 0, 0]) == p * 4 / 2, (qs1, float(out[0, 0, 0]))


@pytest.mark.parametrize("via", VIA)
def test_uint64_deq_scale_is_truncated_to_19_bits(via):
    """deq_scale2 = 1 + 0.75 * 2**-10: the UINT64 (npu_trans_quant_param) encoding keeps 10 mantissa bits, so it
    decodes to 1.0; as FLOAT32 it is used as given (DECISIONS.md)."""
    from attnops.testing.golden_fia import encode_deq_scale
    d, s2 = 32, 1 + 0.75 * 2 ** -10
    q = torch.zeros(1, 2, d, dtype=torch.int8)
    k = torch.zeros(1, 2, d, dtype=torch.int8)
    v = torch.zeros(1, 2, d, dtype=torch.int8)
    v[0, :, 0] = 100
    # S = 0: P~ = 1, P_i8 = 1; O = (100 + 100) * deq2 / 2
    out, _ = run(via, q, k, v, deq_scale1=encode_deq_scale(1.0), quant_scale1=torch.tensor([1.0]),
                 deq_scale2=encode_deq_scale(s2), num_heads=1, input_layout="BSH")
    assert float(out[0, 0, 0]) == 100.0
    # the decoder itself truncates: raw fp32 bits (not pre-truncated) in the low 32 bits decode to 1.0 as well
    raw = int(torch.tensor([s2], dtype=F32).view(torch.int32)) | (1 << 46)
    out, _ = run(via, q, k, v, deq_scale1=encode_deq_scale(1.0), quant_scale1=torch.tensor([1.0]),
                 deq_scale2=torch.tensor([raw], dtype=torch.uint64), num_heads=1, input_layout="BSH")
    assert float(out[0, 0, 0]) == 100.0
    out32, _ = run(via, q, k, v, deq_scale1=torch.tensor([1.0]), quant_scale1=torch.tensor([1.0]),
                   deq_scale2=torch.tensor([s2]), num_heads=1, input_layout="BSH")
    assert float(out32[0, 0, 0]) == float(torch.tensor(100 * s2, dtype=F16)) == 100.0625


@pytest.mark.parametrize("via", VIA)
def test_int8_output_rounding_by_hand(via):
    """One KV token -> O = v exactly; out = sat(round_half_even(v * qs2 + qo2))."""
    d = 32
    q = randn(1, 1, d, dtype=F16)
    vals = torch.tensor([0.25, 0.75, -0.25, 1.25, 100.0, -100.0, 0.5, 1.0] * 4, dtype=F16)
    k = randn(1, 1, d, dtype=F16, seed=1)
    v = vals.view(1, 1, d)
    out, _ = run(via, q, k, v, quant_scale2=torch.tensor([2.0]), quant_offset2=torch.tensor([0.0]), num_heads=1,
                 input_layout="BSH")
    # 0.5 -> 0, 1.5 -> 2, -0.5 -> 0, 2.5 -> 2, 200 -> 127, -200 -> -128, 1 -> 1, 2 -> 2
    assert out.dtype == torch.int8
    assert out[0, 0].tolist() == [0, 2, 0, 2, 127, -128, 1, 2] * 4


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_int4_unpacking_by_hand(via, dtype):
    """q = 0 -> uniform attention: out = mean over tokens of the dequantized V (scale 1, offset 0)."""
    n, d = 1, 64
    q = torch.zeros(1, 1, n * d, dtype=dtype)
    words = torch.tensor([0x87654321 - 2 ** 32, 0x0F0F0F0F, 0x12345678, -1, 0, 0x7FFFFFFF, 0x11111111,
                          0x76543210], dtype=torch.int32)
    v = words.reshape(1, 1, 8).repeat(1, 2, 1)
    v[0, 1] = 0  # second token all zeros
    k = torch.zeros(1, 2, 8, dtype=torch.int32)
    one = torch.ones(1, n, 1, d, dtype=dtype)
    out, _ = run(via, q, k, v, key_antiquant_scale=one, value_antiquant_scale=one, num_heads=n,
                 input_layout="BSH")
    expect = []
    for w in words.tolist():
        w &= 0xFFFFFFFF
        for e in range(8):
            nib = (w >> (4 * e)) & 0xF
            expect.append((nib - 16 if nib >= 8 else nib) / 2)
    assert out[0, 0].float().tolist() == expect


@pytest.mark.parametrize("via", VIA)
def test_int4_equals_same_values_in_int8(via):
    b, n, d, s = 2, 2, 64, 7
    q = randn(b, 1, n * d, dtype=F16)
    k4, v4 = randint4(b, s, n * d, seed=1), randint4(b, s, n * d, seed=2)
    g = torch.Generator().manual_seed(3)
    sk, sv = (torch.rand(1, b, s, generator=g) * 0.3 + 0.1 for _ in range(2))
    kw = dict(key_antiquant_scale=sk, value_antiquant_scale=sv, key_antiquant_mode=1, value_antiquant_mode=1,
              num_heads=n, scale_value=0.125, input_layout="BSH")
    o4, _ = run(via, q, pack_int4(k4), pack_int4(v4), **kw)
    o8, _ = run(via, q, k4.to(torch.int8), v4.to(torch.int8), **kw)
    close(o4, o8)


@pytest.mark.parametrize("via", VIA)
def test_antiquant_equals_dequantized_fp16(via):
    """(x + offset) * scale: antiquant of int8 KV == the same computation on KV dequantized by hand (exact in fp16)."""
    b, n, d, s = 2, 2, 32, 6
    q = randn(b, 1, n * d, dtype=F16)
    k8, v8 = randint8(b, s, n * d, seed=1, lo=-8, hi=8), randint8(b, s, n * d, seed=2, lo=-8, hi=8)
    sc = torch.tensor([0.25, 0.5], dtype=F16).view(2, 1).expand(2, n * d).contiguous()
    off = torch.tensor([1.0, -2.0], dtype=F16).view(2, 1).expand(2, n * d).contiguous()
    o_q, _ = run(via, q, k8, v8, antiquant_scale=sc, antiquant_offset=off, num_heads=n, input_layout="BSH")
    kd, vd = ((k8.to(F16) + 1) * 0.25), ((v8.to(F16) - 2) * 0.5)
    o_f, _ = run(via, q, kd, vd, num_heads=n, input_layout="BSH")
    close(o_q, o_f)


# ------------------------------------------------------------------------------------------- masks of padding
@pytest.mark.parametrize("via", VIA)
def test_rows_outside_actual_length_are_zero(via):
    """Project convention checked here (not by the golden comparisons alone): query rows beyond
    actual_seq_lengths (right padding) and left-padding rows are 0 in attention_out and +inf in softmax_lse."""
    q, k, v = make_inputs("BSND", b=2, n=2, sq=6, skv=7, d=16, dtype=F16)
    out, lse = run(via, q, k, v, actual_seq_lengths=[4, 2], num_heads=2, scale_value=0.25, input_layout="BSND",
                   softmax_lse_flag=True)
    assert bool((out[0, 4:] == 0).all()) and bool((out[1, 2:] == 0).all())
    assert bool(torch.isposinf(lse[0, :, 4:]).all()) and bool(torch.isposinf(lse[1, :, 2:]).all())
    out, lse = run(via, q, k, v, actual_seq_lengths=[4, 2], query_padding_size=torch.tensor([1]), num_heads=2,
                   scale_value=0.25, input_layout="BSND", softmax_lse_flag=True)
    assert bool((out[0, :1] == 0).all()) and bool((out[0, 5:] == 0).all()) and bool((out[1, :3] == 0).all())
    assert bool(torch.isposinf(lse[1, :, :3]).all())
