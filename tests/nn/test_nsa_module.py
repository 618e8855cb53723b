"""attnops.nn.NativeSparseAttention: prefix invariance, batched == packed, chunked decoding with NSACache == full
forward, gradients reach every parameter."""
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
