"""The NSA layer's sliding-window branch (:mod:`attnops.ops.nsa.window`): exactly FlashAttention's
``causal=True, window_size=(window - 1, 0)`` on packed sequences, forward and gradients."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.ops.nsa.window import window_attention

from .nsa_helpers import randn


@pytest.mark.parametrize("window", [1, 3, 64])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_window_branch_equals_flash_attention(window, scale):
    cum = [5, 12, 13]
    leaves = [randn(13, 4, 8, seed=1), randn(13, 2, 8, seed=2), randn(13, 2, 6, seed=3)]
    dy = randn(13, 4, 6, seed=4)
    results = []
    for attention in (lambda q, k, v: window_attention(q, k, v, cum, window, scale),
                      lambda q, k, v: attnops.flash_attention(q, k, v, layout="TND", actual_seq_qlen=cum,
                                                              actual_seq_kvlen=cum, causal=True,
                                                              window_size=(window - 1, 0), scale=scale)):
        q, k, v = (x.clone().requires_grad_() for x in leaves)
        out = attention(q, k, v)
        out.backward(dy)
        results.append((out, q.grad, k.grad, v.grad))
    for got, expected in zip(*results):
        assert torch.equal(got, expected)
