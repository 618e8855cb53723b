"""Self-checks of the dense golden (attnops.testing.golden) and the tolerance rule (attnops.testing.compare)."""

import math

import pytest
import torch
import torch.nn.functional as F

from attnops.testing.compare import assert_close_to_golden, default_floor, max_abs_err
from attnops.testing.golden import FLT_LOWEST, FLT_MAX, fa_backward, fa_backward_given_stats, fa_forward, seq_lengths

F64 = torch.float64
TRIU2048 = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


def rnd(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64)


def close(a, b, tol=1e-10):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, atol=tol, rtol=0), (a - b).abs().max()


def bnsd(b=2, n1=4, n2=2, sq=5, skv=7, d=8, dv=8, seed=0):
    return rnd(b, n1, sq, d, seed=seed), rnd(b, n2, skv, d, seed=seed + 1), rnd(b, n2, skv, dv, seed=seed + 2)


def keep_pattern_tnd(sq_cum, skv_cum, n=1, **kw):
    """Keep pattern per batch, read from the output: q = 0 gives uniform P over the kept entries, V = one-hot(j)."""
    lq, lk = seq_lengths(sq_cum), seq_lengths(skv_cum)
    d = max(lk)
    q = torch.zeros(sum(lq), n, d, dtype=F64)
    k = torch.zeros(sum(lk), n, d, dtype=F64)
    v = torch.zeros(sum(lk), n, d, dtype=F64)
    off = 0
    for L in lk:
        for j in range(L):
            v[off + j, :, j] = 1.0
        off += L
    out, _, _ = fa_forward(q, k, v, head_num=n, input_layout="TND", actual_seq_qlen=sq_cum,
                           actual_seq_kvlen=skv_cum, atten_mask=TRIU2048, **kw)
    pats, off = [], 0
    for a, c in zip(lq, lk):
        pats.append(out[off:off + a, 0, :c] > 0)
        off += a
    return pats


def ij(sq, skv):
    return torch.arange(sq).view(-1, 1), torch.arange(skv).view(1, -1)


# ---------------------------------------------------------------------------------------------- SDPA


def test_plain_matches_sdpa():
    q, k, v = bnsd(n1=2, n2=2, dv=6)
    sc = 0.3
    out, smax, ssum = fa_forward(q, k, v, head_num=2, input_layout="BNSD", scale=sc)
    close(out, F.scaled_dot_product_attention(q, k, v, scale=sc))
    s = sc * q @ k.transpose(-1, -2)
    close(smax, s.amax(-1, keepdim=True).expand(-1, -1, -1, 8))
    close(ssum, torch.exp(s - s.amax(-1, keepdim=True)).sum(-1, keepdim=True).expand(-1, -1, -1, 8))
    assert smax.shape == (2, 2, 5, 8) and out.dtype == F64


def test_causal_mode2_matches_sdpa():
    q, k, v = bnsd(n1=2, n2=2, sq=6, skv=6)
    out, _, _ = fa_forward(q, k, v, head_num=2, input_layout="BNSD", atten_mask=TRIU2048, sparse_mode=2,
                           scale=0.5)
    close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5))
    # mode 2 ignores pre/next; without a mask everything is kept
    out2, _, _ = fa_forward(q, k, v, head_num=2, input_layout="BNSD", atten_mask=TRIU2048, sparse_mode=2,
                            scale=0.5, pre_tokens=1, next_tokens=-3)
    close(out2, out)
    full, _, _ = fa_forward(q, k, v, head_num=2, input_layout="BNSD", sparse_mode=2, scale=0.5)
    close(full, F.scaled_dot_product_attention(q, k, v, scale=0.5))


def test_gqa_matches_sdpa():
    q, k, v = bnsd(n1=6, n2=2, d=8, dv=5)
    out, _, _ = fa_forward(q, k, v, head_num=6, input_layout="BNSD", scale=0.25)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), scale=0.25)
    close(out, ref)
    assert out.shape == (2, 6, 5, 5)


def test_explicit_mask_matches_sdpa():
    q, k, v = bnsd(n1=2, n2=2, sq=6, skv=9)
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(2, 1, 6, 9, generator=g) < 0.5
    mask[..., 0] = False  # no fully-masked rows
    for mode in (0, 1):
        out, _, _ = fa_forward(q, k, v, head_num=2, input_layout="BNSD", atten_mask=mask, sparse_mode=mode,
                               scale=0.4)
        close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=~mask, scale=0.4))
    # uint8 mask and 2-D / [1,1,S,S] shapes
    m2 = mask[0, 0]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=~m2, scale=0.4)
    for m in (m2.to(torch.uint8), m2[None, None]):
        out, _, _ = fa_forward(q, k, v, head_num=2, input_layout="BNSD", atten_mask=m, sparse_mode=1, scale=0.4)
        close(out, ref)


