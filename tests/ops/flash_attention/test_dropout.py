"""Dropout vs the fp64 golden: an explicit bit-packed drop_mask, and the Philox seed/offset generator."""
import pytest
import torch

import attnops
from attnops._core.dropout import DropoutSpec, keep_mask, pack_bits, philox_uniform
from tests.helpers import TRIU2048, check_fa, cum, make_qkv, random_keep


@pytest.mark.parametrize("layout", ["BNSD", "SBH"])
@pytest.mark.parametrize("keep_prob", [0.5, 0.9])
@pytest.mark.parametrize("drop", ["mask", "seed"])
def test_dropout_dense(layout, keep_prob, drop):
    q, k, v, dy = make_qkv(layout, b=2, n1=4, n2=2, sq=5, skv=7, seed=70)
    check_fa(q, k, v, dy, layout=layout, head_num=4, scale=0.4, keep_prob=keep_prob, drop=drop, drop_seed=1234)


@pytest.mark.parametrize("drop", ["mask", "seed"])
@pytest.mark.parametrize("softmax_layout", ["", "TND"])
def test_dropout_tnd(drop, softmax_layout):
    q_lens, kv_lens = [3, 0, 4, 2], [5, 3, 4, 0]
    q, k, v, dy = make_qkv("TND", n1=2, n2=1, q_lens=q_lens, kv_lens=kv_lens, seed=71)
    check_fa(q, k, v, dy, layout="TND", head_num=2, scale=0.4, keep_prob=0.7, drop=drop, drop_seed=99,
             actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(kv_lens), atten_mask=TRIU2048, sparse_mode=3,
             softmax_layout=softmax_layout)


def test_dropout_with_pse_and_mask_fp16():
    q, k, v, dy = make_qkv("BSND", b=1, n1=2, sq=6, skv=6, dtype=torch.float16, seed=72)
    pse = torch.randn(1, 2, 6, 6, generator=torch.Generator().manual_seed(73)).half()
    check_fa(q, k, v, dy, layout="BSND", head_num=2, scale=0.4, keep_prob=0.8, pse=pse, atten_mask=TRIU2048,
             sparse_mode=2)


def test_dropout_large_seed_and_offset():
    """int64 seeds and offsets beyond 2**32 reach the generator unchanged (golden uses the same Philox bits)."""
    q, k, v, dy = make_qkv("BNSD", b=1, n1=2, sq=4, skv=5, seed=74)
    r = check_fa(q, k, v, dy, head_num=2, scale=0.5, keep_prob=0.6, drop="seed", drop_seed=2**40 + 17,
                 offset=3 * 2**32 + 5)
    assert r["offset"] == 3 * 2**32 + 5


def test_seed_mask_layout_matches_explicit_mask():
    """Seed/offset dropout equals passing its Philox keep bits as an explicit packed mask (same element order)."""
    q, k, v, _ = make_qkv("TND", n1=2, q_lens=[3, 2], kv_lens=[4, 6], seed=75)
    kw = dict(layout="TND", actual_seq_qlen=[3, 5], actual_seq_kvlen=[4, 10], scale=0.5, keep_prob=0.6)
    numel = 2 * (3 * 4 + 2 * 6)
    out_seed = attnops.flash_attention(q, k, v, seed=7, offset=11, **kw)
    keep = philox_uniform(7, torch.arange(numel) + 11) < torch.tensor(0.6)
    assert torch.equal(keep, keep_mask(DropoutSpec(0.6, (), seed=7, offset=11), numel))
    out_mask = attnops.flash_attention(q, k, v, drop_mask=pack_bits(keep), **kw)
    torch.testing.assert_close(out_seed, out_mask, rtol=0, atol=0)


def test_keep_prob_one_ignores_the_mask():
    q, k, v, _ = make_qkv("BNSD", b=1, n1=1, sq=4, skv=4, seed=76)
    drop_mask = pack_bits(torch.zeros(16, dtype=torch.bool))  # would drop everything
    out = attnops.flash_attention(q, k, v, scale=0.5, keep_prob=1.0, drop_mask=drop_mask)
    torch.testing.assert_close(out, attnops.flash_attention(q, k, v, scale=0.5), rtol=0, atol=0)


def test_seed_is_drawn_and_returned_when_omitted():
    q, k, v, _ = make_qkv("BNSD", b=1, n1=1, sq=4, skv=8, seed=77)
    torch.manual_seed(0)
    r1 = attnops.flash_attention(q, k, v, scale=0.5, keep_prob=0.5, return_stats=True)
    r2 = attnops.flash_attention(q, k, v, scale=0.5, keep_prob=0.5, return_stats=True)
    assert r1.seed != r2.seed and not torch.equal(r1.out, r2.out)
    again = attnops.flash_attention(q, k, v, scale=0.5, keep_prob=0.5, seed=r1.seed, offset=r1.offset)
    torch.testing.assert_close(again, r1.out, rtol=0, atol=0)


def test_dropout_really_drops():
    q, k, v, _ = make_qkv("BNSD", b=1, n1=1, sq=3, skv=8, seed=78)
    keep = random_keep(24, 0.5, seed=79)
    out = attnops.flash_attention(q, k, v, scale=0.5, keep_prob=0.5, drop_mask=pack_bits(keep))
    assert not torch.allclose(out, attnops.flash_attention(q, k, v, scale=0.5))
