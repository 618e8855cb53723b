"""attnops.nn.NativeSparseAttention: prefix invariance, batched == packed, chunked decoding with NSACache == full
forward (prefill then token by token, chunks, both compressions, GQA, no window), the cache's contents and growth,
the cached path never recomputes the layer, gradients reach every parameter."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.nn import NativeSparseAttention

HIDDEN = 16


def _module(compress="weighted"):
    torch.manual_seed(0)
    return NativeSparseAttention(HIDDEN, 4, 2, 8, compress_block_size=8, compress_stride=4, select_block_size=8,
                                 select_block_count=3, window_size=6, compress=compress).double()


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("compress", ["weighted", "mean"])
def test_prefix_invariance_odd_length(compress):
    m = _module(compress)
    x = _x(1, 137, HIDDEN)
    torch.testing.assert_close(m(x[:, :100]), m(x)[:, :100], rtol=1e-10, atol=1e-12)


def test_batched_equals_packed():
    m = _module()
    x = _x(2, 37, HIDDEN)
    packed = m(x.flatten(0, 1), cu_seqlens=torch.tensor([0, 37, 74]))
    torch.testing.assert_close(m(x).flatten(0, 1), packed, rtol=1e-12, atol=1e-12)
    # packed sequences of different lengths: each as if alone
    ragged = m(x.flatten(0, 1)[:50], cu_seqlens=torch.tensor([0, 37, 50]))
    torch.testing.assert_close(ragged[37:], m(x[1:, :13])[0], rtol=1e-12, atol=1e-12)


def test_chunked_decoding_with_cache_equals_full_forward():
    m = _module()
    x = _x(2, 45, HIDDEN)
    cache = m.new_cache(2, max_seq_len=45)
    assert isinstance(cache, attnops.nn.NSACache)
    with pytest.raises(attnops.ParamInvalidError, match="cache: expected calls under torch.no_grad"):
        m(x[:, :3], cache=cache)
    assert cache.seq_len == 0
    with torch.inference_mode():
        chunks = [m(x[:, a:b], cache=cache) for a, b in ((0, 17), (17, 18), (18, 40), (40, 45))]
        torch.testing.assert_close(torch.cat(chunks, 1), m(x), rtol=1e-10, atol=1e-12)
        assert cache.seq_len == 45
        with pytest.raises(attnops.ParamInvalidError, match="max_seq_len"):
            m(x[:, :1], cache=cache)


def test_gradients_reach_every_parameter():
    m = _module()
    m(_x(2, 41, HIDDEN)).square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def _decoder(compress="weighted", n1=4, n2=2, window=16, dtype=torch.float64):
    """compress 8 / stride 4, selection 16 x 4, window 16; non-mean compression weights."""
    torch.manual_seed(0)
    m = NativeSparseAttention(HIDDEN, n1, n2, 8, compress_block_size=8, compress_stride=4, select_block_size=16,
                              select_block_count=4, window_size=window, compress=compress).to(dtype)
    if compress == "weighted":
        with torch.no_grad():
            m.compress_weight_k.copy_(_x(8, n2, seed=5))
            m.compress_weight_v.copy_(_x(8, n2, seed=6))
    return m


def _decode(m, x, prefill, cache=None):
    """Prefill ``x[:, :prefill]`` then one token per call, under no_grad."""
    cache = cache or m.new_cache(x.shape[0])
    with torch.no_grad():
        outs = [m(x[:, :prefill], cache=cache)]
        outs += [m(x[:, i:i + 1], cache=cache) for i in range(prefill, x.shape[1])]
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("compress", ["weighted", "mean"])
@pytest.mark.parametrize("prefill", [1, 7, 37])
def test_prefill_then_token_by_token_equals_full_forward(compress, prefill):
    m = _decoder(compress)
    x = _x(2, 70, HIDDEN)
    got, cache = _decode(m, x, prefill)
    with torch.no_grad():
        torch.testing.assert_close(got, m(x), rtol=1e-10, atol=1e-12)
    assert cache.seq_len == 70 and cache.lengths.tolist() == [70, 70]


@pytest.mark.parametrize("n1, n2, window", [(4, 1, 16), (2, 2, 0), (4, 4, 5)])
def test_decoding_gqa_and_windows(n1, n2, window):
    m = _decoder(n1=n1, n2=n2, window=window)
    x = _x(3, 41, HIDDEN, seed=2)
    got, _ = _decode(m, x, 3)
    with torch.no_grad():
        torch.testing.assert_close(got, m(x), rtol=1e-10, atol=1e-12)


def test_decoding_float32():
    m = _decoder(dtype=torch.float32)
    x = _x(2, 70, HIDDEN).float()
    got, _ = _decode(m, x, 20)
    with torch.no_grad():
        torch.testing.assert_close(got, m(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [1, 9, 16, 33])
def test_two_chunk_prefill_equals_one_chunk(split):
    m = _decoder()
    x = _x(2, 70, HIDDEN, seed=3)
    with torch.no_grad():
        one = m(x, cache=m.new_cache(2))
        cache = m.new_cache(2)
        two = torch.cat([m(x[:, :split], cache=cache), m(x[:, split:], cache=cache)], 1)
    torch.testing.assert_close(two, one, rtol=1e-10, atol=1e-12)


def test_cache_holds_rotated_keys_values_and_compressed_blocks():
    m = _decoder()
    x = _x(2, 37, HIDDEN, seed=4)
    _, cache = _decode(m, x, 5)
    with torch.no_grad():
        pos = torch.arange(37).repeat(2)
        _, k, v, _ = (y.unflatten(0, (2, 37)) for y in m._project(x.flatten(0, 1), pos))
        keys, values = cache.rows(0, 37)
        torch.testing.assert_close(keys, k, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(values, v, rtol=1e-12, atol=1e-12)
        assert cache.compressed_len == (37 - 8) // 4 + 1
        for store, w, full in ((cache.compressed_keys, m.compress_weight_k, k),
                               (cache.compressed_values, m.compress_weight_v, v)):
            want = attnops.nsa_compress(full.flatten(0, 1), w, block_size=8, stride=4, actual_seq_len=[37, 74])
            torch.testing.assert_close(store[:, :cache.compressed_len].flatten(0, 1), want, rtol=1e-12, atol=1e-12)


def test_cache_grows_by_pages_and_preallocates_with_max_seq_len():
    m = _decoder()
    x = _x(2, 70, HIDDEN, seed=5)
    _, grown = _decode(m, x, 1)
    assert grown.block_table.shape == (2, 8)  # 70 tokens in pages of 16, doubling: 1, 2, 4, 8 pages
    assert grown.key_pages.shape[1:] == (16, 2, 8) and grown.block_table.unique().numel() == grown.key_pages.shape[0]
    cache = m.new_cache(2, max_seq_len=70, page_size=8)
    with torch.no_grad():
        m(x[:, :10], cache=cache)
        pages, cmp = cache.key_pages.data_ptr(), cache.compressed_keys.data_ptr()
        # 9 pages of 8 tokens; the compressed rows a decoding step attends: 5 selection blocks of 16 over the 72
        # tokens, 4 compressed rows (stride 4) each
        assert cache.key_pages.shape[0] == 2 * 9 and cache.compressed_keys.shape[1] == cache.compressed_rows() == 20
        _decode(m, x[:, 10:], 1, cache)
    assert cache.key_pages.data_ptr() == pages and cache.compressed_keys.data_ptr() == cmp
    assert cache.nbytes() > 0 and "seq_len=70" in repr(cache)


def test_cached_steps_do_not_recompute_the_layer(monkeypatch):
    m = _decoder()
    x = _x(1, 40, HIDDEN, seed=6)
    cache = m.new_cache(1)
    with torch.no_grad():
        m(x[:, :30], cache=cache)

        def recompute(*args, **kwargs):
            raise AssertionError("the cached path called the full layer")
        monkeypatch.setattr("attnops.nn.nsa.native_sparse_attention", recompute)
        m(x[:, 30:31], cache=cache)
        m(x[:, 31:], cache=cache)


def test_cache_rejects_another_batch_or_layer():
    m = _decoder()
    cache = m.new_cache(2)
    with torch.no_grad():
        m(_x(2, 3, HIDDEN), cache=cache)
        with pytest.raises(attnops.ParamInvalidError, match="batch"):
            m(_x(1, 1, HIDDEN), cache=cache)
        with pytest.raises(attnops.ParamInvalidError, match="cache"):
            _decoder(n2=1)(_x(2, 1, HIDDEN), cache=cache)
        with pytest.raises(attnops.ParamInvalidError, match="cache"):
            m(_x(3, HIDDEN), cache=cache)


def test_truncate_then_continue_equals_the_full_forward():
    m = _decoder()
    x, other = _x(2, 60, HIDDEN, seed=7), _x(2, 60, HIDDEN, seed=8)
    cache = m.new_cache(2)
    with torch.no_grad():
        m(x[:, :30], cache=cache)
        m(other[:, 30:45], cache=cache)  # drafted tokens, then rejected
        cache.truncate(30)
        assert cache.seq_len == 30 and cache.compressed_len == (30 - 8) // 4 + 1
        got = torch.cat([m(x[:, 30:41], cache=cache), m(x[:, 41:42], cache=cache), m(x[:, 42:], cache=cache)], 1)
        torch.testing.assert_close(got, m(x)[:, 30:], rtol=1e-10, atol=1e-12)
        with pytest.raises(attnops.ParamInvalidError, match="length"):
            cache.truncate(61)
