"""torch_npu's DSA and MLA ops vs goldens written from the spec: interleaved RoPE, the KV RMSNorm-RoPE cache in
every cache mode (NZ and int8 writes), the MLA prolog, sparse attention over the packed int8 cache, the NPU's
limits, and the torch_npu-only return conventions."""
from __future__ import annotations

import pytest
import torch

from attnops import ParamDtypeError, ParamInvalidError, ParamNullptrError, torch_npu
from attnops._core import hifloat8
from attnops.ops.dsa.quant_cache import dequantize, pack_rows, quantize
from attnops.testing import golden_dsa as G
from attnops.testing import golden_hifloat8 as G8
from attnops.testing.compare import assert_close_to_golden, sfa_reductions


def _r(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_interleave_rope_is_the_pair_rotation():
    x, angle = _r(2, 3, 4, 64), _r(2, 1, 4, 32, seed=1)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    out = torch_npu.npu_interleave_rope(x, cos, sin)
    even, odd = x[..., 0::2], x[..., 1::2]
    want = torch.cat([even * angle.cos() - odd * angle.sin(), odd * angle.cos() + even * angle.sin()], -1)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert out.shape == x.shape and out.dtype == x.dtype


def _nz_offset(block, row, c, d, bs, d0):
    return ((block * (d // d0) + c // d0) * bs + row) * d0 + c % d0


def _kv_inputs(b=3, s=1):
    kv = _r(b, 1, s, 576, seed=2)
    gamma = _r(512, seed=3)
    cos, sin = _r(b, 1, s, 64, seed=4), _r(b, 1, s, 64, seed=5)
    y = G.rms_norm(kv[..., :512], gamma, 1e-5)
    k = G.interleave_rope(kv[..., 512:], cos, sin)
    return kv, gamma, cos, sin, y, k


@pytest.mark.parametrize("mode", ["PA", "PA_BNSD", "PA_NZ"])
def test_kv_cache_paged_slots(mode):
    kv, gamma, cos, sin, y, k = _kv_inputs()
    index = torch.tensor([17, -1, 2])
    k_cache, ckv_cache = torch.zeros(3, 16, 1, 64), torch.zeros(3, 16, 1, 512)
    out = torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, cache_mode=mode,
                                              is_output_kv=True)
    assert out[0] is k_cache and out[1] is ckv_cache
    torch.testing.assert_close(out[2].double(), k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[3].double(), y, atol=1e-5, rtol=1e-5)
    for cache, rows, d in ((k_cache, k, 64), (ckv_cache, y, 512)):
        flat = cache.view(-1)
        written = torch.zeros_like(flat, dtype=torch.bool)
        for t, slot in ((0, 17), (2, 2)):
            for c in range(d):
                off = _nz_offset(slot // 16, slot % 16, c, d, 16, 32 // cache.element_size()) if mode == "PA_NZ" else slot * d + c
                assert abs(float(flat[off]) - float(rows[t, 0, 0, c])) < 1e-4
                written[off] = True
        assert (flat[~written] == 0).all()  # the -1 token wrote nothing


@pytest.mark.parametrize("mode", ["PA_BLK_BNSD", "PA_BLK_NZ"])
def test_kv_cache_page_slots(mode):
    kv, gamma, cos, sin, y, k = _kv_inputs(b=2, s=20)
    index = torch.tensor([32, 0, -1, 16])  # per (batch, page): the slot of the page's first row
    k_cache, ckv_cache = torch.zeros(3, 16, 1, 64), torch.zeros(3, 16, 1, 512)
    torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, cache_mode=mode)
    logical = (lambda c: c) if mode == "PA_BLK_BNSD" else (
        lambda c: c.reshape(3, c.shape[-1] // 8, 16, 8).permute(0, 2, 1, 3).reshape(3, 16, 1, -1))  # fp32: d0 = 8
    kc, yc = logical(k_cache), logical(ckv_cache)
    torch.testing.assert_close(kc[2, :16, 0].double(), k[0, 0, :16], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(yc[0, :4, 0].double(), y[0, 0, 16:20], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kc[1, :4, 0].double(), k[1, 0, 16:20], atol=1e-5, rtol=1e-5)
    assert (yc[1, 4:] == 0).all()  # batch 1's first page (-1) was not written


def test_kv_cache_norm_mode_and_int8_nz():
    kv, gamma, cos, sin, y, k = _kv_inputs(b=2, s=2)
    k_cache, ckv_cache = torch.zeros(2, 1, 5, 64), torch.zeros(2, 1, 5, 512)
    torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, torch.tensor([[4, 0], [1, -1]]), k_cache, ckv_cache)
    torch.testing.assert_close(ckv_cache[0, 0, 4].double(), y[0, 0, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache[1, 0, 1].double(), k[1, 0, 0], atol=1e-5, rtol=1e-5)
    assert (ckv_cache[1, 0, 0] == 0).all() and (ckv_cache[1, 0, 2:] == 0).all()
    ks, cs = torch.full((64,), 20.0), torch.full((512,), 30.0)
    k8, c8 = torch.zeros(1, 16, 1, 64, dtype=torch.int8), torch.zeros(1, 16, 1, 512, dtype=torch.int8)
    torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, torch.tensor([3, 9, 0, 1]), k8, c8,
                                        k_rope_scale=ks, c_kv_scale=cs, cache_mode="PA_NZ")
    c_logical = c8.view(1, 512 // 32, 16, 32).permute(0, 2, 1, 3).reshape(16, 512)
    want = torch.round(y[0, 0, 1] * 30).clamp(-128, 127).to(torch.int8)
    assert torch.equal(c_logical[9], want)


@pytest.mark.parametrize("mode", ["PA", "PA_NZ", "Norm"])
def test_kv_cache_slot_given_twice_takes_the_last_tokens_row(mode):
    """The write rule the device path shares (no write order): a repeated slot holds its last token's row (Norm:
    each batch has its own cache rows, so position 3 of batches 0, 1 and 3 are three rows)."""
    kv, gamma, cos, sin, y, k = _kv_inputs(b=4)
    norm = mode == "Norm"
    index, shape = (torch.tensor([[3], [3], [-1], [3]]), (4, 1, 5)) if norm else (torch.tensor([7, 7, -1, 7]),
                                                                                 (1, 16, 1))
    k_cache, ckv_cache = torch.zeros(*shape, 64), torch.zeros(*shape, 512)
    torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, cache_mode=mode)
    rows = ckv_cache[:, 0] if norm else (_nz_logical(ckv_cache) if mode == "PA_NZ" else ckv_cache)[0, :, 0]
    if norm:
        torch.testing.assert_close(rows[[0, 1, 3], 3].double(), y[[0, 1, 3], 0, 0], atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(rows[7].double(), y[3, 0, 0], atol=1e-5, rtol=1e-5)
    assert int((rows != 0).any(-1).sum()) == (3 if norm else 1)


def test_kv_cache_host_positions_past_the_cache_raise_by_name():
    kv, gamma, cos, sin, _, _ = _kv_inputs(b=2, s=2)
    caches = torch.zeros(2, 1, 5, 64), torch.zeros(2, 1, 5, 512)
    with pytest.raises(ParamInvalidError, match=r"^index: expected a slot in \[0, 5\) \(positions below the "
                                                r"caches' length\).*, got "
                                                r"index\[1, 0\] = 5$"):
        torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, torch.tensor([[4, 0], [5, 1]]), *caches)
    with pytest.raises(ParamInvalidError, match=r"^index: expected a slot in \[0, 16\) \(the cache's "
                                                r"rows\).*, got index\[1\] = 16$"):
        torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, torch.tensor([3, 16, 0, 1]),
                                            torch.zeros(1, 16, 1, 64), torch.zeros(1, 16, 1, 512), cache_mode="PA")


def _v2_inputs(b=2, n=2, s=3, dk=64, dv=32, dr=16):
    kv, v, gamma = _r(b, n, s, dk, seed=30), _r(b, n, s, dv, seed=31), _r(dk, seed=32)
    cos, sin = _r(b, 1, s, dr, seed=33), _r(b, 1, s, dr, seed=34)
    return (kv, gamma, cos, sin, v), G.kv_cache_rows_v2(kv, gamma, cos, sin, v, 1e-5)


def _nz_logical(cache):
    """An NZ cache's logical ``[blocks, block_size, N, D]`` rows (memory ``[blocks, N, D/d0, block_size, d0]``)."""
    blocks, bs, n, d = cache.shape
    d0 = 32 // cache.element_size()
    return cache.reshape(blocks, n, d // d0, bs, d0).permute(0, 3, 1, 2, 4).reshape(blocks, bs, n, d)


@pytest.mark.parametrize("mode", ["PA_BNSD", "PA_NZ", "PA_BLK_BNSD"])
def test_kv_cache_v2_writes_normed_rotated_k_and_v_per_head(mode):
    (kv, gamma, cos, sin, v), (k, vv) = _v2_inputs()
    index = torch.tensor([0, 16] if mode.startswith("PA_BLK") else [5, -1, 17, 2, 30, 9])
    k_cache, v_cache = torch.zeros(3, 16, 2, 64), torch.zeros(3, 16, 2, 32)
    out = torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, v_cache, v=v, cache_mode=mode,
                                              is_output_kv=True)
    torch.testing.assert_close(out[2].double(), k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[3].double(), vv, atol=1e-5, rtol=1e-5)
    kc, vc = (_nz_logical(k_cache), _nz_logical(v_cache)) if mode == "PA_NZ" else (k_cache, v_cache)
    slots = index.view(2, 1) + torch.arange(3) if mode.startswith("PA_BLK") else index.view(2, 3)
    for b in range(2):
        for s in range(3):
            slot = int(slots[b, s])
            if slot >= 0:
                torch.testing.assert_close(kc.view(48, 2, 64)[slot].double(), k[b, :, s], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(vc.view(48, 2, 32)[slot].double(), vv[b, :, s], atol=1e-6, rtol=0)
    written = int((slots >= 0).sum())
    assert int((kc.view(48, -1) != 0).any(-1).sum()) == written  # -1 wrote nothing, nothing else was touched


def test_kv_cache_v2_norm_mode_and_int8_per_head_scales():
    (kv, gamma, cos, sin, v), (k, vv) = _v2_inputs()
    k_cache, v_cache = torch.zeros(2, 2, 4, 64), torch.zeros(2, 2, 4, 32)
    torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, torch.tensor([[3, 0, -1], [1, 2, 0]]), k_cache, v_cache,
                                        v=v)
    torch.testing.assert_close(k_cache[0, :, 3].double(), k[0, :, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_cache[1, :, 0].double(), vv[1, :, 2], atol=1e-6, rtol=0)
    assert (k_cache[0, :, 1:3] == 0).all()
    ks, vs = torch.tensor([[20.0], [10.0]]).expand(2, 64).contiguous(), torch.full((32,), 30.0)
    k8, v8 = torch.zeros(1, 32, 2, 64, dtype=torch.int8), torch.zeros(1, 32, 2, 32, dtype=torch.int8)
    torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, torch.arange(6), k8, v8, v=v, k_rope_scale=ks,
                                        c_kv_scale=vs, cache_mode="PA_NZ")
    want_k = torch.round(k[1, :, 2] * ks.double()).clamp(-128, 127).to(torch.int8)
    assert torch.equal(_nz_logical(k8)[0, 5], want_k)
    assert torch.equal(_nz_logical(v8)[0, 4], torch.round(vv[1, :, 1] * 30).clamp(-128, 127).to(torch.int8))


def test_kv_cache_v2_rejects_mismatched_shapes_by_name():
    (kv, gamma, cos, sin, v), _ = _v2_inputs()
    caches = torch.zeros(3, 16, 2, 64), torch.zeros(3, 16, 2, 32)
    with pytest.raises(ParamInvalidError, match=r"^v: expected \[B, N, S, Dv\]"):
        torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, torch.arange(6), *caches, v=v[:, :1])
    with pytest.raises(ParamInvalidError, match="^gamma: "):
        torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma[:32], cos, sin, torch.arange(6), *caches, v=v)
    with pytest.raises(ParamInvalidError, match="^ckv_cache: expected last dim 32"):
        torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, torch.arange(6), caches[0], caches[0], v=v,
                                            cache_mode="PA")


def _golden_prolog(x, wdq, wuq, wuk, wdkv, gq, gkv, sin, cos):
    n, d, hckv = wuk.shape
    c_q = G.rms_norm(x.double() @ wdq.double(), gq, 1e-5)
    u = (c_q @ wuq.double()).view(x.shape[0], n, -1)
    query = torch.einsum("tnd,ndh->tnh", u[..., :d], wuk.double())
    q_rope = G.interleave_rope(u[..., d:], cos[:, None], sin[:, None])
    kv = x.double() @ wdkv.double()
    return query, q_rope, c_q, G.rms_norm(kv[:, :hckv], gkv, 1e-5), G.interleave_rope(kv[:, hckv:], cos, sin)


def test_mla_prolog_v3_paged_and_functional():
    he, hcq, n, d, hckv, dr, t = 32, 16, 2, 8, 16, 8, 3
    w = (_r(he, hcq, seed=10), _r(hcq, n * (d + dr), seed=11), _r(n, d, hckv, seed=12), _r(he, hckv + dr, seed=13),
         _r(hcq, seed=14), _r(hckv, seed=15), _r(t, dr, seed=16), _r(t, dr, seed=17))
    x = _r(t, he, seed=18)
    kv_cache, kr_cache = torch.zeros(2, 16, 1, hckv), torch.zeros(2, 16, 1, dr)
    slots = torch.tensor([0, 17, -1])
    q, qr, scale_q, qn, scale_n = torch_npu.npu_mla_prolog_v3(x, *w, kv_cache, kr_cache, cache_index=slots,
                                                              query_norm_flag=True)
    gq, gqr, gqn, gkv, gkr = _golden_prolog(x, *w)
    for name, a, g in (("query", q, gq), ("query_rope", qr, gqr), ("query_norm", qn, gqn)):
        torch.testing.assert_close(a.double(), g, atol=1e-4, rtol=1e-4, msg=name)
    torch.testing.assert_close(kv_cache.view(32, hckv)[17].double(), gkv[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kr_cache.view(32, dr)[0].double(), gkr[0], atol=1e-4, rtol=1e-4)
    assert scale_q.numel() == 0 and scale_n.numel() == 0
    kv2, kr2 = torch.zeros(t, 1, hckv), torch.zeros(t, 1, dr)
    outs = torch_npu.npu_mla_prolog_v3_functional(x, *w, kv2, kr2, cache_mode="TND")
    assert len(outs) == 7 and (kv2 == 0).all()
    torch.testing.assert_close(outs[5][:, 0].double(), gkv, atol=1e-4, rtol=1e-4)
    with pytest.raises(NotImplementedError, match="^weight_quant_mode: .* got 3"):
        torch_npu.npu_mla_prolog_v3(x, *w, kv_cache, kr_cache, cache_index=slots, weight_quant_mode=3)
    with pytest.raises(ParamInvalidError, match="^weight_uq_qr: expected dtype in \\['torch.int8'\\]"):
        torch_npu.npu_mla_prolog_v3(x, *w, kv_cache, kr_cache, cache_index=slots, weight_quant_mode=2)


def test_mla_prolog_page_blocks_follow_actual_seq_len():
    """``PA_BLK_BSND`` with ``[T, He]`` tokens: ``cache_index`` holds a block id per (batch, page), the batches
    from the cumulative ``actual_seq_len``; a -1 page is not written."""
    he, hcq, n, d, hckv, dr, t = 32, 16, 2, 8, 16, 8, 5
    w = (_r(he, hcq, seed=10), _r(hcq, n * (d + dr), seed=11), _r(n, d, hckv, seed=12), _r(he, hckv + dr, seed=13),
         _r(hcq, seed=14), _r(hckv, seed=15), _r(t, dr, seed=16), _r(t, dr, seed=17))
    x = _r(t, he, seed=18)
    kv_cache, kr_cache = torch.zeros(6, 2, 1, hckv), torch.zeros(6, 2, 1, dr)
    lens = torch.tensor([2, 5], dtype=torch.int32)  # batch 0: tokens 0-1 (1 page), batch 1: tokens 2-4 (2 pages)
    torch_npu.npu_mla_prolog_v3(x, *w, kv_cache, kr_cache, cache_index=torch.tensor([4, 1, -1]),
                                actual_seq_len=lens, cache_mode="PA_BLK_BSND")
    _, _, _, gkv, gkr = _golden_prolog(x, *w)
    slots = [8, 9, 2, 3]  # block 4 rows 0-1, block 1 rows 0-1; token 4 is on the -1 page
    torch.testing.assert_close(kv_cache.view(12, hckv)[slots].double(), gkv[:4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kr_cache.view(12, dr)[slots].double(), gkr[:4], atol=1e-4, rtol=1e-4)
    assert int((kv_cache.view(12, hckv) != 0).any(-1).sum()) == 4
    with pytest.raises(ParamInvalidError, match="^actual_seq_len: expected non-decreasing cumulative lengths"):
        torch_npu.npu_mla_prolog_v3(x, *w, kv_cache, kr_cache, cache_index=torch.tensor([4, 1, -1]),
                                    actual_seq_len=torch.tensor([2, 4]), cache_mode="PA_BLK_BSND")
    with pytest.raises(ParamInvalidError, match="^cache_index: expected \\[1, >= 3\\] block ids"):
        torch_npu.npu_mla_prolog_v3(x[None], *w[:6], w[6][None], w[7][None], kv_cache, kr_cache,
                                    cache_index=torch.tensor([4, 1]), cache_mode="PA_BLK_BSND")
    with pytest.raises(ParamInvalidError, match="^cache_index: expected 3 block ids"):
        torch_npu.npu_mla_prolog_v3(x, *w, kv_cache, kr_cache, cache_index=torch.tensor([4, 1]),
                                    actual_seq_len=lens, cache_mode="PA_BLK_BSND")


def _assert_codes(name, codes, real):
    """int8 ``codes`` are the round-half-even of the fp64 golden's unrounded ``real`` (up to fp32 error)."""
    assert codes.dtype == torch.int8, name
    err = (codes.double() - real.clamp(-128, 127)).abs().max()
    assert err <= 0.5 + 1e-3, f"{name}: a code is {float(err)} from the golden value"


def _int8_prolog_inputs(t=3, he=32, hcq=16, n=2, d=8, hckv=16, dr=8):
    def i8(*shape, seed):
        return torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8)

    def pos(*shape, seed):
        return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 0.1 + 0.01

    w = (i8(he, hcq, seed=40), i8(hcq, n * (d + dr), seed=41), _r(n, d, hckv, seed=42), i8(he, hckv + dr, seed=43),
         _r(hcq, seed=44), _r(hckv, seed=45), _r(t, dr, seed=46), _r(t, dr, seed=47))
    scales = dict(dequant_scale_x=pos(t, 1, seed=48), dequant_scale_w_dq=pos(1, hcq, seed=49),
                  dequant_scale_w_uq_qr=pos(1, n * (d + dr), seed=50),
                  dequant_scale_w_dkv_kr=pos(1, hckv + dr, seed=51),
                  smooth_scales_cq=pos(1, hcq, seed=52) * 10)
    return i8(t, he, seed=53), w, scales


def test_mla_prolog_v3_int8_weights_cache_and_query():
    x, w, scales = _int8_prolog_inputs()
    qs = torch.tensor([40.0])
    kv_cache, kr_cache = torch.zeros(1, 16, 1, 16, dtype=torch.int8), torch.zeros(1, 16, 1, 8)
    q, qr, scale_q, qn, scale_n = torch_npu.npu_mla_prolog_v3(
        x, *w, kv_cache, kr_cache, cache_index=torch.tensor([4, -1, 9]), quant_scale_ckv=qs, query_norm_flag=True,
        weight_quant_mode=2, kv_cache_quant_mode=1, query_quant_mode=1, **scales)
    g = G.mla_prolog_int8(x, *w, quant_scale_ckv=qs, smooth=scales.pop("smooth_scales_cq"), **scales)
    _assert_codes("query_norm", qn, g["query_norm_real"])
    _assert_codes("query", q, g["query_real"])
    _assert_codes("kv_cache", kv_cache.view(16, 16)[9], g["kv_real"][2])
    assert (kv_cache.view(16, 16)[[0, 1, 2, 3, 5, 6, 7, 8]] == 0).all()  # the -1 token wrote nothing
    for name, a, want in (("dequant_scale_q_norm", scale_n, g["dequant_scale_q_norm"]),
                          ("dequant_scale_q_nope", scale_q, g["dequant_scale_q_nope"]),
                          ("query_rope", qr, g["query_rope"]), ("kr_cache", kr_cache.view(16, 8)[4], g["kr"][0])):
        torch.testing.assert_close(a.double(), want, atol=1e-4, rtol=1e-4, msg=name)
    assert scale_q.shape == (3, 2, 1) and scale_n.shape == (3, 1)


def test_mla_prolog_int8_uq_qr_only_and_v2_modes():
    x8, w8, scales = _int8_prolog_inputs()
    x = _r(*x8.shape, seed=54)
    w = (_r(*w8[0].shape, seed=55), w8[1], w8[2], _r(*w8[3].shape, seed=56), *w8[4:])
    kv_cache, kr_cache = torch.zeros(1, 16, 1, 16), torch.zeros(1, 16, 1, 8)
    q, qr, scale_q, qn, scale_n = torch_npu.npu_mla_prolog_v3(
        x, *w, kv_cache, kr_cache, cache_index=torch.tensor([0, 1, 2]), query_norm_flag=True, weight_quant_mode=1,
        dequant_scale_w_uq_qr=scales["dequant_scale_w_uq_qr"])
    g = G.mla_prolog_int8(x, *w, dequant_scale_w_uq_qr=scales["dequant_scale_w_uq_qr"])
    _assert_codes("query_norm", qn, g["query_norm_real"])
    for name, a, want in (("query", q, g["query"]), ("query_rope", qr, g["query_rope"]),
                          ("kv_cache", kv_cache.view(16, 16)[:3], g["kv"])):
        torch.testing.assert_close(a.double(), want, atol=1e-4, rtol=1e-4, msg=name)
    assert scale_q.numel() == 0
    out = torch_npu.npu_mla_prolog_v2(x8, *w8, torch.tensor([0, 1, 2]), torch.zeros(1, 16, 1, 16, dtype=torch.int8),
                                      torch.zeros(1, 16, 1, 8), quant_scale_ckv=torch.tensor([40.0]), **scales)
    assert out[0].dtype == torch.int8 and out[4].shape == (3, 2, 1)  # "full": int8 cache, quantized query
    with pytest.raises(NotImplementedError, match="^query_quant_mode: "):
        torch_npu.npu_mla_prolog_v3(x, *w, kv_cache, kr_cache, cache_index=torch.tensor([0, 1, 2]),
                                    weight_quant_mode=1, query_quant_mode=1, **scales)
    with pytest.raises(ParamInvalidError, match="^dequant_scale_x: expected None"):
        torch_npu.npu_mla_prolog_v3(x, *w, kv_cache, kr_cache, cache_index=torch.tensor([0, 1, 2]),
                                    weight_quant_mode=1, **scales)



def _positive(*shape, seed):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 40 + 20


def test_mla_prolog_v2_full_mode_reads_the_first_value_of_a_per_channel_shaped_scale():
    """op-plugin's call: W8A8 with an int8 cache and ``quant_scale_ckv [1, Hckv]`` holding a value per channel; the
    per-tensor cache and the query's scale use its first value."""
    x8, w8, scales = _int8_prolog_inputs()
    qs = _positive(1, 16, seed=60)
    kv_cache, kr_cache = torch.zeros(1, 16, 1, 16, dtype=torch.int8), torch.zeros(1, 16, 1, 8)
    q, qr, _, _, scale_q = torch_npu.npu_mla_prolog_v2(x8, *w8, torch.tensor([0, 1, 2]), kv_cache, kr_cache,
                                                       quant_scale_ckv=qs, **scales)
    smooth = scales.pop("smooth_scales_cq")
    g = G.mla_prolog_int8(x8, *w8, quant_scale_ckv=qs, smooth=smooth, **scales)
    _assert_codes("query", q, g["query_real"])
    _assert_codes("kv_cache", kv_cache.view(16, 16)[:3], g["kv_real"])
    for name, a, want in (("dequant_scale_q_nope", scale_q, g["dequant_scale_q_nope"]),
                          ("query_rope", qr, g["query_rope"]), ("kr_cache", kr_cache.view(16, 8)[:3], g["kr"])):
        torch.testing.assert_close(a.double(), want, atol=1e-4, rtol=1e-4, msg=name)


def _partial_quant_inputs():
    x8, w8, scales = _int8_prolog_inputs()
    x = _r(*x8.shape, seed=54)
    w = (_r(*w8[0].shape, seed=55), w8[1], w8[2], _r(*w8[3].shape, seed=56), *w8[4:])
    return x, w, {k: scales[k] for k in ("dequant_scale_w_uq_qr", "smooth_scales_cq")}


def test_mla_prolog_v2_partial_mode_quantizes_both_caches_per_channel():
    """int8 ``weight_uq_qr`` with int8 caches: ``quant_scale_ckv [1, Hckv]`` and ``quant_scale_ckr [1, Dr]`` scale each
    channel; the query stays unquantized (``dequant_scale_q_nope [1]``)."""
    x, w, scales = _partial_quant_inputs()
    qs, qr_scale = _positive(1, 16, seed=61), _positive(1, 8, seed=62)
    kv_cache, kr_cache = torch.zeros(1, 16, 1, 16, dtype=torch.int8), torch.zeros(1, 16, 1, 8, dtype=torch.int8)
    q, qr, _, _, scale_q = torch_npu.npu_mla_prolog_v2(x, *w, torch.tensor([5, 1, 2]), kv_cache, kr_cache,
                                                       quant_scale_ckv=qs, quant_scale_ckr=qr_scale, **scales)
    g = G.mla_prolog_int8(x, *w, dequant_scale_w_uq_qr=scales["dequant_scale_w_uq_qr"],
                          smooth=scales["smooth_scales_cq"], quant_scale_ckv=qs, quant_scale_ckr=qr_scale,
                          per_channel_cache=True)
    _assert_codes("kv_cache", kv_cache.view(16, 16)[[5, 1, 2]], g["kv_real"])
    _assert_codes("kr_cache", kr_cache.view(16, 8)[[5, 1, 2]], g["kr_real"])
    assert q.dtype == torch.float32 and scale_q.shape == (1,)
    for name, a, want in (("query", q, g["query"]), ("query_rope", qr, g["query_rope"])):
        torch.testing.assert_close(a.double(), want, atol=1e-4, rtol=1e-4, msg=name)


def test_mla_prolog_cache_scale_shapes_raise_by_name():
    x, w, scales = _partial_quant_inputs()
    kv8, kr8, kr = (torch.zeros(1, 16, 1, 16, dtype=torch.int8), torch.zeros(1, 16, 1, 8, dtype=torch.int8),
                    torch.zeros(1, 16, 1, 8))
    index = torch.tensor([0, 1, 2])
    with pytest.raises(ParamInvalidError, match=r"^quant_scale_ckv: expected shape \[1, 16\]"):
        torch_npu.npu_mla_prolog_v2(x, *w, index, kv8, kr, quant_scale_ckv=torch.tensor([40.0]), **scales)
    with pytest.raises(ParamNullptrError, match=r"^quant_scale_ckr: expected a tensor"):
        torch_npu.npu_mla_prolog_v2(x, *w, index, kv8, kr8, quant_scale_ckv=_positive(1, 16, seed=63), **scales)
    with pytest.raises(ParamInvalidError, match="^kr_cache: expected a floating-point cache"):
        torch_npu.npu_mla_prolog_v3(x, *w, torch.zeros(1, 16, 1, 16), kr8, cache_index=index, weight_quant_mode=1,
                                    **scales)
    with pytest.raises(ParamInvalidError, match=r"^quant_scale_ckv: expected shape \[1\]"):  # W8A8 only
        torch_npu.npu_mla_prolog_v3(x, *w, kv8, kr, cache_index=index, weight_quant_mode=1, kv_cache_quant_mode=1,
                                    query_quant_mode=1, quant_scale_ckv=_positive(1, 16, seed=64), **scales)

def test_kv_quant_sparse_attention_matches_golden_on_dequantized_rows():
    q = _r(1, 3, 2, 576, seed=20, dtype=torch.bfloat16)
    nope, rope = _r(1, 5, 1, 512, seed=21), _r(1, 5, 1, 64, seed=22, dtype=torch.bfloat16)
    packed = quantize(nope, rope)
    assert packed.shape == (1, 5, 1, 656) and packed.dtype == torch.int8
    idx = torch.tensor([[[[2, 0, -1]], [[3, 1, 0]], [[4, 2, 1]]]], dtype=torch.int32)
    out = torch_npu.npu_kv_quant_sparse_flash_attention(q, packed, packed, idx, 0.05, 2, 2, attention_mode=2)
    assert out.shape == (1, 3, 2, 512) and out.dtype == torch.bfloat16
    k_nope, k_rope = dequantize(packed[0, :, 0], torch.bfloat16)
    k_nope = k_nope.to(torch.bfloat16)
    rows = idx[0, :, 0].tolist()
    g = G.sparse_flash_attention(q[0, :, :, :512], k_nope, k_nope, rows, 0.05, q_rope=q[0, :, :, 512:],
                                 k_rope=k_rope)[0]
    base = G.sparse_flash_attention(q[0, :, :, :512], k_nope, k_nope, rows, 0.05, q_rope=q[0, :, :, 512:],
                                    k_rope=k_rope, dtype=torch.bfloat16)[0]
    assert_close_to_golden("out", out[0], g, base, reduction=sfa_reductions([3], 2, 512, 64, idx.shape[-1])["out"])



def _hifloat8_cache(tokens, seed):
    """Packed rows with HiFloat8 codes (uint8), and their nope values from the paper's formula ``[S, 512]``."""
    nope, rope = _r(tokens, 512, seed=seed), _r(tokens, 64, seed=seed + 1, dtype=torch.bfloat16)
    scales = nope.view(tokens, 4, 128).abs().amax(-1) / 8
    codes = hifloat8.encode(nope.view(tokens, 4, 128) / scales[..., None]).view(tokens, 512)
    values = torch.tensor([G8.value(c) for c in range(256)], dtype=torch.float64)[codes.long()]
    nope_values = (values.view(tokens, 4, 128) * scales[..., None].double()).view(tokens, 512)
    return pack_rows(codes, rope, scales), nope_values, rope


def test_kv_quant_sparse_attention_reads_a_hifloat8_cache():
    q = _r(1, 3, 2, 576, seed=30, dtype=torch.bfloat16)
    packed, k_nope, k_rope = _hifloat8_cache(5, seed=31)
    rows = [[2, 0], [3, 1, 0], [4, 2, 1]]
    idx = torch.full((1, 3, 1, 2048), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        idx[0, i, 0, :len(r)] = torch.tensor(r)
    out = torch_npu.npu_kv_quant_sparse_flash_attention(q, packed[None, :, None], packed[None, :, None], idx, 0.05,
                                                        2, 2, attention_mode=2, key_dtype=torch_npu.hifloat8,
                                                        value_dtype=torch_npu.hifloat8)
    assert out.shape == (1, 3, 2, 512) and out.dtype == torch.bfloat16
    k = k_nope.to(torch.bfloat16)  # the nope values in the query's dtype, as Huawei's golden rounds them
    g = G.sparse_flash_attention(q[0, :, :, :512], k, k, rows, 0.05, q_rope=q[0, :, :, 512:], k_rope=k_rope)[0]
    base = G.sparse_flash_attention(q[0, :, :, :512], k, k, rows, 0.05, q_rope=q[0, :, :, 512:], k_rope=k_rope,
                                    dtype=torch.bfloat16)[0]
    assert_close_to_golden("out", out[0], g, base,
                           reduction=sfa_reductions([3], 2, 512, 64, max(len(r) for r in rows))["out"])
    as_int8 = torch_npu.npu_kv_quant_sparse_flash_attention(q, packed.view(torch.int8)[None, :, None],
                                                            packed.view(torch.int8)[None, :, None], idx, 0.05, 2, 2,
                                                            attention_mode=2, key_dtype=torch_npu.hifloat8)
    assert torch.equal(as_int8, out)


def test_kv_quant_sparse_attention_dtype_arguments_raise_by_name():
    q = _r(1, 1, 2, 576, dtype=torch.bfloat16)
    packed = _hifloat8_cache(2, seed=32)[0][None, :, None]
    idx = torch.full((1, 1, 1, 2048), -1, dtype=torch.int32)
    idx[0, 0, 0, 0] = 1

    def run(key=packed, indices=idx, **kw):
        return torch_npu.npu_kv_quant_sparse_flash_attention(q, key, key, indices, 0.05, 2, 2, attention_mode=2, **kw)

    with pytest.raises(ParamDtypeError, match="^key_dtype: expected None or torch_npu.hifloat8"):
        run(key_dtype=torch.float8_e4m3fn)
    with pytest.raises(ParamDtypeError, match="^value_dtype: expected None unless key_dtype"):
        run(value_dtype=torch_npu.hifloat8)
    with pytest.raises(ParamInvalidError, match="^sparse_indices: expected last dim 2048"):
        run(indices=idx[..., :16].contiguous(), key_dtype=torch_npu.hifloat8)
    with pytest.raises(ParamDtypeError, match="^key: "):
        run(key=packed.view(torch.float8_e4m3fn), key_dtype=torch_npu.hifloat8)
    with pytest.raises(ParamDtypeError, match="^key: "):  # uint8 bytes without key_dtype: not int8 / fp8 codes
        run()

def test_quantize_round_trip_is_within_a_tile_step():
    nope = _r(4, 512, seed=23)
    back, _ = dequantize(quantize(nope, _r(4, 64, seed=24, dtype=torch.float16)), torch.float16)
    step = nope.view(4, 4, 128).abs().amax(-1) / 127
    assert ((back - nope).view(4, 4, 128).abs() <= step[..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize("call,match", [
    (lambda: torch_npu.npu_sparse_flash_attention(_r(1, 2, 2, 512), _r(1, 2, 1, 512), _r(1, 2, 1, 512),
                                                  torch.zeros(1, 2, 1, 2, dtype=torch.int32), 0.1), "attention_mode"),
    (lambda: torch_npu.npu_sparse_flash_attention(_r(1, 2, 2, 64), _r(1, 2, 1, 64), _r(1, 2, 1, 64),
                                                  torch.zeros(1, 2, 1, 2, dtype=torch.int32), 0.1, attention_mode=2),
     "head dim 512"),
    (lambda: torch_npu.npu_lightning_indexer(_r(1, 2, 2, 128), _r(1, 2, 1, 128), _r(1, 2, 2), sparse_count=2049),
     "sparse_count"),
    (lambda: torch_npu.npu_lightning_indexer(_r(1, 2, 2, 128), _r(1, 2, 1, 128), _r(1, 2, 2), sparse_mode=1),
     "sparse_mode"),
    (lambda: torch_npu.npu_lightning_indexer(_r(1, 2, 2, 128), _r(1, 2, 1, 128), _r(1, 2, 2), pre_tokens=5),
     "pre_tokens"),
    (lambda: torch_npu.npu_lightning_indexer(_r(2, 2, 128), _r(2, 1, 128), _r(2, 2), layout_query="TND",
                                             layout_key="TND"), "actual_seq_lengths_query"),
    (lambda: torch_npu.npu_lightning_indexer(_r(1, 2, 2, 128), _r(1, 2, 2, 128), _r(1, 2, 2)), "N2 = 1"),
    (lambda: torch_npu.npu_lightning_indexer(_r(1, 2, 2, 128), _r(4, 16, 1, 128), _r(1, 2, 2),
                                             layout_key="PA_BSND", block_table=torch.zeros(1, 1, dtype=torch.int32),
                                             actual_seq_lengths_key=torch.tensor([2], dtype=torch.int32),
                                             return_value=True), "return_value"),
])
def test_npu_limits_raise_named_errors(call, match):
    with pytest.raises(ParamInvalidError, match=match):
        call()


def test_unrequested_outputs_are_empty():
    q, kv = _r(1, 2, 2, 512), _r(1, 2, 1, 512)
    qr, kr = _r(1, 2, 2, 64), _r(1, 2, 1, 64)
    idx = torch.tensor([[[[0, -1]], [[1, 0]]]], dtype=torch.int32)
    out, m, l = torch_npu.npu_sparse_flash_attention(q, kv, kv, idx, 0.1, query_rope=qr, key_rope=kr,
                                                     attention_mode=2)
    assert out.shape == q.shape and m.shape == (0,) and l.shape == (0,)
    _, m, l = torch_npu.npu_sparse_flash_attention(q, kv, kv, idx, 0.1, query_rope=qr, key_rope=kr,
                                                   attention_mode=2, return_softmax_lse=True)
    assert m.shape == (1, 1, 2, 2) and m.dtype == torch.float32
    idx_out, values = torch_npu.npu_lightning_indexer(_r(1, 2, 2, 128), _r(1, 2, 1, 128), _r(1, 2, 2),
                                                      sparse_count=4)
    assert idx_out.shape == (1, 2, 1, 4) and values.shape == (0,)
    assert idx_out[0, 0, 0].tolist() == [0, -1, -1, -1]


def test_kv_cache_unvalidated_positions_past_the_cache_write_nothing(monkeypatch):
    """``ATTNOPS_VALIDATE=0``: a slot or Norm position outside the cache (or below -1) is dropped, not clamped."""
    monkeypatch.setenv("ATTNOPS_VALIDATE", "0")
    kv, gamma, cos, sin, y, k = _kv_inputs(b=2, s=2)
    k_cache, ckv_cache = torch.zeros(2, 1, 5, 64), torch.zeros(2, 1, 5, 512)
    torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, torch.tensor([[4, -3], [5, 1]]), k_cache, ckv_cache)
    for cache, rows in ((k_cache, k), (ckv_cache, y)):
        want = torch.zeros_like(cache)
        want[0, 0, 4], want[1, 0, 1] = rows[0, 0, 0], rows[1, 0, 1]
        torch.testing.assert_close(cache, want, atol=1e-5, rtol=1e-5)
    paged = torch.zeros(1, 16, 1, 64), torch.zeros(1, 16, 1, 512)
    torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, torch.tensor([3, 16, -2, 1]), *paged, cache_mode="PA")
    assert (paged[0].abs().sum(-1) > 0).flatten().nonzero().flatten().tolist() == [1, 3]
