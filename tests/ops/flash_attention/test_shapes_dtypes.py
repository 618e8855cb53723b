"""Reference vs the fp64 golden over shapes and dtypes: every layout, GQA ratios 1/4/8, Dk > Dv, fp32/fp16/bf16,
varlen (TND) edge cases, both TND softmax layouts, non-contiguous inputs; inputs are never modified."""
import pytest
import torch

import attnops
from tests.helpers import FLT_LOWEST, FLT_MAX, TRIU2048, check_fa, cum, make_qkv, noncontig, randn

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layouts_and_dtypes(layout, dtype):
    q, k, v, dy = make_qkv(layout, b=2, n1=2, sq=6, skv=9, dtype=dtype, seed=80)
    check_fa(q, k, v, dy, layout=layout, head_num=2, scale=0.35, atten_mask=TRIU2048, sparse_mode=3)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("layout", ["BNSD", "BSH", "TND"])
def test_gqa_ratios(group, layout):
    n1 = 8
    if layout == "TND":
        q_lens, kv_lens = [3, 5], [4, 5]
        q, k, v, dy = make_qkv("TND", n1=n1, n2=n1 // group, q_lens=q_lens, kv_lens=kv_lens, seed=81)
        kw = dict(actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(kv_lens))
    else:
        q, k, v, dy = make_qkv(layout, b=1, n1=n1, n2=n1 // group, sq=4, skv=5, seed=81)
        kw = {}
    check_fa(q, k, v, dy, layout=layout, head_num=n1, scale=0.4, **kw)


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH", "TND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_dk_greater_than_dv(layout, dtype):
    if layout == "TND":
        q, k, v, dy = make_qkv("TND", n1=4, n2=2, d=16, dv=8, q_lens=[3, 4], kv_lens=[5, 2], dtype=dtype, seed=82)
        kw = dict(actual_seq_qlen=[3, 7], actual_seq_kvlen=[5, 7])
    else:
        q, k, v, dy = make_qkv(layout, b=2, n1=4, n2=2, d=16, dv=8, sq=4, skv=5, dtype=dtype, seed=82)
        kw = {}
    r = check_fa(q, k, v, dy, layout=layout, head_num=4, scale=0.25, **kw)
    assert r["out"].shape == dy.shape and r["dv"].shape == v.shape


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", [0, 2, 4])
def test_tnd_dtypes_and_modes(dtype, mode):
    q_lens, kv_lens = [4, 1, 6], [4, 3, 7]
    q, k, v, dy = make_qkv("TND", n1=2, n2=1, q_lens=q_lens, kv_lens=kv_lens, dtype=dtype, seed=83)
    mask = TRIU2048 if mode else torch.ones(6, 7, dtype=torch.bool).triu(2)
    check_fa(q, k, v, dy, layout="TND", head_num=2, scale=0.4, actual_seq_qlen=cum(q_lens),
             actual_seq_kvlen=cum(kv_lens), atten_mask=mask, sparse_mode=mode, pre_tokens=2, next_tokens=1)


# ------------------------------------------------------------------------------------------ varlen edge cases

VARLEN_CASES = {
    "zero_length": ([3, 0, 2, 0, 4], [3, 2, 0, 0, 5]),
    "length_one": ([1, 1, 2], [1, 3, 1]),
    "not_tile_multiples": ([63, 111], [111, 63]),
    "sq_ne_skv": ([2, 7], [9, 3]),
    "trailing_zero_batches": ([3, 4, 0, 0], [5, 2, 0, 0]),
}


def _varlen(q_lens, kv_lens, t_extra=0, n1=2, n2=1, seed=84, dtype=torch.float32):
    q, k, v, dy = make_qkv("TND", n1=n1, n2=n2, q_lens=q_lens, kv_lens=kv_lens, t_extra=t_extra, dtype=dtype,
                           seed=seed)
    # trailing disabled batches are written as zeros (cann_semantics §5: real [2,3,4,5,6], last two unused ->
    # [2,5,9,0,0])
    def cumz(lens):
        c = cum(lens)
        last = max((i for i, n in enumerate(lens) if n), default=-1)
        return [x if i <= last else 0 for i, x in enumerate(c)]
    return q, k, v, dy, dict(layout="TND", head_num=n1, actual_seq_qlen=cumz(q_lens), actual_seq_kvlen=cumz(kv_lens))


@pytest.mark.parametrize("case", list(VARLEN_CASES))
@pytest.mark.parametrize("mode", [0, 3])
def test_varlen_edge_cases(case, mode):
    q_lens, kv_lens = VARLEN_CASES[case]
    q, k, v, dy, kw = _varlen(q_lens, kv_lens)
    if mode == 3:
        kw.update(atten_mask=TRIU2048, sparse_mode=3)
    r = check_fa(q, k, v, dy, scale=0.4, **kw)
    assert r["out"].shape == (sum(q_lens), 2, 8)


def test_trailing_zero_batches_leave_unused_tokens_alone():
    """actual_seq_qlen [3, 7, 0, 0] with T = 10 + 3 unused rows: those rows give 0 output, invalid stats, 0 grads."""
    q, k, v, dy, kw = _varlen([3, 4, 0, 0], [5, 2, 0, 0], t_extra=3)
    assert kw["actual_seq_qlen"] == [3, 7, 0, 0] and q.shape[0] == 10
    r = check_fa(q, k, v, dy, scale=0.4, **kw)
    tail = slice(7, 10)
    assert bool((r["out"][tail] == 0).all()) and bool((r["dq"][tail] == 0).all())
    assert bool((r["dk"][7:] == 0).all()) and bool((r["dv"][7:] == 0).all())
    assert bool((r["smax"].reshape(-1, 8)[14:] == FLT_LOWEST).all())
    assert bool((r["ssum"].reshape(-1, 8)[14:] == FLT_MAX).all())


@pytest.mark.parametrize("softmax_layout", ["", "TND"])
@pytest.mark.parametrize("n1,n2", [(1, 1), (4, 2)])
def test_tnd_softmax_layouts(softmax_layout, n1, n2):
    q_lens, kv_lens = [2, 0, 3, 4], [3, 2, 3, 5]
    q, k, v, dy, kw = _varlen(q_lens, kv_lens, n1=n1, n2=n2, seed=85)
    r = check_fa(q, k, v, dy, scale=0.4, softmax_layout=softmax_layout, atten_mask=TRIU2048, sparse_mode=3, **kw)
    assert r["smax"].shape == (9, n1, 8) and r["ssum"].shape == (9, n1, 8)
    assert bool((r["smax"] == r["smax"][..., :1]).all())  # the value is replicated 8 times
    # the two layouts hold the same numbers in different orders
    other = attnops.flash_attention(q, k, v, scale=0.4, softmax_layout="TND" if softmax_layout == "" else "",
                                    atten_mask=TRIU2048, sparse_mode=3, return_stats=True, **kw)
    blocked, tnd = (r["smax"], other.softmax_max) if softmax_layout == "" else (other.softmax_max, r["smax"])
    off = 0
    flat = blocked.reshape(-1, 8)
    for sq in q_lens:
        block = flat[off * n1:(off + sq) * n1].reshape(n1, sq, 8)
        assert torch.equal(block, tnd[off:off + sq].permute(1, 0, 2))
        off += sq


# ------------------------------------------------------------------------------------------ non-contiguous


@pytest.mark.parametrize("how", ["transpose", "strided"])
@pytest.mark.parametrize("layout", ["BNSD", "BSH", "TND"])
def test_noncontiguous_inputs(how, layout):
    if layout == "TND":
        q, k, v, dy, kw = _varlen([3, 5], [4, 2], n1=2, n2=2, seed=86)
        kw.pop("layout")
        kw.pop("head_num")
    else:
        q, k, v, dy = make_qkv(layout, b=2, n1=2, sq=5, skv=6, seed=86)
        kw = {}
    q, k, v, dy = (noncontig(t, how) for t in (q, k, v, dy))
    pse = noncontig(randn(2, 2, 5, 6, seed=90), how)
    check_fa(q, k, v, dy, layout=layout, head_num=2, scale=0.4, pse=pse, atten_mask=TRIU2048, sparse_mode=3, **kw)


def test_noncontiguous_real_transposed_views():
    """BNSD views of BSND storage (what a model that transposes its projections passes)."""
    q, k, v, dy = (t.transpose(1, 2) for t in make_qkv("BSND", b=2, n1=4, n2=2, sq=5, skv=7, seed=87))
    assert not q.is_contiguous()
    check_fa(q, k, v, dy, layout="BNSD", head_num=4, scale=0.4)


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "TND"])
@pytest.mark.parametrize("n1", [1, 2])
def test_inputs_are_not_modified(layout, n1):
    if layout == "TND":
        q, k, v, dy, kw = _varlen([4, 3], [4, 5], n1=n1, n2=n1, seed=88)
        kw.pop("head_num")
    else:
        q, k, v, dy = make_qkv(layout, b=1, n1=n1, sq=5, skv=5, seed=88)
        kw = dict(layout=layout)
    pse = randn(1, n1, 5, 5, seed=91)
    saved = [t.clone() for t in (q, k, v, dy, pse)]
    r = attnops.flash_attention(q, k, v, scale=0.5, pse=pse, return_stats=True, **kw)
    out, smax, ssum = (t.clone() for t in (r.out, r.softmax_max, r.softmax_sum))
    attnops.flash_attention_backward(dy, q, k, v, r.out, r.softmax_max, r.softmax_sum, scale=0.5, pse=pse, **kw)
    for before, after in zip(saved + [out, smax, ssum], (q, k, v, dy, pse, r.out, r.softmax_max, r.softmax_sum)):
        assert torch.equal(before, after)


