"""FIA with a value head dim Dv different from the key's Dk: the output (and int8 output / value antiquant
parameters) take Dv, in every layout, dense, tensor lists and paged, decode and prefill, against the fp64 golden."""
from __future__ import annotations

import pytest
import torch

from attnops import torch_npu
from attnops.ops.fused_infer_attention import PagedKVCache
from attnops.testing import golden_fia
from attnops.testing.compare import assert_close_to_golden, fia_reduction
from tests.helpers import randn
from tests.ops.fused_infer_attention.fia_helpers import (TRIU2048, check_fia, layout_of, make_inputs, randint8,
                                                         run_api, to_paged)

F16, BF16 = torch.float16, torch.bfloat16
VIA = ["aclnn", "api"]
DK, DV = 48, 32  # K 48 / V 32 (both multiples of 16 for the aclnn envelope)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD", "BNSD_BSND"])
@pytest.mark.parametrize("sq", [1, 20])
def test_dense(via, layout, sq):
    if layout == "BNSD_BSND" and sq == 1:
        pytest.skip("BNSD_BSND needs Q_S > 1")
    q, k, v = make_inputs(layout, b=2, n=4, nkv=2, sq=sq, skv=37, d=DK, dv=DV, dtype=F16)
    r = check_fia(q, k, v, via=via, num_heads=4, num_key_value_heads=2, scale_value=0.2, input_layout=layout,
                  actual_seq_lengths_kv=[37, 20], softmax_lse_flag=True)
    assert r["out"].shape[-1] == (4 * DV if layout == "BSH" else DV)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("dk,dv", [(DK, DV), (16, 32)])
