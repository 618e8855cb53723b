"""Self-checks of the NSA golden (``attnops.testing.golden_nsa``) against independent formulations."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnops.testing import golden_nsa as G

from .nsa_helpers import F64, cum, randn, random_topk


def test_cum_to_lengths():
    assert G.cum_to_lengths([0, 5, 9]) == [0, 5, 4]
    assert G.cum_to_lengths([3, 3, 7]) == [3, 0, 4]
    assert G.cum_to_lengths([2, 5, 0, 0]) == [2, 3, 0, 0]
    with pytest.raises(ValueError):
        G.cum_to_lengths([4, 2, 5])


def test_compress_matches_unfold_and_drops_tails():
    lens = [0, 7, 8, 21, 3]  # empty batch, short sequence, exact block, tail dropped, short
    x = randn(sum(lens), 3, 5, dtype=F64, seed=1)
    w = randn(8, 3, dtype=F64, seed=2)
    out = G.nsa_compress(x, w, 8, 4, cum(lens))
    rows = []
    start = 0
    for n in lens:
        if n >= 8:
            win = x[start:start + n].unfold(0, 8, 4)  # [nb, N, D, l]
            rows.append(torch.einsum("cndw,wn->cnd", win, w))
        start += n
    want = torch.cat(rows)
    assert out.shape == (1 + 4, 3, 5)  # (8-8)//4+1 = 1 ; (21-8)//4+1 = 4
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    # a leading 0 is an empty batch; None means one batch
    torch.testing.assert_close(G.nsa_compress(x, w, 8, 4, [0] + cum(lens)), out)
    torch.testing.assert_close(G.nsa_compress(x[:21], w, 8, 4, None), G.nsa_compress(x[:21], w, 8, 4, [21]))
    assert G.nsa_compress(x[:7], w, 8, 4, [7]).shape == (0, 3, 5)


def test_compress_backward_matches_spec_loops():
    lens = [0, 13, 11]
    x = randn(24, 2, 3, dtype=F64, seed=3)
    w = randn(4, 2, dtype=F64, seed=4)
    out = G.nsa_compress(x, w, 4, 2, cum(lens))
    dy = randn(*out.shape, dtype=F64, seed=5)
    gi, gw = G.nsa_compress_backward(dy, x, w, 4, 2, cum(lens))
    want_i, want_w = torch.zeros_like(x), torch.zeros_like(w)
    c, start = 0, 0
    for n in lens:
        for kk in range(0 if n < 4 else (n - 4) // 2 + 1):
            s = start + kk * 2
            for j in range(4):
                want_i[s + j] += dy[c] * w[j].unsqueeze(-1)
                want_w[j] += (dy[c] * x[s + j]).sum(-1)
            c += 1
        start += n
    assert c == out.shape[0]
    torch.testing.assert_close(gi, want_i)
    torch.testing.assert_close(gw, want_w)
    assert bool((gi[12] == 0).all()) and bool((gi[23] == 0).all())  # dropped tail tokens get no gradient


def _selected_loop(q, k, v, topk, scale, bs, q_lens, kv_lens, causal):
    """Per token, per head: gather K/V blocks, softmax. The most literal form of §7.4."""
    t1, n1, _ = q.shape
    g = n1 // k.shape[1]
    out = torch.zeros(t1, n1, v.shape[2], dtype=F64)
    smax = torch.full((t1, n1), G.FLT_LOWEST, dtype=F64)
    ssum = torch.full((t1, n1), G.FLT_MAX, dtype=F64)
    qs = ks = 0
    for sq, skv in zip(q_lens, kv_lens):
        for i in range(sq):
            for h in range(n1):
                h2 = h // g
                pos = [int(b) * bs + o for b in topk[qs + i, h2] for o in range(bs)]
                if causal:
                    pos_vis = [p for p in pos if p <= i]
                else:
                    pos_vis = pos
                if not pos_vis:
                    continue
                ksel = torch.stack([k[ks + p, h2] for p in pos_vis])
                vsel = torch.stack([v[ks + p, h2] for p in pos_vis])
                s = (ksel @ q[qs + i, h]) * scale
                m = s.max()
                e = torch.exp(s - m)
                out[qs + i, h] = (e / e.sum()) @ vsel
                smax[qs + i, h], ssum[qs + i, h] = m, e.sum()
        qs += sq
        ks += skv
    return out, smax, ssum


@pytest.mark.parametrize("causal", [False, True])
def test_selected_matches_literal_gather_loop(causal):
    q_lens, kv_lens, bs, count = [5, 0, 9], [16, 8, 24], 4, 3
    q = randn(sum(q_lens) + 2, 4, 6, dtype=F64, seed=1)  # 2 tail tokens outside every batch
    k = randn(sum(kv_lens), 2, 6, dtype=F64, seed=2)
    v = randn(sum(kv_lens), 2, 5, dtype=F64, seed=3)
    topk = random_topk(q_lens, kv_lens, 2, count, bs, seed=4, distinct=False, extra_tokens=2)
    topk[0, 0] = torch.tensor([2, 2, 3])  # duplicates and, for token 0 with causal, a fully-masked row
    out, smax, ssum = G.nsa_selected_attention(q, k, v, topk, 0.7, bs, cum(q_lens), cum(kv_lens), causal)
    w_out, w_max, w_sum = _selected_loop(q, k, v, topk, 0.7, bs, q_lens, kv_lens, causal)
    torch.testing.assert_close(out, w_out)
    torch.testing.assert_close(smax, w_max.unsqueeze(-1).expand(-1, -1, 8))
    torch.testing.assert_close(ssum, w_sum.unsqueeze(-1).expand(-1, -1, 8))
    if causal:
        assert bool((out[0, :2] == 0).all()) and smax[0, 0, 0] == G.FLT_LOWEST and ssum[0, 1, 0] == G.FLT_MAX
    assert bool((out[-2:] == 0).all()) and bool((smax[-2:] == G.FLT_LOWEST).all())


def test_selected_all_blocks_equals_sdpa():
    """Selecting every block in order is dense attention (causal: SDPA is_causal with Sq == Skv)."""
    s, bs, n1, n2 = 12, 4, 4, 2
    q, k, v = (randn(s, n, 8, dtype=F64, seed=i) for i, n in enumerate((n1, n2, n2)))
    topk = torch.arange(3, dtype=torch.int32).expand(s, n2, 3).contiguous()
    for causal in (False, True):
        out, _, _ = G.nsa_selected_attention(q, k, v, topk, 0.5, bs, [s], [s], causal)
        want = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
                                              v.repeat_interleave(2, 1).transpose(0, 1), is_causal=causal,
                                              scale=0.5).transpose(0, 1)
        torch.testing.assert_close(out, want)


def test_selected_duplicates_count_twice():
    """A block selected twice carries twice the weight: equals dense attention with a log(2) bias on it."""
    q, k, v = randn(1, 1, 4, dtype=F64, seed=1), randn(8, 1, 4, dtype=F64, seed=2), randn(8, 1, 3, dtype=F64, seed=3)
    topk = torch.tensor([[[0, 1, 1]]], dtype=torch.int32)
    out, _, ssum = G.nsa_selected_attention(q, k, v, topk, 1.0, 4, [1], [8], False)
    s = k[:, 0] @ q[0, 0]
    s[4:] += math.log(2.0)
    torch.testing.assert_close(out[0, 0], torch.softmax(s, 0) @ v[:, 0])


def test_selected_backward_finite_and_zero_for_masked_rows():
    q, k, v = randn(4, 2, 4, dtype=F64, seed=1), randn(8, 1, 4, dtype=F64, seed=2), randn(8, 1, 3, dtype=F64, seed=3)
    topk = torch.tensor([[[1]], [[0]], [[1]], [[0]]], dtype=torch.int32)  # row 0 and 2 see only the future
    dy = randn(4, 2, 3, dtype=F64, seed=4)
    dq, dk, dv = G.nsa_selected_attention_backward(dy, q, k, v, topk, 1.0, 4, [4], [8], True)
    assert all(bool(torch.isfinite(t).all()) for t in (dq, dk, dv))
    assert bool((dq[0] == 0).all()) and bool((dq[2] == 0).all()) and bool((dk[4:] == 0).all())


def test_selected_backward_with_a_given_output_uses_it_for_d():
    """With ``attention_in``, dS = P * (dP - rowsum(dy * attention_in)): the grad operator's formula."""
    q, k, v = randn(1, 1, 4, dtype=F64, seed=1), randn(4, 1, 4, dtype=F64, seed=2), randn(4, 1, 3, dtype=F64, seed=3)
    topk, dy = torch.tensor([[[1]]], dtype=torch.int32), randn(1, 1, 3, dtype=F64, seed=4)
    out = G.nsa_selected_attention(q, k, v, topk, 1.0, 2, [1], [4], False)[0]
    exact = G.nsa_selected_attention_backward(dy, q, k, v, topk, 1.0, 2, [1], [4], False)
    same = G.nsa_selected_attention_backward(dy, q, k, v, topk, 1.0, 2, [1], [4], False, attention_in=out)
    assert all(torch.allclose(a, b) for a, b in zip(exact, same))
    given = out + 0.01
    dq = G.nsa_selected_attention_backward(dy, q, k, v, topk, 1.0, 2, [1], [4], False, attention_in=given)[0]
    kb, vb = k[2:4, 0], v[2:4, 0]
    p = torch.softmax(q[0, 0] @ kb.T, 0)
    ds = p * (dy[0, 0] @ vb.T - (dy[0, 0] * given[0, 0]).sum())
    torch.testing.assert_close(dq[0, 0], ds @ kb)


