"""Reference vs fp64 golden for every sparse mode (0-8), dense and TND, forward and backward; the worked
examples of cann_semantics.md §1.1 for modes 7 and 8; fully-masked rows."""
import pytest
import torch

import attnops
from tests.helpers import (FLT_LOWEST, FLT_MAX, INT_MAX, PREFIX3072, TRIU2048, check_fa, cum, make_qkv,
                           random_keep)

DENSE = ("BNSD", "BSND", "BSH", "SBH")


def _explicit(shape, seed, dtype=torch.bool, p=0.3):
    m = random_keep(int(torch.Size(shape).numel()), p, seed=seed).reshape(shape)
    return m.to(dtype)


# ------------------------------------------------------------------------------------------ dense layouts


@pytest.mark.parametrize("layout", DENSE)
@pytest.mark.parametrize("mask_shape", ["BNSS", "B1SS", "11SS", "SS"])
@pytest.mark.parametrize("pre,nxt", [(INT_MAX, INT_MAX), (2, 1), (3, -1), (-1, 3)])
def test_mode0_dense(layout, mask_shape, pre, nxt):
    b, n1, sq, skv = 2, 2, 5, 7
    q, k, v, dy = make_qkv(layout, b=b, n1=n1, n2=1, sq=sq, skv=skv, seed=1)
    shape = {"BNSS": (b, n1, sq, skv), "B1SS": (b, 1, sq, skv), "11SS": (1, 1, sq, skv), "SS": (sq, skv)}[mask_shape]
    mask = _explicit(shape, seed=3, dtype=torch.uint8 if mask_shape == "SS" else torch.bool)
    check_fa(q, k, v, dy, layout=layout, head_num=n1, scale=0.4, atten_mask=mask, sparse_mode=0,
             pre_tokens=pre, next_tokens=nxt)


def test_mode0_without_mask_ignores_tokens():
    q, k, v, dy = make_qkv("BNSD", sq=5, skv=6, seed=2)
    r = check_fa(q, k, v, dy, head_num=2, scale=0.3, sparse_mode=0, pre_tokens=0, next_tokens=0)
    full = attnops.flash_attention(q, k, v, scale=0.3)
    torch.testing.assert_close(r["out"], full, rtol=0, atol=0)


@pytest.mark.parametrize("layout", DENSE)
@pytest.mark.parametrize("mask_shape", ["BNSS", "SS"])
def test_mode1_dense(layout, mask_shape):
    b, n1, sq, skv = 2, 2, 6, 5
    q, k, v, dy = make_qkv(layout, b=b, n1=n1, sq=sq, skv=skv, seed=4)
    shape = (b, n1, sq, skv) if mask_shape == "BNSS" else (sq, skv)
    # pre/next are ignored in mode 1 (the golden ignores them too)
    check_fa(q, k, v, dy, layout=layout, head_num=n1, scale=0.5, atten_mask=_explicit(shape, seed=5),
             sparse_mode=1, pre_tokens=0, next_tokens=0)


@pytest.mark.parametrize("layout", DENSE)
@pytest.mark.parametrize("mode", [2, 3])
@pytest.mark.parametrize("sq,skv", [(6, 6), (4, 7), (7, 4)])
def test_causal_modes_dense(layout, mode, sq, skv):
    q, k, v, dy = make_qkv(layout, b=2, n1=4, n2=2, sq=sq, skv=skv, seed=6)
    check_fa(q, k, v, dy, layout=layout, head_num=4, scale=0.35, atten_mask=TRIU2048, sparse_mode=mode,
             pre_tokens=1, next_tokens=-2)  # tokens are ignored by modes 2/3


