"""nsa_compress_attention (output, statistics, top-k, gradients) through the Pythonic API vs the fp64 golden."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.testing import golden_nsa as G

from .nsa_helpers import F64, causal_cmp_mask, check_compress_attention, cum, randn, sel_cum

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _inputs(q_lens, cmp_lens, n1, n2, d, dv, dtype, *, seed=0, scale=1.0):
    q = randn(sum(q_lens), n1, d, dtype=dtype, seed=seed, scale=scale)
    k = randn(sum(cmp_lens), n2, d, dtype=dtype, seed=seed + 1, scale=scale)
    v = randn(sum(cmp_lens), n2, dv, dtype=dtype, seed=seed + 2)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
def test_compress_attention_varlen_no_mask(dtype):
    q_lens, cmp_lens = [5, 9], [7, 12]
    q, k, v = _inputs(q_lens, cmp_lens, 4, 2, 16, 8, dtype, seed=1)
    check_compress_attention(q, k, v, block=32, stride=16, select_block=64, count=2, q_lens=q_lens,
                             cmp_lens=cmp_lens)


@pytest.mark.parametrize("dtype", DTYPES)
def test_compress_attention_causal_mask_and_forced_blocks(dtype):
    """The NSA masks: compressed blocks visible once complete, block 0 and the local block forced."""
    l, d, ls = 32, 16, 64
    seq = [96, 160]
    cmp_lens = [(n - l) // d + 1 for n in seq]  # 5, 9
    q, k, v = _inputs(seq, cmp_lens, 2, 1, 16, 16, dtype, seed=2)
    mask = causal_cmp_mask(seq, cmp_lens, l, d)
    mask[:l - 1] = False  # rows before the first complete block would be fully masked; keep them defined
    own = (torch.arange(max(seq)) // ls).unsqueeze(1)
    sel_max = max(-(-c // (ls // d)) for c in cmp_lens)
    cols = torch.arange(sel_max).unsqueeze(0)
    tmask = (cols == 0) | (cols == own)
    check_compress_attention(q, k, v, block=l, stride=d, select_block=ls, count=2, q_lens=seq, cmp_lens=cmp_lens,
                             atten_mask=mask, topk_mask=tmask)


def test_compress_attention_causal_and_forced_block_rules():
    """``causal=True`` and ``local_blocks``: the layer's masks as rules, exactly as the golden's dense masks."""
    l, d, ls = 32, 16, 32
    seq = [130, 230]
    cmp_lens = [(n - l) // d + 1 for n in seq]
    q, k, v = _inputs(seq, cmp_lens, 2, 1, 16, 16, torch.float32, seed=6)
    check_compress_attention(q, k, v, block=l, stride=d, select_block=ls, count=4, q_lens=seq, cmp_lens=cmp_lens,
                             causal=True, local_blocks=2, backward=False)
    with pytest.raises(attnops.ParamInvalidError, match="topk_mask"):
        attnops.nsa_compress_attention(q, k, v, compress_block_size=l, compress_stride=d, select_block_size=ls,
                                       select_block_count=4, causal=True, local_blocks=2,
                                       topk_mask=torch.ones(max(seq), 8, dtype=torch.bool),
                                       actual_seq_qlen=cum(seq), actual_cmp_seq_kvlen=cum(cmp_lens))


def test_compress_attention_rules_from_a_position_offset():
    """``position_offset``: a chunk of new tokens after cached ones, its rows at positions ``offset + i`` in both
    rules (forward and backward, several sequences)."""
    l, d, ls = 32, 16, 32
    seq, offset = [20, 45], 70
    cmp_lens = [(offset + n - l) // d + 1 for n in seq]
    q, k, v = _inputs(seq, cmp_lens, 2, 1, 16, 16, torch.float32, seed=8)
    check_compress_attention(q, k, v, block=l, stride=d, select_block=ls, count=2, q_lens=seq, cmp_lens=cmp_lens,
                             causal=True, local_blocks=2, position_offset=offset)
    with pytest.raises(attnops.ParamInvalidError, match="position_offset"):
        attnops.nsa_compress_attention(q, k, v, compress_block_size=l, compress_stride=d, select_block_size=ls,
                                       select_block_count=2, position_offset=3, actual_seq_qlen=cum(seq),
                                       actual_cmp_seq_kvlen=cum(cmp_lens))


def test_compress_attention_fully_masked_rows():
    """Rows before the first complete compressed block: out 0, invalid stats, zero gradients, indices 0..k-1."""
    l, d, ls = 32, 16, 32
    seq = [40]
    cmp_lens = [2]
    q, k, v = _inputs(seq, cmp_lens, 2, 2, 8, 8, torch.float32, seed=3)
    mask = causal_cmp_mask(seq, cmp_lens, l, d)
    res = check_compress_attention(q, k, v, block=l, stride=d, select_block=ls, count=1, q_lens=seq,
                                   cmp_lens=cmp_lens, atten_mask=mask)
    assert bool((res["out"][:31] == 0).all())
    assert bool((res["smax"].reshape(2, 40, 8)[:, :31] == G.FLT_LOWEST).all())
    assert bool((res["topk"][:31] == 0).all())


@pytest.mark.parametrize("g", [1, 4, 16])
def test_compress_attention_gqa(g):
    q_lens, cmp_lens = [4, 6], [8, 9]
    n2 = 2 if g < 16 else 1
    q, k, v = _inputs(q_lens, cmp_lens, n2 * g, n2, 8, 8, torch.float32, seed=4)
    check_compress_attention(q, k, v, block=32, stride=16, select_block=32, count=3, q_lens=q_lens,
                             cmp_lens=cmp_lens)


@pytest.mark.parametrize("l,d,ls", [(32, 16, 32), (32, 16, 64), (16, 16, 48), (48, 16, 64), (64, 32, 128)])
def test_compress_attention_geometries(l, d, ls):
    q_lens, cmp_lens = [3, 5], [9, 13]
    q, k, v = _inputs(q_lens, cmp_lens, 2, 1, 16, 16, torch.float32, seed=5)
    count = min(-(-c // (ls // d)) for c in cmp_lens)
    check_compress_attention(q, k, v, block=l, stride=d, select_block=ls, count=count, q_lens=q_lens,
                             cmp_lens=cmp_lens, backward=False)


def test_compress_attention_random_masks():
    q_lens, cmp_lens = [6, 4], [10, 7]
    q, k, v = _inputs(q_lens, cmp_lens, 4, 2, 8, 4, torch.float16, seed=6)
    g = torch.Generator().manual_seed(7)
    mask = torch.rand(6, 10, generator=g) < 0.4
    mask[:, 0] = False
    tmask = (torch.rand(6, 5, generator=g) < 0.2).to(torch.uint8)
    check_compress_attention(q, k, v, block=32, stride=16, select_block=32, count=3, q_lens=q_lens,
                             cmp_lens=cmp_lens, atten_mask=mask, topk_mask=tmask)


def test_compress_attention_topk_exact_with_separated_scores():
    """Scores made well separated (peaked attention on one compressed key per row): indices must match exactly."""
    sq, cmp = 8, 16
    d = 16
    k = torch.zeros(cmp, 1, d, dtype=torch.float16)
    k[torch.arange(cmp), 0, torch.arange(cmp)] = 1.0  # orthonormal compressed keys
    q = torch.zeros(sq, 2, d, dtype=torch.float16)
    g = torch.Generator().manual_seed(8)
    for i in range(sq):
        w = torch.randperm(cmp, generator=g).float() / 2  # distinct logits 0, 0.5, ..., 7.5
        q[i, 0] = w
        q[i, 1] = w.flip(0) * 0.5
    v = randn(cmp, 1, 8, dtype=torch.float16, seed=9)
    res = check_compress_attention(q, k, v, block=32, stride=16, select_block=32, count=4, q_lens=[sq],
                                   cmp_lens=[cmp], scale=1.0)
    assert torch.equal(res["topk"], res["golden_topk"])


def test_compress_attention_default_scale_and_cu_seqlens():
    q_lens, cmp_lens = [3, 4], [5, 6]
    q, k, v = _inputs(q_lens, cmp_lens, 2, 1, 8, 8, F64, seed=10)
    r1 = attnops.nsa_compress_attention(q, k, v, compress_block_size=32, compress_stride=16, select_block_size=32,
                                        select_block_count=2, actual_seq_qlen=cum(q_lens),
                                        actual_cmp_seq_kvlen=cum(cmp_lens))
    r2 = attnops.nsa_compress_attention(q, k, v, compress_block_size=32, compress_stride=16, select_block_size=32,
                                        select_block_count=2, cu_seqlens_q=[0] + cum(q_lens),
                                        cu_seqlens_cmp=[0] + cum(cmp_lens))
    assert isinstance(r1, attnops.CompressAttentionResult)
    for a, b in zip(r1, r2):
        assert torch.equal(a, b)
    g = G.nsa_compress_attention(q, k, v, 8 ** -0.5, 2, 32, 16, 32, 2, None, None, cum(q_lens), cum(cmp_lens),
                                 sel_cum(cmp_lens, 32, 16))
    torch.testing.assert_close(r1.out, g[0])
    assert torch.equal(r1.topk_indices, g[1])
