"""FIA over NZ paged caches ``[blocknum, KV_N, D/x, blocksize, x]`` (x = 16 fp16/bf16, 32 int8): element
``(n, t, d)`` of a block at ``[n, d // x, t, d % x]``, through the aclnn and Pythonic entries, against the fp64 golden;
and :class:`PagedKVCache` handing out that layout."""
from __future__ import annotations

import pytest
import torch

from attnops import torch_npu
from attnops.ops.fused_infer_attention import PagedKVCache
from attnops.testing.compare import assert_close_to_golden, fia_reduction
from tests.helpers import randn
from tests.ops.fused_infer_attention.fia_helpers import check_fia, golden, randint8, run_api, to_paged

F16, BF16 = torch.float16, torch.bfloat16
VIA = ["aclnn", "api"]
N, NKV = 4, 2


def nz(cache: torch.Tensor) -> torch.Tensor:
    """``(blocknum, KV_N, blocksize, D)`` -> NZ ``(blocknum, KV_N, D/x, blocksize, x)``."""
    x = 32 // cache.dtype.itemsize
    return cache.unflatten(-1, (-1, x)).permute(0, 1, 3, 2, 4).contiguous()


def _caches(lens, bs, dk, dv, *, int8=False, dtype=F16):
    make = (lambda d, seed: randint8(2, NKV, max(lens), d, seed=seed)) if int8 else (
        lambda d, seed: randn(2, NKV, max(lens), d, dtype=dtype, seed=seed))
    kc, bt = to_paged(make(dk, 2), lens, bs, cache_layout="BNSD", seed=4)
    vc, _ = to_paged(make(dv, 3), lens, bs, cache_layout="BNSD", seed=4)
    return nz(kc), nz(vc), bt


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
@pytest.mark.parametrize("sq,bs,lens", [(1, 16, [40, 7]), (20, 128, [200, 130])])
@pytest.mark.parametrize("dk,dv", [(32, 32), (48, 32)])
def test_fp16(via, layout, sq, bs, lens, dk, dv):
    kc, vc, bt = _caches(lens, bs, dk, dv)
    q = randn(2, sq, N, dk, dtype=F16, seed=1)
    q = q.flatten(2) if layout == "BSH" else q.transpose(1, 2).contiguous()
    check_fia(q, kc, vc, via=via, block_table=bt, block_size=bs, actual_seq_lengths_kv=lens, num_heads=N,
              num_key_value_heads=NKV, scale_value=0.25, input_layout=layout, softmax_lse_flag=True)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("mode", [0, 5])
def test_int8_antiquant(via, mode):
    bs, lens, d = 32, [70, 33], 64
    kc, vc, bt = _caches(lens, bs, d, d, int8=True)
    q = randn(2, N, 1, d, dtype=BF16, seed=1)
    g = torch.Generator().manual_seed(6)
    shape = (1, NKV, 1, d) if mode == 0 else (kc.shape[0], NKV, bs)
    ks, vs = (torch.rand(*shape, generator=g) * 0.02 + 0.005 for _ in range(2))
    if mode == 0:
        ks, vs = ks.to(BF16), vs.to(BF16)
    check_fia(q, kc, vc, via=via, key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_mode=mode,
              value_antiquant_mode=mode, block_table=bt, block_size=bs, actual_seq_lengths_kv=lens, num_heads=N,
              num_key_value_heads=NKV, scale_value=0.25, input_layout="BNSD", softmax_lse_flag=True)


def test_bad_nz_shapes_name_the_cache():
    kc, vc, bt = _caches([40, 7], 16, 32, 32)
    q = randn(2, N, 1, 32, dtype=F16, seed=1)
    kw = dict(block_table=bt, block_size=16, actual_seq_lengths_kv=[40, 7], num_heads=N, num_key_value_heads=NKV,
              input_layout="BNSD")
    with pytest.raises(ValueError, match="key: expected an NZ"):
        run_api(q, kc[..., :8], vc[..., :8], **kw)  # x = 8: not 32 bytes of fp16
    with pytest.raises(ValueError, match="key: expected an NZ"):
        run_api(q, kc[:, :1], vc[:, :1], **kw)  # KV_N 1, num_key_value_heads 2
    with pytest.raises(ValueError, match="key: expected an NZ"):
        run_api(q, kc[:, :, :1], vc, **kw)  # D = 16, the query's is 32
    with pytest.raises(ValueError, match="value"):
        run_api(q, kc, vc[:, :, :, :8], **kw)  # block size differs from the key's


@pytest.mark.parametrize("dtype,quant", [(F16, None), (torch.float32, None), (F16, "int8")])
def test_paged_kv_cache_nz_round_trip(dtype, quant):
    lens = [40, 7]
    kw = dict(num_kv_heads=NKV, head_dim=64, value_head_dim=32, dtype=dtype, quant=quant)
    caches = {layout: PagedKVCache(16, 16, layout=layout, **kw) for layout in ("NZ", "BnNBsD")}
    for cache in caches.values():
        seqs = [cache.new_sequence() for _ in lens]
        for i, (s, n) in enumerate(zip(seqs, lens)):
            cache.append(s, randn(n, NKV, 64, dtype=dtype, seed=i), randn(n, NKV, 32, dtype=dtype, seed=5 + i))
    z, ref = caches["NZ"], caches["BnNBsD"]
    x = 32 // z.key_cache.dtype.itemsize
    assert z.key_cache.shape == (16, NKV, 64 // x, 16, x) and z.value_cache.shape == (16, NKV, 32 // x, 16, x)
    for c, r in ((z.key_cache, ref.key_cache), (z.value_cache, ref.value_cache)):
        assert torch.equal(c.permute(0, 1, 3, 2, 4).flatten(-2), r)  # (n, t, d) at [n, d // x, t, d % x]
    q = randn(2, N, 1, 64, dtype=dtype, seed=9)
    out_z, out_r = (run_api(q, c.key_cache, c.value_cache, num_heads=N, num_key_value_heads=NKV, input_layout="BNSD",
                            scale_value=0.125, **c.attention_kwargs())[0] for c in (z, ref))
    assert out_z.shape == (2, N, 1, 32) and torch.equal(out_z, out_r)


@pytest.mark.parametrize("sq", [1, 6])
def test_torch_npu(sq):
    lens, bs = [40, 7], 16
    kc, vc, bt = _caches(lens, bs, 48, 32)
    q = randn(2, sq, N, 48, dtype=F16, seed=1).flatten(2)
    kw = dict(block_table=bt, block_size=bs, actual_seq_lengths_kv=lens, num_heads=N, num_key_value_heads=NKV,
              input_layout="BSH", softmax_lse_flag=True)
    out, lse = torch_npu.npu_fused_infer_attention_score(q, kc, vc, scale=0.25, **kw)
    g, base = (golden(q, kc, vc, dtype=dt, scale_value=0.25, **kw) for dt in (torch.float64, F16))
    assert out.shape == (2, sq, N * 32)
    red = fia_reduction(q, kc, **kw)
    assert_close_to_golden("attention_out", out, g.out, base.out, reduction=red)
    assert_close_to_golden("softmax_lse", lse, g.lse, base.lse, reduction=red)