# ---------------------------------------------------------------------------------------------- layouts


def test_layouts_agree_with_bnsd():
    b, n1, n2, sq, skv, d, dv = 2, 4, 2, 5, 6, 8, 4
    q, k, v = bnsd(b, n1, n2, sq, skv, d, dv, seed=10)
    pse = rnd(b, n1, sq, skv, seed=20)
    kw = dict(head_num=n1, scale=0.3, pse=pse, atten_mask=TRIU2048, sparse_mode=3)
    ref, rmax, rsum = fa_forward(q, k, v, input_layout="BNSD", **kw)
    dy = rnd(*ref.shape, seed=30)
    rgrads = fa_backward(dy, q, k, v, input_layout="BNSD", **kw)

    def bsnd(x):
        return x.permute(0, 2, 1, 3)

    def bsh(x):
        return bsnd(x).reshape(x.shape[0], x.shape[2], -1)

    def sbh(x):
        return x.permute(2, 0, 1, 3).reshape(x.shape[2], x.shape[0], -1)

    for layout, f in (("BSND", bsnd), ("BSH", bsh), ("SBH", sbh)):
        out, smax, ssum = fa_forward(f(q), f(k), f(v), input_layout=layout, **kw)
        close(out, f(ref))
        close(smax, rmax)
        close(ssum, rsum)
        grads = fa_backward(f(dy), f(q), f(k), f(v), input_layout=layout, **kw)
        for g, r in zip(grads[:3], rgrads[:3]):
            close(g, f(r))
        close(grads[3], rgrads[3])
    # TND with equal lengths == BNSD
    t = lambda x: bsnd(x).reshape(-1, x.shape[1], x.shape[3])  # noqa: E731
    kw_t = dict(kw, pse=pse)
    out, smax, ssum = fa_forward(t(q), t(k), t(v), input_layout="TND", actual_seq_qlen=[sq, 2 * sq],
                                 actual_seq_kvlen=[skv, 2 * skv], softmax_layout="TND", **kw_t)
    close(out, t(ref))
    close(smax, t(rmax))
    grads = fa_backward(t(dy), t(q), t(k), t(v), input_layout="TND", actual_seq_qlen=[sq, 2 * sq],
                        actual_seq_kvlen=[skv, 2 * skv], **kw_t)
    for g, r in zip(grads[:3], rgrads[:3]):
        close(g, t(r))
    close(grads[3], rgrads[3])


def test_tnd_two_batches_equals_separate_runs():
    n1, n2, d, dv = 4, 2, 8, 6
    lq, lk = [3, 5], [4, 7]
    q, k, v = rnd(8, n1, d, seed=1), rnd(11, n2, d, seed=2), rnd(11, n2, dv, seed=3)
    mask = rnd(5, 7, seed=4) > 0.3
    mask[:, 0] = False
    kw = dict(head_num=n1, input_layout="TND", actual_seq_qlen=[3, 8], actual_seq_kvlen=[4, 11], scale=0.2,
              atten_mask=mask, sparse_mode=1)
    out, smax, ssum = fa_forward(q, k, v, **kw)
    _, tmax, tsum = fa_forward(q, k, v, softmax_layout="TND", **kw)
    assert out.shape == (8, n1, dv) and smax.shape == (8, n1, 8)
    qo = ko = 0
    flat_max = smax.reshape(-1)
    for a, c in zip(lq, lk):
        ob, mb, sb = fa_forward(q[qo:qo + a].transpose(0, 1)[None], k[ko:ko + c].transpose(0, 1)[None],
                                v[ko:ko + c].transpose(0, 1)[None], head_num=n1, input_layout="BNSD", scale=0.2,
                                atten_mask=mask[:a, :c], sparse_mode=1)
        close(out[qo:qo + a], ob[0].transpose(0, 1))
        # default layout: per-batch [N1, Sq_b, 8] blocks
        close(flat_max[qo * n1 * 8:(qo + a) * n1 * 8], mb[0].reshape(-1))
        close(tmax[qo:qo + a], mb[0].transpose(0, 1))
        close(tsum[qo:qo + a], sb[0].transpose(0, 1))
        qo, ko = qo + a, ko + c
    assert not torch.equal(smax, tmax)  # the two stat layouts really differ for B > 1


