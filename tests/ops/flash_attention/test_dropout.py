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


@pytest.mark.parametrize("layout", ["BNSD", "TND"])
def test_seed_mask_is_regenerated_identically_by_forward_and_backward(layout):
    """Tiles of several generator chunks, on and off a causal band: the seed path's output and gradients equal
    the explicit-mask path's bit for bit (same keep bits in the forward and in the backward)."""
    n, d = 2, 16
    if layout == "BNSD":
        q, k, v, dy = make_qkv("BNSD", b=1, n1=n, sq=300, skv=300, seed=80)
        kw, numel = dict(layout="BNSD"), n * 300 * 300
    else:
        lens = [130, 1, 257]
        q, k, v, dy = make_qkv("TND", n1=n, q_lens=lens, kv_lens=lens, seed=81)
        kw, numel = dict(layout="TND", actual_seq_qlen=cum(lens), actual_seq_kvlen=cum(lens)), n * sum(x * x for x in lens)
    kw.update(scale=d ** -0.5, keep_prob=0.8, atten_mask=TRIU2048, sparse_mode=3 if layout == "TND" else 2)
    keep = keep_mask(DropoutSpec(0.8, (), seed=2**40 + 1, offset=2**32 - numel // 3), numel)
    grads = []
    for drop in (dict(seed=2**40 + 1, offset=2**32 - numel // 3), dict(drop_mask=pack_bits(keep))):
        qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out = attnops.flash_attention(qq, kk, vv, **kw, **drop)
        out.backward(dy)
        grads.append((out, qq.grad, kk.grad, vv.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seed,offset,error,match", [
    (2**70, 0, ValueError, "seed: expected an int in .*got 1180591620717411303424"),
    (1, -3, ValueError, "offset: expected an int in .*got -3"),
    (1.5, 0, TypeError, "seed: expected an int"),
    (1, True, TypeError, "offset: expected an int"),
])
def test_out_of_range_seed_offset_at_every_entry(seed, offset, error, match):
    from attnops import torch_npu
    from attnops.distributed import ring_dropout_mask
    q, k, v, dy = make_qkv("BNSD", b=1, n1=1, sq=4, skv=4, seed=82)
    calls = [
        lambda: attnops.flash_attention(q, k, v, keep_prob=0.5, seed=seed, offset=offset),
        lambda: attnops.flash_attention_backward(dy, q, k, v, q, torch.zeros(1, 1, 4, 8), torch.ones(1, 1, 4, 8),
                                                 keep_prob=0.5, seed=seed, offset=offset),
        lambda: torch_npu.npu_fusion_attention(q, k, v, 1, "BNSD", keep_prob=0.5, seed=seed, offset=offset),
        lambda: torch_npu.npu_fusion_attention_grad(q, k, v, dy, 1, "BNSD", softmax_max=torch.zeros(1, 1, 4, 8),
                                                    softmax_sum=torch.ones(1, 1, 4, 8), attention_in=q,
                                                    keep_prob=0.5, seed=seed, offset=offset, numels=16),
        lambda: ring_dropout_mask(world_size=1, keep_prob=0.5, seed=seed, offset=offset, head_num=1, seq_len=4),
    ]
    for call in calls:
        with pytest.raises(error, match=match):
            call()
