"""attnops.native_sparse_attention beyond the NPU's constraints: any length, BSND, branch toggles, external
indices, per-token counts, mean pooling; strictly causal (prefix invariance)."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.testing import golden_nsa as G
from attnops.testing.golden import fa_forward

from .nsa_helpers import F64, randn

CFG = dict(compress_block_size=8, compress_stride=4, select_block_size=8, select_block_count=3, window_size=6,
           scale=0.4)
N1, N2, D, DV = 4, 2, 8, 4


def _inputs(t, seed=0):
    q, k, v = randn(t, N1, D, dtype=F64, seed=seed), randn(t, N2, D, dtype=F64, seed=seed + 1), \
        randn(t, N2, DV, dtype=F64, seed=seed + 2)
    gates = torch.sigmoid(randn(t, N1, 3, dtype=F64, seed=seed + 3))
    wk, wv = randn(8, N2, dtype=F64, seed=seed + 4), randn(8, N2, dtype=F64, seed=seed + 5)
    return q, k, v, gates, wk, wv


def _nsa(q, k, v, gates, wk, wv, **kw):
    return attnops.native_sparse_attention(q, k, v, gates, wk, wv, **{**CFG, **kw})


@pytest.mark.parametrize("lens,prefix", [([137], 100), ([5], 3), ([1], 1), ([23, 41], 17)])
def test_prefix_invariance_any_length(lens, prefix):
    q, k, v, gates, wk, wv = _inputs(sum(lens))
    full = _nsa(q, k, v, gates, wk, wv, cu_seqlens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]))
    s = lens[-1] - prefix  # cut the last sequence to its prefix
    cut = sum(lens) - s
    part = _nsa(q[:cut], k[:cut], v[:cut], gates[:cut], wk, wv,
                cu_seqlens=torch.tensor([0, *torch.tensor(lens[:-1] + [prefix]).cumsum(0).tolist()]))
    torch.testing.assert_close(part, full[:cut], rtol=1e-10, atol=1e-12)
    assert full.isfinite().all()


def test_bsnd_equals_packed_tnd():
    b, s = 3, 21
    q, k, v, gates, wk, wv = _inputs(b * s)
    packed = _nsa(q, k, v, gates, wk, wv, cu_seqlens=torch.arange(b + 1) * s)
    bsnd = _nsa(*(x.unflatten(0, (b, s)) for x in (q, k, v, gates)), wk, wv, layout="BSND")
    assert bsnd.shape == (b, s, N1, DV)
    torch.testing.assert_close(bsnd.flatten(0, 1), packed, rtol=1e-12, atol=1e-12)


def test_branch_toggles_sum_to_the_whole():
    q, k, v, gates, wk, wv = _inputs(45)
    g = dict(g_cmp=gates[..., 0], g_slc=gates[..., 1], g_swa=gates[..., 2])
    whole = _nsa(q, k, v, None, wk, wv, **g)
    torch.testing.assert_close(whole, _nsa(q, k, v, gates, wk, wv), rtol=1e-12, atol=1e-12)
    parts = [_nsa(q, k, v, None, wk, wv, **{name: t}) for name, t in g.items()]
    torch.testing.assert_close(sum(parts), whole, rtol=1e-10, atol=1e-12)
    no_window = _nsa(q, k, v, gates, wk, wv, window_size=0)
    torch.testing.assert_close(no_window, parts[0] + parts[1], rtol=1e-10, atol=1e-12)


def _window_golden(q, k, v, t, window):
    act = [t]
    triu = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    return fa_forward(q, k, v, head_num=N1, input_layout="TND", atten_mask=triu, scale=0.4, pre_tokens=window - 1,
                      next_tokens=0, actual_seq_qlen=act, actual_seq_kvlen=act, sparse_mode=4)[0]


def _selected_golden(q, k, v, idx, t):
    """Dense selected attention of each token over the listed blocks (-1 ignored), positions <= the token."""
    out = torch.zeros(t, N1, DV, dtype=F64)
    pos = torch.arange(t)
    for i in range(t):
        for h in range(N1):
            blocks = [int(b) for b in idx[i, h // (N1 // N2)] if b >= 0]
            keep = torch.zeros(t, dtype=torch.bool)
            for b in blocks:
                keep |= (pos // 8) == b
            keep &= pos <= i
            if keep.any():
                s = 0.4 * k[keep, h // (N1 // N2)] @ q[i, h]
                out[i, h] = torch.softmax(s, 0) @ v[keep, h // (N1 // N2)]
    return out


def test_external_block_indices_equal_selected_attention_on_them():
    t = 29
    q, k, v, gates, wk, wv = _inputs(t)
    own = torch.arange(t) // 8
    gen = torch.Generator().manual_seed(7)
    # distinct blocks at or before the token's own one, in any order, -1 anywhere
    idx = torch.stack([torch.randperm(4, generator=gen)[:3] for _ in range(t * N2)]).view(t, N2, 3)
    idx = torch.where(idx > own.view(-1, 1, 1), torch.full_like(idx, -1), idx)
    out = _nsa(q, k, v, None, None, None, g_slc=torch.ones(t, N1, dtype=F64), block_indices=idx)
    torch.testing.assert_close(out, _selected_golden(q, k, v, idx, t), rtol=1e-10, atol=1e-12)
    counts = torch.randint(0, 4, (t, N2), generator=gen)
    limited = torch.where(torch.arange(3) < counts.unsqueeze(-1), idx, torch.full_like(idx, -1))
    out = _nsa(q, k, v, None, None, None, g_slc=torch.ones(t, N1, dtype=F64), block_indices=idx,
               block_counts=counts)
    torch.testing.assert_close(out, _selected_golden(q, k, v, limited, t), rtol=1e-10, atol=1e-12)


def test_block_indices_after_the_token_are_rejected():
    q, k, v, gates, wk, wv = _inputs(16)
    idx = torch.full((16, N2, 3), -1)
    idx[0, 0, 0] = 1
    with pytest.raises(Exception, match="block_indices"):
        _nsa(q, k, v, gates, wk, wv, block_indices=idx)


def test_mean_pooling_compression_by_hand():
    t = 27
    q, k, v, gates, wk, wv = _inputs(t)
    out = _nsa(q, k, v, None, None, None, g_cmp=torch.ones(t, N1, dtype=F64), compress="mean")
    n_cmp = (t - 8) // 4 + 1
    kc = torch.stack([k[4 * c:4 * c + 8].mean(0) for c in range(n_cmp)])
    vc = torch.stack([v[4 * c:4 * c + 8].mean(0) for c in range(n_cmp)])
    want = torch.zeros(t, N1, DV, dtype=F64)
    for i in range(t):
        visible = [c for c in range(n_cmp) if 4 * c + 7 <= i]
        for h in range(N1):
            if visible:
                s = 0.4 * kc[visible, h // 2] @ q[i, h]
                want[i, h] = torch.softmax(s, 0) @ vc[visible, h // 2]
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)


def test_default_selection_matches_golden_topk_with_unused_slots_ignored():
    """Any length: the golden compression + top-k on the zero-padded sequence, future blocks dropped."""
    t = 37
    q, k, v, gates, wk, wv = _inputs(t)
    out = _nsa(q, k, v, None, wk, wv, g_slc=torch.ones(t, N1, dtype=F64), local_blocks=1)
    pad = 48  # max(ceil(37/8) + 1, 3) blocks of 8
    kp = torch.cat([k, k.new_zeros(pad - t, N2, D)])
    vp = torch.cat([v, v.new_zeros(pad - t, N2, DV)])
    k_cmp, v_cmp = G.nsa_compress(kp, wk, 8, 4, [pad]), G.nsa_compress(vp, wv, 8, 4, [pad])
    n_cmp = (pad - 8) // 4 + 1
    mask = (torch.arange(n_cmp) * 4 + 7).unsqueeze(0) > torch.arange(t).unsqueeze(1)
    own = (torch.arange(t) // 8).unsqueeze(1)
    cols = torch.arange(pad // 8).unsqueeze(0)
    tmask = (cols == 0) | (cols == own)
    topk = G.nsa_compress_attention(q, k_cmp, v_cmp, 0.4, N1, 8, 4, 8, 3, mask, tmask, [t], [n_cmp], [pad // 8])[1]
    topk = torch.where(topk.long() > own.unsqueeze(-1), -1, topk.long())
    torch.testing.assert_close(out, _selected_golden(q, k, v, topk, t), rtol=1e-10, atol=1e-12)


def test_compression_branch_is_zero_before_the_first_complete_block():
    q, k, v, gates, wk, wv = _inputs(11)
    out = _nsa(q, k, v, None, wk, wv, g_cmp=torch.ones(11, N1, dtype=F64))
    assert out[:7].abs().max() == 0 and out[7:].abs().min() > 0  # block 0 covers tokens 0..7