def test_seq_lengths_conventions():
    assert seq_lengths([2, 4, 4, 6, 8]) == [2, 2, 0, 2, 2]
    assert seq_lengths([2, 5, 9, 0, 0]) == [2, 3, 4, 0, 0]
    assert seq_lengths(torch.tensor([0, 3])) == [0, 3]
    with pytest.raises(ValueError):
        seq_lengths([3, 2, 5])


def test_tnd_empty_batches_and_unused_tail_tokens():
    n, d = 2, 4
    q, k, v = rnd(9, n, d, seed=5), rnd(9, n, d, seed=6), rnd(9, n, d, seed=7)
    # batches: (2,3), (0,2) empty q, (3,0) empty kv -> invalid rows, then trailing zeros; tokens 5.. of q unused
    cq, ck = [2, 2, 5, 0], [3, 5, 5, 0]
    out, smax, ssum = fa_forward(q, k, v, head_num=n, input_layout="TND", actual_seq_qlen=cq,
                                 actual_seq_kvlen=ck, softmax_layout="TND")
    ref, _, _ = fa_forward(q[None, :2].transpose(1, 2), k[None, :3].transpose(1, 2), v[None, :3].transpose(1, 2),
                           head_num=n, input_layout="BNSD")
    close(out[:2], ref[0].transpose(0, 1))
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert torch.all(smax[2:] == FLT_LOWEST) and torch.all(ssum[2:] == FLT_MAX)
    assert torch.all(smax[:2] > FLT_LOWEST)
    dq, dk, dv, dpse = fa_backward(torch.ones_like(out), q, k, v, head_num=n, input_layout="TND",
                                   actual_seq_qlen=cq, actual_seq_kvlen=ck)
    assert dpse is None
    assert torch.equal(dq[2:], torch.zeros_like(dq[2:])) and torch.equal(dk[3:], torch.zeros_like(dk[3:]))
    assert dq[:2].abs().sum() > 0 and dv[:3].abs().sum() > 0


# ---------------------------------------------------------------------------------------------- masks


def test_fully_masked_row_invalid_values():
    q, k, v = bnsd(b=1, n1=2, n2=1, sq=4, skv=5)
    mask = torch.zeros(4, 5, dtype=torch.bool)
    mask[2] = True
    kw = dict(head_num=2, input_layout="BNSD", atten_mask=mask, sparse_mode=1, scale=0.5)
    out, smax, ssum = fa_forward(q, k, v, **kw)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    assert torch.all(smax[:, :, 2] == -3.4028234663852886e38)
    assert torch.all(ssum[:, :, 2] == 3.4028234663852886e38)
    assert torch.isfinite(out).all() and torch.all(smax[:, :, [0, 1, 3]] > -1e30)
    dq, dk, dv, _ = fa_backward(rnd(*out.shape, seed=9), q, k, v, **kw)
    assert torch.equal(dq[:, :, 2], torch.zeros_like(dq[:, :, 2]))
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and dq.abs().sum() > 0
    # fp16 baseline: stats stay fp32 so that the invalid-row values are representable
    _, smax16, ssum16 = fa_forward(q, k, v, dtype=torch.float16, **kw)
    assert smax16.dtype == torch.float32 and torch.all(ssum16[:, :, 2] == FLT_MAX)


