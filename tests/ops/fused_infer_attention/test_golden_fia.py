"""Self-checks of the fp64 FIA golden (attnops.testing.golden_fia): against torch SDPA in fp64 on plain cases,
and hand-computed int8 / int4 / deq-scale / antiquant cases. No attnops operator is involved here."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnops.testing.golden_fia import (decode_deq_scale, encode_deq_scale, fia_forward, fia_forward_detail,
                                        pack_int4, sat_int8, unpack_int4)
from tests.ops.fused_infer_attention.fia_helpers import (TRIU2048, F64, bnsd, from_bnsd, make_inputs, rand_mask,
                                                         randint4, randint8, to_paged)

LAYOUTS = ["BSH", "BSND", "BNSD", "BNSD_BSND"]


def sdpa(q, k, v, *, scale, mask=None, n, nkv):
    """q [B,N,S,D] (fp64), mask: bool keep or float additive [.., Sq, Skv]."""
    k = k.repeat_interleave(n // nkv, dim=1)
    v = v.repeat_interleave(n // nkv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def out_bnsd(out, layout, n):
    return bnsd(out, "BSND" if layout == "BNSD_BSND" else layout, n)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n,nkv", [(2, 2), (4, 1), (4, 2)])
def test_plain_vs_sdpa(layout, n, nkv):
    q, k, v = make_inputs(layout, b=2, n=n, nkv=nkv, sq=5, skv=7, d=8, dtype=F64)
    out, lse = fia_forward(q, k, v, num_heads=n, num_key_value_heads=nkv, scale_value=0.3, input_layout=layout,
                           softmax_lse_flag=True)
    qb, kb, vb = bnsd(q, layout, n), bnsd(k, layout, nkv), bnsd(v, layout, nkv)
    ref = sdpa(qb, kb, vb, scale=0.3, n=n, nkv=nkv)
    torch.testing.assert_close(out_bnsd(out, layout, n), ref, rtol=1e-12, atol=1e-12)
    s = 0.3 * qb @ kb.repeat_interleave(n // nkv, 1).transpose(-1, -2)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1, keepdim=True), rtol=1e-12, atol=1e-12)
    assert out.shape == (q.shape if layout != "BNSD_BSND" else q.permute(0, 2, 1, 3).shape)


def test_lse_flag_false_gives_zeros1():
    q, k, v = make_inputs("BSH", dtype=F64)
    _, lse = fia_forward(q, k, v, num_heads=2, input_layout="BSH")
    assert lse.shape == (1,) and lse.dtype == torch.float32 and float(lse) == 0


@pytest.mark.parametrize("mshape", ["SS", "BSS", "1SS", "B1SS", "11SS"])
@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.uint8])
@pytest.mark.parametrize("mode", [0, 1])
def test_explicit_mask_vs_sdpa(mshape, dtype, mode):
    b, n, sq, skv = 2, 2, 5, 7
    q, k, v = make_inputs("BNSD", b=b, n=n, sq=sq, skv=skv, d=8, dtype=F64)
    full = rand_mask(b, sq + 3, skv + 9, seed=4)  # larger than S: indexed at [i, j]
    m = {"SS": full[0], "BSS": full, "1SS": full[:1], "B1SS": full[:, None], "11SS": full[:1, None]}[mshape]
    out, _ = fia_forward(q, k, v, atten_mask=m.to(dtype), num_heads=n, input_layout="BNSD", sparse_mode=mode)
    per_b = full if mshape in ("BSS", "B1SS") else full[:1].expand(b, -1, -1)
    keep = ~per_b[:, None, :sq, :skv]
    torch.testing.assert_close(out, sdpa(q, k, v, scale=1.0, mask=keep, n=n, nkv=n), rtol=1e-12, atol=1e-12)


def band_keep(sq, skv, lo, hi):
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(skv).view(1, -1)
    return (j - i >= lo) & (j - i <= hi)


@pytest.mark.parametrize("sq,skv", [(5, 5), (4, 9), (9, 4)])
@pytest.mark.parametrize("mode,pre,nxt", [(2, 0, 0), (3, 0, 0), (4, 2, 1), (4, 3, -1), (0, 2, 1), (0, 1, 0)])
def test_sparse_modes_vs_sdpa(sq, skv, mode, pre, nxt):
    n = 2
    q, k, v = make_inputs("BNSD", b=1, n=n, sq=sq, skv=skv, d=8, dtype=F64)
    delta = skv - sq
    if mode == 0:
        user = rand_mask(sq, skv, seed=9, keep_col0=False)
        keep = band_keep(sq, skv, -pre, nxt) & ~user
        mask = user
    else:
        mask = TRIU2048
        keep = {2: band_keep(sq, skv, -10 ** 6, 0), 3: band_keep(sq, skv, -10 ** 6, delta),
                4: band_keep(sq, skv, delta - pre, delta + nxt)}[mode]
    out, lse = fia_forward(q, k, v, atten_mask=mask, num_heads=n, input_layout="BNSD", sparse_mode=mode,
                           pre_tokens=pre, next_tokens=nxt, softmax_lse_flag=True)
    valid = keep.any(-1)
    ref = sdpa(q, k, v, scale=1.0, mask=keep | ~valid[:, None], n=n, nkv=n)
    ref = torch.where(valid[None, None, :, None], ref, torch.zeros_like(ref))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert bool(torch.isinf(lse[0, :, ~valid]).all()) and bool(torch.isfinite(lse[0, :, valid]).all())


def test_pse_is_added_after_scale():
    n, b = 2, 2
    q, k, v = make_inputs("BNSD", b=b, n=n, sq=4, skv=6, d=8, dtype=F64)
    pse = torch.randn(1, n, 4, 6, dtype=F64)
    out, _ = fia_forward(q, k, v, pse_shift=pse, num_heads=n, input_layout="BNSD", scale_value=0.5)
    torch.testing.assert_close(out, sdpa(q, k, v, scale=0.5, mask=pse, n=n, nkv=n), rtol=1e-12, atol=1e-12)


def test_decode_mask_b_kvs():
    n, b, skv = 2, 3, 9
    q, k, v = make_inputs("BSH", b=b, n=n, sq=1, skv=skv, d=8, dtype=F64)
    m = rand_mask(b, skv, seed=2)
    for shaped in (m, m[:, None], m[:, None, None]):
        out, _ = fia_forward(q, k, v, atten_mask=shaped, num_heads=n, input_layout="BSH", sparse_mode=3,
                             pre_tokens=0, next_tokens=0)  # Q_S=1 ignores sparse_mode/pre/next
        ref = sdpa(bnsd(q, "BSH", n), bnsd(k, "BSH", n), bnsd(v, "BSH", n), scale=1.0, mask=~m[:, None, None],
                   n=n, nkv=n)
        torch.testing.assert_close(out, from_bnsd(ref, "BSH"), rtol=1e-12, atol=1e-12)


def test_actual_lengths_and_invalid_rows():
    n = 2
    q, k, v = make_inputs("BNSD", b=2, n=n, sq=6, skv=8, d=8, dtype=F64)
    out, lse = fia_forward(q, k, v, actual_seq_lengths=[4, 6], actual_seq_lengths_kv=[5, 0], num_heads=n,
                           input_layout="BNSD", softmax_lse_flag=True)
    ref = sdpa(q[:1, :, :4], k[:1, :, :5], v[:1, :, :5], scale=1.0, n=n, nkv=n)
    torch.testing.assert_close(out[:1, :, :4], ref, rtol=1e-12, atol=1e-12)
    assert bool((out[0, :, 4:] == 0).all()) and bool((out[1] == 0).all())  # padded rows, empty KV batch
    assert bool(torch.isinf(lse[0, :, 4:]).all()) and bool(torch.isinf(lse[1]).all())


def test_left_padding_equals_right_padding():
    n, sq, skv, qpad, kvpad = 2, 7, 9, 1, 2
    q, k, v = make_inputs("BSND", b=2, n=n, sq=sq, skv=skv, d=8, dtype=F64)
    aq, akv = [4, 6], [5, 7]
    ql, kl, vl = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for b in range(2):
        ql[b, sq - qpad - aq[b]:sq - qpad] = q[b, :aq[b]]
        kl[b, skv - kvpad - akv[b]:skv - kvpad] = k[b, :akv[b]]
        vl[b, skv - kvpad - akv[b]:skv - kvpad] = v[b, :akv[b]]
    kw = dict(actual_seq_lengths=aq, actual_seq_lengths_kv=akv, num_heads=n, input_layout="BSND",
              softmax_lse_flag=True)
    o_r, l_r = fia_forward(q, k, v, **kw)
    o_l, l_l = fia_forward(ql, kl, vl, query_padding_size=torch.tensor([qpad]),
                           kv_padding_size=torch.tensor([kvpad]), **kw)
    for b in range(2):
        torch.testing.assert_close(o_l[b, sq - qpad - aq[b]:sq - qpad], o_r[b, :aq[b]])
        torch.testing.assert_close(l_l[b, :, sq - qpad - aq[b]:sq - qpad], l_r[b, :, :aq[b]])


@pytest.mark.parametrize("cache_layout", ["BSH", "BNSD"])
def test_paged_equals_contiguous(cache_layout):
    n, nkv, bs = 4, 2, 16
    q, k, v = make_inputs("BNSD", b=2, n=n, nkv=nkv, sq=3, skv=40, d=8, dtype=F64)
    lens = [40, 21]
    kc, bt = to_paged(k, lens, bs, cache_layout=cache_layout, seed=1)
    vc, _ = to_paged(v, lens, bs, cache_layout=cache_layout, seed=1)
    kw = dict(actual_seq_lengths_kv=lens, num_heads=n, num_key_value_heads=nkv, input_layout="BNSD")
    torch.testing.assert_close(fia_forward(q, kc, vc, block_table=bt, block_size=bs, **kw)[0],
                               fia_forward(q, k, v, **kw)[0])


def test_shared_prefix_is_prepended():
    n, plen = 2, 4
    q, k, v = make_inputs("BSH", b=2, n=n, sq=3, skv=5, d=8, dtype=F64)
    kp, vp, _ = make_inputs("BSH", b=1, n=n, sq=6, skv=6, d=8, dtype=F64, seed=7)
    kw = dict(num_heads=n, input_layout="BSH", softmax_lse_flag=True)
    out, lse = fia_forward(q, k, v, key_shared_prefix=kp, value_shared_prefix=vp,
                           actual_shared_prefix_len=[plen], **kw)
    kc = torch.cat([kp[:, :plen].expand(2, -1, -1), k], 1)
    vc = torch.cat([vp[:, :plen].expand(2, -1, -1), v], 1)
    ref, ref_lse = fia_forward(q, kc, vc, **kw)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)


def test_tensor_list_equals_padded_tensor():
    n = 2
    q, k, v = make_inputs("BSH", b=2, n=n, sq=3, skv=8, d=8, dtype=F64)
    lens = [8, 5]
    kl = [k[b:b + 1, :lens[b]] for b in range(2)]
    vl = [v[b:b + 1, :lens[b]] for b in range(2)]
    torch.testing.assert_close(fia_forward(q, kl, vl, num_heads=n)[0],
                               fia_forward(q, k, v, num_heads=n, actual_seq_lengths_kv=lens)[0])


def test_tnd_equals_per_batch():
    n = 2
    lq, lk = [3, 2, 4], [5, 2, 6]
    q = torch.randn(sum(lq), n, 8, dtype=F64)
    k = torch.randn(sum(lk), n, 8, dtype=F64)
    v = torch.randn(sum(lk), n, 8, dtype=F64)
    cq, ck = [3, 5, 9], [5, 7, 13]
    out, lse = fia_forward(q, k, v, actual_seq_lengths=cq, actual_seq_lengths_kv=ck, num_heads=n,
                           input_layout="TND", sparse_mode=3, atten_mask=TRIU2048, softmax_lse_flag=True)
    assert out.shape == (9, n, 8) and lse.shape == (9, n, 1)
    oq = ok = 0
    for a, c in zip(lq, lk):
        o1, l1 = fia_forward(q[None, oq:oq + a], k[None, ok:ok + c], v[None, ok:ok + c], num_heads=n,
                             input_layout="BSND", sparse_mode=3, atten_mask=TRIU2048, softmax_lse_flag=True)
        torch.testing.assert_close(out[oq:oq + a], o1[0])
        torch.testing.assert_close(lse[oq:oq + a], l1[0].transpose(0, 1))
        oq, ok = oq + a, ok + c


# ---------------------------------------------------------------------------------------- quantization helpers
def test_int4_pack_by_hand():
    x = torch.tensor([[1, 2, 3, 4, 5, 6, 7, -8, 0, -1, 0, 0, 0, 0, 0, 0]])
    p = pack_int4(x)
    assert p.dtype == torch.int32 and p.shape == (1, 2)
    assert int(p[0, 0]) == 0x87654321 - 2 ** 32  # element 0 in bits 0-3, -8 = 0x8 in bits 28-31
    assert int(p[0, 1]) == 0xF0
    torch.testing.assert_close(unpack_int4(p), x)
    r = randint4(3, 5, 64, seed=1)
    torch.testing.assert_close(unpack_int4(pack_int4(r)), r)


def test_deq_scale_encoding_by_hand():
    e = encode_deq_scale(0.1)
    assert e.dtype == torch.uint64 and int(e.tolist()[0]) == (0x3DCCC000 | (1 << 46))
    assert decode_deq_scale(e) == 0.0999755859375  # fp32 0x3DCCC000, truncated to 19 bits
    assert decode_deq_scale(encode_deq_scale(0.1, torch.int64)) == 0.0999755859375
    assert decode_deq_scale(torch.tensor([0.1], dtype=torch.float32)) == float(torch.tensor(0.1, dtype=torch.float32))
    assert decode_deq_scale(encode_deq_scale(0.5)) == 0.5
    assert decode_deq_scale(torch.tensor([0x3DCCCCCD | (1 << 46)], dtype=torch.uint64)) == 0.0999755859375  # raw bits


def test_sat_int8_rounds_half_to_even():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 127.4, 127.6, 300.0, -128.4, -200.0], dtype=F64)
    assert sat_int8(x).tolist() == [0, 2, 2, 0, -2, 127, 127, 127, -128, -128]


def test_int8_chain_by_hand():
    # Q_S=2 (prompt path), N=1, D=1: S = q k^T * deq1 * scale; P~ = exp(S - max); P_i8 = round(P~ * qs1)
    q = torch.tensor([[[1], [2]]], dtype=torch.int8)  # BSH [1, 2, 1]
    k = torch.tensor([[[1], [-1]]], dtype=torch.int8)
    v = torch.tensor([[[10], [20]]], dtype=torch.int8)
    deq1, qs1, deq2 = 0.5, 100.0, 0.015625  # exact in fp32
    g = fia_forward_detail(q, k, v, deq_scale1=torch.tensor([deq1]), quant_scale1=torch.tensor([qs1]),
                           deq_scale2=torch.tensor([deq2]), num_heads=1, scale_value=2.0, softmax_lse_flag=True)
    for row, qi in enumerate((1, 2)):
        s = [qi * 1 * deq1 * 2.0, qi * -1 * deq1 * 2.0]
        m = max(s)
        e = [math.exp(x - m) for x in s]
        p = [min(127, round(x * qs1)) for x in e]  # no ties here
        o = (p[0] * 10 + p[1] * 20) * deq2 / sum(e)
        assert abs(float(g.out[0, row, 0]) - o) < 1e-12
        assert abs(float(g.lse[0, 0, row, 0]) - (m + math.log(sum(e)))) < 1e-12
    # int8 output: sat(round(O * qs2 + qo2)); per-channel scale per (n, d)
    g2 = fia_forward_detail(q, k, v, deq_scale1=encode_deq_scale(deq1), quant_scale1=torch.tensor([qs1]),
                            deq_scale2=torch.tensor([deq2]), quant_scale2=torch.tensor([3.0]),
                            quant_offset2=torch.tensor([0.5]), num_heads=1, scale_value=2.0)
    torch.testing.assert_close(g2.out_real, g.out * 3.0 + 0.5)
    torch.testing.assert_close(g2.out, torch.round(g.out * 3.0 + 0.5).clamp(-128, 127))


def test_int8_chain_saturates_p_and_rounds_ties_to_even():
    q = torch.tensor([[[1]]], dtype=torch.int8).expand(1, 2, 1).contiguous()
    k = torch.tensor([[[0], [0]]], dtype=torch.int8)  # S = 0 everywhere: P~ = 1
    v = torch.tensor([[[1], [3]]], dtype=torch.int8)
    for qs1, p in ((2.5, 2), (3.5, 4), (200.0, 127)):
        g = fia_forward_detail(q, k, v, deq_scale1=torch.tensor([1.0]), quant_scale1=torch.tensor([qs1]),
                               deq_scale2=torch.tensor([1.0]), num_heads=1)
        assert float(g.out[0, 0, 0]) == p * (1 + 3) / 2


@pytest.mark.parametrize("which", ["combined-channel", "combined-tensor", "combined-token", "sep-channel",
                                   "sep-token", "sep-head", "sep-token-head", "sep-k0-v1"])
def test_antiquant_modes_equal_dequantized_input(which):
    b, n, s, d = 2, 2, 5, 8
    q = torch.randn(b, 1, n * d, dtype=F64)
    kq, vq = randint8(b, s, n * d, seed=1), randint8(b, s, n * d, seed=2)
    sc_c, of_c = torch.rand(2, n, 1, d, dtype=F64) + 0.1, torch.randn(2, n, 1, d, dtype=F64)
    sc_t, of_t = torch.rand(2, b, s, dtype=F64) + 0.1, torch.randn(2, b, s, dtype=F64)
    sc_h, of_h = torch.rand(2, n, dtype=F64) + 0.1, torch.randn(2, n, dtype=F64)
    sc_th, of_th = torch.rand(2, b, n, s, dtype=F64) + 0.1, torch.randn(2, b, n, s, dtype=F64)
    kf, vf = kq.to(F64).reshape(b, s, n, d), vq.to(F64).reshape(b, s, n, d)
    kw = dict(num_heads=n, input_layout="BSH")

    def chan(x, i, sc, of):
        return (x + of[i].reshape(1, 1, n, d)) * sc[i].reshape(1, 1, n, d)

    def tok(x, i, sc, of):
        return (x + of[i][:, :, None, None]) * sc[i][:, :, None, None]

    if which == "combined-channel":
        args = dict(antiquant_scale=sc_c, antiquant_offset=of_c)
        kd, vd = chan(kf, 0, sc_c, of_c), chan(vf, 1, sc_c, of_c)
    elif which == "combined-tensor":
        args = dict(antiquant_scale=torch.tensor([0.5, 2.0]), antiquant_offset=torch.tensor([1.0, -3.0]))
        kd, vd = (kf + 1) * 0.5, (vf - 3) * 2
    elif which == "combined-token":
        args = dict(antiquant_scale=sc_t, antiquant_offset=of_t, antiquant_mode=1)
        kd, vd = tok(kf, 0, sc_t, of_t), tok(vf, 1, sc_t, of_t)
    elif which == "sep-channel":
        args = dict(key_antiquant_scale=sc_c[0], key_antiquant_offset=of_c[0], value_antiquant_scale=sc_c[1],
                    value_antiquant_offset=of_c[1], antiquant_scale=sc_t)  # the separate ones win
        kd, vd = chan(kf, 0, sc_c, of_c), chan(vf, 1, sc_c, of_c)
    elif which == "sep-token":
        args = dict(key_antiquant_scale=sc_t[0:1], key_antiquant_offset=of_t[0:1], value_antiquant_scale=sc_t[1],
                    value_antiquant_offset=of_t[1], key_antiquant_mode=1, value_antiquant_mode=1)
        kd, vd = tok(kf, 0, sc_t, of_t), tok(vf, 1, sc_t, of_t)
    elif which == "sep-head":
        args = dict(key_antiquant_scale=sc_h[0], key_antiquant_offset=of_h[0], value_antiquant_scale=sc_h[1],
                    value_antiquant_offset=of_h[1], key_antiquant_mode=2, value_antiquant_mode=2)
        kd = (kf + of_h[0].view(1, 1, n, 1)) * sc_h[0].view(1, 1, n, 1)
        vd = (vf + of_h[1].view(1, 1, n, 1)) * sc_h[1].view(1, 1, n, 1)
    elif which == "sep-token-head":
        args = dict(key_antiquant_scale=sc_th[0], key_antiquant_offset=of_th[0], value_antiquant_scale=sc_th[1],
                    value_antiquant_offset=of_th[1], key_antiquant_mode=3, value_antiquant_mode=3)
        kd = (kf + of_th[0].permute(0, 2, 1)[..., None]) * sc_th[0].permute(0, 2, 1)[..., None]
        vd = (vf + of_th[1].permute(0, 2, 1)[..., None]) * sc_th[1].permute(0, 2, 1)[..., None]
    else:  # key per-channel, value per-token, symmetric
        args = dict(key_antiquant_scale=sc_c[0], value_antiquant_scale=sc_t[1:2], key_antiquant_mode=0,
                    value_antiquant_mode=1)
        kd = kf * sc_c[0].reshape(1, 1, n, d)
        vd = vf * sc_t[1][:, :, None, None]
    out, _ = fia_forward(q, kq, vq, **args, **kw)
    ref, _ = fia_forward(q, kd.reshape(b, s, n * d), vd.reshape(b, s, n * d), **kw)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_antiquant_paged_scales_modes_4_5():
    b, n, d, bs = 2, 2, 8, 16
    lens = [20, 9]
    q = torch.randn(b, n, 1, d, dtype=F64)
    kq, vq = randint8(b, n, 20, d, seed=1), randint8(b, n, 20, d, seed=2)
    kc, bt = to_paged(kq, lens, bs, cache_layout="BNSD", seed=3)
    vc, _ = to_paged(vq, lens, bs, cache_layout="BNSD", seed=3)
    nblk = kc.shape[0]
    sk, sv = torch.rand(nblk, bs, dtype=F64) + 0.1, torch.rand(nblk, bs, dtype=F64) + 0.1
    skh, svh = torch.rand(nblk, n, bs, dtype=F64) + 0.1, torch.rand(nblk, n, bs, dtype=F64) + 0.1
    kw = dict(block_table=bt, block_size=bs, actual_seq_lengths_kv=lens, num_heads=n, input_layout="BNSD")
    o4, _ = fia_forward(q, kc, vc, key_antiquant_scale=sk, value_antiquant_scale=sv, key_antiquant_mode=4,
                        value_antiquant_mode=4, **kw)
    o5, _ = fia_forward(q, kc, vc, key_antiquant_scale=skh, value_antiquant_scale=svh, key_antiquant_mode=5,
                        value_antiquant_mode=5, **kw)
    # dequantize the cache by hand, then run unquantized
    kd4 = kc.to(F64) * sk[:, None, :, None]
    vd4 = vc.to(F64) * sv[:, None, :, None]
    kd5, vd5 = kc.to(F64) * skh[..., None], vc.to(F64) * svh[..., None]
    torch.testing.assert_close(o4, fia_forward(q, kd4, vd4, **kw)[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o5, fia_forward(q, kd5, vd5, **kw)[0], rtol=1e-12, atol=1e-12)


def test_int4_kv_equals_int8_values():
    b, n, s, d = 1, 2, 6, 64
    q = torch.randn(b, 1, n * d, dtype=F64)
    kv4, vv4 = randint4(b, s, n * d, seed=1), randint4(b, s, n * d, seed=2)
    sc = torch.rand(n * d, dtype=F64) + 0.1
    kw = dict(key_antiquant_scale=sc, value_antiquant_scale=sc, num_heads=n, input_layout="BSH")
    o4, _ = fia_forward(q, pack_int4(kv4), pack_int4(vv4), **kw)
    o8, _ = fia_forward(q, kv4.to(torch.int8), vv4.to(torch.int8), **kw)
    torch.testing.assert_close(o4, o8, rtol=0, atol=0)


def test_low_precision_baseline_runs_in_dtype():
    q, k, v = make_inputs("BSH", dtype=torch.float16)
    o16, l16 = fia_forward(q, k, v, num_heads=2, dtype=torch.float16, softmax_lse_flag=True)
    o64, l64 = fia_forward(q, k, v, num_heads=2, softmax_lse_flag=True)
    assert o16.dtype == torch.float16 and l16.dtype == torch.float32 and o64.dtype == F64
    assert 0 < float((o16.double() - o64).abs().max()) < 1e-2