@pytest.mark.parametrize("layout", ["BNSD", "SBH"])
@pytest.mark.parametrize("sq,skv", [(5, 8), (8, 5)])
@pytest.mark.parametrize("pre,nxt", [(1, 0), (0, 1), (2, 2), (INT_MAX, 0), (3, -2)])
def test_band_mode4_dense(layout, sq, skv, pre, nxt):
    q, k, v, dy = make_qkv(layout, b=1, n1=2, sq=sq, skv=skv, seed=7)
    check_fa(q, k, v, dy, layout=layout, head_num=2, scale=0.4, atten_mask=TRIU2048.to(torch.uint8),
             sparse_mode=4, pre_tokens=pre, next_tokens=nxt)


@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
@pytest.mark.parametrize("sq,skv,prefix", [(5, 7, [2, 7]), (7, 5, [0, 3]), (6, 6, [0, 4])])
@pytest.mark.parametrize("mask_shape", ["BNSS", "B1SS"])
def test_prefix_mode5_dense(layout, sq, skv, prefix, mask_shape):
    b, n1 = 2, 2
    q, k, v, dy = make_qkv(layout, b=b, n1=n1, sq=sq, skv=skv, seed=8)
    shape = (b, n1, sq, skv) if mask_shape == "BNSS" else (b, 1, sq, skv)
    check_fa(q, k, v, dy, layout=layout, head_num=n1, scale=0.4, atten_mask=_explicit(shape, seed=9, p=0.2),
             sparse_mode=5, prefix=prefix)


def test_prefix_mode5_b1_allows_broadcast_masks():
    q, k, v, dy = make_qkv("BNSD", b=1, n1=2, sq=4, skv=6, seed=10)
    for mask in (_explicit((4, 6), seed=11, p=0.2), _explicit((1, 1, 4, 6), seed=12, p=0.2)):
        check_fa(q, k, v, dy, head_num=2, scale=0.4, atten_mask=mask, sparse_mode=5, prefix=[3])


@pytest.mark.parametrize("layout", DENSE)
@pytest.mark.parametrize("sq,skv,prefix", [(5, 7, [2, 5]), (7, 5, [0, 5]), (6, 6, [3, 1])])
def test_prefix_mode6_dense(layout, sq, skv, prefix):
    q, k, v, dy = make_qkv(layout, b=2, n1=2, n2=1, sq=sq, skv=skv, seed=13)
    check_fa(q, k, v, dy, layout=layout, head_num=2, scale=0.4, atten_mask=PREFIX3072, sparse_mode=6,
             prefix=prefix)


def test_prefix_mode6_really_uses_prefix():
    """A prefix makes the first columns visible to every row: the output differs from plain mode 3."""
    q, k, v, _ = make_qkv("BNSD", b=1, n1=1, sq=6, skv=6, seed=14)
    out6 = attnops.flash_attention(q, k, v, scale=0.3, atten_mask=PREFIX3072, sparse_mode=6, prefix=[4])
    out3 = attnops.flash_attention(q, k, v, scale=0.3, atten_mask=TRIU2048, sparse_mode=3)
    assert not torch.allclose(out6[..., :3, :], out3[..., :3, :])  # rows 0..2 see columns up to 3
    torch.testing.assert_close(out6[..., 3:, :], out3[..., 3:, :])  # rows >= 3 already see columns 0..3


def _band_mask(shape, lo, hi, dtype=torch.bool):
    """A full mask (True = masked) that is the band lo <= j - i <= hi, broadcast to ``shape``."""
    diff = torch.arange(shape[-1]).unsqueeze(0) - torch.arange(shape[-2]).unsqueeze(1)
    return ((diff < lo) | (diff > hi)).expand(shape).to(dtype)