def test_dense_modes_against_explicit_masks():
    sq, skv = 5, 8
    q, k, v = bnsd(b=2, n1=2, n2=2, sq=sq, skv=skv, seed=40)
    i, j = ij(sq, skv)
    delta = skv - sq
    pre, nxt = 2, -1
    prefix = [1, 4]
    kw = dict(head_num=2, input_layout="BNSD", scale=0.3)
    ref_mask = {
        0: lambda b: ~((j - i >= -pre) & (j - i <= nxt)),
        2: lambda b: ~(j <= i),
        3: lambda b: ~(j <= i + delta),
        4: lambda b: ~((j - i - delta >= -pre) & (j - i - delta <= nxt)),
        6: lambda b: ~((j <= i + delta) | (j < prefix[b])),
    }
    for mode, fm in ref_mask.items():
        am = torch.zeros(sq, skv, dtype=torch.bool) if mode == 0 else TRIU2048
        out, _, _ = fa_forward(q, k, v, atten_mask=am, sparse_mode=mode, pre_tokens=pre, next_tokens=nxt,
                               prefix=prefix, **kw)
        full = torch.stack([fm(b).expand(2, sq, skv) for b in range(2)])
        ref, _, _ = fa_forward(q, k, v, atten_mask=full, sparse_mode=1, **kw)
        close(out, ref)
    # mode 0 ANDs the explicit mask with the band; mode 5 ANDs it with causal-or-prefix
    extra = torch.zeros(sq, skv, dtype=torch.bool)
    extra[:, 0] = True
    out0, _, _ = fa_forward(q, k, v, atten_mask=extra, sparse_mode=0, pre_tokens=pre, next_tokens=nxt, **kw)
    ref0, _, _ = fa_forward(q, k, v, atten_mask=extra | ref_mask[0](0), sparse_mode=1, **kw)
    close(out0, ref0)
    m5 = extra[None, None].expand(2, 1, sq, skv)
    out5, _, _ = fa_forward(q, k, v, atten_mask=m5, sparse_mode=5, prefix=prefix, **kw)
    full5 = torch.stack([(extra | ref_mask[6](b))[None] for b in range(2)])
    ref5, _, _ = fa_forward(q, k, v, atten_mask=full5, sparse_mode=1, **kw)
    close(out5, ref5)
    # row 0 of mode 4 (j - i in [1, 3+... ]) is really restricted: compare against a hand pattern
    out4, _, _ = fa_forward(q, k, v, atten_mask=TRIU2048, sparse_mode=4, pre_tokens=pre, next_tokens=nxt, **kw)
    s = 0.3 * q[0, 0, 0] @ k[0, 0].T
    cols = [1, 2]  # delta=3: -2 <= j - 3 <= -1
    p = torch.softmax(s[cols], 0)
    close(out4[0, 0, 0], p @ v[0, 0, cols])


def test_mode8_card2_worked_example():
    pats = keep_pattern_tnd([3, 8, 12], [4, 9, 13], sparse_mode=8, pre_tokens=4, next_tokens=1)
    i, j = ij(3, 4)
    assert torch.equal(pats[0], j <= i + 2)
    assert torch.equal(pats[0], torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool))
    i, j = ij(5, 5)
    assert torch.equal(pats[1], j <= i)
    i, j = ij(4, 4)
    assert torch.equal(pats[2], j <= i)


def test_mode8_band_batch_is_first_nonempty():
    pats = keep_pattern_tnd([0, 3, 6], [0, 4, 7], sparse_mode=8, pre_tokens=4, next_tokens=1)
    assert pats[0].numel() == 0
    i, j = ij(3, 4)
    assert torch.equal(pats[1], j <= i + 2)
    i, j = ij(3, 3)
    assert torch.equal(pats[2], j <= i)


def test_mode7_card1_worked_example():
    pats = keep_pattern_tnd([3, 5], [3, 9], sparse_mode=7, pre_tokens=6, next_tokens=-2)
    i, j = ij(3, 3)
    assert torch.equal(pats[0], j <= i)
    assert torch.equal(pats[1], torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool))
    # band batch is the LAST non-empty batch (trailing zeros are empty batches)
    pats = keep_pattern_tnd([3, 5, 0], [3, 9, 0], sparse_mode=7, pre_tokens=6, next_tokens=-2)
    assert torch.equal(pats[1], torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool))


def test_mode3_card2_worked_example():
    pats = keep_pattern_tnd([2, 7, 11], [6, 11, 15], sparse_mode=3)
    i, j = ij(2, 6)
    assert torch.equal(pats[0], j <= i + 4)
    i, j = ij(5, 5)
    assert torch.equal(pats[1], j <= i)


def test_tnd_mask_top_left_slice():
    mask = torch.zeros(5, 6, dtype=torch.bool)
    mask[0, 1:] = True
    mask[4, :] = True  # row 4 lies outside every batch's [:Sq_b, :Skv_b] slice
    q = torch.zeros(5, 1, 3, dtype=F64)
    k = torch.zeros(6, 1, 3, dtype=F64)
    v = torch.cat([torch.eye(3, dtype=F64), torch.eye(3, dtype=F64)])[:, None]
    out, _, _ = fa_forward(q, k, v, head_num=1, input_layout="TND", actual_seq_qlen=[2, 5],
                           actual_seq_kvlen=[3, 6], atten_mask=mask, sparse_mode=1)
    assert torch.equal(out[:, 0] > 0, torch.tensor([[1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1]],
                                                   dtype=torch.bool))


# ---------------------------------------------------------------------------------------------- pse


