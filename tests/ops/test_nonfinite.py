"""Non-finite inputs propagate as in the fp64 formula, on every path (docs/precision.md, "NaN and infinity").

One NaN, +inf or -inf is put into one element of q, k, v (or pse, or a dequant scale) at a key that a row sees,
and at a key past the sequence length, which no output may notice. Every CPU path (the C++ decode kernel, the
PyTorch path with the kernel off) and the Triton kernels (under the interpreter, fp16/fp32) must give the golden's
NaN and infinities exactly where it gives them, and its finite values within the usual tolerance rule.
"""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.ops.common import cpu_kernels
from attnops.ops.fused_infer_attention import decode as fia_decode
from attnops.testing import golden_nsa
from attnops.testing.compare import assert_close_to_golden, fa_reductions, fia_reduction, sfa_reductions
from attnops.testing.golden import fa_backward, fa_forward
from tests.helpers import F64, TRIU2048, golden_kwargs, make_qkv, randn
from tests.ops.dsa.dsa_helpers import golden_sfa
from tests.ops.fused_infer_attention.fia_helpers import golden as fia_golden
from tests.ops.fused_infer_attention.fia_helpers import make_inputs, randint8, run_api, to_paged
from tests.triton_backend import triton_backend  # noqa: F401 (fixture)

F16, F32 = torch.float16, torch.float32
NAN, INF = float("nan"), float("inf")
VALUES = {"nan": NAN, "+inf": INF, "-inf": -INF}


def assert_nonfinite_close(name, actual, golden, baseline, *, factor=2.0, reduction=1):
    """NaN exactly where the golden is NaN, the golden's infinities (with their sign) where it has them, and the
    finite values within ``assert_close_to_golden``'s rule (``reduction``: its summed terms per element)."""
    a, g = actual.detach().double(), golden.detach().double()
    assert a.shape == g.shape, (name, tuple(a.shape), tuple(g.shape))
    nan_a, nan_g = a.isnan(), g.isnan()
    assert torch.equal(nan_a, nan_g), f"{name}: NaN where the golden is not at " \
        f"{(nan_a & ~nan_g).nonzero().tolist()[:6]}, not NaN where it is at {(nan_g & ~nan_a).nonzero().tolist()[:6]}"
    inf_g = g.isinf()
    assert torch.equal(a.isinf(), inf_g) and torch.equal(a[inf_g], g[inf_g]), f"{name}: infinities differ"
    finite = g.isfinite()
    b = baseline.detach().double()
    finite_b = finite & b.isfinite()
    assert_close_to_golden(name, torch.where(finite, a, 0.0).to(actual.dtype), torch.where(finite, g, 0.0),
                           torch.where(finite_b, b, 0.0), factor=factor, reduction=reduction)


