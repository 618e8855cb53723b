"""The indexer's KL loss and its fused gradients vs the fp64 golden (autograd through the golden loss)."""
from __future__ import annotations

import pytest
import torch

import attnops
import attnops.torch_npu
from attnops.ops.dsa import kl_loss
from attnops.ops.dsa.problem import row_chunks
from attnops.testing import golden_dsa as G
from attnops.testing.compare import assert_close_to_golden, kl_reductions

from .dsa_helpers import pack_rows, randn, random_rows


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
    red = kl_reductions(s, heads, d, dr, ni, di, k)
    assert_close_to_golden("loss", loss[0], golden[0], base[0], reduction=red["loss"])
    for name, leaf, g, b in zip(("d_query_index", "d_key_index", "d_weights"), leaves, golden[1:], base[1:]):
        assert_close_to_golden(name, leaf.grad.reshape(g.shape), 2 * g, 2 * b, factor=3.0, reduction=red[name])


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
    assert_close_to_golden("d_weights", leaves[2].grad[0], golden[3], base[3], factor=3.0,
                           reduction=kl_reductions(s, 2, 8, 0, 2, 8, k)["d_weights"])



def _golden_over_batches(qs, ks, qis, kis, ws, rows, maxes, sums, scale, dtype=torch.float64):
    """The golden per batch, concatenated: ``(loss, d_qi [R, Ni, Di], d_ki [R2, 1, Di], d_w [R, Ni])``."""
    parts = [G.indexer_kl_loss_grad(*args, scale, dtype=dtype)
             for args in zip(qs, ks, qis, kis, ws, rows, maxes, sums)]
    return (sum(p[0] for p in parts), torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])[:, None],
            torch.cat([p[3] for p in parts]))


def _check_tnd_against_golden(q_lens, k_lens, count, dtype, rows=None):
    """torch_npu's op on random multi-batch TND inputs (its head dims: 512, indexer 128; SFA statistics from the
    golden; ``rows``: index rows per batch, default random) vs the golden batch by batch. float32: the gradients
    under the tolerance rule; float64 (the same code path in fp64): loss and gradients to fp64 precision. (The
    float32 loss is a sum of ``T * K`` rounded terms whose error against a plain fp32 sum is a ratio of two rounding
    noises, so it is judged in fp64.)"""
    heads, ni, scale = 2, 2, 0.05
    qs = [randn(n, heads, 512, seed=10 + b, dtype=dtype) for b, n in enumerate(q_lens)]
    ks = [randn(n, 512, seed=20 + b, dtype=dtype) for b, n in enumerate(k_lens)]
    qis = [randn(n, ni, 128, seed=30 + b, dtype=dtype) for b, n in enumerate(q_lens)]
    kis = [randn(n, 128, seed=40 + b, dtype=dtype) for b, n in enumerate(k_lens)]
    ws = [randn(n, ni, seed=50 + b, dtype=dtype).abs() for b, n in enumerate(q_lens)]
    rows = rows or random_rows(q_lens, k_lens, count)
    stats = [G.sparse_flash_attention(q, k, k, r, scale)[1:] for q, k, r in zip(qs, ks, rows)]
    maxes, sums = [m for m, _ in stats], [s for _, s in stats]
    cumulative = lambda lens: torch.tensor(lens).cumsum(0).tolist()
    got = attnops.torch_npu.npu_sparse_lightning_indexer_grad_kl_loss(
        torch.cat(qs), torch.cat(ks)[:, None], torch.cat(qis), torch.cat(kis)[:, None], torch.cat(ws),
        pack_rows(rows, "TND"), torch.cat(maxes)[None].to(dtype), torch.cat(sums)[None].to(dtype), scale,
        actual_seq_qlen=cumulative(q_lens), actual_seq_klen=cumulative(k_lens), layout="TND")
    golden = _golden_over_batches(qs, ks, qis, kis, ws, rows, maxes, sums, scale)
    names = ("d_query_index", "d_key_index", "d_weights")
    assert [tuple(g.shape) for g in got[:3]] == [tuple(g.shape) for g in golden[1:]]
    if dtype == torch.float64:
        for name, g, gold in zip(("loss",) + names, (got[3][0],) + got[:3], golden):
            torch.testing.assert_close(g, gold, rtol=1e-10, atol=1e-12, msg=name)
        return
    base = _golden_over_batches(qs, ks, qis, kis, ws, rows, [m.float() for m in maxes], [s.float() for s in sums],
                                scale, dtype=torch.float32)
    red = kl_reductions(max(q_lens), heads, 512, 0, ni, 128, count)
    for name, g, gold, b in zip(names, got[:3], golden[1:], base[1:]):
        assert_close_to_golden(name, g, gold, b, factor=3.0, reduction=red[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("q_lens, k_lens", [([4, 4], [4, 4]), ([3, 0, 6, 1], [5, 2, 6, 4])])
def test_multi_batch_tnd_matches_golden(q_lens, k_lens, dtype):
    """Every batch after the first: its rows, keys and statistics start past the previous batches'."""
    _check_tnd_against_golden(q_lens, k_lens, 3, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_two_batches_with_padded_and_unordered_rows(dtype):
    """Rows ending in -1 past the causal limit and rows not sorted by position, two batches of 4."""
    rows = [[0, -1], [0, 1], [1, 2], [3, 0]]
    _check_tnd_against_golden([4, 4], [4, 4], 2, dtype, rows=[rows, rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_long_batch_split_into_row_chunks_matches_golden(monkeypatch, dtype):
    """A batch longer than one row chunk (the chunk budget shrunk so that its 40 rows make six chunks)."""
    chunks = []

    def seven_row_chunks(problem, bytes_per_row):
        for chunk in row_chunks(problem, bytes_per_row, budget=7 * bytes_per_row):
            chunks.append(chunk)
            yield chunk

    monkeypatch.setattr(kl_loss, "row_chunks", seven_row_chunks)
    _check_tnd_against_golden([40], [40], 4, dtype)
    assert [lo for _, lo, _ in chunks] == [0, 7, 14, 21, 28, 35]