def test_pse_types_0_and_1():
    q, k, v = bnsd(b=2, n1=2, n2=2, sq=4, skv=6, seed=50)
    pse = rnd(2, 2, 4, 6, seed=51)
    sc = 0.37
    kw = dict(head_num=2, input_layout="BNSD", scale=sc)
    o1, m1, _ = fa_forward(q, k, v, pse=pse, pse_type=1, **kw)
    close(o1, F.scaled_dot_product_attention(q, k, v, attn_mask=sc * pse, scale=sc))
    close(m1[..., 0], (sc * (q @ k.transpose(-1, -2) + pse)).amax(-1))
    o0, _, _ = fa_forward(q, k, v, pse=pse, pse_type=0, **kw)
    close(o0, F.scaled_dot_product_attention(q, k, v, attn_mask=pse, scale=sc))
    # [1,N,Sq,Skv] batch broadcast and [B,N,1,Skv] row broadcast
    o, _, _ = fa_forward(q, k, v, pse=pse[:1], pse_type=0, **kw)
    close(o, F.scaled_dot_product_attention(q, k, v, attn_mask=pse[:1].expand(2, -1, -1, -1), scale=sc))
    row = pse[:, :, :1]
    o, _, _ = fa_forward(q, k, v, pse=row, pse_type=1, **kw)
    close(o, F.scaled_dot_product_attention(q, k, v, attn_mask=sc * row.expand(-1, -1, 4, -1), scale=sc))
    *_, dpse = fa_backward(torch.ones_like(o), q, k, v, pse=row, pse_type=1, **kw)
    assert dpse.shape == row.shape


@pytest.mark.parametrize("pse_type", [2, 3])
def test_inner_alibi(pse_type):
    q, k, v = bnsd(b=2, n1=2, n2=1, sq=5, skv=5, seed=60)
    slopes = torch.tensor([[0.5, 0.25], [1.0, 0.125]], dtype=torch.float32)
    sc, qs, ks = 0.3, 3, 1
    i, j = ij(5, 5)
    dist = ((j + ks) - (i + qs)).abs().to(F64)
    if pse_type == 3:
        dist = dist.sqrt()
    full = -slopes.to(F64)[:, :, None, None] * dist
    kw = dict(head_num=2, input_layout="BNSD", scale=sc, q_start_idx=qs, kv_start_idx=ks)
    out, _, _ = fa_forward(q, k, v, pse=slopes, pse_type=pse_type, **kw)
    ref, _, _ = fa_forward(q, k, v, pse=full, pse_type=0, **kw)
    close(out, ref)
    out_n, _, _ = fa_forward(q, k, v, pse=slopes[0], pse_type=pse_type, **kw)
    ref_n, _, _ = fa_forward(q, k, v, pse=full[:1], pse_type=0, **kw)
    close(out_n, ref_n)
    assert fa_backward(torch.ones_like(out), q, k, v, pse=slopes, pse_type=pse_type, **kw)[3] is None


def test_inner_alibi_tnd_mode8_resets_start_idx():
    n, d = 1, 4
    q, k, v = rnd(6, n, d, seed=70), rnd(6, n, d, seed=71), rnd(6, n, d, seed=72)
    slopes = torch.tensor([0.5])
    kw = dict(head_num=n, input_layout="TND", actual_seq_qlen=[3, 6], actual_seq_kvlen=[3, 6],
              atten_mask=TRIU2048, pse=slopes, pse_type=2, scale=0.5)
    # (with j <= i, a start shift q_start - kv_start >= 0 only adds a per-row constant, so shift the kv side)
    out, _, _ = fa_forward(q, k, v, sparse_mode=8, q_start_idx=0, kv_start_idx=2, pre_tokens=10,
                           next_tokens=0, **kw)
    # batch 1 uses start 0 -> equals a plain causal run of batch 1 alone with start 0
    sep, _, _ = fa_forward(q[3:], k[3:], v[3:], head_num=n, input_layout="TND", actual_seq_qlen=[3],
                           actual_seq_kvlen=[3], atten_mask=TRIU2048, sparse_mode=2, pse=slopes, pse_type=2,
                           scale=0.5)
    close(out[3:], sep)
    sep0, _, _ = fa_forward(q[:3], k[:3], v[:3], head_num=n, input_layout="TND", actual_seq_qlen=[3],
                            actual_seq_kvlen=[3], atten_mask=TRIU2048, sparse_mode=2, pse=slopes, pse_type=2,
                            scale=0.5, kv_start_idx=2)
    close(out[:3], sep0)
    assert (out[:3] - fa_forward(q[:3], k[:3], v[:3], head_num=n, input_layout="TND", actual_seq_qlen=[3],
                                 actual_seq_kvlen=[3], atten_mask=TRIU2048, sparse_mode=2, pse=slopes,
                                 pse_type=2, scale=0.5)[0]).abs().max() > 1e-3  # the start index matters


