"""Triton FlashAttention kernels vs the fp64 golden (forward, statistics, dq/dk/dv/dpse): layouts, varlen, every
sparse mode, pse types 0-3, dropout (Philox bits equal to the CPU generator's, and packed masks), GQA, Dk != Dv,
fully-masked rows. On the CPU they run through Triton's interpreter (fp16/fp32, tiny shapes, 16 x 16 tiles, so
shapes of 17-40 rows cover interior, edge and skipped tiles); on a GPU the same tests run compiled, bf16 included.
"""
import pytest
import torch

import attnops
from tests.helpers import PREFIX3072, TRIU2048, check_fa, cum, make_qkv, noncontig, random_keep

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # exp2(-inf) in numpy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float16, torch.float32) + ((torch.bfloat16,) if DEVICE == "cuda" else ())


def _on(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


def check(q, k, v, dy, **kw):
    """:func:`check_fa` on the Triton backend (tensors moved to the test device)."""
    q, k, v, dy = _on(q, k, v, dy)
    for name in ("pse", "atten_mask", "drop_mask"):
        if kw.get(name) is not None:
            kw[name] = kw[name].to(DEVICE)
    return check_fa(q, k, v, dy, backend="triton", **kw)


@pytest.mark.parametrize("d,dv,dtype", [(192, 128, torch.float16), (160, 64, torch.float32)])
def test_padded_head_dims_above_128(d, dv, dtype):
    """Head dims above 128 that are not powers of two (padded tiles; D=192/Dv=128 is NSA's compressed attention),
    with GQA, causal and a pse."""
    q, k, v, dy = make_qkv("BNSD", b=1, n1=2, n2=1, sq=20, skv=37, d=d, dv=dv, dtype=dtype, seed=5)
    pse = torch.randn(1, 2, 20, 37, dtype=dtype)
    check(q, k, v, dy, layout="BNSD", head_num=2, scale=0.1, pse=pse, atten_mask=TRIU2048, sparse_mode=3)


@pytest.mark.parametrize("layout,dtype", [("BNSD", torch.float32), ("BSH", torch.float16), ("SBH", torch.float32)])
def test_dense_layouts_gqa_dv(layout, dtype):
    q, k, v, dy = make_qkv(layout, b=2, n1=4, n2=2, sq=20, skv=37, d=16, dv=8, dtype=dtype, seed=1)
    check(q, k, v, dy, layout=layout, head_num=4, scale=0.3)


@pytest.mark.parametrize("how", ["transpose", "strided"])
def test_non_contiguous_inputs(how):
    """Strided views are read in place (reversed strides) or copied once (no unit last stride)."""
    q, k, v, dy = (noncontig(t, how) for t in make_qkv("BSND", b=2, n1=2, n2=1, sq=18, skv=21, d=16, seed=20))
    check(q, k, v, dy, layout="BSND", head_num=2, scale=0.3, atten_mask=TRIU2048, sparse_mode=3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_causal(dtype):
    q, k, v, dy = make_qkv("BSND", b=1, n1=2, sq=33, skv=33, d=32, dtype=dtype, seed=2)
    check(q, k, v, dy, layout="BSND", head_num=2, scale=32 ** -0.5, atten_mask=TRIU2048, sparse_mode=2)


@pytest.mark.parametrize("softmax_layout", ["", "TND"])
def test_tnd_varlen(softmax_layout):
    q_lens, kv_lens = [17, 0, 1, 9], [20, 5, 3, 0]  # zero-length query and KV batches, length 1, odd lengths
    q, k, v, dy = make_qkv("TND", n1=2, n2=1, d=16, dv=8, q_lens=q_lens, kv_lens=kv_lens, t_extra=2, seed=3)
    check(q, k, v, dy, layout="TND", head_num=2, scale=0.25, actual_seq_qlen=cum(q_lens),
          actual_seq_kvlen=cum(kv_lens), softmax_layout=softmax_layout)


@pytest.mark.parametrize("mode,pre,nxt", [(0, 5, 3), (0, 21, -4), (1, 0, 0)])
def test_explicit_mask_modes(mode, pre, nxt):
    b, n1, sq, skv = 2, 2, 19, 24
    q, k, v, dy = make_qkv("BNSD", b=b, n1=n1, sq=sq, skv=skv, d=16, seed=4)
    mask = random_keep(b * n1 * sq * skv, 0.3, seed=5).reshape(b, n1, sq, skv)
    mask[0, 1, 3] = True  # a fully-masked row: output 0, statistics FLT_LOWEST / FLT_MAX
    check(q, k, v, dy, head_num=n1, scale=0.4, atten_mask=mask, sparse_mode=mode, pre_tokens=pre, next_tokens=nxt)


@pytest.mark.parametrize("mode,sq,skv", [(2, 20, 35), (3, 35, 20), (4, 40, 40)])
def test_band_modes(mode, sq, skv):
    q, k, v, dy = make_qkv("BSH", b=2, n1=2, n2=1, sq=sq, skv=skv, d=16, seed=6)
    r = check(q, k, v, dy, layout="BSH", head_num=2, scale=0.3, atten_mask=TRIU2048, sparse_mode=mode,
              pre_tokens=9, next_tokens=2)
    if mode == 3 and sq > skv:  # bottom-right causal: the first sq - skv rows are fully masked
        assert bool((r["out"][:, : sq - skv] == 0).all())


@pytest.mark.parametrize("mode", [5, 6])
def test_prefix_modes(mode):
    b, n1, sq, skv = 2, 2, 24, 36
    q, k, v, dy = make_qkv("BNSD", b=b, n1=n1, sq=sq, skv=skv, d=16, seed=7)
    mask = random_keep(b * sq * skv, 0.2, seed=8).reshape(b, 1, sq, skv) if mode == 5 else PREFIX3072
    check(q, k, v, dy, head_num=n1, scale=0.3, atten_mask=mask, sparse_mode=mode, prefix=[14, 30])


@pytest.mark.parametrize("mode", [7, 8])
def test_tnd_split_modes(mode):
    q_lens, kv_lens = [18, 5, 21], [25, 5, 17]
    q, k, v, dy = make_qkv("TND", n1=2, d=16, q_lens=q_lens, kv_lens=kv_lens, seed=9)
    check(q, k, v, dy, layout="TND", head_num=2, scale=0.3, atten_mask=TRIU2048, sparse_mode=mode,
          actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(kv_lens), pre_tokens=6, next_tokens=1)


@pytest.mark.parametrize("pse_type,rows", [(0, 20), (1, 20), (1, 1)])
def test_pse_tensor(pse_type, rows):
    q, k, v, dy = make_qkv("BNSD", b=2, n1=2, sq=20, skv=23, d=16, seed=10)
    pse = torch.randn(1 if rows == 20 else 2, 2, rows, 23, generator=torch.Generator().manual_seed(11))
    r = check(q, k, v, dy, head_num=2, scale=0.3, pse=pse, pse_type=pse_type, atten_mask=TRIU2048, sparse_mode=3)
    assert r["dpse"].shape == pse.shape


@pytest.mark.parametrize("pse_type", [2, 3])
def test_alibi_slopes(pse_type):
    q_lens = [19, 7]
    q, k, v, dy = make_qkv("TND", n1=2, n2=1, d=16, q_lens=q_lens, kv_lens=q_lens, seed=12)
    slopes = torch.rand(2, 2, generator=torch.Generator().manual_seed(13))
    r = check(q, k, v, dy, layout="TND", head_num=2, scale=0.3, pse=slopes, pse_type=pse_type,
              actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(q_lens), q_start_idx=3, kv_start_idx=1)
    assert r["dpse"] is None


@pytest.mark.parametrize("drop,layout", [("seed", "BNSD"), ("mask", "BNSD"), ("seed", "TND")])
def test_dropout(drop, layout):
    """``drop="seed"``: the golden gets the CPU Philox keep bits, so any bit the kernel's ``tl.rand`` draws
    differently would show up as an error far above the tolerance."""
    kw = dict(layout=layout, head_num=2, scale=0.3, keep_prob=0.7)
    if layout == "TND":
        q_lens, kv_lens = [13, 20], [22, 9]
        q, k, v, dy = make_qkv("TND", n1=2, d=16, q_lens=q_lens, kv_lens=kv_lens, seed=14)
        kw.update(actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(kv_lens), atten_mask=TRIU2048, sparse_mode=3)
    else:
        q, k, v, dy = make_qkv("BNSD", b=2, n1=2, sq=18, skv=21, d=16, seed=14)
    check(q, k, v, dy, drop=drop, drop_seed=2**40 + 77, offset=2**33 + 5, **kw)


def test_dropout_matches_reference_bits():
    """The kernel and the CPU reference draw the same keep mask from the same seed and offset."""
    q, k, v, _ = make_qkv("BSND", b=1, n1=2, sq=17, skv=19, d=16, seed=15)
    kw = dict(layout="BSND", scale=0.3, keep_prob=0.5, seed=123456789, offset=2**32 - 3)
    ref = attnops.flash_attention(q, k, v, backend="reference", **kw)
    tri = attnops.flash_attention(*_on(q, k, v), backend="triton", **kw).cpu()
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)


def test_backward_is_deterministic():
    q, k, v, dy = _on(*make_qkv("BNSD", b=1, n1=4, n2=1, sq=20, skv=20, d=16, seed=16))
    kw = dict(scale=0.3, backend="triton")
    res = attnops.flash_attention(q, k, v, return_stats=True, **kw)
    runs = [attnops.flash_attention_backward(dy, q, k, v, res.out, res.softmax_max, res.softmax_sum, **kw)[:3]
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_autograd_through_the_kernels():
    q, k, v, dy = make_qkv("BNSD", b=1, n1=2, sq=17, skv=17, d=16, seed=17)
    q, k, v, dy = _on(q, k, v, dy)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attnops.flash_attention(*leaves, scale=0.3, backend="triton").backward(dy)
    ref = [t.detach().cpu().clone().requires_grad_() for t in (q, k, v)]
    attnops.flash_attention(*ref, scale=0.3, backend="reference").backward(dy.cpu())
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pse_b,pse_type,dtype", [(1, 1, torch.float32), (3, 0, torch.float16)])
def test_alibi_compressed_tnd_short_sequences(pse_b, pse_type, dtype):
    """TND: the [B|1, N1, 1024, W] pse is the compressed ALiBi even when every sequence is short; its gradient
    (row 1023, the sums along the diagonals, summed over batches for a B=1 pse) vs the golden."""
    lens, n1 = [20, 33, 7], 2
    q, k, v, dy = make_qkv("TND", n1=n1, n2=1, d=16, q_lens=lens, kv_lens=lens, dtype=dtype, seed=21)
    pse = torch.randn(pse_b, n1, 1024, 36, generator=torch.Generator().manual_seed(22)).to(dtype)
    r = check(q, k, v, dy, layout="TND", head_num=n1, scale=0.3, pse=pse, pse_type=pse_type,
              atten_mask=TRIU2048, sparse_mode=3, actual_seq_qlen=cum(lens), actual_seq_kvlen=cum(lens))
    assert r["dpse"].shape == pse.shape and bool(r["dpse"][0, :, 1023, 36 - 20:].ne(0).all())


@pytest.mark.parametrize("form,pse_type,dtype", [("row", 1, torch.float32), ("full", 0, torch.float16),
                                                 ("full", 1, torch.float32)])
def test_flattened_tnd_pse(form, pse_type, dtype):
    """The 1-D TND pse (per-batch [N1, 1, Skv_b] or [N1, Sq_b, Skv_b] segments end to end) and its 1-D gradient."""
    q_lens, kv_lens, n1 = [9, 20, 3], [14, 20, 17], 2
    q, k, v, dy = make_qkv("TND", n1=n1, n2=1, d=16, q_lens=q_lens, kv_lens=kv_lens, dtype=dtype, seed=23)
    rows = [1] * 3 if form == "row" else q_lens
    pse = torch.randn(n1 * sum(r * c for r, c in zip(rows, kv_lens)),
                      generator=torch.Generator().manual_seed(24)).to(dtype)
    r = check(q, k, v, dy, layout="TND", head_num=n1, scale=0.3, pse=pse, pse_type=pse_type,
              actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(kv_lens))
    assert r["dpse"].shape == pse.shape


@pytest.mark.slow
@pytest.mark.parametrize("pse_type", [0, 1])
def test_alibi_compressed_forward(pse_type):
    """The compressed ``[B|1, N1, 1024, Skv]`` pse (Sq > 1024) read along the diagonal in-kernel (forward only: the
    gradient is tested on short TND sequences, where the pse is compressed too)."""
    s = 1100
    q, k, v, _ = make_qkv("BNSD", b=1, n1=1, sq=s, skv=s, d=16, seed=18)
    pse = torch.randn(1, 1, 1024, s, generator=torch.Generator().manual_seed(19))
    check(q, k, v, None, backward=False, head_num=1, scale=0.3, pse=pse, pse_type=pse_type, atten_mask=TRIU2048,
          sparse_mode=2)
