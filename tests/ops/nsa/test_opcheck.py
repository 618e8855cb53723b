"""torch.library.opcheck on the NSA custom ops (schema, fake kernels, autograd registration, AOT dispatch)."""
from __future__ import annotations

import pytest
import torch

import attnops  # noqa: F401  (registers the ops)

from .nsa_helpers import randn, random_topk


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_opcheck_nsa_compress(dtype):
    x = randn(23, 2, 16, dtype=dtype, seed=1).requires_grad_()
    w = randn(4, 2, dtype=dtype, seed=2).requires_grad_()
    torch.library.opcheck(torch.ops.attnops.nsa_compress.default, (x, w, 4, 2, [0, 9, 23], 0))


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_nsa_selected_attention(causal):
    q_lens, kv_lens = [3, 4], [8, 12]
    q = randn(7, 4, 8, seed=3).requires_grad_()
    k = randn(20, 2, 8, seed=4).requires_grad_()
    v = randn(20, 2, 4, seed=5).requires_grad_()
    topk = random_topk(q_lens, kv_lens, 2, 2, 4, seed=6)
    mask = torch.ones(4, 4, dtype=torch.bool).triu(1) if causal else None
    torch.library.opcheck(torch.ops.attnops.nsa_selected_attention.default,
                          (q, k, v, topk, mask, 0.5, 4, 4, 2, [3, 7], [8, 20], 2 if causal else 0))


def test_opcheck_nsa_compress_attention():
    q = randn(7, 2, 8, seed=7).requires_grad_()
    k = randn(9, 1, 8, seed=8).requires_grad_()
    v = randn(9, 1, 4, seed=9).requires_grad_()
    mask = torch.zeros(4, 5, dtype=torch.bool)
    mask[0, 3:] = True
    tmask = torch.zeros(4, 3, dtype=torch.bool)
    tmask[:, 0] = True
    torch.library.opcheck(torch.ops.attnops.nsa_compress_attention.default,
                          (q, k, v, tmask, mask, 0.5, 2, 32, 16, 32, 2, [3, 7], [4, 9], [2, 5], 1))


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_nsa_compress_attention_grad(causal):
    """The backward op of compressed attention, with a mask tensor or the causal rule computed by the kernels."""
    q, k, v = randn(7, 2, 8, seed=10), randn(9, 1, 8, seed=11), randn(9, 1, 4, seed=12)
    mask = None if causal else torch.zeros(4, 5, dtype=torch.bool)
    lens = ([3, 7], [4, 9])
    out, _, smax, ssum = torch.ops.attnops.nsa_compress_attention(q, k, v, None, mask, 0.5, 2, 32, 16, 32, 2, *lens,
                                                                  [2, 5], 0 if causal else 1, causal)
    torch.library.opcheck(torch.ops.attnops.nsa_compress_attention_grad.default,
                          (randn(7, 2, 4, seed=13), q, k, v, out, smax, ssum, mask, 0.5, 2, 32, 16, *lens,
                           0 if causal else 1, causal))


def test_opcheck_nsa_window_attention():
    q = randn(9, 4, 8, seed=10).requires_grad_()
    k = randn(9, 2, 8, seed=11).requires_grad_()
    v = randn(9, 2, 4, seed=12).requires_grad_()
    torch.library.opcheck(torch.ops.attnops.nsa_window_attention.default, (q, k, v, [4, 9], 3, 0.5))
    q, k, v = q.detach(), k.detach(), v.detach()
    out, smax, ssum = torch.ops.attnops.nsa_window_attention(q, k, v, [4, 9], 3, 0.5)
    dy = randn(9, 4, 4, seed=13)
    torch.library.opcheck(torch.ops.attnops.nsa_window_attention_grad.default,
                          (dy, q, k, v, out, smax, ssum, [4, 9], 3, 0.5))