def test_alibi_compressed_pse():
    s, n = 1030, 1
    q, k, v = rnd(1, n, s, 2, seed=80), rnd(1, n, s, 2, seed=81), rnd(1, n, s, 2, seed=82)
    i, j = ij(s, s)
    diag = rnd(s, seed=83)  # arbitrary Toeplitz values, by i - j
    full = diag[(i - j).clamp(min=0)].expand(1, n, s, s).contiguous()
    kw = dict(head_num=n, input_layout="BNSD", atten_mask=TRIU2048, sparse_mode=2, scale=0.7, pse_type=1)
    ref, _, _ = fa_forward(q, k, v, pse=full, **kw)
    comp = full[:, :, -1024:, :].clone()
    out, _, _ = fa_forward(q, k, v, pse=comp, **kw)
    close(out, ref)
    dy = rnd(*out.shape, seed=84)
    *_, dcomp = fa_backward(dy, q, k, v, pse=comp, **kw)
    assert dcomp.shape == comp.shape and torch.count_nonzero(dcomp[:, :, :1023]) == 0
    *_, dfull = fa_backward(dy, q, k, v, pse=full, **kw)
    # the compressed row holds the sum of the full gradient over each diagonal
    per_diag = torch.zeros(s, dtype=F64).index_add_(0, (i - j).clamp(min=0).reshape(-1),
                                                    torch.where(j <= i, dfull[0, 0], 0).reshape(-1))
    close(dcomp[0, 0, 1023], per_diag.flip(0), tol=1e-9)


# ---------------------------------------------------------------------------------------------- dropout


def test_dropout_all_keep_equals_no_dropout():
    q, k, v = bnsd(seed=90)
    kw = dict(head_num=4, input_layout="BNSD", scale=0.3)
    ref = fa_forward(q, k, v, **kw)
    numels = 2 * 4 * 5 * 7
    out = fa_forward(q, k, v, keep_prob=1.0, drop_keep=torch.zeros(numels, dtype=torch.bool), **kw)
    for a, b in zip(out, ref):
        close(a, b)
    out = fa_forward(q, k, v, keep_prob=0.5, drop_keep=torch.ones(numels, dtype=torch.bool), **kw)
    close(out[0], 2 * ref[0])
    close(out[1], ref[1])
    close(out[2], ref[2])


def test_dropout_hand_example():
    q = torch.zeros(1, 1, 1, 1, dtype=F64)
    k = torch.tensor([[[[1.0], [2.0]]]], dtype=F64)
    v = torch.tensor([[[[1.0], [3.0]]]], dtype=F64)
    kw = dict(head_num=1, input_layout="BNSD")
    out, smax, ssum = fa_forward(q, k, v, keep_prob=0.5, drop_keep=torch.tensor([True, False]), **kw)
    assert out.item() == pytest.approx(1.0)  # 0.5 * 1 / 0.5
    assert smax[0, 0, 0, 0].item() == 0.0 and ssum[0, 0, 0, 0].item() == 2.0
    out, _, _ = fa_forward(q, k, v, keep_prob=0.25, drop_keep=torch.tensor([False, True]), **kw)
    assert out.item() == pytest.approx(6.0)  # 0.5 * 3 / 0.25


def test_dropout_tnd_block_order():
    n = 2
    q, k, v = rnd(5, n, 3, seed=91), rnd(6, n, 3, seed=92), rnd(6, n, 3, seed=93)
    lq, lk = [2, 3], [4, 2]
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(n * (2 * 4 + 3 * 2), generator=g) < 0.7
    out, _, _ = fa_forward(q, k, v, head_num=n, input_layout="TND", actual_seq_qlen=[2, 5], actual_seq_kvlen=[4, 6],
                           keep_prob=0.7, drop_keep=keep)
    off, qo, ko = 0, 0, 0
    for a, c in zip(lq, lk):
        blk = keep[off:off + n * a * c]
        ob, _, _ = fa_forward(q[qo:qo + a].transpose(0, 1)[None], k[ko:ko + c].transpose(0, 1)[None],
                              v[ko:ko + c].transpose(0, 1)[None], head_num=n, input_layout="BNSD", keep_prob=0.7,
                              drop_keep=blk)
        s = q[qo:qo + a].transpose(0, 1) @ k[ko:ko + c].transpose(0, 1).transpose(-1, -2)
        p = torch.softmax(s, -1) * blk.reshape(n, a, c) / 0.7
        close(ob[0], p @ v[ko:ko + c].transpose(0, 1))
        close(out[qo:qo + a], ob[0].transpose(0, 1))
        off, qo, ko = off + n * a * c, qo + a, ko + c


