"""The indexer's KL loss and its fused gradients vs the fp64 golden (autograd through the golden loss)."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.testing import golden_dsa as G
from attnops.testing.compare import assert_close_to_golden

from .dsa_helpers import randn


@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_loss_and_grads_match_golden(layout):
    s, heads, ni, d, dr, di, k = 7, 4, 2, 16, 4, 8, 4
    q, qr = randn(s, heads, d, seed=1), randn(s, heads, dr, seed=2)
    kk, kr = randn(s, d, seed=3), randn(s, dr, seed=4)
    qi, ki, w = randn(s, ni, di, seed=5), randn(s, di, seed=6), randn(s, ni, seed=7).abs()
    rows = [list(range(min(k, i + 1)))[::-1] + [-1] * (k - min(k, i + 1)) for i in range(s)]
    _, row_max, row_sum = G.sparse_flash_attention(q, kk, kk, rows, 0.25, q_rope=qr, k_rope=kr)
    stats = (lambda x: x[None].float()) if layout == "TND" else (lambda x: x[None, None].float())
    lead = (lambda x: x) if layout == "TND" else (lambda x: x[None])
    idx = torch.tensor(rows, dtype=torch.int32)[:, None]
    lens = dict(actual_seq_lengths_query=[s], actual_seq_lengths_key=[s]) if layout == "TND" else {}
    leaves = [t.clone().requires_grad_() for t in (lead(qi), lead(ki[:, None]), lead(w))]
    loss = attnops.lightning_indexer_kl_loss(
        lead(q), lead(kk[:, None]), *leaves, lead(idx), stats(row_max), stats(row_sum), scale=0.25,
        query_rope=lead(qr), key_rope=lead(kr[:, None]), layout=layout, **lens)
    (loss * 2).sum().backward()
    golden = G.indexer_kl_loss_grad(q, kk, qi, ki, w, rows, row_max, row_sum, 0.25, q_rope=qr, k_rope=kr)
    base = G.indexer_kl_loss_grad(q, kk, qi, ki, w, rows, row_max.float(), row_sum.float(), 0.25, q_rope=qr,
                                  k_rope=kr, dtype=torch.float32)
    assert loss.shape == (1,) and loss.dtype == torch.float32
    assert_close_to_golden("loss", loss[0], golden[0], base[0])
    for name, leaf, g, b in zip(("d_query_index", "d_key_index", "d_weights"), leaves, golden[1:], base[1:]):
        assert_close_to_golden(name, leaf.grad.reshape(g.shape), 2 * g, 2 * b, factor=3.0)


def test_clamped_probabilities_keep_the_spec_gradient():
    """Peaked distributions (Y < 1e-8 somewhere): the gradient is Y - P, not the clamped loss's autograd."""
    s, k = 6, 6
    q, kk = randn(s, 2, 8, seed=1) * 4, randn(s, 8, seed=2) * 4
    qi, ki, w = randn(s, 2, 8, seed=3) * 4, randn(s, 8, seed=4) * 4, randn(s, 2, seed=5).abs() * 4
    rows = [list(range(i + 1)) + [-1] * (k - i - 1) for i in range(s)]
    _, m, l = G.sparse_flash_attention(q, kk, kk, rows, 1.0)
    idx = torch.tensor(rows, dtype=torch.int32)[None, :, None]
    leaves = [t.clone()[None].requires_grad_() for t in (qi, ki[:, None], w)]
    loss = attnops.lightning_indexer_kl_loss(q[None], kk[None, :, None], *leaves, idx, m[None, None].float(),
                                             l[None, None].float(), scale=1.0)
    loss.sum().backward()
    golden = G.indexer_kl_loss_grad(q, kk, qi, ki, w, rows, m, l, 1.0)
    base = G.indexer_kl_loss_grad(q, kk, qi, ki, w, rows, m.float(), l.float(), 1.0, dtype=torch.float32)
    assert_close_to_golden("d_weights", leaves[2].grad[0], golden[3], base[3], factor=3.0)
