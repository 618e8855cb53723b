"""The Pythonic API: autograd through the custom backward op, flash_attention_backward, cu_seqlens vs
actual_seq_qlen/kvlen, FlashAttentionResult, and torch.autograd.gradcheck in float64."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnops
from attnops._core.dropout import pack_bits
from attnops.testing.compare import assert_close_to_golden, fa_reductions
from attnops.testing.golden import fa_backward, fa_forward
from tests.helpers import F64, TRIU2048, cum, golden_kwargs, make_qkv, random_keep, randn


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _leaf(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


AUTOGRAD_CASES = {
    "plain_bnsd": lambda: (make_qkv("BNSD", b=2, n1=2, sq=5, skv=6, seed=100), dict(head_num=2)),
    "tnd_causal_gqa": lambda: (make_qkv("TND", n1=4, n2=1, q_lens=[3, 0, 5], kv_lens=[4, 2, 5], seed=101),
                               dict(layout="TND", head_num=4, actual_seq_qlen=[3, 3, 8], actual_seq_kvlen=[4, 6, 11],
                                    atten_mask=TRIU2048, sparse_mode=3)),
    "bsh_pse": lambda: (make_qkv("BSH", b=1, n1=2, sq=4, skv=4, seed=102),
                        dict(layout="BSH", head_num=2, pse=randn(1, 2, 4, 4, seed=103), pse_type=1)),
    "fp16_band": lambda: (make_qkv("BSND", b=1, n1=2, sq=6, skv=6, dtype=torch.float16, seed=104),
                          dict(layout="BSND", head_num=2, atten_mask=TRIU2048, sparse_mode=4, pre_tokens=2,
                               next_tokens=1)),
}


@pytest.mark.parametrize("case", list(AUTOGRAD_CASES))
def test_autograd_matches_golden(case):
    (q, k, v, dy), kw = AUTOGRAD_CASES[case]()
    kw = dict(kw, scale=0.4)
    pse = kw.pop("pse", None)
    leaves = _leaf(q, k, v) + ([] if pse is None else _leaf(pse))
    out = attnops.flash_attention(*leaves[:3], pse=None if pse is None else leaves[3], **kw)
    out.backward(dy)
    gkw = golden_kwargs(dict(kw, pse=pse))
    g_out, _, _ = fa_forward(q, k, v, dtype=F64, **gkw)
    b_out, _, _ = fa_forward(q, k, v, dtype=q.dtype, **gkw)
    red = fa_reductions(q, k, v, layout=gkw["input_layout"], head_num=gkw["head_num"],
                        actual_seq_qlen=gkw.get("actual_seq_qlen"), actual_seq_kvlen=gkw.get("actual_seq_kvlen"))
    assert_close_to_golden("out", out, g_out, b_out, factor=2, reduction=red["out"])
    gold = fa_backward(dy, q, k, v, dtype=F64, **gkw)
    base = fa_backward(dy, q, k, v, dtype=q.dtype, **gkw)
    for name, leaf, g, b in zip(("dq", "dk", "dv", "dpse"), leaves, gold, base):
        assert leaf.grad is not None, name
        assert_close_to_golden(name, leaf.grad, g, b, factor=3, reduction=red[name])


def test_autograd_backward_is_the_custom_op_and_equals_flash_attention_backward():
    q, k, v, dy = make_qkv("BSND", b=1, n1=4, n2=2, sq=5, skv=7, seed=105)
    pse = randn(1, 4, 5, 7, seed=106)
    kw = dict(layout="BSND", scale=0.3, atten_mask=TRIU2048, sparse_mode=3, keep_prob=0.8, seed=1234)
    lq, lk, lv, lp = _leaf(q, k, v, pse)
    res = attnops.flash_attention(lq, lk, lv, pse=lp, return_stats=True, **kw)
    with _OpRecorder() as rec:
        res.out.backward(dy)
    assert "attnops.flash_attention_bwd.default" in rec.ops
    dq, dk, dv, dpse = attnops.flash_attention_backward(dy, q, k, v, res.out.detach(), res.softmax_max,
                                                        res.softmax_sum, pse=pse, **kw)
    for a, b in ((lq.grad, dq), (lk.grad, dk), (lv.grad, dv), (lp.grad, dpse)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_forward_is_the_custom_op():
    q, k, v, _ = make_qkv("BNSD", b=1, n1=1, sq=3, skv=3, seed=107)
    with _OpRecorder() as rec:
        attnops.flash_attention(q, k, v)
    assert "attnops.flash_attention_fwd.default" in rec.ops


def test_result_namedtuple():
    q, k, v, _ = make_qkv("TND", n1=2, q_lens=[2, 3], kv_lens=[3, 3], seed=108)
    r = attnops.flash_attention(q, k, v, layout="TND", actual_seq_qlen=[2, 5], actual_seq_kvlen=[3, 6],
                                return_stats=True, keep_prob=0.5, seed=5, offset=7)
    assert isinstance(r, attnops.FlashAttentionResult) and r._fields == ("out", "softmax_max", "softmax_sum", "seed",
                                                                          "offset")
    assert r.out.shape == (5, 2, 8) and r.softmax_max.shape == (5, 2, 8) and r.softmax_sum.dtype == torch.float32
    assert (r.seed, r.offset) == (5, 7)
    out = attnops.flash_attention(q, k, v, layout="TND", actual_seq_qlen=[2, 5], actual_seq_kvlen=[3, 6],
                                  keep_prob=0.5, seed=5, offset=7)
    torch.testing.assert_close(out, r.out, rtol=0, atol=0)


def test_default_scale_is_inverse_sqrt_d():
    q, k, v, _ = make_qkv("BSH", b=1, n1=2, d=16, sq=3, skv=4, seed=109)
    torch.testing.assert_close(attnops.flash_attention(q, k, v, layout="BSH", head_num=2),
                               attnops.flash_attention(q, k, v, layout="BSH", head_num=2, scale=0.25), rtol=0, atol=0)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_cu_seqlens_equals_actual_seq(as_tensor):
    q_lens, kv_lens = [3, 0, 2, 4], [2, 3, 0, 4]
    q, k, v, dy = make_qkv("TND", n1=2, n2=1, q_lens=q_lens, kv_lens=kv_lens, seed=110)
    cu_q, cu_k = [0] + cum(q_lens), [0] + cum(kv_lens)
    if as_tensor:
        cu_q, cu_k = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    common = dict(layout="TND", scale=0.4, atten_mask=TRIU2048, sparse_mode=2)
    a = attnops.flash_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_stats=True, **common)
    b = attnops.flash_attention(q, k, v, actual_seq_qlen=cum(q_lens), actual_seq_kvlen=cum(kv_lens),
                                return_stats=True, **common)
    for x, y in zip(a[:3], b[:3]):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    ga = attnops.flash_attention_backward(dy, q, k, v, *a[:3], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **common)
    gb = attnops.flash_attention_backward(dy, q, k, v, *b[:3], actual_seq_qlen=cum(q_lens),
                                          actual_seq_kvlen=cum(kv_lens), **common)
    for x, y in zip(ga[:3], gb[:3]):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_cu_seqlens_misuse_is_rejected():
    q, k, v, _ = make_qkv("TND", n1=1, q_lens=[2], kv_lens=[2], seed=111)
    with pytest.raises(attnops.ParamInvalidError, match="cu_seqlens_q"):
        attnops.flash_attention(q, k, v, layout="TND", cu_seqlens_q=[0, 2], cu_seqlens_k=[0, 2],
                                actual_seq_qlen=[2], actual_seq_kvlen=[2])
    with pytest.raises(attnops.ParamInvalidError, match="cu_seqlens_k"):
        attnops.flash_attention(q, k, v, layout="TND", cu_seqlens_q=[0, 2])
    with pytest.raises(attnops.ParamInvalidError, match="cu_seqlens_q"):
        attnops.flash_attention(q, k, v, layout="TND", cu_seqlens_q=[2], cu_seqlens_k=[0, 2])
    with pytest.raises(ValueError, match="actual_seq_qlen"):
        attnops.flash_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), layout="BSND",
                                actual_seq_qlen=[2], actual_seq_kvlen=[2])


def test_backward_needs_the_seed_with_dropout():
    q, k, v, dy = make_qkv("BNSD", b=1, n1=1, sq=3, skv=3, seed=112)
    r = attnops.flash_attention(q, k, v, keep_prob=0.5, return_stats=True)
    with pytest.raises(attnops.AclnnError, match="seed"):
        attnops.flash_attention_backward(dy, q, k, v, r.out, r.softmax_max, r.softmax_sum, keep_prob=0.5)


def test_dpse_none_without_pse_tensor():
    q, k, v, dy = make_qkv("BNSD", b=1, n1=2, sq=4, skv=4, seed=113)
    r = attnops.flash_attention(q, k, v, return_stats=True)
    assert attnops.flash_attention_backward(dy, q, k, v, *r[:3])[3] is None
    slopes = torch.tensor([0.5, 0.1])
    r = attnops.flash_attention(q, k, v, pse=slopes, pse_type=2, return_stats=True)
    assert attnops.flash_attention_backward(dy, q, k, v, *r[:3], pse=slopes, pse_type=2)[3] is None


# --------------------------------------------------------------------------------------------- gradcheck


def _f64(*ts):
    return [t.to(F64).requires_grad_() for t in ts]


GRADCHECK_CASES = {
    "plain": lambda: (make_qkv("BNSD", b=1, n1=2, sq=3, skv=4, d=4, seed=120)[:3], dict(), None),
    "tnd_mode2": lambda: (make_qkv("TND", n1=2, q_lens=[2, 3], kv_lens=[3, 3], d=4, seed=121)[:3],
                          dict(layout="TND", actual_seq_qlen=[2, 5], actual_seq_kvlen=[3, 6], atten_mask=TRIU2048,
                               sparse_mode=2), None),
    "tnd_mode3_invalid_rows": lambda: (make_qkv("TND", n1=1, q_lens=[3, 2], kv_lens=[2, 0], d=4, seed=122)[:3],
                                       dict(layout="TND", actual_seq_qlen=[3, 5], actual_seq_kvlen=[2, 2],
                                            atten_mask=TRIU2048, sparse_mode=3), None),
    "pse_type1": lambda: (make_qkv("BSH", b=1, n1=2, sq=3, skv=3, d=4, seed=123)[:3], dict(layout="BSH", head_num=2),
                          randn(1, 2, 3, 3, seed=124)),
    "gqa_dv": lambda: (make_qkv("BSND", b=1, n1=4, n2=1, sq=3, skv=4, d=4, dv=2, seed=125)[:3],
                       dict(layout="BSND"), None),
    "dropout_mask": lambda: (make_qkv("BNSD", b=1, n1=1, sq=3, skv=4, d=4, seed=126)[:3],
                             dict(keep_prob=0.7, drop_mask=pack_bits(random_keep(12, 0.7, seed=127))), None),
}


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_gradcheck_float64(case):
    (q, k, v), kw, pse = GRADCHECK_CASES[case]()
    inputs = _f64(q, k, v) + ([] if pse is None else _f64(pse))

    def fn(*xs):
        return attnops.flash_attention(*xs[:3], pse=xs[3] if len(xs) > 3 else None, scale=0.5, **kw)

    assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_options_defaults_are_the_forwards():
    """``Options`` (what the forward, the backward and ``attention_probabilities`` resolve) has exactly the keyword
    options of :func:`flash_attention` but ``return_stats``, with the same defaults."""
    import dataclasses
    import inspect

    from attnops.ops.flash_attention import flash_attention
    from attnops.ops.flash_attention.options import Options

    params = inspect.signature(flash_attention).parameters.values()
    forward = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY and p.name != "return_stats"}
    assert {f.name: f.default for f in dataclasses.fields(Options)} == forward
