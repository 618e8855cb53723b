"""pse vs the fp64 golden: external tensors (types 0/1) in every documented shape with dpse, the ALiBi-compressed
[B|1, N, 1024, Skv] form, and the generated ALiBi slopes (types 2/3) with q/kv start indices."""
import pytest
import torch

import attnops
from tests.helpers import TRIU2048, check_fa, cum, make_qkv, randn


@pytest.mark.parametrize("pse_type", [0, 1])
@pytest.mark.parametrize("shape", ["BNSS", "1NSS", "BN1S"])
@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
def test_external_pse_dense(pse_type, shape, layout):
    b, n1, n2, sq, skv = 2, 4, 2, 5, 6
    q, k, v, dy = make_qkv(layout, b=b, n1=n1, n2=n2, sq=sq, skv=skv, seed=40)
    pse_shape = {"BNSS": (b, n1, sq, skv), "1NSS": (1, n1, sq, skv), "BN1S": (b, n1, 1, skv)}[shape]
    pse = randn(*pse_shape, seed=41)
    r = check_fa(q, k, v, dy, layout=layout, head_num=n1, scale=0.4, pse=pse, pse_type=pse_type)
    assert r["dpse"] is not None and r["dpse"].shape == pse.shape


@pytest.mark.parametrize("pse_type", [0, 1])
def test_external_pse_with_causal_mask(pse_type):
    q, k, v, dy = make_qkv("BSND", b=2, n1=2, sq=6, skv=6, seed=42)
    pse = randn(2, 2, 6, 6, seed=43)
    check_fa(q, k, v, dy, layout="BSND", head_num=2, scale=0.5, pse=pse, pse_type=pse_type, atten_mask=TRIU2048,
             sparse_mode=2)


def test_pse_type_changes_the_result():
    """Type 0 (scale*QK + pse) and type 1 (scale*(QK + pse)) differ unless scale == 1."""
    q, k, v, _ = make_qkv("BNSD", b=1, n1=2, sq=4, skv=4, seed=44)
    pse = randn(1, 2, 4, 4, seed=45)
    o0 = attnops.flash_attention(q, k, v, scale=0.3, pse=pse, pse_type=0)
    o1 = attnops.flash_attention(q, k, v, scale=0.3, pse=pse, pse_type=1)
    assert not torch.allclose(o0, o1)
    torch.testing.assert_close(attnops.flash_attention(q, k, v, scale=1.0, pse=pse, pse_type=0),
                               attnops.flash_attention(q, k, v, scale=1.0, pse=pse, pse_type=1))


@pytest.mark.parametrize("pse_type", [0, 1])
@pytest.mark.parametrize("shape", ["BNSS", "BN1S"])
def test_external_pse_tnd(pse_type, shape):
    q_lens, kv_lens = [3, 5, 1], [4, 5, 2]
    n1 = 2
    q, k, v, dy = make_qkv("TND", n1=n1, n2=1, q_lens=q_lens, kv_lens=kv_lens, seed=46)
    pse_shape = (3, n1, max(q_lens), max(kv_lens)) if shape == "BNSS" else (3, n1, 1, max(kv_lens))
    pse = randn(*pse_shape, seed=47)
    check_fa(q, k, v, dy, layout="TND", head_num=n1, scale=0.4, pse=pse, pse_type=pse_type,
             actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(kv_lens), atten_mask=TRIU2048, sparse_mode=3)


# ----------------------------------------------------------------------------- flattened TND pse (1-D)

FLAT_Q, FLAT_KV = [3, 5, 1, 4], [4, 5, 2, 6]  # batches of different lengths, Sq != Skv


def flat_pse(form, n1, q_lens, kv_lens, seed):
    """The 1-D TND pse: ``row`` = per-batch [N1, 1, Skv_b], ``full`` = per-batch [N1, Sq_b, Skv_b], end to end."""
    rows = [1] * len(q_lens) if form == "row" else q_lens
    return randn(n1 * sum(r * c for r, c in zip(rows, kv_lens)), seed=seed)


