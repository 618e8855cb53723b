"""``flash_attn.layers.rotary`` against the complex-number golden (``rotary_golden``): GPT-J (interleaved) and
GPT-NeoX pairs, partial rotary dims, int and per-batch offsets, varlen, positions past the table; in-place packed
forms; ``RotaryEmbedding`` against its angle formula; gradients."""
from __future__ import annotations

import math

import pytest
import torch

import attnops
from attnops.flash_attn.layers.rotary import (RotaryEmbedding, apply_rotary_emb, apply_rotary_emb_kv_,
                                              apply_rotary_emb_qkv_)
from attnops.testing.compare import assert_close_to_golden
from attnops.testing.golden_flash_attn_kvcache import rotary_golden
from tests.helpers import randn

F16, F32, F64 = torch.float16, torch.float32, torch.float64


def tables(n, rotary_dim, dtype=F32, seed=0):
    angles = torch.rand(n, rotary_dim // 2, generator=torch.Generator().manual_seed(seed), dtype=F64) * 2 * math.pi
    return angles.cos().to(dtype), angles.sin().to(dtype)


def judge(out, x, cos, sin, positions, interleaved):
    want = rotary_golden(x, cos, sin, positions, interleaved, F64)
    base = rotary_golden(x, cos, sin, positions, interleaved, x.dtype)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close_to_golden("rotary", out, want, base, reduction=2)  # a rotated element sums two products


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype,rotary_dim", [(F32, 16), (F16, 8)])
def test_dense_with_offsets(interleaved, dtype, rotary_dim):
    x = randn(2, 5, 3, 16, dtype=dtype)
    cos, sin = tables(9, rotary_dim, dtype)
    offsets = torch.tensor([0, 6], dtype=torch.int32)  # the second sequence runs past the table (left unrotated)
    out = apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offsets)
    judge(out, x, cos, sin, torch.arange(5) + offsets.long().unsqueeze(1), interleaved)
    assert torch.equal(out[1, 3:], x[1, 3:]) and torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])
    shifted = apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=2)
    judge(shifted, x, cos, sin, torch.arange(2, 7).expand(2, 5), interleaved)


def test_varlen_positions_restart_per_sequence():
    x = randn(7, 2, 8)
    cos, sin = tables(8, 8)
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    out = apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([1, 0, 2]), cu_seqlens=cu, max_seqlen=4)
    judge(out, x, cos, sin, torch.tensor([1, 2, 3, 2, 3, 4, 5]), False)


def test_inplace_and_packed_forms():
    cos, sin = tables(6, 8)
    x = randn(1, 6, 2, 8)
    want = apply_rotary_emb(x, cos, sin)
    assert apply_rotary_emb(x, cos, sin, inplace=True) is x and torch.equal(x, want)
    qkv = randn(1, 6, 3, 2, 8, seed=1)
    q, k, v = (qkv[:, :, i].clone() for i in range(3))
    apply_rotary_emb_qkv_(qkv, cos, sin, interleaved=True)
    assert torch.equal(qkv[:, :, 0], apply_rotary_emb(q, cos, sin, True))
    assert torch.equal(qkv[:, :, 1], apply_rotary_emb(k, cos, sin, True)) and torch.equal(qkv[:, :, 2], v)
    gqa = randn(1, 6, 4 + 2 * 1, 8, seed=2)  # 4 q heads, 1 k and 1 v head
    before = gqa.clone()
    apply_rotary_emb_qkv_(gqa, cos, sin, num_heads_q=4)
    assert torch.equal(gqa[:, :, :5], apply_rotary_emb(before[:, :, :5], cos, sin))
    assert torch.equal(gqa[:, :, 5], before[:, :, 5])
    kv = randn(1, 6, 2, 2, 8, seed=3)
    values = kv[:, :, 1].clone()
    apply_rotary_emb_kv_(kv, cos, sin, seqlen_offsets=0)
    assert torch.equal(kv[:, :, 1], values)


