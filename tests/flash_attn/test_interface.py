"""flash-attn 2's functions (attnops.flash_attn) against an independent fp64 ``attention_ref`` of flash-attn's
documented semantics: forward, LSE and gradients by FlashAttention's tolerance rule (the baseline: the same
reference in the inputs' precision), over causal / window / softcap / ALiBi / GQA / dropout / varlen combinations;
the packed forms; S_dmask; the errors."""
import pytest
import torch

from attnops._core.errors import ParamInvalidError
from attnops.flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                flash_attn_varlen_qkvpacked_func)
from attnops.testing.compare import assert_close_to_golden, attention_reductions
from tests.flash_attn.attention_ref import attention_ref, attention_ref_varlen, keep_matrix

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _inputs(b, sq, sk, h, hk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g).to(dtype)
    k, v = (torch.randn(b, sk, hk, d, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(b, sq, h, d, generator=g).to(dtype)
    return q, k, v, dout


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def _check(actual_fn, ref_fn, q, k, v, dout, *, lse=True, lengths=None):
    """``actual_fn(q, k, v) -> (out, lse)`` against ``ref_fn(q, k, v, dtype) -> (out, lse)``: fp64 golden,
    baseline in the inputs' dtype; outputs factor 2, gradients factor 3; the LSE (fp32) within fp32 rounding.
    ``lengths``: the longest (Sq, Sk) (default: the inputs' sequence dims), for the tolerance floor."""
    sq, sk = lengths or (q.shape[-3], k.shape[-3])
    red = attention_reductions(q.shape[-1], v.shape[-1], sq, sk)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, out_lse = actual_fn(*leaves)
    gold_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    gold, gold_lse = ref_fn(*gold_in, torch.float64)
    base_in = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    base, _ = ref_fn(*base_in, q.dtype)
    assert_close_to_golden("out", out, gold, base, reduction=red["out"])
    if lse:
        assert out_lse.dtype == torch.float32
        finite = torch.isfinite(gold_lse)
        assert torch.equal(torch.isfinite(out_lse), finite)  # +inf exactly on rows without keys
        assert_close_to_golden("lse", out_lse[finite], gold_lse[finite], None, reduction=red["lse"])
    for name, a, gd, bs in zip(("dq", "dk", "dv"), _grads(out, leaves, dout), _grads(gold, gold_in, dout.double()),
                               _grads(base, base_in, dout)):
        assert_close_to_golden(name, a, gd, bs, factor=3.0, reduction=red[name])


# (causal, window_size, softcap, alibi, sq, sk, kv heads)
CASES = [
    (False, (-1, -1), 0.0, False, 17, 17, 4),
    (True, (-1, -1), 0.0, False, 9, 23, 2),  # bottom-right causal, GQA
    (True, (-1, -1), 0.0, False, 23, 9, 1),  # rows without keys (Sq > Sk), MQA
    (False, (5, 2), 0.0, False, 19, 26, 4),  # sliding window
    (True, (3, -1), 0.0, False, 21, 21, 2),  # causal window
    (False, (-1, -1), 4.0, False, 18, 13, 4),  # softcap
    (True, (-1, -1), 2.0, True, 11, 30, 2),  # softcap + ALiBi + causal, Sq != Sk
    (False, (4, 4), 0.0, True, 16, 12, 1),  # ALiBi + window
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal,window_size,softcap,alibi,sq,sk,hk", CASES)
def test_flash_attn_func_matches_attention_ref(causal, window_size, softcap, alibi, sq, sk, hk, dtype):
    q, k, v, dout = _inputs(2, sq, sk, 4, hk, 16, dtype)
    slopes = torch.rand(2, 4) if alibi else None
    options = dict(softmax_scale=0.3, causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=slopes)

    def actual(q, k, v):
        out, lse, s_dmask = flash_attn_func(q, k, v, return_attn_probs=True, **options)
        assert s_dmask.numel() == 0  # no dropout: flash-attn returns no probabilities
        return out, lse

    _check(actual, lambda q, k, v, dtype: attention_ref(q, k, v, dtype=dtype, **options), q, k, v, dout)


def test_default_scale_and_output_alone():
    q, k, v, _ = _inputs(1, 8, 8, 2, 2, 16, torch.float64)
    out = flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, attention_ref(q, k, v)[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal,window_size,softcap,alibi", [(False, (-1, -1), 0.0, False),
                                                              (True, (-1, -1), 3.0, True),
                                                              (False, (2, 3), 0.0, True)])
def test_flash_attn_varlen_func_matches_attention_ref(causal, window_size, softcap, alibi, dtype):
    q_lens, k_lens = [5, 0, 13, 1], [7, 3, 13, 4]  # an empty sequence, Sq != Sk, one token
    cu_q, cu_k = [0, 5, 5, 18, 19], [0, 7, 10, 23, 27]
    q, k, v, dout = (x[0] for x in _inputs(1, 27, 27, 4, 2, 16, dtype, seed=1))
    q, dout = q[:19], dout[:19]
    slopes = torch.rand(4) if alibi else None
    options = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=slopes)
    cu = [torch.tensor(c, dtype=torch.int32) for c in (cu_q, cu_k)]

    def actual(q, k, v):
        out, lse, _ = flash_attn_varlen_func(q, k, v, *cu, max(q_lens), max(k_lens), return_attn_probs=True,
                                             **options)
        assert lse.shape == (4, 19)
        return out, lse

    _check(actual, lambda q, k, v, dtype: attention_ref_varlen(q, k, v, cu_q, cu_k, dtype=dtype, **options),
           q, k, v, dout, lengths=(max(q_lens), max(k_lens)))


@pytest.mark.parametrize("varlen", [False, True])
def test_dropout_s_dmask_encodes_the_kept_probabilities(varlen):
    """With dropout: S_dmask holds the probabilities in flash-attn's block encoding (negated where dropped); the
    output and gradients equal the reference fed that keep pattern; about dropout_p of the kept band is dropped."""
    p_drop = 0.25
    q, k, v, dout = _inputs(2, 24, 24, 2, 1, 16, torch.float32, seed=2)
    options = dict(causal=True, softcap=5.0, alibi_slopes=torch.rand(2))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    if varlen:
        cu = torch.tensor([0, 24, 48], dtype=torch.int32)
        flat = [x.reshape(48, *x.shape[2:]) for x in leaves]
        out, lse, s_dmask = flash_attn_varlen_func(*flat, cu, cu, 24, 24, dropout_p=p_drop, return_attn_probs=True,
                                                   **options)
        out = out.view(2, 24, 2, 16)
    else:
        out, lse, s_dmask = flash_attn_func(*leaves, dropout_p=p_drop, return_attn_probs=True, **options)
    assert s_dmask.shape == (2, 2, 24, 24) and s_dmask.dtype == torch.float32
    keep = s_dmask >= 0
    band = keep_matrix(24, 24, True, (-1, -1))
    dropped = (~keep & band).sum().item() / (band.sum().item() * 4)
    assert 0.15 < dropped < 0.35
    gold_in = [x.double().requires_grad_() for x in (q, k, v)]
    gold, _ = attention_ref(*gold_in, dropout_p=p_drop, keep=keep, **options)
    base_in = [x.clone().requires_grad_() for x in (q, k, v)]
    base, _ = attention_ref(*base_in, dropout_p=p_drop, keep=keep, dtype=torch.float32, **options)
    red = attention_reductions(16, 16, 24, 24)
    assert_close_to_golden("out", out, gold, base, reduction=red["out"])
    for name, a, g, bs in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, dout),
                              torch.autograd.grad(gold, gold_in, dout.double()),
                              torch.autograd.grad(base, base_in, dout)):
        assert_close_to_golden(name, a, g, bs, factor=3.0, reduction=red[name])
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * 16 ** -0.5
    s = 5.0 * torch.tanh(s / 5.0) - options["alibi_slopes"].double().view(1, 2, 1, 1) * (
        torch.arange(24)[:, None] - torch.arange(24)[None]).abs()
    expected = torch.softmax(s.masked_fill(~band, float("-inf")), -1)
    expected = expected / expected.amax(-1, keepdim=True)  # one key block (d=16: 128 keys): P / the row's max P
    assert_close_to_golden("s_dmask", s_dmask.abs(), expected, None, reduction=red["softmax_sum"])


