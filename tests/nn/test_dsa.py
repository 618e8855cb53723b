"""The DeepSeekSparseAttention module: cached prefill + decode equal the uncached causal forward; with a top-k
covering the context it is dense causal MLA attention (checked against a plain formula); gradients reach every
weight but the indexer's."""
from __future__ import annotations

import torch

import attnops
from attnops.testing import golden_dsa as G


def _module(topk):
    torch.manual_seed(0)
    return attnops.nn.DeepSeekSparseAttention(48, 4, kv_rank=32, qk_nope_dim=16, qk_rope_dim=8, v_head_dim=12,
                                              index_heads=4, index_dim=16, index_topk=topk)


def test_prefill_then_decode_matches_the_full_forward():
    m = _module(5)
    x = torch.randn(2, 11, 48)
    full = m(x)
    cache = m.new_cache(2, 16, block_size=16)
    steps = [m(x[:, :8], cache)] + [m(x[:, i:i + 1], cache) for i in range(8, 11)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert cache.lengths == [11, 11]


def test_topk_covering_the_context_is_dense_causal_mla():
    m = _module(64).double()
    x = torch.randn(1, 9, 48, dtype=torch.float64)
    with torch.no_grad():
        pos = torch.arange(9)
        ang = pos[:, None].double() * 10000.0 ** (-torch.arange(0, 8, 2).double() / 8)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        q = m.q_proj(x)[0].view(9, 4, 24)
        kv = m.kv_proj(x)[0]
        c = G.rms_norm(kv[:, :32], m.kv_norm.weight, 1e-6)
        kr = G.interleave_rope(kv[:, 32:], cos, sin)
        qr = G.interleave_rope(q[..., 16:], cos[:, None], sin[:, None])
        ql = torch.einsum("snd,ndc->snc", q[..., :16], m.w_uk)
        logits = (torch.einsum("snc,tc->nst", ql, c) + torch.einsum("snr,tr->nst", qr, kr)) * 24 ** -0.5
        logits = logits.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("nst,tc->snc", torch.softmax(logits, -1), c)
        want = m.o_proj(torch.einsum("snc,ncv->snv", o, m.w_uv).reshape(9, -1))
        torch.testing.assert_close(m(x)[0], want)


def test_gradients_reach_the_attention_weights():
    m = _module(4)
    m(torch.randn(1, 7, 48)).square().sum().backward()
    for p in (m.q_proj.weight, m.kv_proj.weight, m.w_uk, m.w_uv, m.o_proj.weight, m.kv_norm.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert m.index_q.weight.grad is None  # the indexer trains with lightning_indexer_kl_loss
