"""DeepSeekV4Attention and DSV4Cache: chunked prefill and decode against an fp64 formula of the layer (written here
from DeepSeek-V4's equations: RoPE, RMSNorm, the compressor's per-column softmax, the indexer's top-k, one softmax
over window + compressed keys + sink), autograd, and one cache per layer."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.nn import DeepSeekV4Attention


def _rope(x, pos, theta=10000.0):
    """Rotate-half RoPE of the last dim of ``x [B, len(pos), .., d]`` (fp64 angles ``pos * theta**(-2i/d)``)."""
    d = x.shape[-1]
    ang = pos.double()[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    shape = [1, len(pos)] + [1] * (x.dim() - 3) + [d]
    cos, sin = torch.cat([ang, ang], -1).cos().view(shape), torch.cat([ang, ang], -1).sin().view(shape)
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def _rope_last(x, pos, dr):
    return torch.cat([x[..., :-dr], _rope(x[..., -dr:], pos)], -1)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


def _compress(x, c, dr, eps):
    """Compressed rows ``[B, S // r, dim]`` of compressor ``c`` over ``x [B, S, H]`` (fp64)."""
    wkv, wgate, ape, norm = (t.detach().double() for t in (c.wkv, c.wgate, c.ape, c.norm))
    r, dim, s = c.ratio, c.dim, x.shape[1]
    kv, score = x @ wkv.T, x @ wgate.T + ape[torch.arange(s) % r]
    rows = []
    for j in range(s // r):
        cur = slice(j * r, (j + 1) * r)
        if c.coff == 1:
            k, g = kv[:, cur], score[:, cur]
        else:  # previous block through the first dim columns (weight 0 before position 0), this block the last
            prev = slice(max(0, (j - 1) * r), j * r)
            pk, pg = kv[:, prev, :dim], score[:, prev, :dim]
            k, g = torch.cat([pk, kv[:, cur, dim:]], 1), torch.cat([pg, score[:, cur, dim:]], 1)
        rows.append((torch.softmax(g, 1) * k).sum(1))
    out = _rms(torch.stack(rows, 1), norm, eps)
    return _rope_last(out, torch.arange(s // r) * r, dr)


def _formula(m: DeepSeekV4Attention, x: torch.Tensor) -> torch.Tensor:
    """The layer's outputs over ``x [B, S, hidden]`` in fp64, every token attending causally."""
    x = x.double()
    b, s, _ = x.shape
    n, d, dr, r, w = m.heads, m.head_dim, m.rope_dim, m.cmp_ratio, m.window
    pos = torch.arange(s)
    q = _rope_last((x @ m.q_proj.weight.double().T).view(b, s, n, d), pos, dr)
    kv = _rope_last(_rms(x @ m.kv_proj.weight.double().T, m.kv_norm.weight.double(), m.eps), pos, dr)
    cmp = _compress(x, m.compressor, dr, m.eps)
    if m.index_topk is not None:
        ni, di = m.index_heads, m.index_dim
        iq = _rope_last((x @ m.index_q.weight.double().T).view(b, s, ni, di), pos, dr)
        iw = (x @ m.index_w.weight.double().T) / (ni * di) ** 0.5
        ik = _compress(x, m.index_compressor, dr, m.eps)
    sinks = m.sinks.double()
    out = torch.zeros(b, s, n, d, dtype=torch.float64)
    for bi in range(b):
        for p in range(s):
            keys = [kv[bi, max(0, p - w + 1):p + 1]]
            done = (p + 1) // r  # compressed blocks that end at or before p
            if done:
                picked = torch.arange(done)
                if m.index_topk is not None:
                    score = (iw[bi, p, :, None] * torch.relu(iq[bi, p] @ ik[bi, :done].T)).sum(0)
                    picked = torch.sort(torch.argsort(-score, stable=True)[:m.index_topk]).values
                keys.append(cmp[bi, picked])
            k = torch.cat(keys)
            logits = torch.cat([q[bi, p] @ k.T * d ** -0.5, sinks[:, None]], 1)
            out[bi, p] = torch.softmax(logits, 1)[:, :-1] @ k
    out = _rope_last(out, -pos, dr)  # inverse rotation at the query's position
    return out.reshape(b, s, -1) @ m.o_proj.weight.double().T


def _layer(topk, window=6, seed=0):
    torch.manual_seed(seed)
    m = DeepSeekV4Attention(32, 4, head_dim=16, rope_dim=8, window=window, cmp_ratio=4, index_topk=topk,
                            index_heads=3, index_dim=8)
    with torch.no_grad():
        m.sinks.normal_()
    return m


@pytest.mark.parametrize("topk", [3, None], ids=["csa", "hca"])
def test_prefill_chunks_and_decode_equal_the_fp64_formula(topk):
    m = _layer(topk)
    x = torch.randn(2, 29, 32)
    want = _formula(m, x)
    with torch.no_grad():
        full = m(x)
        cache = m.new_cache(2, 32, block_size=4)
        outs = [m(x[:, :7], cache=cache), m(x[:, 7:17], cache=cache)]
        outs += [m(x[:, t:t + 1], cache=cache) for t in range(17, 29)]
    torch.testing.assert_close(full.double(), want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(outs, 1).double(), want, atol=2e-5, rtol=1e-4)
    assert cache.seq_len == 29


def test_ratio_128_layer_decodes_like_the_formula():
    torch.manual_seed(1)
    m = DeepSeekV4Attention(16, 2, head_dim=8, rope_dim=4, window=16, cmp_ratio=128, index_topk=None)
    x = torch.randn(1, 300, 16)
    with torch.no_grad():
        cache = m.new_cache(1, 300, block_size=16)
        out = torch.cat([m(x[:, :250], cache=cache)] + [m(x[:, t:t + 1], cache=cache) for t in range(250, 300)], 1)
    torch.testing.assert_close(out.double(), _formula(m, x), atol=2e-5, rtol=1e-4)


def test_prefill_is_differentiable():
    m = _layer(3)
    x = torch.randn(1, 13, 32, requires_grad=True)
    m(x).square().sum().backward()
    for p in (m.q_proj.weight, m.kv_proj.weight, m.kv_norm.weight, m.sinks, m.o_proj.weight):
        assert p.grad is not None and bool(p.grad.abs().sum() > 0)
    assert bool(x.grad.abs().sum() > 0)


def test_gradients_match_the_fp64_formula():
    m = _layer(3)
    x = torch.randn(1, 11, 32)
    m(x).square().sum().backward()
    params = (m.q_proj.weight, m.kv_proj.weight, m.sinks, m.o_proj.weight)
    got = [p.grad.clone() for p in params]
    m.zero_grad()
    _formula(m, x).square().sum().backward()  # the formula reads the same weights (in fp64): their gradients
    for g, p in zip(got, params):
        torch.testing.assert_close(g, p.grad, atol=2e-5 * float(p.grad.abs().max()), rtol=1e-4)


def test_a_cache_belongs_to_one_layer():
    a, b = _layer(3), _layer(3, seed=1)
    cache = a.new_cache(1, 8)
    with torch.no_grad():
        a(torch.randn(1, 2, 32), cache=cache)
        with pytest.raises(attnops.ParamInvalidError, match="another layer"):
            b(torch.randn(1, 1, 32), cache=cache)
        a.window = 3
        with pytest.raises(attnops.ParamInvalidError, match="other settings"):
            a(torch.randn(1, 1, 32), cache=cache)


def test_cache_checks_its_room_and_batch():
    m = _layer(None)
    cache = m.new_cache(2, 5)
    with torch.no_grad(), pytest.raises(attnops.ParamInvalidError, match="at most 5 new tokens"):
        m(torch.randn(2, 6, 32), cache=cache)
    with torch.no_grad(), pytest.raises(attnops.ParamInvalidError, match="B=2"):
        m(torch.randn(1, 1, 32), cache=cache)
    other = attnops.nn.DSV4Cache(2, 5, head_dim=16, cmp_ratio=128, coff=1)
    with torch.no_grad(), pytest.raises(attnops.ParamInvalidError, match="cmp_ratio=128"):
        m(torch.randn(2, 1, 32), cache=other)