def test_packed_forms_equal_the_unpacked_function():
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 10, 3, 4, 16, generator=g, requires_grad=True)
    kv = torch.randn(2, 12, 2, 2, 16, generator=g, requires_grad=True)
    q = qkv[:, :, 0].detach().requires_grad_()
    options = dict(causal=True, softcap=3.0)
    out = flash_attn_qkvpacked_func(qkv, **options)
    assert torch.equal(out, flash_attn_func(*qkv.unbind(2), **options))
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape and bool(qkv.grad.abs().sum() > 0)
    assert torch.equal(flash_attn_kvpacked_func(q, kv, **options), flash_attn_func(q, *kv.unbind(2), **options))
    cu = torch.tensor([0, 4, 20], dtype=torch.int32)
    flat_qkv, flat_kv = qkv.detach().reshape(20, 3, 4, 16), kv.detach()[:, :10].reshape(20, 2, 2, 16)
    expected = flash_attn_varlen_func(*flat_qkv.unbind(1), cu, cu, 16, 16, **options)
    assert torch.equal(flash_attn_varlen_qkvpacked_func(flat_qkv, cu, 16, **options), expected)
    assert torch.equal(flash_attn_varlen_kvpacked_func(flat_qkv[:, 0], flat_kv, cu, cu, 16, 16, **options),
                       flash_attn_varlen_func(flat_qkv[:, 0], *flat_kv.unbind(1), cu, cu, 16, 16, **options))


@pytest.mark.parametrize("call,name", [
    (lambda q: flash_attn_func(q, q, q, dropout_p=1.0), "dropout_p"),
    (lambda q: flash_attn_func(q, q, q, window_size=(1, 2, 3)), "window_size"),
    (lambda q: flash_attn_func(q, q, q, alibi_slopes=torch.rand(3)), "alibi_slopes"),
    (lambda q: flash_attn_func(q, q, q, softcap=-1.0), "softcap"),
    (lambda q: flash_attn_func(q, q, q, deterministic=None), "deterministic"),
    (lambda q: flash_attn_func(q[0], q[0], q[0]), "q"),
    (lambda q: flash_attn_qkvpacked_func(q), "qkv"),
    (lambda q: flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 8], dtype=torch.int32),
                                      torch.tensor([0, 8], dtype=torch.int32), 8, 8, block_table=q), "block_table"),
])
def test_invalid_arguments_name_the_argument(call, name):
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ParamInvalidError, match=name):
        call(q)