def test_tnd(via, dk, dv):
    n, nkv, lq, lk = 4, 2, [3, 21, 1], [6, 25, 9]
    q = randn(sum(lq), n, dk, dtype=F16, seed=1)
    k = randn(sum(lk), nkv, dk, dtype=F16, seed=2)
    v = randn(sum(lk), nkv, dv, dtype=F16, seed=3)
    check_fia(q, k, v, via=via, actual_seq_lengths=[3, 24, 25], actual_seq_lengths_kv=[6, 31, 40], num_heads=n,
              num_key_value_heads=nkv, scale_value=0.25, input_layout="TND", sparse_mode=3, atten_mask=TRIU2048,
              softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
@pytest.mark.parametrize("sq", [1, 18])
def test_tensor_list(via, layout, sq):
    n, lens = 2, [7, 3, 11]
    q, _, _ = make_inputs(layout, b=3, n=n, sq=sq, d=DK, dtype=F16)
    ks = [make_inputs(layout, b=1, n=n, sq=1, skv=s, d=DK, dv=DV, dtype=F16, seed=5 + i)[1:] for i, s in
          enumerate(lens)]
    check_fia(q, [x[0] for x in ks], [x[1] for x in ks], via=via, num_heads=n, scale_value=0.25,
              input_layout=layout, softmax_lse_flag=True)


def _paged(layout, *, n, nkv, sq, lens, bs, cache_layout, dtype=F16):
    q, _, _ = make_inputs(layout, b=2, n=n, nkv=nkv, sq=sq, skv=1, d=DK, dtype=dtype)
    k = randn(2, nkv, max(lens), DK, dtype=dtype, seed=1)
    v = randn(2, nkv, max(lens), DV, dtype=dtype, seed=2)
    kc, bt = to_paged(k, lens, bs, cache_layout=cache_layout, seed=3)
    vc, _ = to_paged(v, lens, bs, cache_layout=cache_layout, seed=3)
    return q, kc, vc, bt


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("layout,cache_layout", [("BSH", "BSH"), ("BNSD", "BNSD")])
@pytest.mark.parametrize("sq,bs,lens", [(1, 16, [40, 7]), (20, 128, [200, 130])])
def test_paged(via, layout, cache_layout, sq, bs, lens):
    q, kc, vc, bt = _paged(layout, n=4, nkv=2, sq=sq, lens=lens, bs=bs, cache_layout=cache_layout)
    check_fia(q, kc, vc, via=via, block_table=bt, block_size=bs, actual_seq_lengths_kv=lens, num_heads=4,
              num_key_value_heads=2, scale_value=0.25, input_layout=layout, softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
def test_int8_antiquant_per_channel_takes_each_head_dim(via):
    n, bs, lens = 2, 32, [70, 33]
    q = randn(2, n, 1, DK, dtype=BF16, seed=1)
    kc, bt = to_paged(randint8(2, n, 70, DK, seed=2), lens, bs, cache_layout="BNSD", seed=4)
    vc, _ = to_paged(randint8(2, n, 70, DV, seed=3), lens, bs, cache_layout="BNSD", seed=4)
    g = torch.Generator().manual_seed(5)
    ks, vs = ((torch.rand(1, n, 1, d, generator=g) * 0.02 + 0.005).to(BF16) for d in (DK, DV))
    check_fia(q, kc, vc, via=via, key_antiquant_scale=ks, value_antiquant_scale=vs, block_table=bt, block_size=bs,
              actual_seq_lengths_kv=lens, num_heads=n, scale_value=0.25, input_layout="BNSD", softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
def test_int8_output_per_channel_takes_dv(via):
    q, k, v = make_inputs("BSND", b=2, n=2, sq=32, skv=40, d=64, dv=32, dtype=F16)
    scale2 = torch.rand(2, 32, generator=torch.Generator().manual_seed(1)) + 0.5
    check_fia(q, k, v, via=via, quant_scale2=scale2, num_heads=2, scale_value=0.125, input_layout="BSND")


@pytest.mark.parametrize("via", VIA)
def test_shared_prefix(via):
    q, k, v = make_inputs("BSH", b=2, n=2, sq=1, skv=9, d=DK, dv=DV, dtype=F16)
    _, kp, vp = make_inputs("BSH", b=1, n=2, sq=1, skv=5, d=DK, dv=DV, dtype=F16, seed=7)
    check_fia(q, k, v, via=via, key_shared_prefix=kp, value_shared_prefix=vp, actual_shared_prefix_len=[4],
              num_heads=2, scale_value=0.25, input_layout="BSH", softmax_lse_flag=True)


def test_value_shape_must_match_key_but_for_head_dim():
    q, k, v = make_inputs("BNSD", b=2, n=2, sq=1, skv=9, d=DK, dv=DV, dtype=F16)
    with pytest.raises(ValueError, match="value"):
        run_api(q, k, v[:, :, :5], num_heads=2, input_layout="BNSD")
    with pytest.raises(ValueError, match="value"):
        q, k, v = (x.transpose(1, 2).flatten(2) for x in (q, k, v))
        run_api(q, k, v[..., :-1], num_heads=2, input_layout="BSH")  # H_v = 63 is not N2*Dv


@pytest.mark.parametrize("layout", ["BSH", "BNSD", "TND", "NTD", "BSH_BNSD", "BSND_NBSD"])
@pytest.mark.parametrize("sq", [1, 6])
def test_torch_npu(layout, sq):
    n, nkv, b, skv = 4, 2, 2, 9
    reads, writes = (layout.split("_") + [None])[:2]
    q, k, v = make_inputs("BSND", b=b, n=n, nkv=nkv, sq=sq, skv=skv, d=DK, dv=DV, dtype=F16)
    kw = dict(num_heads=n, num_key_value_heads=nkv, actual_seq_lengths_kv=[9, 6])
    if reads in ("TND", "NTD"):
        q, k, v = (x.flatten(0, 1) for x in (q, k, v))
        kw.update(actual_seq_lengths=[sq, 2 * sq], actual_seq_lengths_kv=[9, 18])
        args = [x.transpose(0, 1).contiguous() if reads == "NTD" else x for x in (q, k, v)]
        gargs, glayout = (q, k, v), "TND"
    else:
        args = [layout_of(x, reads) for x in (q, k, v)]
        gargs, glayout = args, reads
    out, lse = torch_npu.npu_fused_infer_attention_score(*args, scale=0.25, input_layout=layout,
                                                         softmax_lse_flag=True, **kw)
    g, base = (golden_fia.fia_forward(*gargs, dtype=dt, scale_value=0.25, input_layout=glayout,
                                      softmax_lse_flag=True, **kw) for dt in (torch.float64, F16))
    g, b_out = g[0], base[0]
    if reads == "NTD":
        g, b_out = g.transpose(0, 1), b_out.transpose(0, 1)
    if writes is not None:
        to_bsnd = (lambda x: x.unflatten(-1, (n, -1))) if reads == "BSH" else (lambda x: x)
        order = (0, 2, 1, 3) if writes == "BNSD" else (2, 0, 1, 3)
        g, b_out = (to_bsnd(x).permute(order) for x in (g, b_out))
    assert out.shape == g.shape and out.shape[-1] in (DV, n * DV)
    assert_close_to_golden("attention_out", out, g, b_out,
                           reduction=fia_reduction(*gargs[:2], input_layout=glayout, **kw))


@pytest.mark.parametrize("layout", ["BnNBsD", "BnBsH"])
def test_paged_kv_cache_value_head_dim(layout):
    cache = PagedKVCache(16, 16, num_kv_heads=2, head_dim=DK, value_head_dim=DV, dtype=F16, layout=layout)
    seqs = [cache.new_sequence() for _ in range(2)]
    ks = [randn(n, 2, DK, dtype=F16, seed=i) for i, n in enumerate((40, 7))]
    vs = [randn(n, 2, DV, dtype=F16, seed=5 + i) for i, n in enumerate((40, 7))]
    for s, k, v in zip(seqs, ks, vs):
        cache.append(s, k, v)
    q = randn(2, 4, 1, DK, dtype=F16, seed=9)
    out = torch.stack([run_api(q[i:i + 1], cache.key_cache, cache.value_cache, num_heads=4, num_key_value_heads=2,
                               input_layout="BNSD", scale_value=0.25,
                               **cache.attention_kwargs([s]))[0][0] for i, s in enumerate(seqs)])
    for i in range(2):
        g = golden_fia.fia_forward(q[i:i + 1], ks[i].permute(1, 0, 2)[None], vs[i].permute(1, 0, 2)[None],
                                   dtype=torch.float64, num_heads=4, num_key_value_heads=2, input_layout="BNSD",
                                   scale_value=0.25)[0]
        base = golden_fia.fia_forward(q[i:i + 1], ks[i].permute(1, 0, 2)[None], vs[i].permute(1, 0, 2)[None],
                                      dtype=F16, num_heads=4, num_key_value_heads=2, input_layout="BNSD",
                                      scale_value=0.25)[0]
        assert_close_to_golden("attention_out", out[i:i + 1], g, base, reduction=DK + ks[i].shape[0])