# ---------------------------------------------------------------------------------------------- backward


def test_backward_matches_finite_differences():
    b, n1, n2, sq, skv, d, dv = 1, 2, 1, 3, 4, 3, 2
    q, k, v = bnsd(b, n1, n2, sq, skv, d, dv, seed=100)
    pse = rnd(b, n1, sq, skv, seed=101)
    mask = torch.zeros(sq, skv, dtype=torch.bool)
    mask[1, 2] = True
    mask[2] = True  # fully-masked row
    keep = torch.tensor([True, True, False, True] * 6)
    kw = dict(head_num=n1, input_layout="BSND", scale=0.6, pse=pse, pse_type=1, atten_mask=mask, sparse_mode=1,
              keep_prob=0.8, drop_keep=keep)
    bs = lambda x: x.permute(0, 2, 1, 3).contiguous()  # noqa: E731
    qs, ks, vs = bs(q), bs(k), bs(v)
    dy = rnd(b, sq, n1, dv, seed=102)
    dq, dk, dv_, dpse = fa_backward(dy, qs, ks, vs, **kw)

    def loss(q_, k_, v_, p_):
        return (fa_forward(q_, k_, v_, **dict(kw, pse=p_))[0] * dy).sum()

    eps = 1e-6
    args = [qs, ks, vs, pse]
    for idx, grad in enumerate((dq, dk, dv_, dpse)):
        num = torch.zeros_like(args[idx])
        for e in range(num.numel()):
            plus = [a.clone() for a in args]
            minus = [a.clone() for a in args]
            plus[idx].view(-1)[e] += eps
            minus[idx].view(-1)[e] -= eps
            num.view(-1)[e] = (loss(*plus) - loss(*minus)) / (2 * eps)
        close(grad, num, tol=1e-7)
    assert torch.count_nonzero(dq[:, 2]) == 0 and dq.abs().sum() > 0


def test_gradcheck_tnd_gqa():
    q = rnd(5, 4, 3, seed=110).requires_grad_()
    k = rnd(6, 2, 3, seed=111).requires_grad_()
    v = rnd(6, 2, 2, seed=112).requires_grad_()

    def f(q_, k_, v_):
        o, m, s = fa_forward(q_, k_, v_, head_num=4, input_layout="TND", actual_seq_qlen=[2, 5],
                             actual_seq_kvlen=[2, 6], atten_mask=TRIU2048, sparse_mode=3, scale=0.5)
        return o, s

    assert torch.autograd.gradcheck(f, (q, k, v))


# ---------------------------------------------------------------------------------------------- low precision


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_baseline(dtype):
    q, k, v = bnsd(sq=16, skv=16, d=16, dv=16, seed=120)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    kw = dict(head_num=4, input_layout="BNSD", scale=0.25, atten_mask=TRIU2048, sparse_mode=2)
    gold = fa_forward(q, k, v, **kw)
    base = fa_forward(q, k, v, dtype=dtype, **kw)
    assert base[0].dtype == dtype and base[1].dtype == torch.float32
    err = max_abs_err(base[0], gold[0])
    assert 0 < err < {torch.float16: 1e-2, torch.bfloat16: 1e-1, torch.float32: 1e-5}[dtype]
    assert_close_to_golden("out", base[0], gold[0], base[0])
    dy = rnd(*gold[0].shape, seed=121).to(dtype)
    gg = fa_backward(dy, q, k, v, **kw)
    bg = fa_backward(dy, q, k, v, dtype=dtype, **kw)
    for name, a, g in zip("qkv", bg[:3], gg[:3]):
        assert a.dtype == dtype
        assert_close_to_golden("d" + name, a, g, a, factor=3.0)


# ---------------------------------------------------------------------------------------------- compare


