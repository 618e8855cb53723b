"""attnops.PagedKVCache: appended tokens round-trip through the block table (both layouts, chunked appends across
block boundaries), blocks are freed and reused, quantized caches store ``round(x / s)`` with ``s = max|x| / qmax``
per token and head, and attention through ``attention_kwargs`` equals attention on the contiguous (dequantized)
tokens and the fp64 golden."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops import ParamInvalidError
from attnops.testing.golden_fia import unpack_int4
from tests.helpers import randn
from tests.ops.fused_infer_attention.fia_helpers import check_fia, golden

F16 = torch.float16
LAYOUTS = ["BnNBsD", "BnBsH"]


def gather(cache: attnops.PagedKVCache, which: str, seq_index: int) -> torch.Tensor:
    """Tokens [T, N2, D] of a sequence read back through block_table (independent of the cache's code)."""
    c = cache.key_cache if which == "key" else cache.value_cache
    table = cache.block_table()[seq_index]
    n = cache.seq_lens()[seq_index]
    bs = cache.block_size
    rows = []
    for t in range(n):
        blk, off = int(table[t // bs]), t % bs
        x = c[blk, :, off] if c.dim() == 4 else c[blk, off].reshape(cache.num_kv_heads, -1)
        rows.append(x)
    x = torch.stack(rows) if rows else c.new_zeros(0, cache.num_kv_heads, c.shape[-1])
    if x.dtype == torch.int32:
        x = unpack_int4(x)
    return x


def scales(cache, which, seq_index):
    s = cache.key_scale if which == "key" else cache.value_scale
    table = cache.block_table()[seq_index]
    bs = cache.block_size
    return torch.stack([s[int(table[t // bs]), :, t % bs] for t in range(cache.seq_lens()[seq_index])])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_append_round_trip_and_block_table(layout):
    cache = attnops.PagedKVCache(12, 16, num_kv_heads=2, head_dim=16, dtype=F16, layout=layout)
    s0, s1 = cache.new_sequence(), cache.new_sequence()
    k0, v0 = randn(40, 2, 16, dtype=F16, seed=1), randn(40, 2, 16, dtype=F16, seed=2)
    k1, v1 = randn(7, 2, 16, dtype=F16, seed=3), randn(7, 2, 16, dtype=F16, seed=4)
    cache.append(s0, k0[:10], v0[:10])  # chunks crossing block boundaries, interleaved sequences
    cache.append(s1, k1, v1)
    cache.append(s0, k0[10:33], v0[10:33])
    cache.append(s0, k0[33:], v0[33:])
    assert cache.seq_lens() == [40, 7]
    bt = cache.block_table()
    assert bt.dtype == torch.int32 and bt.shape == (2, 3)
    assert int(bt[1, 1]) == -1 and int(bt[1, 2]) == -1
    used = [int(x) for x in bt.flatten() if int(x) >= 0]
    assert len(used) == len(set(used)) == 4 and cache.num_free_blocks == 8
    torch.testing.assert_close(gather(cache, "key", 0), k0, rtol=0, atol=0)
    torch.testing.assert_close(gather(cache, "value", 0), v0, rtol=0, atol=0)
    torch.testing.assert_close(gather(cache, "key", 1), k1, rtol=0, atol=0)
    torch.testing.assert_close(gather(cache, "value", 1), v1, rtol=0, atol=0)
    expected_shape = (12, 2, 16, 16) if layout == "BnNBsD" else (12, 16, 32)
    assert tuple(cache.key_cache.shape) == expected_shape


def test_free_and_reuse():
    cache = attnops.PagedKVCache(4, 16, num_kv_heads=1, head_dim=16, dtype=F16)
    a, b = cache.new_sequence(), cache.new_sequence()
    cache.append(a, randn(40, 1, 16, dtype=F16), randn(40, 1, 16, dtype=F16))
    assert cache.num_free_blocks == 1
    with pytest.raises(ParamInvalidError) as info:
        cache.append(b, randn(20, 1, 16, dtype=F16), randn(20, 1, 16, dtype=F16))  # needs 2 blocks, 1 free
    assert str(info.value).startswith("key")
    cache.free(a)
    assert cache.num_free_blocks == 4
    kb = randn(20, 1, 16, dtype=F16, seed=5)
    cache.append(b, kb, kb)
    assert cache.seq_lens([b]) == [20]
    torch.testing.assert_close(gather(cache, "key", 0), kb, rtol=0, atol=0)
    with pytest.raises(ParamInvalidError) as info:
        cache.append(a, kb, kb)  # freed sequence
    assert str(info.value).startswith("seq")


def test_append_validates_shapes():
    cache = attnops.PagedKVCache(4, 16, num_kv_heads=2, head_dim=16, dtype=F16)
    s = cache.new_sequence()
    with pytest.raises(ParamInvalidError):
        cache.append(s, randn(3, 1, 16, dtype=F16), randn(3, 1, 16, dtype=F16))
    with pytest.raises(ParamInvalidError):
        cache.append(s, randn(3, 2, 16, dtype=F16), randn(4, 2, 16, dtype=F16))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sq", [1, 3])
def test_attention_through_cache_equals_contiguous(layout, sq):
    n, nkv, d, bs = 4, 2, 16, 16 if sq == 1 else 128
    cache = attnops.PagedKVCache(8, bs, num_kv_heads=nkv, head_dim=d, dtype=F16, layout=layout)
    lens = [150, 37] if sq > 1 else [40, 7]
    ks = [randn(t, nkv, d, dtype=F16, seed=10 + i) for i, t in enumerate(lens)]
    vs = [randn(t, nkv, d, dtype=F16, seed=20 + i) for i, t in enumerate(lens)]
    seqs = [cache.new_sequence() for _ in lens]
    for s, k, v in zip(seqs, ks, vs):
        cache.append(s, k, v)
    q = randn(2, n, sq, d, dtype=F16, seed=30)
    kw = cache.attention_kwargs(seqs)
    assert kw["actual_seq_lengths_kv"] == lens and kw["block_size"] == bs
    out, lse = attnops.fused_infer_attention(q, cache.key_cache, cache.value_cache, num_heads=n,
                                             num_key_value_heads=nkv, scale=0.25, return_lse=True, **kw)
    # contiguous: [B, N2, S, D] padded, with actual lengths
    smax = max(lens)
    kd = torch.zeros(2, nkv, smax, d, dtype=F16)
    vd = torch.zeros(2, nkv, smax, d, dtype=F16)
    for b in range(2):
        kd[b, :, :lens[b]] = ks[b].transpose(0, 1)
        vd[b, :, :lens[b]] = vs[b].transpose(0, 1)
    ref, ref_lse = attnops.fused_infer_attention(q, kd, vd, num_heads=n, num_key_value_heads=nkv, scale=0.25,
                                                 actual_seq_lengths_kv=lens, return_lse=True)
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    # and the aclnn operator vs the fp64 golden on the cache itself
    check_fia(q, cache.key_cache, cache.value_cache, num_heads=n, num_key_value_heads=nkv, scale_value=0.25,
              input_layout="BNSD", softmax_lse_flag=True, **kw)


@pytest.mark.parametrize("quant,qmax", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantized_cache_stores_per_token_head_scales(quant, qmax, layout):
    nkv, d = 2, 64
    cache = attnops.PagedKVCache(6, 16, num_kv_heads=nkv, head_dim=d, dtype=F16, layout=layout, quant=quant)
    s = cache.new_sequence()
    k = randn(37, nkv, d, dtype=torch.float32, seed=1)
    v = randn(37, nkv, d, dtype=torch.float32, seed=2)
    k[5, 1] = 0  # an all-zero token/head: scale stays finite
    cache.append(s, k[:20], v[:20])
    cache.append(s, k[20:], v[20:])
    assert cache.key_cache.dtype == (torch.int8 if quant == "int8" else torch.int32)
    for which, x in (("key", k), ("value", v)):
        xq = gather(cache, which, 0).to(torch.float64)
        sc = scales(cache, which, 0).to(torch.float64)  # [T, N2]
        assert bool(torch.isfinite(sc).all()) and bool((sc > 0).all())
        expect_s = x.abs().amax(-1).double() / qmax
        nz = expect_s > 0
        torch.testing.assert_close(sc[nz], expect_s[nz], rtol=1e-6, atol=0)
        assert int(xq.abs().max()) <= qmax
        assert float((xq - x.double() / sc[..., None]).abs().max()) <= 0.5 + 1e-5  # round(x / s)
        assert float((xq * sc[..., None] - x.double()).abs().max()) <= float(sc.max()) / 2 + 1e-6


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_quantized_cache_attention_vs_golden(quant, dtype):
    """attention_kwargs of a quantized cache (page-managed per-token+head scales, mode 5) vs the fp64 golden."""
    n, nkv, d = 4, 2, 64
    cache = attnops.PagedKVCache(8, 16, num_kv_heads=nkv, head_dim=d, dtype=dtype, quant=quant)
    seqs = [cache.new_sequence() for _ in range(2)]
    for i, (s, t) in enumerate(zip(seqs, (33, 9))):
        cache.append(s, randn(t, nkv, d, seed=i), randn(t, nkv, d, seed=10 + i))
    q = randn(2, n, 1, d, dtype=dtype, seed=5)
    kw = cache.attention_kwargs(seqs)
    assert kw["key_antiquant_mode"] == 5 and kw["value_antiquant_mode"] == 5
    out, lse = attnops.fused_infer_attention(q, cache.key_cache, cache.value_cache, num_heads=n,
                                             num_key_value_heads=nkv, scale=0.125, return_lse=True, **kw)
    g = golden(q, cache.key_cache, cache.value_cache, num_heads=n, num_key_value_heads=nkv, scale_value=0.125,
               input_layout="BNSD", softmax_lse_flag=True, **kw)
    base = golden(q, cache.key_cache, cache.value_cache, dtype=dtype, num_heads=n, num_key_value_heads=nkv,
                  scale_value=0.125, input_layout="BNSD", softmax_lse_flag=True, **kw)
    from attnops.testing.compare import assert_close_to_golden, fia_reduction
    assert out.dtype == dtype
    red = fia_reduction(q, cache.key_cache, num_heads=n, input_layout="BNSD", **kw)
    assert_close_to_golden("out", out, g.out, base.out, reduction=red)
    assert_close_to_golden("lse", lse, g.lse, base.lse, reduction=red)


def test_cache_is_exported():
    assert "PagedKVCache" in attnops.__all__ and "fused_infer_attention" in attnops.__all__