def flat_as_blocks(pse, form, n1, q_lens, kv_lens):
    """The same pse as per-batch [N1, Sq_b, Skv_b] blocks (the segments read in the documented order)."""
    blocks, off = [], 0
    for sq, skv in zip(q_lens, kv_lens):
        rows = 1 if form == "row" else sq
        blocks.append(pse[off:off + n1 * rows * skv].view(n1, rows, skv).expand(n1, sq, skv))
        off += n1 * rows * skv
    return blocks


@pytest.mark.parametrize("pse_type", [0, 1])
@pytest.mark.parametrize("form", ["row", "full"])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_flattened_tnd_pse_vs_golden(pse_type, form, mask):
    n1 = 2
    q, k, v, dy = make_qkv("TND", n1=n1, n2=1, q_lens=FLAT_Q, kv_lens=FLAT_KV, seed=60)
    pse = flat_pse(form, n1, FLAT_Q, FLAT_KV, seed=61)
    kw = dict(atten_mask=TRIU2048, sparse_mode=3) if mask == "causal" else {}
    r = check_fa(q, k, v, dy, layout="TND", head_num=n1, scale=0.4, pse=pse, pse_type=pse_type,
                 actual_seq_qlen=cum(FLAT_Q), actual_seq_kvlen=cum(FLAT_KV), **kw)
    assert r["dpse"].shape == pse.shape
    if mask == "none":  # every pse entry reaches a score
        assert bool(r["dpse"].abs().gt(0).all())


