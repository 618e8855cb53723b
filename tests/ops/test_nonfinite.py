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
from attnops._core import cpu_kernels
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
    With the kernel: the list of its calls (each a table of chunks), so a test can check that it ran; else None."""
    if request.param == "pytorch":
        monkeypatch.setattr(cpu_kernels, "_state", {"lib": None, "why": "switched off by the test"})
        return None
    if cpu_kernels.library() is None:
        pytest.skip(f"no C++ decode kernel: {cpu_kernels.status()}")
    calls, real = [], cpu_kernels.decode_chunks
    monkeypatch.setattr(cpu_kernels, "decode_chunks", lambda rows: (calls.append(rows), real(rows))[1])
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
