"""The backward uses the forward results it is given (softmax_max, softmax_sum, attention_in) and never
recomputes them: P = exp(S - max) / sum and D = rowsum(dy * attention_in) (cann_semantics.md §3, §4.1).

The expected gradients are computed here by hand, in float64, from the very statistics passed in; the
"baseline" of the tolerance rule is the same formula evaluated in the input dtype.
"""
import math

import pytest
import torch

import attnops
from attnops.testing.compare import assert_close_to_golden, fa_reductions
from tests.helpers import F64, TRIU2048, make_qkv


def _hand_grads(q, k, v, dy, out, smax, ssum, *, scale, causal, dtype):
    """dq, dk, dv from the given stats/out, for BNSD inputs without GQA (one dense score matrix per head)."""
    q, k, v, dy, out = (t.to(dtype) for t in (q, k, v, dy, out))
    m, l = smax[..., :1].to(dtype), ssum[..., :1].to(dtype)
    s = scale * q @ k.transpose(-1, -2)
    if causal:
        s = s.masked_fill(TRIU2048[:s.shape[-2], :s.shape[-1]], -math.inf)
    p = torch.exp(s - m) / l
    dp = dy @ v.transpose(-1, -2)
    d = (dy * out).sum(-1, keepdim=True)
    ds = p * (dp - d)
    return scale * ds @ k, scale * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ dy


def _forward(causal, dtype=torch.float32, seed=130):
    q, k, v, dy = make_qkv("BNSD", b=2, n1=2, sq=5, skv=6, dtype=dtype, seed=seed)
    kw = dict(scale=0.4, atten_mask=TRIU2048, sparse_mode=2) if causal else dict(scale=0.4)
    r = attnops.flash_attention(q, k, v, return_stats=True, **kw)
    return q, k, v, dy, r, kw


def _check(q, k, v, dy, out, smax, ssum, kw, causal):
    grads = attnops.flash_attention_backward(dy, q, k, v, out, smax, ssum, **kw)[:3]
    gold = _hand_grads(q, k, v, dy, out, smax, ssum, scale=0.4, causal=causal, dtype=F64)
    base = _hand_grads(q, k, v, dy, out, smax, ssum, scale=0.4, causal=causal, dtype=q.dtype)
    red = fa_reductions(q, k, v, layout="BNSD", head_num=q.shape[1])
    for name, a, g, b in zip(("dq", "dk", "dv"), grads, gold, base):
        assert_close_to_golden(name, a, g, b, factor=3, reduction=red[name])
    return grads


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_doubled_softmax_sum_halves_dv(causal, dtype):
    q, k, v, dy, r, kw = _forward(causal, dtype)
    dq, dk, dv = _check(q, k, v, dy, r.out, r.softmax_max, r.softmax_sum, kw, causal)
    dq2, dk2, dv2 = _check(q, k, v, dy, r.out, r.softmax_max, r.softmax_sum * 2, kw, causal)
    torch.testing.assert_close(dv2.float(), dv.float() / 2, rtol=1e-2 if dtype == torch.float16 else 1e-5,
                               atol=1e-3 if dtype == torch.float16 else 1e-6)
    assert not torch.allclose(dq2.float(), dq.float(), rtol=1e-2, atol=1e-3)
    assert not torch.allclose(dk2.float(), dk.float(), rtol=1e-2, atol=1e-3)


def test_shifted_softmax_max_acts_like_a_scaled_sum():
    """max + ln 2 and 2 * sum both halve P."""
    q, k, v, dy, r, kw = _forward(causal=True, seed=131)
    a = _check(q, k, v, dy, r.out, r.softmax_max + math.log(2.0), r.softmax_sum, kw, causal=True)
    b = attnops.flash_attention_backward(dy, q, k, v, r.out, r.softmax_max, r.softmax_sum * 2, **kw)[:3]
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_attention_in_is_used_for_d():
    """With attention_in = 0, D = 0 and dS = P * dP; with attention_in * 2 the result changes accordingly."""
    q, k, v, dy, r, kw = _forward(causal=False, seed=132)
    dq0, dk0, dv0 = _check(q, k, v, dy, torch.zeros_like(r.out), r.softmax_max, r.softmax_sum, kw, causal=False)
    dq, dk, dv = _check(q, k, v, dy, r.out, r.softmax_max, r.softmax_sum, kw, causal=False)
    _check(q, k, v, dy, r.out * 2, r.softmax_max, r.softmax_sum, kw, causal=False)
    torch.testing.assert_close(dv0, dv, rtol=0, atol=0)  # dV = P^T dy does not use attention_in
    assert not torch.allclose(dq0, dq, rtol=1e-2, atol=1e-3)


def test_per_batch_statistics_are_read_in_place_tnd():
    """Scaling the sums of batch 1 only (in the blocked TND layout) changes only batch 1's gradients."""
    q_lens, kv_lens = [3, 4], [4, 4]
    q, k, v, dy = make_qkv("TND", n1=2, q_lens=q_lens, kv_lens=kv_lens, seed=133)
    kw = dict(layout="TND", actual_seq_qlen=[3, 7], actual_seq_kvlen=[4, 8], scale=0.4)
    r = attnops.flash_attention(q, k, v, return_stats=True, **kw)
    ssum = r.softmax_sum.clone()
    ssum.view(-1, 8)[3 * 2:] *= 2  # blocked layout: batch 0 is the first Sq0 * N1 = 6 rows
    dq, dk, dv, _ = attnops.flash_attention_backward(dy, q, k, v, r.out, r.softmax_max, r.softmax_sum, **kw)
    dq2, dk2, dv2, _ = attnops.flash_attention_backward(dy, q, k, v, r.out, r.softmax_max, ssum, **kw)
    torch.testing.assert_close(dq2[:3], dq[:3], rtol=0, atol=0)
    torch.testing.assert_close(dv2[:4], dv[:4], rtol=0, atol=0)
    torch.testing.assert_close(dv2[4:], dv[4:] / 2, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(dq2[3:], dq[3:], rtol=1e-2, atol=1e-3)
