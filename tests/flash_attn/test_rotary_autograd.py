"""flash-attn's rotary names added for its own tests: ``apply_rotary_emb_torch``, ``flash_attn.ops.triton.rotary.
apply_rotary`` (with ``conjugate``), and the in-place forms on leaves that require grad (their gradient is the
inverse rotation), eager and compiled; all against the fp64 complex-number golden ``rotary_golden``."""
from __future__ import annotations

import math

import pytest
import torch

from attnops.flash_attn.layers.rotary import (apply_rotary_emb, apply_rotary_emb_kv_, apply_rotary_emb_qkv_,
                                              apply_rotary_emb_torch)
from attnops.flash_attn.ops.triton.rotary import apply_rotary
from attnops.testing.compare import assert_close_to_golden
from attnops.testing.golden_flash_attn_kvcache import rotary_golden
from tests.helpers import randn

F16, F32, F64 = torch.float16, torch.float32, torch.float64


def tables(n, rotary_dim, dtype=F32, seed=0):
    angles = torch.rand(n, rotary_dim // 2, generator=torch.Generator().manual_seed(seed), dtype=F64) * 2 * math.pi
    return angles.cos().to(dtype), angles.sin().to(dtype)


def judge(name, out, x, cos, sin, positions, interleaved):
    want = rotary_golden(x, cos, sin, positions, interleaved, F64)
    base = rotary_golden(x, cos, sin, positions, interleaved, x.dtype)
    assert out.dtype == x.dtype
    assert_close_to_golden(name, out, want, base, reduction=2)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_emb_torch_per_token_tables(interleaved):
    """``cos``/``sin`` hold one row per token (``[S, r/2]`` or ``[B, S, r/2]``); dims past ``rotary_dim`` pass."""
    x = randn(2, 5, 3, 12, dtype=F16)
    cos, sin = tables(5, 8, F16)
    judge("torch 2-D", apply_rotary_emb_torch(x, cos, sin, interleaved), x, cos, sin,
          torch.arange(5).expand(2, 5), interleaved)
    cos_b, sin_b = tables(10, 8, F16, seed=1)
    out = apply_rotary_emb_torch(x, cos_b.view(2, 5, 4), sin_b.view(2, 5, 4), interleaved)
    judge("torch 3-D", out, x, cos_b, sin_b, torch.arange(10).view(2, 5), interleaved)


def test_apply_rotary_conjugate_undoes_the_rotation():
    x = randn(2, 6, 2, 8, dtype=F64)
    cos, sin = tables(9, 8, F64)
    offsets = torch.tensor([0, 3], dtype=torch.int32)
    rotated = apply_rotary(x, cos, sin, seqlen_offsets=offsets)
    judge("apply_rotary", rotated, x, cos, sin, torch.arange(6) + offsets.long()[:, None], False)
    torch.testing.assert_close(apply_rotary(rotated, cos, sin, seqlen_offsets=offsets, conjugate=True), x)


def _inverse(grad, cos, sin, positions, interleaved):
    """The gradient of a rotation: the fp64 rotation by the negated angle."""
    return rotary_golden(grad, cos, -sin, positions, interleaved, F64)


@pytest.mark.parametrize("interleaved", [False, True])
def test_inplace_on_a_leaf_that_requires_grad(interleaved):
    """As flash-attn: ``inplace=True`` on a leaf writes into it and the result carries the rotation's backward."""
    x0 = randn(2, 7, 2, 8)
    cos, sin = tables(10, 6)
    x = x0.clone().requires_grad_()
    out = apply_rotary_emb(x, cos, sin, interleaved, inplace=True, seqlen_offsets=2)
    positions = torch.arange(2, 9).expand(2, 7)
    judge("out", out, x0, cos, sin, positions, interleaved)
    assert torch.equal(x.detach(), out.detach())  # written in place
    g = randn(2, 7, 2, 8, seed=3)
    out.backward(g)
    assert_close_to_golden("dx", x.grad, _inverse(g, cos, sin, positions, interleaved),
                           rotary_golden(g, cos, -sin, positions, interleaved, F32), reduction=2)


def test_varlen_inplace_gradient():
    x0 = randn(7, 2, 8)
    cos, sin = tables(8, 8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    x = x0.clone().requires_grad_()
    out = apply_rotary_emb(x, cos, sin, inplace=True, cu_seqlens=cu, max_seqlen=4)
    positions = torch.tensor([0, 1, 2, 0, 1, 2, 3])
    judge("out", out, x0, cos, sin, positions, False)
    g = randn(7, 2, 8, seed=4)
    out.backward(g)
    torch.testing.assert_close(x.grad.double(), _inverse(g, cos, sin, positions, False), rtol=1e-6, atol=1e-6)


def _qkv_case(compiled: bool):
    qkv0 = randn(2, 5, 4, 8, seed=5)  # GQA: 2 q heads, 1 k head, 1 v head
    cos, sin = tables(8, 8)
    cos_k, sin_k = tables(8, 8, seed=6)
    qkv = qkv0.clone().requires_grad_()
    fn = torch.compile(apply_rotary_emb_qkv_, backend="eager") if compiled else apply_rotary_emb_qkv_
    out = fn(qkv, cos, sin, cos_k, sin_k, seqlen_offsets=1, num_heads_q=2)
    positions = torch.arange(1, 6).expand(2, 5)
    judge("q", out[:, :, :2], qkv0[:, :, :2], cos, sin, positions, False)
    judge("k", out[:, :, 2:3], qkv0[:, :, 2:3], cos_k, sin_k, positions, False)
    assert torch.equal(out[:, :, 3], qkv0[:, :, 3])
    g = randn(2, 5, 4, 8, seed=7)
    out.backward(g)
    expected = torch.cat([_inverse(g[:, :, :2], cos, sin, positions, False),
                          _inverse(g[:, :, 2:3], cos_k, sin_k, positions, False), g[:, :, 3:].double()], 2)
    torch.testing.assert_close(qkv.grad.double(), expected, rtol=1e-6, atol=1e-6)


def test_qkv_inplace_on_a_leaf_gqa():
    _qkv_case(compiled=False)


def test_qkv_inplace_on_a_leaf_compiled():
    _qkv_case(compiled=True)


def test_kv_inplace_on_a_leaf():
    kv0 = randn(1, 6, 2, 3, 8, seed=8)
    cos, sin = tables(6, 4)
    kv = kv0.clone().requires_grad_()
    out = apply_rotary_emb_kv_(kv, cos, sin, interleaved=True)
    positions = torch.arange(6).expand(1, 6)
    judge("k", out[:, :, 0], kv0[:, :, 0], cos, sin, positions, True)
    assert torch.equal(out[:, :, 1], kv0[:, :, 1])
    g = randn(1, 6, 2, 3, 8, seed=9)
    out.backward(g)
    torch.testing.assert_close(kv.grad[:, :, 0].double(), _inverse(g[:, :, 0], cos, sin, positions, True),
                               rtol=1e-6, atol=1e-6)
    assert torch.equal(kv.grad[:, :, 1], g[:, :, 1])