def test_gradients():
    x = randn(1, 4, 1, 8, dtype=F64).requires_grad_()
    cos, sin = tables(4, 8, F64)
    assert torch.autograd.gradcheck(lambda t: apply_rotary_emb(t, cos, sin, True), (x,))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_embedding_module(interleaved):
    dim, base = 8, 10000.0
    module = RotaryEmbedding(dim, base=base, interleaved=interleaved)
    qkv = randn(2, 5, 3, 2, dim)
    before = qkv.clone()
    assert module(qkv, seqlen_offset=3) is qkv
    angles = torch.arange(8, dtype=F64).unsqueeze(1) * base ** (-torch.arange(0, dim, 2, dtype=F64) / dim)
    cos, sin = angles.cos(), angles.sin()
    positions = torch.arange(3, 8).expand(2, 5)
    for i in (0, 1):
        judge(qkv[:, :, i], before[:, :, i], cos, sin, positions, interleaved)
    assert torch.equal(qkv[:, :, 2], before[:, :, 2])
    q, kv = randn(2, 5, 2, dim, seed=1), randn(2, 5, 2, 2, dim, seed=2)
    q0, kv0 = q.clone(), kv.clone()
    module(q, kv=kv, seqlen_offset=torch.tensor([0, 2]), max_seqlen=7)
    judge(q, q0, cos, sin, torch.arange(5) + torch.tensor([[0], [2]]), interleaved)
    judge(kv[:, :, 0], kv0[:, :, 0], cos, sin, torch.arange(5) + torch.tensor([[0], [2]]), interleaved)


def test_xpos_scales_q_and_k_reciprocally():
    xpos, plain = RotaryEmbedding(8, scale_base=512), RotaryEmbedding(8)
    xpos(torch.ones(1, 4, 3, 1, 8))
    plain(torch.ones(1, 4, 3, 1, 8))
    assert not torch.allclose(xpos._cos_cached, plain._cos_cached)
    torch.testing.assert_close(xpos._cos_cached * xpos._cos_k_cached, plain._cos_cached ** 2)
    torch.testing.assert_close(xpos._sin_cached * xpos._sin_k_cached, plain._sin_cached ** 2)


@pytest.mark.parametrize("call,message", [
    (lambda: apply_rotary_emb(torch.ones(1, 2, 1, 4), torch.ones(2, 4), torch.ones(2, 4)),
     r"cos: expected \[seqlen_ro, rotary_dim / 2\] with rotary_dim <= headdim \(4\)"),
    (lambda: apply_rotary_emb(torch.ones(1, 2, 1, 4), torch.ones(2, 2), torch.ones(3, 2)), r"sin: expected shape"),
    (lambda: apply_rotary_emb(torch.ones(1, 2, 1, 4), torch.ones(2, 2), torch.ones(2, 2), seqlen_offsets=-1),
     r"seqlen_offsets: expected an int in \[0"),
    (lambda: apply_rotary_emb_qkv_(torch.ones(1, 2, 5, 4), torch.ones(2, 2), torch.ones(2, 2)),
     r"num_heads_q: expected the number of q heads"),
    (lambda: RotaryEmbedding(7), r"dim: expected an even rotary dimension"),
])
def test_bad_arguments_raise_naming_them(call, message):
    with pytest.raises((attnops.ParamInvalidError, attnops.ParamDtypeError), match=message):
        call()


def test_half_module_keeps_fp32_angles():
    module = RotaryEmbedding(8).half()
    assert module.inv_freq.dtype == torch.float16
    qkv = randn(1, 300, 3, 1, 8, dtype=F16)
    before = qkv.clone()
    module(qkv)
    angles = torch.arange(300, dtype=F64).unsqueeze(1) * 10000.0 ** (-torch.arange(0, 8, 2, dtype=F64) / 8)
    judge(qkv[:, :, 0], before[:, :, 0], angles.cos(), angles.sin(), torch.arange(300).unsqueeze(0), False)
