"""NSA selected-attention grad in sparse_mode 2: causal with or without an ``atten_mask`` (as the NPU grad), while
the forward is causal only with a mask; the Pythonic ``causal`` flag drives both alike."""
from __future__ import annotations

import pytest
import torch

import attnops
import attnops.aclnn as aclnn
import attnops.torch_npu as tnpu
from attnops.testing import golden_nsa as G
from attnops.testing.compare import assert_close_to_golden

from .nsa_helpers import baseline_dtype, cum, nsa_reductions, randn, random_topk

BLOCK, COUNT, Q_LENS, KV_LENS, N1, N2 = 16, 2, [40, 24], [48, 32], 4, 2


def _inputs(dtype, d=128):
    q, k, v = (randn(t, n, d, dtype=dtype, seed=s) for t, n, s in ((64, N1, 1), (80, N2, 2), (80, N2, 3)))
    topk = random_topk(Q_LENS, KV_LENS, N2, COUNT, BLOCK, seed=4)
    return q, k, v, topk, cum(Q_LENS), cum(KV_LENS), d ** -0.5


def _golden_masked_grad_of_unmasked_forward(dy, q, k, v, topk, qc, kc, scale):
    """fp64 golden and input-dtype baseline of the mode-2 grad from the unmasked forward's outputs."""
    res = []
    for dt in (torch.float64, baseline_dtype(q.dtype)):
        out, smax, ssum = G.nsa_selected_attention(q, k, v, topk, scale, BLOCK, qc, kc, False, dtype=dt)
        res.append(G.nsa_selected_attention_grad_from_stats(dy, q, k, v, out, smax, ssum, topk, scale, BLOCK, qc,
                                                            kc, True, dtype=dt))
    return res


def test_golden_grad_from_stats_equals_autograd_golden():
    q, k, v, topk, qc, kc, scale = _inputs(torch.float64, d=16)
    dy = randn(64, N1, 16, dtype=torch.float64, seed=5)
    for causal in (False, True):
        out, smax, ssum = G.nsa_selected_attention(q, k, v, topk, scale, BLOCK, qc, kc, causal)
        got = G.nsa_selected_attention_grad_from_stats(dy, q, k, v, out, smax, ssum, topk, scale, BLOCK, qc, kc,
                                                       causal)
        for a, b in zip(got, G.nsa_selected_attention_backward(dy, q, k, v, topk, scale, BLOCK, qc, kc, causal)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dialect", ["aclnn", "torch_npu"])
def test_grad_mode2_with_and_without_mask_equal_golden(dialect):
    q, k, v, topk, qc, kc, scale = _inputs(torch.float16)
    dy = randn(64, N1, 128, dtype=torch.float16, seed=5)
    out, smax, ssum = tnpu.npu_nsa_select_attention(q, k, v, topk, scale, N1, BLOCK, COUNT, actual_seq_qlen=qc,
                                                    actual_seq_kvlen=kc)  # unmasked forward
    grads = []
    for mask in (torch.ones(64, 64, dtype=torch.bool).triu(1), None):
        if dialect == "aclnn":
            grads.append(aclnn.nsa_selected_attention_grad(q, k, v, out, dy, smax, ssum, topk, qc, kc, mask, scale,
                                                           BLOCK, COUNT, N1, "TND", 2))
        else:
            grads.append(tnpu.npu_nsa_select_attention_grad(dy, q, k, v, out, smax, ssum, topk, scale, N1, BLOCK,
                                                            COUNT, atten_mask=mask, actual_seq_qlen=qc,
                                                            actual_seq_kvlen=kc))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    golden, base = _golden_masked_grad_of_unmasked_forward(dy, q, k, v, topk, qc, kc, scale)
    for name, a, g, b in zip(("dq", "dk", "dv"), grads[1], golden, base):
        assert_close_to_golden(f"grad.{name}", a, g, b, factor=3,
                               reduction=nsa_reductions(q, k, v, Q_LENS, COUNT * BLOCK, topk)[name])


def test_torch_npu_autograd_without_mask_is_masked_grad_of_unmasked_forward():
    q, k, v, topk, qc, kc, scale = _inputs(torch.float16)
    dy = randn(64, N1, 128, dtype=torch.float16, seed=5)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out, _, _ = tnpu.npu_nsa_select_attention(qq, kk, vv, topk, scale, N1, BLOCK, COUNT, actual_seq_qlen=qc,
                                              actual_seq_kvlen=kc)
    g_out, _, _ = G.nsa_selected_attention(q, k, v, topk, scale, BLOCK, qc, kc, False)
    b_out, _, _ = G.nsa_selected_attention(q, k, v, topk, scale, BLOCK, qc, kc, False, dtype=torch.float16)
    assert_close_to_golden("out", out, g_out, b_out, factor=2,  # the forward stays unmasked
                           reduction=nsa_reductions(q, k, v, Q_LENS, COUNT * BLOCK, topk)["out"])
    out.backward(dy)
    golden, base = _golden_masked_grad_of_unmasked_forward(dy, q, k, v, topk, qc, kc, scale)
    for name, a, g, b in zip(("dq", "dk", "dv"), (qq.grad, kk.grad, vv.grad), golden, base):
        assert_close_to_golden(f"autograd.{name}", a, g, b, factor=3,
                               reduction=nsa_reductions(q, k, v, Q_LENS, COUNT * BLOCK, topk)[name])


@pytest.mark.parametrize("causal", [False, True])
def test_pythonic_forward_and_backward_consistent(causal):
    q, k, v, topk, qc, kc, scale = _inputs(torch.float16)
    dy = randn(64, N1, 128, dtype=torch.float16, seed=5)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    attnops.nsa_selected_attention(qq, kk, vv, topk, select_block_size=BLOCK, causal=causal, scale=scale,
                                   actual_seq_qlen=qc, actual_seq_kvlen=kc).backward(dy)
    golden = G.nsa_selected_attention_backward(dy, q, k, v, topk, scale, BLOCK, qc, kc, causal)
    base = G.nsa_selected_attention_backward(dy, q, k, v, topk, scale, BLOCK, qc, kc, causal, dtype=torch.float16)
    for name, a, g, b in zip(("dq", "dk", "dv"), (qq.grad, kk.grad, vv.grad), golden, base):
        assert_close_to_golden(f"pythonic.{name}", a, g, b, factor=3,
                               reduction=nsa_reductions(q, k, v, Q_LENS, COUNT * BLOCK, topk)[name])
