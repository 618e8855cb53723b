"""The NSA paper configuration (l=32, d=16, l'=64, n=16, Dqk=192, Dv=128; N1=4, N2=1) at small T, end to end:
compression of K and V, compressed attention with the causal compressed mask and forced blocks (top-k), then
selected attention on the chosen blocks. Every stage is judged against the fp64 golden on the same inputs
(the package's previous-stage outputs). fp32 through the Pythonic API, fp16 through the aclnn dialect.
"""
from __future__ import annotations

import pytest
import torch

from .nsa_helpers import causal_cmp_mask, check_compress, check_compress_attention, check_selected, cum, randn

L, D, LS, N_SEL = 32, 16, 64, 16
N1, N2, DQK, DV = 4, 1, 192, 128


def _forced(seq_lens, local=2):
    max_s = max(seq_lens)
    own = (torch.arange(max_s) // LS).unsqueeze(1)
    cols = torch.arange(-(-max_s // LS)).unsqueeze(0)
    return (cols == 0) | ((cols <= own) & (cols > own - local))


def _run(seq_lens, dtype, via):
    t = sum(seq_lens)
    q = randn(t, N1, DQK, dtype=dtype, seed=1)
    k = randn(t, N2, DQK, dtype=dtype, seed=2)
    v = randn(t, N2, DV, dtype=dtype, seed=3)
    wk = randn(L, N2, dtype=dtype, seed=4, scale=L ** -0.5)
    wv = randn(L, N2, dtype=dtype, seed=5, scale=L ** -0.5)
    act = cum(seq_lens)
    k_cmp = check_compress(k, wk, L, D, act, via=via).detach()
    v_cmp = check_compress(v, wv, L, D, act, via=via, backward=False).detach()
    cmp_lens = [(n - L) // D + 1 for n in seq_lens]
    assert k_cmp.shape == (sum(cmp_lens), N2, DQK) and v_cmp.shape == (sum(cmp_lens), N2, DV)

    res = check_compress_attention(q, k_cmp, v_cmp, block=L, stride=D, select_block=LS, count=N_SEL,
                                   q_lens=seq_lens, cmp_lens=cmp_lens,
                                   atten_mask=causal_cmp_mask(seq_lens, cmp_lens, L, D), topk_mask=_forced(seq_lens),
                                   via=via, backward=via == "api", exact_topk=False)
    topk = res["topk"]
    assert topk.shape == (t, N2, N_SEL)
    exact = float((topk == res["golden_topk"]).all(-1).float().mean())
    assert exact > 0.9, f"only {exact:.1%} of the top-k rows equal the golden's exactly"
    check_selected(q, k, v, topk, block=LS, q_lens=seq_lens, kv_lens=seq_lens, causal=True, via=via)


@pytest.mark.parametrize("via,dtype", [("api", torch.float32), ("aclnn", torch.float16)], ids=["api-fp32", "aclnn-fp16"])
def test_paper_config_one_sequence(via, dtype):
    _run([1024], dtype, via)


@pytest.mark.slow
@pytest.mark.parametrize("via,dtype", [("api", torch.float32), ("aclnn", torch.float16), ("aclnn", torch.bfloat16)],
                         ids=["api-fp32", "aclnn-fp16", "aclnn-bf16"])
def test_paper_config_two_sequences(via, dtype):
    _run([1024, 1024], dtype, via)