def _times_formula(p, sel, m, nn):
    """§7.3 second form: sum_t times[t] * P[m*(k+1) - t], times[t] = min(t+1, nn, m+nn-1-t) (m >= nn)."""
    out = torch.zeros(p.shape[:-1] + (sel,), dtype=p.dtype)
    for kk in range(sel):
        for t in range(m + nn - 1):
            c = m * (kk + 1) - t
            if 0 <= c < p.shape[-1]:
                out[..., kk] += min(t + 1, nn, m + nn - 1 - t) * p[..., c]
    return out


@pytest.mark.parametrize("m,nn", [(4, 2), (2, 2), (3, 1), (8, 2), (4, 4)])
def test_importance_literal_equals_times_form(m, nn):
    p = randn(3, 11, dtype=F64, seed=m * 10 + nn).abs()
    sel = -(-11 // m)
    torch.testing.assert_close(G.importance_score_literal(p, sel, m, nn), _times_formula(p, sel, m, nn))


def test_compress_attention_no_mask_equals_sdpa_and_blocked_stats():
    q_lens, c_lens = [3, 5], [4, 6]
    q = randn(8, 4, 8, dtype=F64, seed=1)
    k = randn(10, 2, 8, dtype=F64, seed=2)
    v = randn(10, 2, 6, dtype=F64, seed=3)
    out, topk, smax, ssum = G.nsa_compress_attention(q, k, v, 0.4, 4, 32, 16, 32, 2, None, None, cum(q_lens),
                                                     cum(c_lens), [2, 5])
    qs = ks = 0
    flat_max = []
    for sq, sc in zip(q_lens, c_lens):
        qb = q[qs:qs + sq].transpose(0, 1)
        kb = k[ks:ks + sc].repeat_interleave(2, 1).transpose(0, 1)
        vb = v[ks:ks + sc].repeat_interleave(2, 1).transpose(0, 1)
        want = F.scaled_dot_product_attention(qb, kb, vb, scale=0.4).transpose(0, 1)
        torch.testing.assert_close(out[qs:qs + sq], want)
        flat_max.append((0.4 * qb @ kb.transpose(-1, -2)).amax(-1))  # [N1, Sq_b]
        qs += sq
        ks += sc
    blocked = torch.cat([m.reshape(-1) for m in flat_max])  # concat_b of [N1, Sq_b]
    torch.testing.assert_close(smax.reshape(-1, 8)[:, 0], blocked)
    assert bool((smax == smax[..., :1]).all()) and bool((ssum > 0).all())
    assert topk.shape == (8, 2, 2) and topk.dtype == torch.int32


def test_compress_attention_topk_ties_mask_and_masked_rows():
    """Fully-masked rows: out 0, invalid stats, scores 0 -> indices 0..count-1; topk_mask forces blocks."""
    q = randn(4, 2, 4, dtype=F64, seed=1)
    k = randn(8, 1, 4, dtype=F64, seed=2)
    v = randn(8, 1, 4, dtype=F64, seed=3)
    mask = torch.zeros(4, 8, dtype=torch.bool)
    mask[0] = True  # row 0 fully masked
    mask[1, 1:] = True  # row 1 sees column 0 only
    tmask = torch.zeros(4, 4, dtype=torch.bool)
    tmask[2, 3] = True
    tmask[3, 2] = tmask[3, 1] = True
    out, topk, smax, ssum, scores = G.nsa_compress_attention(q, k, v, 1.0, 2, 32, 16, 32, 3, mask, tmask, [4], [8],
                                                             [4], return_scores=True)
    assert bool((out[0] == 0).all())
    blocked_max = smax.reshape(2, 4, 8)  # [N1, Sq, 8] for one batch
    assert bool((blocked_max[:, 0] == G.FLT_LOWEST).all()) and bool((ssum.reshape(2, 4, 8)[:, 0] == G.FLT_MAX).all())
    assert topk[0, 0].tolist() == [0, 1, 2]  # all scores 0: lower indices first
    # row 1: P = 1 on column 0 per head; m = 2, nn = 2: block 0 covers columns 2,1,1,0 -> score 2 heads * 1
    torch.testing.assert_close(scores[0][1, 0], torch.tensor([2.0, 0, 0, 0], dtype=F64))
    assert topk[1, 0].tolist() == [0, 1, 2]
    assert topk[2, 0, 0] == 3
    assert topk[3, 0, :2].tolist() == [1, 2]  # forced blocks tie: lower index first
