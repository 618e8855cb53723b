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
    ref = [t.double().requires_grad_() for t in (qi, ki, w)]
    golden = G.indexer_kl_loss(q, kk, *ref, rows, row_max, row_sum, 0.25, q_rope=qr, k_rope=kr)
    (golden * 2).backward()
    assert loss.shape == (1,) and loss.dtype == torch.float32
    assert_close_to_golden("loss", loss[0], golden.detach(), None, floor=1e-5)
    for name, leaf, g in zip(("d_query_index", "d_key_index", "d_weights"), leaves, ref):
        assert_close_to_golden(name, leaf.grad.reshape(g.grad.shape), g.grad, None, factor=3.0, floor=1e-5)