@pytest.mark.parametrize("form", ["row", "full"])
def test_flattened_tnd_pse_is_each_batch_segment(form):
    """Batch b of the output equals a dense BNSD call on that batch with its segment as a [1, N1, Sq_b, Skv_b] pse."""
    n1 = 2
    q, k, v, _ = make_qkv("TND", n1=n1, n2=2, q_lens=FLAT_Q, kv_lens=FLAT_KV, seed=62)
    pse = flat_pse(form, n1, FLAT_Q, FLAT_KV, seed=63)
    out = attnops.flash_attention(q, k, v, layout="TND", scale=0.4, pse=pse, pse_type=1,
                                  actual_seq_qlen=cum(FLAT_Q), actual_seq_kvlen=cum(FLAT_KV))
    qo, ko = 0, 0
    for block, sq, skv in zip(flat_as_blocks(pse, form, n1, FLAT_Q, FLAT_KV), FLAT_Q, FLAT_KV):
        dense = attnops.flash_attention(*(t[o:o + s].transpose(0, 1).unsqueeze(0)
                                          for t, o, s in ((q, qo, sq), (k, ko, skv), (v, ko, skv))),
                                        layout="BNSD", scale=0.4, pse=block.unsqueeze(0).contiguous(), pse_type=1)
        torch.testing.assert_close(out[qo:qo + sq], dense[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
        qo, ko = qo + sq, ko + skv


def test_flattened_tnd_pse_length_is_checked():
    n1 = 2
    q, k, v, _ = make_qkv("TND", n1=n1, n2=1, q_lens=FLAT_Q, kv_lens=FLAT_KV, seed=64)
    row_len, full_len = n1 * sum(FLAT_KV), n1 * sum(a * c for a, c in zip(FLAT_Q, FLAT_KV))
    with pytest.raises(ValueError, match=rf"pse.*{row_len}.*{full_len}.*length {full_len + 1}"):
        attnops.flash_attention(q, k, v, layout="TND", scale=0.4, pse=randn(full_len + 1, seed=65),
                                actual_seq_qlen=cum(FLAT_Q), actual_seq_kvlen=cum(FLAT_KV))
    qd, kd, vd, _ = make_qkv("BNSD", b=1, n1=n1, sq=4, skv=4, seed=66)
    with pytest.raises(ValueError, match="TND layout only"):
        attnops.flash_attention(qd, kd, vd, scale=0.4, pse=randn(n1 * 4, seed=67))


# ----------------------------------------------------------------------------- ALiBi-compressed [.., 1024, S]

S_LONG = 1100  # > 1024: the smallest kind of shape where the compressed form applies


def _toeplitz(b, n, s, seed):
    """A pse whose value depends only on i - j (what ALiBi is), [b, n, s, s]."""
    diag = randn(b, n, 2 * s - 1, seed=seed)
    i, j = torch.arange(s).view(-1, 1), torch.arange(s).view(1, -1)
    return diag[:, :, (i - j) + s - 1]


@pytest.mark.parametrize("pse_type,pse_b,b,mode", [(1, 1, 1, 2), (0, 2, 2, 3), (1, 1, 2, 0)])
def test_alibi_compressed_vs_golden(pse_type, pse_b, b, mode):
    q, k, v, dy = make_qkv("BNSD", b=b, n1=1, sq=S_LONG, skv=S_LONG, seed=48)
    pse = randn(pse_b, 1, 1024, S_LONG, seed=49)
    mask = TRIU2048 if mode else torch.ones(S_LONG, S_LONG, dtype=torch.bool).triu(1)  # mode 0: explicit causal
    r = check_fa(q, k, v, dy, head_num=1, scale=0.35, pse=pse, pse_type=pse_type, atten_mask=mask,
                 sparse_mode=mode)
    assert r["dpse"].shape == pse.shape


def test_alibi_compressed_equals_uncompressed_toeplitz():
    """For a Toeplitz pse, passing its last 1024 rows gives the same result as passing it whole (causal)."""
    q, k, v, dy = make_qkv("BNSD", b=1, n1=1, sq=S_LONG, skv=S_LONG, seed=50)
    full = _toeplitz(1, 1, S_LONG, seed=51)
    comp = full[:, :, -1024:, :].contiguous()
    kw = dict(scale=0.35, atten_mask=TRIU2048, sparse_mode=2)
    out_c = attnops.flash_attention(q, k, v, pse=comp, **kw)
    out_f = attnops.flash_attention(q, k, v, pse=full, **kw)
    torch.testing.assert_close(out_c, out_f, rtol=1e-5, atol=1e-6)


def test_alibi_compressed_fp16():
    q, k, v, dy = make_qkv("BSND", b=1, n1=1, sq=S_LONG, skv=S_LONG, dtype=torch.float16, seed=52)
    pse = randn(1, 1, 1024, S_LONG, dtype=torch.float16, seed=53)
    check_fa(q, k, v, dy, layout="BSND", head_num=1, scale=0.35, pse=pse, pse_type=1, atten_mask=TRIU2048,
             sparse_mode=3)


@pytest.mark.parametrize("lens,pse_b,pse_type", [([287, 150, 33], 3, 1), ([287, 150, 33], 1, 0), ([1100, 287], 1, 1),
                                                  ([1100, 287], 2, 0)])
def test_alibi_compressed_tnd_vs_golden(lens, pse_b, pse_type):
    """TND: a [B|1, N1, 1024, W] pse is the compressed ALiBi whatever the lengths (also when all are < 1024)."""
    n1, w = 2, max(lens) + 5
    q, k, v, dy = make_qkv("TND", n1=n1, n2=1, d=16, q_lens=lens, kv_lens=lens, seed=54)
    pse = randn(pse_b, n1, 1024, w, seed=55)
    r = check_fa(q, k, v, dy, layout="TND", head_num=n1, scale=0.35, pse=pse, pse_type=pse_type,
                 actual_seq_qlen=cum(lens), actual_seq_kvlen=cum(lens), atten_mask=TRIU2048, sparse_mode=3)
    assert r["dpse"].shape == pse.shape


def test_alibi_compressed_tnd_is_each_batch_bottom_right_block():
    """As the CANN goldens build it: the compressed pse is the last 1024 rows of a Toeplitz [max(1024, Sq), W] pse
    and each batch reads the bottom-right [Sq_b, Skv_b] block of that full pse."""
    lens, w = [287, 40], 300
    q, k, v, _ = make_qkv("TND", n1=1, n2=1, d=16, q_lens=lens, kv_lens=lens, seed=56)
    diag = randn(1, 1, 1024 + w - 1, seed=57)
    i, j = torch.arange(1024).view(-1, 1), torch.arange(w).view(1, -1)
    full = diag[:, :, (i - j) + w - 1]  # [1, 1, 1024, W], Toeplitz
    kw = dict(scale=0.35, pse_type=1, atten_mask=TRIU2048, sparse_mode=3)
    out = attnops.flash_attention(q, k, v, layout="TND", pse=full, actual_seq_qlen=cum(lens),
                                  actual_seq_kvlen=cum(lens), **kw)
    starts = [0] + cum(lens)[:-1]
    for s0, n in zip(starts, lens):
        qb, kb, vb = (t[s0:s0 + n].unsqueeze(0) for t in (q, k, v))
        block = full[:, :, 1024 - n:, w - n:].contiguous()
        ref = attnops.flash_attention(qb, kb, vb, layout="BSND", pse=block, **kw)
        torch.testing.assert_close(out[s0:s0 + n], ref[0], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- generated ALiBi (types 2, 3)


@pytest.mark.parametrize("pse_type", [2, 3])
@pytest.mark.parametrize("slope_shape", ["BN", "N"])
@pytest.mark.parametrize("starts", [(0, 0), (3, 1), (0, 5)])
def test_alibi_slopes_dense(pse_type, slope_shape, starts):
    b, n1, s = 2, 4, 6
    q, k, v, dy = make_qkv("BSH", b=b, n1=n1, n2=2, sq=s, skv=s, seed=54)
    slopes = randn(b, n1, seed=55).abs() if slope_shape == "BN" else randn(n1, seed=55).abs()
    r = check_fa(q, k, v, dy, layout="BSH", head_num=n1, scale=0.4, pse=slopes, pse_type=pse_type,
                 q_start_idx=starts[0], kv_start_idx=starts[1])
    assert r["dpse"] is None


@pytest.mark.parametrize("pse_type", [2, 3])
def test_alibi_slopes_change_the_result(pse_type):
    q, k, v, _ = make_qkv("BNSD", b=1, n1=2, sq=5, skv=5, seed=56)
    slopes = torch.tensor([0.5, 0.25])
    base = attnops.flash_attention(q, k, v, scale=0.4, pse=slopes, pse_type=pse_type)
    shifted = attnops.flash_attention(q, k, v, scale=0.4, pse=slopes, pse_type=pse_type, q_start_idx=2)
    plain = attnops.flash_attention(q, k, v, scale=0.4)
    assert not torch.allclose(base, plain) and not torch.allclose(base, shifted)


@pytest.mark.parametrize("pse_type", [2, 3])
def test_alibi_slopes_tnd_causal(pse_type):
    lens = [3, 6, 2]
    q, k, v, dy = make_qkv("TND", n1=2, n2=2, q_lens=lens, kv_lens=lens, seed=57)
    check_fa(q, k, v, dy, layout="TND", head_num=2, scale=0.4, pse=randn(3, 2, seed=58).abs(), pse_type=pse_type,
             actual_seq_qlen=cum(lens), actual_seq_kvlen=cum(lens), atten_mask=TRIU2048, sparse_mode=3,
             q_start_idx=4, kv_start_idx=4)


@pytest.mark.parametrize("pse_type", [2, 3])
def test_alibi_slopes_mode8_split(pse_type):
    """Mode 8 with a q-split first batch: Sq0 - Skv0 + q_start - kv_start == 0; the other batches reset starts."""
    q_lens, kv_lens = [3, 4, 2], [5, 4, 2]
    q, k, v, dy = make_qkv("TND", n1=2, n2=1, q_lens=q_lens, kv_lens=kv_lens, seed=59)
    check_fa(q, k, v, dy, layout="TND", head_num=2, scale=0.4, pse=randn(2, seed=60).abs(), pse_type=pse_type,
             actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(kv_lens), atten_mask=TRIU2048, sparse_mode=8,
             pre_tokens=5, next_tokens=2, q_start_idx=2, kv_start_idx=0)