def test_compare_rule():
    g = torch.linspace(-2, 2, 50, dtype=F64)
    base = (g + 1e-2).to(torch.float16)
    assert_close_to_golden("ok", (g + 1.5e-2).to(torch.float16), g, base)
    with pytest.raises(AssertionError, match="bad.*err=.*base_err.*floor"):
        assert_close_to_golden("bad", (g + 5e-2).to(torch.float16), g, base)
    assert_close_to_golden("factor", (g + 5e-2).to(torch.float16), g, base, factor=6.0)
    assert_close_to_golden("none", None, None, None)
    with pytest.raises(AssertionError):
        assert_close_to_golden("half-none", None, g, g)
    e = torch.empty(0, 3)
    assert_close_to_golden("empty", e, e.double(), e)
    nan = g.clone()
    nan[3] = math.nan
    with pytest.raises(AssertionError):
        assert_close_to_golden("nan", nan.float(), g, g.float())
    with pytest.raises(AssertionError):
        assert_close_to_golden("shape", g[:3].float(), g[:4], g[:4].float())
    # floor: output rounding at the magnitude + 2 * eps(fp32 accumulation) * sqrt(reduction) * max(1, max|golden|)
    eps32 = torch.finfo(torch.float32).eps
    assert default_floor(torch.zeros(3, dtype=F64), torch.float32) == pytest.approx(2 * eps32)
    assert default_floor(torch.zeros(3, dtype=F64), torch.float32, 64) == pytest.approx(2 * eps32 * 8)
    rounding = default_floor(g, torch.float32) - 2 * eps32 * 2
    assert 0 < rounding <= 2 * 2.0**-22  # 2 * fp32 spacing near 2
    assert default_floor(g, torch.float32, 100) == pytest.approx(rounding + 2 * eps32 * 10 * 2)
    assert 0 < default_floor(g, torch.float16) <= 2 * 2.0**-9 + 4 * eps32  # fp16 spacing near 2 dominates
    assert default_floor(g, F64, 4) <= 2 * 2.0**-51 + 8 * torch.finfo(F64).eps
    with pytest.raises(ValueError, match="reduction"):
        default_floor(g, torch.float32, 0)
    assert max_abs_err(torch.tensor([FLT_MAX]), torch.tensor([FLT_MAX], dtype=F64)) == 0.0


def test_backward_given_attention_in_is_the_operator_contract():
    """With the exact output, attention_in changes nothing; with another output, dS gains P * (D_exact - D_given):
    for a single key (P = 1) dq = scale * (dP - dy . attention_in) * k exactly."""
    q, k, v, dy = (torch.randn(1, 1, 1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
                   for s in range(4))
    kw = dict(head_num=1, input_layout="BNSD", scale=0.5)
    out, _, _ = fa_forward(q, k, v, **kw)
    plain = fa_backward(dy, q, k, v, **kw)
    same = fa_backward(dy, q, k, v, out, **kw)
    for a, b in zip(plain[:3], same[:3]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    given = out + 0.01
    dq = fa_backward(dy, q, k, v, given, **kw)[0]
    expected = 0.5 * ((dy * v).sum() - (dy * given).sum()) * k
    torch.testing.assert_close(dq, expected, rtol=1e-12, atol=1e-12)
    assert float(plain[0].abs().max()) < 1e-12  # one key: the exact gradient of q is 0


@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
def test_backward_given_stats_is_autograd_with_the_forward_stats(layout):
    """With the forward's own output and statistics, the explicit backward formula is autograd's gradient (GQA, a
    causal mask with a fully masked row, a pse)."""
    q, k, v = bnsd(sq=7, skv=5)
    pse = rnd(2, 4, 7, 5, seed=5)
    to = (lambda x: x) if layout == "BNSD" else (lambda x: x.permute(0, 2, 1, 3).flatten(2))
    mask = TRIU2048[:7, :5].clone()
    mask[3] = True  # a fully masked row
    kw = dict(head_num=4, input_layout=layout, scale=0.4, pse=pse, atten_mask=mask, sparse_mode=0)
    out, smax, ssum = fa_forward(to(q), to(k), to(v), **kw)
    dy = rnd(*out.shape, seed=6)
    want = fa_backward(dy, to(q), to(k), to(v), **kw)[:3]
    for got, w in zip(fa_backward_given_stats(dy, to(q), to(k), to(v), out, smax, ssum, **kw), want):
        close(got, w)


def test_backward_given_stats_uses_the_given_statistics():
    """A row's given softmax_max of +inf makes its P zero: no gradient flows from it (it is not recomputed)."""
    q, k, v = bnsd()
    out, smax, ssum = fa_forward(q, k, v, head_num=4, input_layout="BNSD")
    smax[0, 1, 2] = math.inf
    dq, dk, dv = fa_backward_given_stats(rnd(*out.shape, seed=3), q, k, v, out, smax, ssum, head_num=4,
                                         input_layout="BNSD")
    assert torch.equal(dq[0, 1, 2], torch.zeros(8, dtype=F64)) and bool(dq[0, 1, 1].abs().sum() > 0)