@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
@pytest.mark.parametrize("mask_shape", ["BNSS", "B1SS", "11SS", "SS"])
@pytest.mark.parametrize("lo,hi", [(-100, 0), (-100, 2), (-2, 1), (-1, 100)])
@pytest.mark.parametrize("mode", [0, 1])
def test_explicit_band_masks_dense(layout, mask_shape, lo, hi, mode):
    """Full masks that are bands (the causal triu mask, windows) run as the band (MaskSpec): same golden."""
    b, n1, sq, skv = 2, 2, 9, 11
    q, k, v, dy = make_qkv(layout, b=b, n1=n1, n2=1, sq=sq, skv=skv, seed=5)
    shape = {"BNSS": (b, n1, sq, skv), "B1SS": (b, 1, sq, skv), "11SS": (1, 1, sq, skv), "SS": (sq, skv)}[mask_shape]
    mask = _band_mask(shape, lo, hi, torch.uint8 if mask_shape == "SS" else torch.bool).contiguous()
    tokens = dict(pre_tokens=3, next_tokens=1) if mode == 0 else {}
    check_fa(q, k, v, dy, layout=layout, head_num=n1, scale=0.4, atten_mask=mask, sparse_mode=mode, **tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_explicit_causal_mask_with_pse_and_dropout(dtype):
    b, n1, sq = 1, 2, 12
    q, k, v, dy = make_qkv("BNSD", b=b, n1=n1, n2=1, sq=sq, skv=sq, dtype=dtype, seed=6)
    pse = torch.randn(b, n1, sq, sq, generator=torch.Generator().manual_seed(7)).to(dtype)
    check_fa(q, k, v, dy, head_num=n1, scale=0.3, atten_mask=torch.ones(sq, sq, dtype=torch.bool).triu(1),
             pse=pse, keep_prob=0.8)


# ------------------------------------------------------------------------------------------ TND

Q_LENS = [3, 0, 5, 4, 1]
KV_LENS = [4, 2, 5, 6, 1]


def _tnd(q_lens=Q_LENS, kv_lens=KV_LENS, n1=2, n2=1, seed=20, **kw):
    q, k, v, dy = make_qkv("TND", n1=n1, n2=n2, q_lens=q_lens, kv_lens=kv_lens, seed=seed, **kw)
    return q, k, v, dy, dict(layout="TND", head_num=n1, actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(kv_lens))


@pytest.mark.parametrize("mask_kind", ["SS", "11SS", "larger"])
@pytest.mark.parametrize("pre,nxt", [(INT_MAX, INT_MAX), (1, 1), (4, -1)])
def test_mode0_tnd(mask_kind, pre, nxt):
    q, k, v, dy, kw = _tnd()
    mq, mk = max(Q_LENS), max(KV_LENS)
    shape = {"SS": (mq, mk), "11SS": (1, 1, mq, mk), "larger": (mq + 3, mk + 2)}[mask_kind]
    check_fa(q, k, v, dy, scale=0.4, atten_mask=_explicit(shape, seed=21), sparse_mode=0, pre_tokens=pre,
             next_tokens=nxt, **kw)


def test_explicit_causal_mask_tnd():
    q, k, v, dy, kw = _tnd()
    mask = torch.ones(max(Q_LENS) + 2, max(KV_LENS) + 3, dtype=torch.bool).triu(1)  # top-left slices: causal
    check_fa(q, k, v, dy, scale=0.4, atten_mask=mask, sparse_mode=0, **kw)


def test_mode1_tnd():
    q, k, v, dy, kw = _tnd()
    mask = _explicit((max(Q_LENS), max(KV_LENS)), seed=22, dtype=torch.uint8)
    check_fa(q, k, v, dy, scale=0.4, atten_mask=mask, sparse_mode=1, **kw)


@pytest.mark.parametrize("mode", [2, 3])
def test_causal_modes_tnd(mode):
    q, k, v, dy, kw = _tnd()
    check_fa(q, k, v, dy, scale=0.4, atten_mask=TRIU2048, sparse_mode=mode, **kw)


@pytest.mark.parametrize("pre,nxt", [(1, 0), (2, 1), (INT_MAX, 0), (0, INT_MAX)])
def test_band_mode4_tnd(pre, nxt):
    q, k, v, dy, kw = _tnd()
    check_fa(q, k, v, dy, scale=0.4, atten_mask=TRIU2048, sparse_mode=4, pre_tokens=pre, next_tokens=nxt, **kw)


def test_prefix_mode6_tnd():
    q_lens, kv_lens = [3, 5, 4], [4, 5, 2]
    q, k, v, dy, kw = _tnd(q_lens, kv_lens)
    # Sq <= Skv: prefix in [Skv-Sq, Skv]; Sq > Skv: [0, Skv]
    check_fa(q, k, v, dy, scale=0.4, atten_mask=PREFIX3072, sparse_mode=6, prefix=[2, 3, 1], **kw)


@pytest.mark.parametrize("q_lens,kv_lens,pre,nxt", [
    ([3, 2], [3, 6], 6, -2),                # cann_semantics §1.1 card 1
    ([2, 5, 4], [6, 5, 4], 4, 0),           # band batch is the last batch, next = 0
    ([2, 3, 0], [4, 5, 0], 8, -1),          # trailing empty batch: the band batch is batch 1
    ([2, 0, 3, 0], [5, 3, 7, 2], 7, -4),    # empty batches in between
])
def test_mode7_tnd(q_lens, kv_lens, pre, nxt):
    q, k, v, dy, kw = _tnd(q_lens, kv_lens, seed=23)
    check_fa(q, k, v, dy, scale=0.4, atten_mask=TRIU2048, sparse_mode=7, pre_tokens=pre, next_tokens=nxt, **kw)


@pytest.mark.parametrize("q_lens,kv_lens,pre,nxt", [
    ([3, 5, 4], [4, 5, 4], 4, 1),           # cann_semantics §1.1 card 2
    ([0, 2, 3], [3, 5, 3], 5, -3),          # leading empty batch: the band batch is batch 1
    ([4, 2], [4, 6], 4, 0),
])
def test_mode8_tnd(q_lens, kv_lens, pre, nxt):
    q, k, v, dy, kw = _tnd(q_lens, kv_lens, seed=24)
    check_fa(q, k, v, dy, scale=0.4, atten_mask=TRIU2048, sparse_mode=8, pre_tokens=pre, next_tokens=nxt, **kw)


# ------------------------------------------------------------------------------ worked examples (§1.1)


def _keep_pattern(q_lens, kv_lens, **kw):
    """Keep pattern of every batch, read from the reference's output: q = 0 gives uniform attention over the kept
    columns, and V = one-hot(column) makes output column j positive iff j is kept."""
    d = max(kv_lens)
    q = torch.zeros(sum(q_lens), 1, d)
    k = torch.zeros(sum(kv_lens), 1, d)
    v = torch.zeros(sum(kv_lens), 1, d)
    off = 0
    for n in kv_lens:
        v[off + torch.arange(n), 0, torch.arange(n)] = 1.0
        off += n
    out = attnops.flash_attention(q, k, v, layout="TND", actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(kv_lens),
                                  atten_mask=TRIU2048, scale=1.0, **kw)
    pats, off = [], 0
    for a, c in zip(q_lens, kv_lens):
        pats.append(out[off:off + a, 0, :c] > 0)
        off += a
    return pats


def test_worked_example_mode7_card1():
    """A 4x6 rightDownCausal batch split by q into 2+2 rows; card 1 holds original rows 0 and 1 in its last batch."""
    i, j = torch.arange(4).view(-1, 1), torch.arange(6).view(1, -1)
    original = j <= i + 2  # right-down causal, delta = 2
    pats = _keep_pattern([3, 2], [3, 6], sparse_mode=7, pre_tokens=6, next_tokens=-2)
    assert torch.equal(pats[0], torch.ones(3, 3, dtype=torch.bool).tril())
    assert torch.equal(pats[1], original[0:2])


def test_worked_example_mode7_card2():
    """Card 2 holds original rows 2 and 3 in batch 0 (mode 3): it keeps j <= i + 4."""
    i, j = torch.arange(4).view(-1, 1), torch.arange(6).view(1, -1)
    original = j <= i + 2
    pats = _keep_pattern([2, 5, 4], [6, 5, 4], sparse_mode=3)
    assert torch.equal(pats[0], original[2:4])
    assert torch.equal(pats[1], torch.ones(5, 5, dtype=torch.bool).tril())


def test_worked_example_mode8_card2():
    """A 5x4 leftUpCausal batch split 2+3; card 2 holds original rows 2, 3, 4 in its first batch."""
    i, j = torch.arange(5).view(-1, 1), torch.arange(4).view(1, -1)
    original = j <= i
    pats = _keep_pattern([3, 5, 4], [4, 5, 4], sparse_mode=8, pre_tokens=4, next_tokens=1)
    assert torch.equal(pats[0], original[2:5])
    assert torch.equal(pats[1], torch.ones(5, 5, dtype=torch.bool).tril())
    assert torch.equal(pats[2], torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("mode,q_lens,kv_lens,pre,nxt", [
    (7, [3, 2], [3, 6], 6, -2), (3, [2, 5, 4], [6, 5, 4], INT_MAX, INT_MAX), (8, [3, 5, 4], [4, 5, 4], 4, 1)])
def test_worked_examples_vs_golden(mode, q_lens, kv_lens, pre, nxt):
    q, k, v, dy, kw = _tnd(q_lens, kv_lens, n1=2, n2=2, seed=25)
    check_fa(q, k, v, dy, scale=0.4, atten_mask=TRIU2048, sparse_mode=mode, pre_tokens=pre, next_tokens=nxt, **kw)


# ------------------------------------------------------------------------------------------ fully-masked rows


def _assert_invalid_rows(out, smax, ssum, dq, rows):
    """``rows``: index tuple selecting the fully-masked rows in out/dq (and, with [..., :], in the stats)."""
    assert bool((out[rows] == 0).all())
    assert bool((dq[rows] == 0).all())
    assert bool((smax[rows] == FLT_LOWEST).all()) and FLT_LOWEST == -3.4028234663852886e38
    assert bool((ssum[rows] == FLT_MAX).all()) and FLT_MAX == 3.4028234663852886e38


def test_fully_masked_rows_mode3_sq_gt_skv():
    q, k, v, dy = make_qkv("BNSD", b=2, n1=2, sq=7, skv=4, seed=30)
    r = check_fa(q, k, v, dy, head_num=2, scale=0.5, atten_mask=TRIU2048, sparse_mode=3)
    _assert_invalid_rows(r["out"], r["smax"], r["ssum"], r["dq"], (slice(None), slice(None), slice(0, 3)))
    assert bool((r["out"][:, :, 3:] != 0).any())


def test_fully_masked_rows_explicit_mask():
    q, k, v, dy = make_qkv("BSND", b=1, n1=2, sq=5, skv=6, seed=31)
    mask = _explicit((1, 2, 5, 6), seed=32, p=0.3)
    mask[0, 0, 1] = True
    mask[0, 1, 4] = True
    mask[0, 1, 0] = True
    r = check_fa(q, k, v, dy, layout="BSND", head_num=2, scale=0.5, atten_mask=mask, sparse_mode=1)
    for n, i in ((0, 1), (1, 4), (1, 0)):
        assert bool((r["out"][0, i, n] == 0).all()) and bool((r["dq"][0, i, n] == 0).all())
        assert float(r["smax"][0, n, i, 0]) == FLT_LOWEST and float(r["ssum"][0, n, i, 0]) == FLT_MAX
        assert bool((r["smax"][0, n, i] == FLT_LOWEST).all()) and bool((r["ssum"][0, n, i] == FLT_MAX).all())


def test_fully_masked_rows_band():
    # mode 4, pre = 1, next = -1: only the diagonal j - i = delta - 1 is kept; rows with j < 0 there are empty
    q, k, v, dy = make_qkv("BNSD", b=1, n1=1, sq=6, skv=4, seed=33)
    r = check_fa(q, k, v, dy, head_num=1, scale=0.5, atten_mask=TRIU2048, sparse_mode=4, pre_tokens=1,
                 next_tokens=-1)
    _assert_invalid_rows(r["out"], r["smax"], r["ssum"], r["dq"], (0, 0, slice(0, 3)))


@pytest.mark.parametrize("pse_type", [0, 1])
def test_every_row_masked_with_a_pse_gradient(pse_type):
    """A batch whose band keeps nothing (mode 4, next_tokens = -1, one token): no tile at all, zero gradients,
    and a zero dpse of the pse's shape."""
    q, k, v, dy = make_qkv("BNSD", b=1, n1=1, sq=1, skv=1, seed=35)
    pse = torch.randn(1, 1, 1, 1)
    kw = dict(layout="BNSD", scale=0.25, atten_mask=TRIU2048, sparse_mode=4, next_tokens=-1, pse=pse,
              pse_type=pse_type)
    r = attnops.flash_attention(q, k, v, return_stats=True, **kw)
    assert bool((r.out == 0).all())
    dq, dk, dv, dpse = attnops.flash_attention_backward(dy, q, k, v, r.out, r.softmax_max, r.softmax_sum, **kw)
    for g in (dq, dk, dv, dpse):
        assert bool((g == 0).all())
    assert dpse.shape == pse.shape


@pytest.mark.parametrize("softmax_layout", ["", "TND"])
def test_fully_masked_rows_tnd_empty_kv(softmax_layout):
    """A batch with Skv = 0 and Sq > 0 has only invalid rows; dk/dv of it are empty and the others unaffected."""
    q_lens, kv_lens = [2, 3, 2], [3, 0, 4]
    q, k, v, dy, kw = _tnd(q_lens, kv_lens, seed=34)
    r = check_fa(q, k, v, dy, scale=0.5, softmax_layout=softmax_layout, **kw)
    rows = slice(2, 5)
    assert bool((r["out"][rows] == 0).all()) and bool((r["dq"][rows] == 0).all())
    if softmax_layout == "TND":
        assert bool((r["smax"][rows] == FLT_LOWEST).all()) and bool((r["ssum"][rows] == FLT_MAX).all())
    else:  # per-batch blocks [N1, Sq_b, 8]: batch 1 occupies flat rows 2*N1 .. 5*N1
        flat_max, flat_sum = r["smax"].reshape(-1, 8), r["ssum"].reshape(-1, 8)
        assert bool((flat_max[4:10] == FLT_LOWEST).all()) and bool((flat_sum[4:10] == FLT_MAX).all())


# ------------------------------------------------------------------------------------------ slow matrix


@pytest.mark.slow
@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4, 6, 7, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_long_varlen_every_mode(mode, dtype):
    """Lengths that are not multiples of any tile (1025, 63, 111), an empty batch, every TND mode."""
    q_lens, kv_lens = [1025, 63, 0, 111], [1025, 111, 5, 111]
    q, k, v, dy = make_qkv("TND", n1=4, n2=2, q_lens=q_lens, kv_lens=kv_lens, dtype=dtype, seed=35)
    mask = {0: _explicit((1025, 1025), seed=36, p=0.2), 1: _explicit((1025, 1025), seed=37, p=0.2),
            6: PREFIX3072}.get(mode, TRIU2048)
    check_fa(q, k, v, dy, layout="TND", head_num=4, scale=0.3, actual_seq_qlen=cum(q_lens),
             actual_seq_kvlen=cum(kv_lens), atten_mask=mask, sparse_mode=mode, pre_tokens=300, next_tokens=20,
             prefix=[100, 60, 5, 50])