def rotated(cases: list) -> list:
    """One case per group of three (the same tensor and place with NaN, +inf, -inf), the value taken in turn from
    group to group: the Triton interpreter is slow, the CPU tests run every combination."""
    return [c for i, c in enumerate(cases) if i % 3 == (i // 3) % 3]


@pytest.fixture(params=["kernel", "pytorch"])
def cpu_path(request, monkeypatch):
    """The C++ decode kernel (where it builds), then the pure-PyTorch path (the kernel switched off in-process).
    With the kernel: the list of its calls (a table of chunks, or a paged call), so a test can check that it ran;
    else None."""
    if request.param == "pytorch":
        monkeypatch.setattr(cpu_kernels, "_state", {"lib": None, "why": "switched off by the test"})
        return None
    if cpu_kernels.library() is None:
        pytest.skip(f"no C++ decode kernel: {cpu_kernels.status()}")
    calls = []
    for entry in ("decode_chunks", "paged_attention"):
        real = getattr(cpu_kernels, entry)
        monkeypatch.setattr(cpu_kernels, entry, lambda arg, real=real: (calls.append(arg), real(arg))[1])
    return calls


# ------------------------------------------------------------------------------------------------ FIA
def test_fia_reported_reproduction(cpu_path):
    """The reported case: a NaN key element at a visible position turns exactly the rows of its KV head NaN."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 1, 64)
    k, v = torch.randn(2, 2, 70, 64), torch.randn(2, 2, 70, 64)
    k[0, 0, 5, 0] = NAN
    out = attnops.fused_infer_attention(q, k, v, num_key_value_heads=2)
    out = out[0] if isinstance(out, tuple) else out
    assert cpu_path is None or cpu_path  # the kernel ran
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    assert torch.equal(out.isnan(), sdpa.isnan())
    assert out[0, :2].isnan().all() and not out[0, 2:].isnan().any() and not out[1].isnan().any()


FIA_B, FIA_N, FIA_NKV, FIA_SKV, FIA_D = 2, 4, 2, 70, 16
FIA_LENS = [70, 40]  # batch 1 ends at 40: its position 55 is past the length


def _fia_case(which, where, value, *, sq, dtype, paged=False, quant=False):
    """Inputs and keywords of an FIA call with one non-finite element: ``which`` in q, k, v, pse, key_scale,
    value_scale (per-token antiquant scales of an int8 cache, ``quant``);
    ``where``: "visible" (batch 1, position 7) or "outside" (batch 1, position 55, past its length)."""
    pos = 7 if where == "visible" else 55
    q, k, v = make_inputs("BNSD", b=FIA_B, n=FIA_N, nkv=FIA_NKV, sq=sq, skv=FIA_SKV, d=FIA_D, dtype=dtype)
    kw = dict(actual_seq_lengths_kv=FIA_LENS, num_heads=FIA_N, num_key_value_heads=FIA_NKV,
              scale_value=FIA_D ** -0.5, input_layout="BNSD", softmax_lse_flag=True)
    if quant:
        k, v = randint8(FIA_B, FIA_NKV, FIA_SKV, FIA_D, seed=2), randint8(FIA_B, FIA_NKV, FIA_SKV, FIA_D, seed=3)
        g = torch.Generator().manual_seed(6)
        for name in ("key", "value"):  # per-token scales (mode 1): [B, pages * page size]
            kw[f"{name}_antiquant_scale"] = torch.rand(FIA_B, 80, generator=g) * 0.02 + 0.005  # 5 pages
        kw.update(key_antiquant_mode=1, value_antiquant_mode=1)
    if which == "q":
        q[1, 1, sq - 1, 3] = value
    elif which in ("k", "v"):
        (k if which == "k" else v)[1, 0, pos, 3] = value
    elif which == "pse":
        kw["pse_shift"] = torch.randn(FIA_B, FIA_N, sq, 80, generator=torch.Generator().manual_seed(9))  # 5 pages
        kw["pse_shift"][1, 1, sq - 1, pos] = value
        kw["pse_shift"] = kw["pse_shift"].to(dtype)
    else:
        kw[which.replace("_scale", "_antiquant_scale")][1, pos] = value
    if paged:
        k, bt = to_paged(k, FIA_LENS, 16, cache_layout="BNSD", seed=4)
        v, _ = to_paged(v, FIA_LENS, 16, cache_layout="BNSD", seed=4)
        kw.update(block_table=bt, block_size=16)
    return q, k, v, kw


def _check_fia(q, k, v, kw, where):
    g = fia_golden(q, k, v, **kw)
    base = fia_golden(q, k, v, dtype=F16 if q.dtype == torch.int8 else q.dtype, **kw)
    if where == "outside":  # the case is what it claims to be
        assert bool(g.out.isfinite().all())
    out, lse = run_api(q, k, v, **kw)
    red = fia_reduction(q, k, **kw)
    assert_nonfinite_close("attention_out", out, g.out, base.out, reduction=red)
    assert_nonfinite_close("softmax_lse", lse, g.lse, base.lse, reduction=red)


FIA_CASES = [(w, p, v) for w in ("q", "k", "v", "pse") for p in ("visible", "outside") for v in VALUES
             if not (w == "q" and p == "outside")]


@pytest.mark.parametrize("which,where,value", FIA_CASES)
@pytest.mark.parametrize("sq", [1, 3], ids=["decode", "prefill"])
def test_fia_cpu(cpu_path, which, where, value, sq):
    _check_fia(*_fia_case(which, where, VALUES[value], sq=sq, dtype=F32), where)


@pytest.mark.parametrize("which,where,value", [c for c in FIA_CASES if c[0] != "pse"])
def test_fia_cpu_paged(cpu_path, which, where, value):
    _check_fia(*_fia_case(which, where, VALUES[value], sq=1, dtype=F16, paged=True), where)
    assert cpu_path is None or cpu_path


@pytest.mark.parametrize("which", ["key_scale", "value_scale"])
@pytest.mark.parametrize("where", ["visible", "outside"])
@pytest.mark.parametrize("value", list(VALUES))
def test_fia_cpu_int8_cache(cpu_path, which, where, value):
    """A non-finite per-token antiquant scale of an int8 paged cache."""
    _check_fia(*_fia_case(which, where, VALUES[value], sq=1, dtype=F16, paged=True, quant=True), where)
    assert cpu_path is None or cpu_path


@pytest.mark.parametrize("which,where,value", [("q", "visible", "nan"), ("k", "visible", "+inf"),
                                               ("v", "visible", "-inf"), ("k", "outside", "nan"),
                                               ("pse", "visible", "nan")])
@pytest.mark.parametrize("sq", [1, 3], ids=["decode", "prefill"])
def test_fia_triton(triton_backend, which, where, value, sq):  # noqa: F811
    _check_fia(*_fia_case(which, where, VALUES[value], sq=sq, dtype=F16, paged=sq == 1), where)
    assert triton_backend


@pytest.mark.parametrize("which,where,value", [("key_scale", "visible", "nan"), ("value_scale", "visible", "+inf"),
                                               ("key_scale", "outside", "nan")])
def test_fia_triton_int8_cache(triton_backend, which, where, value):  # noqa: F811
    _check_fia(*_fia_case(which, where, VALUES[value], sq=1, dtype=F16, paged=True, quant=True), where)
    assert triton_backend


# ------------------------------------------------------------------------------------------------ FlashAttention
FA_Q_LENS, FA_KV_LENS = [5, 4], [6, 9]  # TND, one unused token after each tensor's last sequence


def _fa_case(which, where, value, *, dtype, layout):
    """``(q, k, v, dy, pse, kw)`` with one non-finite element of ``which`` (q, k, v, pse): "visible" at the second
    key of the last batch (every row sees it under the bottom-right causal mask) or its last query row, "outside"
    in the unused token after the last sequence (TND)."""
    if layout == "TND":
        q, k, v, dy = make_qkv("TND", n1=4, n2=2, q_lens=FA_Q_LENS, kv_lens=FA_KV_LENS, t_extra=1, d=16, dtype=dtype,
                               seed=20)
        kw = dict(layout="TND", actual_seq_qlen=[5, 9], actual_seq_kvlen=[6, 15], causal=True)
        q_at, kv_at = (8 if where == "visible" else 9), (7 if where == "visible" else 15)
        index = {"q": (q, (q_at, 1, 3)), "k": (k, (kv_at, 0, 3)), "v": (v, (kv_at, 0, 3))}
    else:
        q, k, v, dy = make_qkv("BNSD", b=2, n1=4, n2=2, sq=4, skv=9, d=16, dtype=dtype, seed=21)
        kw = dict(layout="BNSD", causal=True)
        index = {"q": (q, (1, 1, 3, 3)), "k": (k, (1, 0, 1, 3)), "v": (v, (1, 0, 1, 3))}
    pse = None
    if which == "pse":
        pse = randn(2, 4, 4, 9, dtype=dtype, seed=22)
        pse[1, 1, 3, 1] = value
    else:
        t, at = index[which]
        t[at] = value
    return q, k, v, dy, pse, dict(kw, scale=0.25)


FA_CASES = [("BNSD", w, "visible", val) for w in ("q", "k", "v", "pse") for val in VALUES] + \
           [("TND", w, p, val) for w in ("q", "k", "v") for p in ("visible", "outside") for val in VALUES]


def _check_fa(q, k, v, dy, pse, kw, where):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v) + (() if pse is None else (pse,))]
    res = attnops.flash_attention(*leaves[:3], pse=None if pse is None else leaves[3], return_stats=True, **kw)
    res[0].backward(dy)
    gkw = golden_kwargs(dict(kw, pse=pse, head_num=4))
    if kw.get("causal"):
        gkw.update(atten_mask=TRIU2048, sparse_mode=3)
    g_out, g_max, g_sum = fa_forward(q, k, v, dtype=F64, **gkw)
    b_out, b_max, b_sum = fa_forward(q, k, v, dtype=q.dtype, **gkw)
    if where == "outside":
        assert bool(g_out.isfinite().all())
    red = fa_reductions(q, k, v, layout=gkw["input_layout"], head_num=4, actual_seq_qlen=gkw.get("actual_seq_qlen"),
                        actual_seq_kvlen=gkw.get("actual_seq_kvlen"))
    assert_nonfinite_close("out", res[0], g_out, b_out, reduction=red["out"])
    assert_nonfinite_close("softmax_max", res.softmax_max, g_max, b_max, reduction=red["softmax_max"])
    assert_nonfinite_close("softmax_sum", res.softmax_sum, g_sum, b_sum, reduction=red["softmax_sum"])
    gold = fa_backward(dy, q, k, v, dtype=F64, **gkw)
    base = fa_backward(dy, q, k, v, dtype=q.dtype, **gkw)
    for name, leaf, g, b in zip(("dq", "dk", "dv", "dpse"), leaves, gold, base):
        assert_nonfinite_close(name, leaf.grad, g, b, factor=3, reduction=red[name])


@pytest.mark.parametrize("layout,which,where,value", FA_CASES)
def test_flash_attention_cpu(layout, which, where, value):
    _check_fa(*_fa_case(which, where, VALUES[value], dtype=F32, layout=layout), where)


@pytest.mark.parametrize("layout,which,where,value", rotated(FA_CASES))
def test_flash_attention_triton(triton_backend, layout, which, where, value):  # noqa: F811
    _check_fa(*_fa_case(which, where, VALUES[value], dtype=F16, layout=layout), where)
    assert triton_backend


@pytest.mark.parametrize("value", list(VALUES))
def test_flash_attention_key_masked_for_some_rows(value):
    """A non-finite key that the causal mask hides from every row but the last: the other rows, and the gradients
    of the keys only they see, stay finite (a masked score is -inf, whatever the key holds)."""
    q, k, v, dy, pse, kw = _fa_case("k", "visible", 0.0, dtype=F32, layout="BNSD")
    k[1, 0, 8, 3] = VALUES[value]  # bottom-right causal, Sq 4, Skv 9: only row 3 sees key 8
    _check_fa(q, k, v, dy, pse, kw, "visible")


# ------------------------------------------------------------------------------------------------ DSA
DSA_ROWS = [[1, 2, 3, 5, -1, -1]] * 4  # 4 query rows (causal: row i sees keys < 7 + i); key 0 only as padding


def _dsa_case(which, where, value, dtype):
    """One batch, 4 query rows, 12 keys of which 10 are in the length; a non-finite element of ``which`` (q, k, v)
    "visible" (key 2, or query row 3) or "outside": key 0 (which only the -1 padding slots point at) and key 11
    (past the length) at once."""
    q = randn(1, 4, 4, 16, dtype=dtype, seed=30)
    k, v = randn(1, 12, 1, 16, dtype=dtype, seed=31), randn(1, 12, 1, 16, dtype=dtype, seed=32)
    if which == "q":
        q[0, 3, 1, 5] = value
    else:
        for pos in ((2,) if where == "visible" else (0, 11)):
            (k if which == "k" else v)[0, pos, 0, 5] = value
    return q, k, v


def _check_dsa(q, k, v, where):
    idx = torch.tensor(DSA_ROWS, dtype=torch.int32).view(1, 4, 1, 6)
    res = attnops.sparse_flash_attention(q, k, v, idx, scale=0.25, actual_seq_lengths_query=torch.tensor([4]),
                                         actual_seq_lengths_kv=torch.tensor([10]))
    args = ([q[0]], [k[0, :10, 0]], [v[0, :10, 0]], [DSA_ROWS], 0.25)
    g, b = golden_sfa(*args), golden_sfa(*args, dtype=q.dtype)
    if where == "outside":
        assert bool(g[0].isfinite().all())
    red = sfa_reductions([4], 4, 16, 0, len(DSA_ROWS[0]))
    assert_nonfinite_close("out", res.attention_out[0], g[0], b[0], reduction=red["out"])
    assert_nonfinite_close("softmax_max", res.softmax_max[0, 0], g[1], b[1], reduction=red["max"])
    assert_nonfinite_close("softmax_sum", res.softmax_sum[0, 0], g[2], b[2], reduction=red["sum"])


DSA_CASES = [(w, p, val) for w in ("q", "k", "v") for p in ("visible", "outside") for val in VALUES
             if not (w == "q" and p == "outside")]


@pytest.mark.parametrize("which,where,value", DSA_CASES)
def test_dsa_cpu(which, where, value):
    _check_dsa(*_dsa_case(which, where, VALUES[value], F32), where)


@pytest.mark.parametrize("which,where,value", rotated(DSA_CASES))
def test_dsa_triton(triton_backend, which, where, value):  # noqa: F811
    _check_dsa(*_dsa_case(which, where, VALUES[value], F16), where)
    assert triton_backend


# ------------------------------------------------------------------------------------------------ NSA
NSA_TOPK = torch.tensor([0, 1]).expand(8, 1, 2).contiguous()  # 8 tokens, one KV head, blocks 0 and 1 of 4 keys


def _nsa_case(which, where, value, dtype):
    """8 query tokens (4 heads) and 16 keys (+1 unused token after each) of one sequence; every token selects
    blocks 0 and 1 (causal: token i sees keys <= i). A non-finite element of ``which``: "visible" (key 1, which
    token 0 does not see, or token 5's query), "outside": key 13 (in a block no token selects) and the unused key
    after the sequence."""
    q = randn(9, 4, 16, dtype=dtype, seed=40)
    k, v = randn(17, 1, 16, dtype=dtype, seed=41), randn(17, 1, 16, dtype=dtype, seed=42)
    if which == "q":
        q[5, 2, 4] = value
    else:
        for pos in ((1,) if where == "visible" else (13, 16)):
            (k if which == "k" else v)[pos, 0, 4] = value
    return q, k, v


def _check_nsa_selected(q, k, v, where):
    topk = torch.cat([NSA_TOPK, NSA_TOPK[:1]])  # the unused query token selects something too
    out, smax, ssum = attnops.nsa_selected_attention(q, k, v, topk, select_block_size=4, scale=0.25,
                                                     actual_seq_qlen=[8], actual_seq_kvlen=[16], return_stats=True)
    args = (q[:8], k[:16], v[:16], topk[:8], 0.25, 4, [8], [16], True)
    g, b = golden_nsa.nsa_selected_attention(*args), golden_nsa.nsa_selected_attention(*args, dtype=q.dtype)
    if where == "outside":
        assert bool(g[0].isfinite().all())
    red = q.shape[-1] + topk.shape[-1] * 4  # the scores over D, then P V over two selected blocks of 4 keys
    for name, x, gx, bx in zip(("out", "softmax_max", "softmax_sum"), (out, smax, ssum), g, b):
        assert_nonfinite_close(name, x[:8], gx, bx, reduction=red)


NSA_CASES = DSA_CASES


@pytest.mark.parametrize("which,where,value", NSA_CASES)
def test_nsa_selected_cpu(which, where, value):
    _check_nsa_selected(*_nsa_case(which, where, VALUES[value], F32), where)


@pytest.mark.parametrize("which,where,value", rotated(NSA_CASES))
def test_nsa_selected_triton(triton_backend, which, where, value):  # noqa: F811
    _check_nsa_selected(*_nsa_case(which, where, VALUES[value], F16), where)
    assert triton_backend


def _nsa_decode_case(which, where, value, dtype):
    """2 requests (4 query heads, 1 KV head) over a paged cache of 8-key pages; request 1 has 21 keys and selects
    blocks 0 and 2 of 4 keys, then -1. A non-finite element: "visible" (key 9 of request 1, or its query),
    "outside": key 5 (block 1, skipped), key 17 (a block after the -1) and key 22 (past its length) at once."""
    q = randn(2, 4, 16, dtype=dtype, seed=50)
    k, v = randn(2, 24, 1, 16, dtype=dtype, seed=51), randn(2, 24, 1, 16, dtype=dtype, seed=52)
    if which == "q":
        q[1, 2, 4] = value
    else:
        for pos in ((9,) if where == "visible" else (5, 17, 22)):
            (k if which == "k" else v)[1, pos, 0, 4] = value
    table = torch.tensor([[0, 1, 2], [5, 3, 4]], dtype=torch.int32)
    k_cache, v_cache = (torch.zeros(6, 8, 1, 16, dtype=dtype) for _ in range(2))
    for b in range(2):
        for i in range(3):
            k_cache[table[b, i]], v_cache[table[b, i]] = k[b, 8 * i:8 * i + 8], v[b, 8 * i:8 * i + 8]
    topk = torch.tensor([[[0, 1, 2, 3]], [[0, 2, -1, 4]]], dtype=torch.int32)
    return q, k_cache, v_cache, topk, table, [24, 21]


def _check_nsa_decode(q, k_cache, v_cache, topk, table, lens, where):
    out = attnops.nsa_selected_attention_infer(q, k_cache, v_cache, topk, table, lens, select_block_size=4,
                                               scale=0.25)
    args = (q, k_cache, v_cache, topk, table, lens, 0.25, 4)
    g, b = golden_nsa.nsa_select_attention_infer(*args), golden_nsa.nsa_select_attention_infer(*args, dtype=q.dtype)
    if where == "outside":
        assert bool(g.isfinite().all())
    assert_nonfinite_close("out", out, g, b, reduction=q.shape[-1] + topk.shape[-1] * 4)  # the selected keys


@pytest.mark.parametrize("which,where,value", NSA_CASES)
def test_nsa_decode_cpu(cpu_path, which, where, value):
    _check_nsa_decode(*_nsa_decode_case(which, where, VALUES[value], F32), where)
    assert cpu_path is None or cpu_path


@pytest.mark.parametrize("which,where,value", rotated(NSA_CASES))
def test_nsa_decode_triton(triton_backend, which, where, value):  # noqa: F811
    _check_nsa_decode(*_nsa_decode_case(which, where, VALUES[value], F16), where)
    assert triton_backend


# ------------------------------------------------------------------------------------------------ all scores -inf
def _all_minus_inf_fa(how, layout):
    """An FA case where rows see keys whose every score is -inf: "pse" (-inf pse on the whole row 0 of head 1 in the
    last batch) or "key" (a -inf key element times a positive query element on every key of KV head 0 there)."""
    q, k, v, dy, pse, kw = _fa_case("pse" if how == "pse" else "k", "visible", 0.0, dtype=F32, layout=layout)
    if how == "pse":
        pse[1, 1, 0] = -INF
    else:
        q[1, :2, :, 3] = q[1, :2, :, 3].abs() + 0.1  # heads 0 and 1 (KV head 0), every row: score -inf
        k[1, 0, :, 3] = -INF
    return q, k, v, dy, pse, kw


@pytest.mark.parametrize("how", ["pse", "key"])
def test_flash_attention_all_visible_scores_minus_inf(how):
    """The formula's 0/0: output, softmax_sum and the gradients NaN, softmax_max -inf; rows that see no key (none
    here) would stay fully masked."""
    q, k, v, dy, pse, kw = _all_minus_inf_fa(how, "BNSD")
    _check_fa(q, k, v, dy, pse, kw, "visible")


def _all_minus_inf_fia(how, *, sq, dtype=F32, paged=False):
    """An FIA case where the rows of query heads 0 and 1 (KV head 0) of batch 1 see keys whose scores are all -inf
    ("key": a -inf key element times a positive query element at every key; "first-keys": only at its first 16
    keys, the others finite), or row ``sq - 1`` of head 1 there ("pse": a -inf pse over the whole row)."""
    q, k, v, kw = _fia_case("pse" if how == "pse" else "k", "visible", 0.0, sq=sq, dtype=dtype)
    if how == "pse":
        kw["pse_shift"][1, 1, sq - 1] = -INF
    else:
        q[1, :2, :, 3] = q[1, :2, :, 3].abs() + 0.1
        k[1, 0, :FIA_SKV if how == "key" else 16, 3] = -INF
    if paged:
        k, bt = to_paged(k, FIA_LENS, 16, cache_layout="BNSD", seed=4)
        v, _ = to_paged(v, FIA_LENS, 16, cache_layout="BNSD", seed=4)
        kw.update(block_table=bt, block_size=16)
    return q, k, v, kw


@pytest.mark.parametrize("how", ["key", "first-keys", "pse"])
@pytest.mark.parametrize("sq", [1, 3], ids=["decode", "prefill"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_fia_all_visible_scores_minus_inf(cpu_path, monkeypatch, how, sq, paged):
    """Rows that see only -inf scores give the formula's NaN (output and lse), on the kernel and the PyTorch path;
    with decode chunks of 16 tokens, a chunk of only -inf scores weighs nothing next to finite ones."""
    monkeypatch.setattr(fia_decode, "CHUNK_TOKENS", 16)
    q, k, v, kw = _all_minus_inf_fia(how, sq=sq, paged=paged)
    g = fia_golden(q, k, v, **kw)
    assert bool(g.out.isnan().any()) == (how != "first-keys")
    _check_fia(q, k, v, kw, "visible")
    assert cpu_path is None or cpu_path or how == "pse" or sq > 1


def _dsa_grads(q, k, v, dy, dtype):
    """``(out, dq, dk, dv)``: of attnops (``dtype`` None) or of the golden in ``dtype`` (autograd through it)."""
    idx = torch.tensor(DSA_ROWS, dtype=torch.int32).view(1, 4, 1, 6)
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    if dtype is None:
        out = attnops.sparse_flash_attention(*leaves, idx, scale=0.25, actual_seq_lengths_query=torch.tensor([4]),
                                             actual_seq_lengths_kv=torch.tensor([10])).attention_out
        out.backward(dy)
    else:
        out = golden_sfa([leaves[0][0]], [leaves[1][0, :, 0]], [leaves[2][0, :, 0]], [DSA_ROWS], 0.25,
                         dtype=dtype)[0]
        out.backward(dy[0])
        out = out[None]
    return (out,) + tuple(leaf.grad for leaf in leaves)


def _check_dsa_backward(q, k, v):
    dy = randn(*q.shape, dtype=q.dtype, seed=33)
    got, gold, base = _dsa_grads(q, k, v, dy, None), _dsa_grads(q, k, v, dy, F64), _dsa_grads(q, k, v, dy, q.dtype)
    for name, a, g, b in zip(("out", "dq", "dk", "dv"), got, gold, base):
        assert_nonfinite_close(name, a, g.to(a.dtype) if g.dtype != F64 else g, b, factor=3)


@pytest.mark.parametrize("which,where,value", DSA_CASES)
def test_dsa_backward_cpu(which, where, value):
    _check_dsa_backward(*_dsa_case(which, where, VALUES[value], F32))


def _all_minus_inf_dsa(dtype):
    """Every score of query row 3 is -inf (a -inf key element times a positive query element at each of the keys
    its index row names); the other rows see the same keys with query elements of either sign."""
    q, k, v = _dsa_case("k", "visible", 0.0, dtype)
    q[0, 3, :, 5] = q[0, 3, :, 5].abs() + 0.1
    k[0, [1, 2, 3, 5, 6], 0, 5] = -INF
    return q, k, v


def test_dsa_all_visible_scores_minus_inf_cpu():
    q, k, v = _all_minus_inf_dsa(F32)
    _check_dsa(q, k, v, "visible")
    _check_dsa_backward(q, k, v)


def test_dsa_all_visible_scores_minus_inf_triton(triton_backend):  # noqa: F811
    q, k, v = _all_minus_inf_dsa(F16)
    _check_dsa(q, k, v, "visible")
    assert triton_backend


def _all_minus_inf_nsa(dtype):
    """Token 5 (every head) scores -inf at each key it sees (a -inf key element times a positive query element at
    keys 0..7, the two selected blocks); token 0..4 and 6, 7 see them with query elements of either sign."""
    q, k, v = _nsa_case("k", "visible", 0.0, dtype)
    q[5, :, 4] = q[5, :, 4].abs() + 0.1
    k[:8, 0, 4] = -INF
    return q, k, v


def test_nsa_selected_all_visible_scores_minus_inf_cpu():
    _check_nsa_selected(*_all_minus_inf_nsa(F32), "visible")


def test_nsa_selected_all_visible_scores_minus_inf_triton(triton_backend):  # noqa: F811
    _check_nsa_selected(*_all_minus_inf_nsa(F16), "visible")
    assert triton_backend


def _all_minus_inf_nsa_decode(dtype):
    """Request 1 (every head) scores -inf at each key of its selected blocks 0 and 2 (rows 0..3 of pages 5 and 3)."""
    q, k_cache, v_cache, topk, table, lens = _nsa_decode_case("k", "visible", 0.0, dtype)
    q[1, :, 4] = q[1, :, 4].abs() + 0.1
    k_cache[5, :4, 0, 4] = k_cache[3, :4, 0, 4] = -INF
    return q, k_cache, v_cache, topk, table, lens


def test_nsa_decode_all_visible_scores_minus_inf_cpu(cpu_path):
    _check_nsa_decode(*_all_minus_inf_nsa_decode(F32), "visible")
    assert cpu_path is None or cpu_path


def test_nsa_decode_all_visible_scores_minus_inf_triton(triton_backend):  # noqa: F811
    _check_nsa_decode(*_all_minus_inf_nsa_decode(F16), "visible")
    assert triton_backend


# ------------------------------------------------------------------------------------------------ DeepSeek-V4
@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("how", ["key", "none"])
def test_dsv4_all_visible_scores_minus_inf(sinks, how):
    """Sliding-window sparse_flash_mla (keys are values): query row 3 (every head) scores -inf at each key it sees
    (a -inf key element times a positive query element at every key: "key"): the golden's NaN output and lse
    ``logsumexp = -inf`` (without sinks; rows with a +inf score: +inf); "none": finite inputs, for contrast."""
    from tests.ops.dsv4 import helpers as H

    case = H.Case([4], [9], sinks=sinks, dtype=F32)
    parts = H.make_parts(case)
    if how == "key":
        parts.qs[0][3, :, 0] = parts.qs[0][3, :, 0].abs() + 0.1
        parts.oris[0][:, 0] = -INF
    kw, starts = H.pack(case, parts, "BSND", "BSND")
    out, lse = H.rows_of(*H.call(kw)[:2])
    g_out, g_lse = H.expected(case, parts, starts, out.shape[0])
    b_out, b_lse = H.expected(case, parts, starts, out.shape[0], dtype=F32)
    if how == "key":
        assert bool(g_out[3, :, 0].isnan().all()) and (sinks or bool((g_lse[3] == -INF).all()))
    assert_nonfinite_close("out", out, g_out, b_out)
    assert_nonfinite_close("lse", lse, g_lse, b_lse)


@pytest.mark.parametrize("how", ["pse", "key"])
def test_flash_attention_all_visible_scores_minus_inf_triton(triton_backend, how):  # noqa: F811
    q, k, v, dy, pse, kw = _all_minus_inf_fa(how, "BNSD")
    _check_fa(*(x.to(F16) if isinstance(x, torch.Tensor) else x for x in (q, k, v, dy, pse)), kw, "visible")
    assert triton_backend


@pytest.mark.parametrize("how,sq", [("key", 1), ("first-keys", 1), ("pse", 3)])
def test_fia_all_visible_scores_minus_inf_triton(triton_backend, how, sq):  # noqa: F811
    _check_fia(*_all_minus_inf_fia(how, sq=sq, dtype=F16, paged=sq == 1), "visible")
    assert triton_backend


# ------------------------------------------------------------------------------------------------ int8 output
def _check_fia_int8_out(q, k, v, kw):
    """int8 output (``quant_scale2`` 2): where the golden output is NaN the int8 output is 0, where it is +-inf
    127 / -128 (the NPU's float-to-integer conversion saturates and sends NaN to 0); within 1 elsewhere."""
    kw = dict(kw, softmax_lse_flag=False)
    g = fia_golden(q, k, v, **kw).out  # before the quantization
    assert not bool(g.isfinite().all())  # the case is what it claims to be
    out, _ = run_api(q, k, v, **kw, quant_scale2=torch.tensor([2.0]))
    assert out.dtype == torch.int8
    y = torch.where(g.isnan(), 0.0, g.double() * 2).clamp(-128, 127)
    nonfinite = ~g.isfinite()
    assert torch.equal(out[nonfinite].double(), y[nonfinite]), (out[nonfinite], y[nonfinite])
    assert float((out.double() - y.round()).abs().max()) <= 1


INT8_OUT_CASES = [("k", "nan"), ("v", "+inf"), ("v", "-inf"), ("all -inf", None)]


def _int8_out_case(which, value, dtype):
    if which == "all -inf":
        return _all_minus_inf_fia("key", sq=1, dtype=dtype)
    return _fia_case(which, "visible", VALUES[value], sq=1, dtype=dtype)


@pytest.mark.parametrize("which,value", INT8_OUT_CASES)
def test_fia_int8_output_nonfinite_cpu(cpu_path, which, value):
    _check_fia_int8_out(*_int8_out_case(which, value, F16))


@pytest.mark.parametrize("which,value", INT8_OUT_CASES[:2] + INT8_OUT_CASES[3:])
def test_fia_int8_output_nonfinite_triton(triton_backend, which, value):  # noqa: F811
    _check_fia_int8_out(*_int8_out_case(which, value, F16))
    assert triton_backend


# ------------------------------------------------------------------------------------------------ NSA top-k
def _nsa_topk_with_nan_scores():
    """Compressed attention whose KV head 0 has a NaN compressed key (every token sees it): the importance scores
    of that head's rows are all NaN; KV head 1 stays finite."""
    q, k, v = randn(4, 4, 16, seed=60), randn(32, 2, 16, seed=61), randn(32, 2, 16, seed=62)
    k[3, 0, 5] = NAN
    res = attnops.nsa_compress_attention(q, k, v, compress_block_size=16, compress_stride=16, select_block_size=32,
                                         select_block_count=5, scale=0.25, actual_seq_qlen=[4],
                                         actual_cmp_seq_kvlen=[32])
    return res.topk_indices


def test_nsa_topk_nan_scores_rank_below_real_ones():
    """A NaN importance score ranks below every real score (and above blocks a row may not choose), ties to the
    lower block: rows whose scores are all NaN pick blocks 0, 1, 2, ...; finite rows are unaffected."""
    topk = _nsa_topk_with_nan_scores()
    assert topk[:, 0].tolist() == [[0, 1, 2, 3, 4]] * 4
    assert all(len(set(row)) == 5 for row in topk[:, 1].tolist())


def test_nsa_topk_nan_scores_triton(triton_backend, monkeypatch):  # noqa: F811
    """The Triton top-k kernel picks the CPU reference's blocks."""
    got = _nsa_topk_with_nan_scores()
    assert "topk_kernel" in triton_backend
    monkeypatch.setenv("ATTNOPS_BACKEND", "reference")
    assert torch.equal(got, _nsa_topk_with_nan_scores())
