"""Lightning indexer (Pythonic API) vs the fp64 golden: top-k sets and order, -1 tails, layouts, modes, values."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.testing import golden_dsa as G

from .dsa_helpers import pack_keys, pack_query, randn, unpack_rows

LAYOUTS = [("BSND", "BSND"), ("TND", "TND"), ("TND", "PA_BSND"), ("BSND", "PA_BSND")]


def _case(q_lens, k_lens, heads, d, dtype=torch.float32, seed=0):
    qs = [randn(n, heads, d, dtype=dtype, seed=seed + b) for b, n in enumerate(q_lens)]
    ws = [randn(n, heads, dtype=torch.float32, seed=seed + 10 + b).abs() for b, n in enumerate(q_lens)]
    ks = [randn(n, d, dtype=dtype, seed=seed + 20 + b) for b, n in enumerate(k_lens)]
    return qs, ws, ks


def _index(layout_q, layout_k, qs, ws, ks, count, mode, **kw):
    q, q_lens = pack_query(qs, layout_q)
    w, _ = pack_query(ws, layout_q)
    k, k_lens, table = pack_keys(ks, layout_k)
    return attnops.lightning_indexer(q, k, w, sparse_count=count, layout=layout_q, layout_key=layout_k,
                                     actual_seq_lengths_query=q_lens, actual_seq_lengths_key=k_lens,
                                     block_table=table, sparse_mode=mode, **kw)


@pytest.mark.parametrize("layout_q,layout_k", LAYOUTS)
@pytest.mark.parametrize("mode", [0, 3])
def test_indices_match_golden(layout_q, layout_k, mode):
    q_lens, k_lens = [5, 1, 8], [9, 40, 8]
    qs, ws, ks = _case(q_lens, k_lens, 4, 16, seed=1)
    res = _index(layout_q, layout_k, qs, ws, ks, 6, mode)
    got = unpack_rows(res.sparse_indices, layout_q, q_lens)[:, 0].tolist()
    want = [row for q, w, k in zip(qs, ws, ks) for row in G.lightning_indexer(q, k, w, 6, mode)]
    assert got == want  # fp32 scores: no ties at these sizes, so the ordered rows are exact
    assert res.sparse_values.shape == (0,)


def test_values_and_padding_rows():
    q_lens, k_lens = [3, 6], [4, 6]
    qs, ws, ks = _case(q_lens, k_lens, 2, 8, seed=2)
    res = _index("BSND", "BSND", qs, ws, ks, 5, 3, return_value=True)
    assert res.sparse_indices.shape == (2, 6, 1, 5) and res.sparse_indices.dtype == torch.int32
    assert (res.sparse_indices[0, 3:] == -1).all()  # padding rows of batch 0
    scores = G.lightning_scores(qs[1], ks[1], ws[1])
    for i in range(6):
        idx = res.sparse_indices[1, i, 0]
        n = int((idx >= 0).sum())
        assert n == min(5, i + 1)
        torch.testing.assert_close(res.sparse_values[1, i, 0, :n].double(), scores[i, idx[:n].long()])
        assert torch.isinf(res.sparse_values[1, i, 0, n:]).all()


def test_ties_take_the_smaller_position():
    q = torch.zeros(1, 4, 2, 8)  # every score 0
    k = torch.randn(1, 10, 1, 8)
    w = torch.ones(1, 4, 2)
    res = attnops.lightning_indexer(q, k, w, sparse_count=3, sparse_mode=0)
    assert res.sparse_indices[0, :, 0].tolist() == [[0, 1, 2]] * 4


def test_length_one_lengths_apply_to_every_batch():
    qs, ws, ks = _case([4, 4], [4, 4], 2, 8, seed=3)
    q, _ = pack_query(qs, "BSND")
    w, _ = pack_query(ws, "BSND")
    k, _, _ = pack_keys(ks, "BSND")
    one = attnops.lightning_indexer(q, k, w, sparse_count=2, actual_seq_lengths_query=torch.tensor([4], dtype=torch.int32),
                                    actual_seq_lengths_key=torch.tensor([4], dtype=torch.int32))
    none = attnops.lightning_indexer(q, k, w, sparse_count=2)
    assert torch.equal(one.sparse_indices, none.sparse_indices)


def test_memory_stays_linear(monkeypatch):
    """No [S1, S2] buffer: the largest score tensor the reference builds is [chunk, S2]."""
    from attnops.ops.dsa import indexer, problem

    sizes = []
    real = indexer.weighted_relu_scores

    def spy(*args):
        out = real(*args)
        sizes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(indexer, "weighted_relu_scores", spy)
    monkeypatch.setattr(indexer, "KEY_BLOCK", 16)
    qs, ws, ks = _case([300], [300], 2, 8, seed=4)
    q, _ = pack_query(qs, "BSND")
    w, _ = pack_query(ws, "BSND")
    k, _, _ = pack_keys(ks, "BSND")
    monkeypatch.setattr(indexer, "row_chunks", lambda p, b: problem.row_chunks(p, b, budget=1 << 14))
    attnops.lightning_indexer(q, k, w, sparse_count=8)
    assert len(sizes) > 1 and max(s[0] for s in sizes) < 300
