"""attnops.native_sparse_attention forward vs a composition of the goldens, as its docstring specifies:
compression branch (complete compressed blocks only), selection branch (top-k with block 0 and the local blocks
forced, causal), sliding window (bottom-right band of ``window_size`` tokens), gated sum."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.testing import golden_nsa as G
from attnops.testing.golden import fa_forward

from .nsa_helpers import F64, cum, randn

TRIU = torch.ones(2048, 2048, dtype=torch.bool).triu(1)


def _golden_nsa(q, k, v, gates, wk, wv, lens, *, l, d, ls, count, window, local, scale):
    act = cum(lens)
    k_cmp = G.nsa_compress(k, wk, l, d, act)
    v_cmp = G.nsa_compress(v, wv, l, d, act)
    cmp_lens = [0 if n < l else (n - l) // d + 1 for n in lens]
    max_s = max(lens)
    ends = torch.arange(max(cmp_lens)) * d + l - 1
    mask = ends.unsqueeze(0) > torch.arange(max_s).unsqueeze(1)  # block visible once complete
    own = (torch.arange(max_s) // ls).unsqueeze(1)
    cols = torch.arange(-(-max_s // ls)).unsqueeze(0)
    tmask = (cols == 0) | ((cols <= own) & (cols > own - local))
    sel = cum([-(-c // (ls // d)) for c in cmp_lens])
    o_cmp, topk, _, _ = G.nsa_compress_attention(q, k_cmp, v_cmp, scale, q.shape[1], l, d, ls, count, mask, tmask,
                                                 act, cum(cmp_lens), sel)
    o_slc = G.nsa_selected_attention(q, k, v, topk, scale, ls, act, act, True)[0]
    o_win = fa_forward(q, k, v, head_num=q.shape[1], input_layout="TND", atten_mask=TRIU, scale=scale,
                       pre_tokens=window - 1, next_tokens=0, actual_seq_qlen=act, actual_seq_kvlen=act,
                       sparse_mode=4)[0]
    g = gates.to(F64)
    return g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win


@pytest.mark.parametrize("lens,n1,n2,window", [([16, 16], 2, 1, 5), ([32, 48], 4, 2, 9), ([64], 2, 2, 64)])
def test_native_sparse_attention_matches_composed_golden(lens, n1, n2, window):
    t = sum(lens)
    cfg = dict(l=8, d=4, ls=8, count=2, window=window, local=2, scale=0.4)
    q, k, v = randn(t, n1, 8, dtype=F64, seed=1), randn(t, n2, 8, dtype=F64, seed=2), randn(t, n2, 4, dtype=F64, seed=3)
    gates = torch.sigmoid(randn(t, n1, 3, dtype=F64, seed=4))
    wk, wv = randn(8, n2, dtype=F64, seed=5), randn(8, n2, dtype=F64, seed=6)
    out = attnops.native_sparse_attention(q, k, v, gates, wk, wv, actual_seq_len=cum(lens), compress_block_size=8,
                                          compress_stride=4, select_block_size=8, select_block_count=2,
                                          window_size=window, local_blocks=2, scale=0.4)
    want = _golden_nsa(q, k, v, gates, wk, wv, lens, **cfg)
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("on", [(0, 1, 2), (0, 2), (1, 2)])
@pytest.mark.parametrize("whole", [True, False])
def test_batched_gated_sum_equals_the_elementwise_one(on, whole):
    """The gated sum's GPU form (one batched product over the branches' outputs copied into one buffer) equals the
    elementwise form, with the gates given as one ``[T, N1, 3]`` tensor or three ``[T, N1]`` ones."""
    from attnops.ops.nsa.layer import batched_gated_sum, gated_sum

    gates = torch.sigmoid(randn(6, 4, 3, dtype=F64, seed=1))
    gate = [gates[..., i] if i in on else None for i in range(3)]
    outs = {i: randn(6, 4, 5, dtype=F64, seed=2 + i) for i in on}
    want = sum(gates[..., i:i + 1] * outs[i] for i in on)
    torch.testing.assert_close(gated_sum(outs, gate, gates if whole else None), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(batched_gated_sum(outs, gate, gates if whole else None), want, rtol=1e-12, atol=1e-12)
