"""attnops.msprobe.bench_functions: msprobe bench functions, judged against float64 SDPA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnops.msprobe import bench_functions as bench

B, S, N, D = 2, 24, 2, 16


def _qkv(sq=S, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, sq, D, generator=g)
    k, v = (torch.randn(B, N, S, D, generator=g) for _ in range(2))
    return q, k, v


def _sdpa(q, k, v, causal=False):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal, scale=0.3)


def test_fusion_attention_forward_and_grad_are_exact():
    q, k, v = _qkv()
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)
    out, smax, ssum = bench.npu_fusion_attention(q, k, v, N, "BNSD", atten_mask=mask, scale=0.3)
    assert out.dtype == torch.float64 and smax.shape == (B, N, S, 8)
    torch.testing.assert_close(out, _sdpa(q, k, v, causal=True), rtol=1e-12, atol=1e-12)
    dy = torch.randn(B, N, S, D)
    dq, dk, dv, dpse = bench.npu_fusion_attention_grad(q, k, v, dy, N, "BNSD", atten_mask=mask, scale_value=0.3,
                                                       softmax_max=smax, softmax_sum=ssum, attention_in=out)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    F.scaled_dot_product_attention(*leaves, is_causal=True, scale=0.3).backward(dy.double())
    for got, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-10)
    assert dpse is None


def test_inference_ops_are_exact():
    q, k, v = _qkv(sq=1)
    out, lse = bench.npu_fused_infer_attention_score(q, k, v, num_heads=N, input_layout="BNSD", scale=0.3,
                                                     softmax_lse_flag=True)
    torch.testing.assert_close(out, _sdpa(q, k, v), rtol=1e-12, atol=1e-12)
    assert lse.shape == (B, N, 1, 1)
    torch.testing.assert_close(bench.npu_incre_flash_attention(q, k, v, num_heads=N, input_layout="BNSD",
                                                               scale_value=0.3), _sdpa(q, k, v))
    q, k, v = _qkv(seed=1)
    torch.testing.assert_close(bench.npu_prompt_flash_attention(q, k, v, num_heads=N, input_layout="BNSD",
                                                                scale_value=0.3, next_tokens=65535), _sdpa(q, k, v))


def test_dropout_is_not_reproducible():
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="npu_fusion_attention: keep_prob=0.9"):
        bench.npu_fusion_attention(q, k, v, N, "BNSD", scale=0.3, keep_prob=0.9)