def test_dense_and_tnd_agree():
    """The same sequences as dense BNSD and as TND give identical results (mode 4, finite band)."""
    q, k, v, _ = make_qkv("BSND", b=2, n1=2, sq=5, skv=6, seed=89)
    kw = dict(scale=0.4, atten_mask=TRIU2048, sparse_mode=4, pre_tokens=2, next_tokens=0)
    dense = attnops.flash_attention(q, k, v, layout="BSND", **kw)
    tnd = attnops.flash_attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), layout="TND",
                                  actual_seq_qlen=[5, 10], actual_seq_kvlen=[6, 12], **kw)
    torch.testing.assert_close(tnd, dense.flatten(0, 1), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ row chunks


def test_several_row_chunks_tnd_band():
    """Long enough that the reference works in several row chunks (8 query heads per KV head, Skv = 600), with a
    band whose column range changes from chunk to chunk and rows with a single kept key."""
    q_lens, kv_lens = [1000, 37], [600, 40]
    q, k, v, dy = make_qkv("TND", n1=8, n2=1, q_lens=q_lens, kv_lens=kv_lens, seed=92)
    check_fa(q, k, v, dy, layout="TND", head_num=8, scale=0.4, actual_seq_qlen=cum(q_lens),
             actual_seq_kvlen=cum(kv_lens), atten_mask=TRIU2048, sparse_mode=4, pre_tokens=700, next_tokens=-100)


def test_several_row_chunks_dense_bf16():
    q, k, v, dy = make_qkv("BSND", b=1, n1=8, n2=1, sq=600, skv=1000, dtype=torch.bfloat16, seed=93)
    check_fa(q, k, v, dy, layout="BSND", head_num=8, scale=0.4, atten_mask=TRIU2048, sparse_mode=3)
