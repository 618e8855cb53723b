"""torch.autograd.gradcheck in float64 through the Pythonic NSA API (tiny shapes)."""
from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

import attnops

from .nsa_helpers import F64, cum, randn, random_topk


def _req(*xs):
    return tuple(x.detach().clone().requires_grad_() for x in xs)


def test_gradcheck_nsa_compress():
    lens = [0, 9, 11, 3]
    x, w = _req(randn(23, 2, 3, dtype=F64, seed=1), randn(4, 2, dtype=F64, seed=2))
    assert gradcheck(lambda a, b: attnops.nsa_compress(a, b, block_size=4, stride=2, actual_seq_len=cum(lens)),
                     (x, w))


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_nsa_selected_attention(causal):
    q_lens, kv_lens, bs = [3, 4], [8, 12], 4
    q, k, v = _req(randn(7, 4, 3, dtype=F64, seed=3), randn(20, 2, 3, dtype=F64, seed=4),
                   randn(20, 2, 2, dtype=F64, seed=5))
    topk = random_topk(q_lens, kv_lens, 2, 2, bs, seed=6, distinct=False)
    topk[0, 0] = torch.tensor([1, 1])  # duplicates; causal: row 0 fully masked

    def f(a, b, c):
        return attnops.nsa_selected_attention(a, b, c, topk, select_block_size=bs, causal=causal, scale=0.6,
                                              actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(kv_lens))

    assert gradcheck(f, (q, k, v))


def test_gradcheck_nsa_compress_attention():
    q_lens, cmp_lens = [3, 4], [4, 5]
    q, k, v = _req(randn(7, 2, 3, dtype=F64, seed=7), randn(9, 1, 3, dtype=F64, seed=8),
                   randn(9, 1, 2, dtype=F64, seed=9))
    mask = torch.zeros(4, 5, dtype=torch.bool)
    mask[0, 2:] = True
    mask[1, 4] = True

    def f(a, b, c):
        return attnops.nsa_compress_attention(a, b, c, compress_block_size=32, compress_stride=16,
                                              select_block_size=32, select_block_count=2, scale=0.7,
                                              atten_mask=mask, actual_seq_qlen=cum(q_lens),
                                              actual_cmp_seq_kvlen=cum(cmp_lens)).out

    assert gradcheck(f, (q, k, v))


@pytest.mark.parametrize("fast", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["fast", "full"])
def test_gradcheck_native_sparse_attention(fast):
    """Tiny NSA layer (two sequences of 16, l=4, d=2, l'=4, 2 blocks, window 5): every differentiable input."""
    t, n1, n2, d = 32, 2, 1, 2
    q, k, v = _req(randn(t, n1, d, dtype=F64, seed=10), randn(t, n2, d, dtype=F64, seed=11),
                   randn(t, n2, d, dtype=F64, seed=12))
    gates, wk, wv = _req(torch.sigmoid(randn(t, n1, 3, dtype=F64, seed=13)), randn(4, n2, dtype=F64, seed=14),
                         randn(4, n2, dtype=F64, seed=15))

    def f(a, b, c, gt, w1, w2):
        return attnops.native_sparse_attention(a, b, c, gt, w1, w2, cu_seqlens=[0, 16, 32], compress_block_size=4,
                                               compress_stride=2, select_block_size=4, select_block_count=2,
                                               window_size=5)

    out = f(q, k, v, gates, wk, wv)
    assert out.shape == (t, n1, d)
    assert gradcheck(f, (q, k, v, gates, wk, wv), fast_mode=fast)
