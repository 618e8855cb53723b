"""precision="npu": the Ascend FlashAttentionScore kernels' rounding (docs/precision.md), judged against
independent fp64 models of that rounding and against the fp64 golden."""
import pytest
import torch

import attnops
from attnops._core.errors import ParamInvalidError
from attnops.ops.common import bf16_gemm
from attnops.ops.common.npu_rounding import cast_round

S_ONE_BLOCK = 384  # keys of one online-softmax block (the kernel's 512)


def _inputs(dtype, sq=64, skv=S_ONE_BLOCK, n=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, s, d, generator=g).to(dtype) for s in (sq, skv, skv)]


def _model_forward(q, k, v):
    """fp64 model of the kernel on one key block: P = exp(S - max) rounded to the input dtype (ties away) for
    P V, the row sum from the unrounded P, the output cast ties away."""
    q64, k64, v64 = (t.double() for t in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) * q.shape[-1] ** -0.5
    p = (s - s.amax(-1, keepdim=True)).exp()
    o = cast_round(p, q.dtype).double() @ v64 / p.sum(-1, keepdim=True)
    return cast_round(o, q.dtype), p / p.sum(-1, keepdim=True)


@pytest.fixture(autouse=True)
def _fp32_products(monkeypatch):
    """"exact" here is fp32-then-cast: the CPU engine's bf16 GEMM (AVX512-BF16 CPUs) rounds P and dS of bf16
    inputs as the NPU does (docs/precision.md); it is judged in tests/ops/common/test_bf16_gemm.py."""
    monkeypatch.setenv("ATTNOPS_CPU_BF16_GEMM", "0")


# precision="npu" on the two kinds of products: fp32 GEMMs of the widened operands, and (bf16 inputs on CPUs with
# AVX512-BF16) the bf16 GEMM, whose exact bf16 x bf16 products are the NPU cube's
ROUTES = [pytest.param(torch.float16, False, id="fp16"), pytest.param(torch.bfloat16, False, id="bf16-fp32-products"),
          pytest.param(torch.bfloat16, True, id="bf16-gemm", marks=pytest.mark.skipif(
              bf16_gemm.bound_library() is None, reason="no bf16 GEMM on this CPU (AVX512-BF16)"))]


def _products(monkeypatch, gemm: bool) -> None:
    """The next calls' products: the bf16 GEMM (``gemm``) or fp32 GEMMs."""
    monkeypatch.setenv("ATTNOPS_CPU_BF16_GEMM", "1" if gemm else "0")


@pytest.mark.parametrize("dtype, gemm", ROUTES)
def test_forward_rounds_p_to_the_input_dtype(dtype, gemm, monkeypatch):
    q, k, v = _inputs(dtype)
    model, _ = _model_forward(q, k, v)
    exact = attnops.flash_attention(q, k, v)
    _products(monkeypatch, gemm)
    npu = attnops.flash_attention(q, k, v, precision="npu")
    # fp32 vs fp64 scores and sums: a few roundings land one place off; the exact path misses the model often
    assert (npu != model).float().mean() < 0.03
    assert (exact != model).float().mean() > 0.2
    err = [(x.double() - model.double()).abs().mean() for x in (npu, exact)]
    assert err[0] < 0.1 * err[1]


@pytest.mark.parametrize("dtype, gemm", ROUTES)
def test_backward_rounds_p_and_ds(dtype, gemm, monkeypatch):
    q, k, v = _inputs(dtype, seed=1)
    dy = _inputs(dtype, seed=2)[0]
    _products(monkeypatch, gemm)
    res = attnops.flash_attention(q, k, v, precision="npu", return_stats=True)
    _, p = _model_forward(q, k, v)
    do, o, k64, v64, q64 = (t.double() for t in (dy, res.out, k, v, q))
    scale = q.shape[-1] ** -0.5
    ds = p * (do @ v64.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    model = {"dq": cast_round(cast_round(ds, dtype).double() @ k64 * scale, dtype),
             "dk": cast_round(cast_round(ds, dtype).double().transpose(-1, -2) @ q64 * scale, dtype),
             "dv": cast_round(cast_round(p, dtype).double().transpose(-1, -2) @ do, dtype)}
    kw = dict(scale=scale)
    npu = attnops.flash_attention_backward(dy, q, k, v, res.out, res.softmax_max, res.softmax_sum,
                                           precision="npu", **kw)
    _products(monkeypatch, False)
    exact = attnops.flash_attention_backward(dy, q, k, v, res.out, res.softmax_max, res.softmax_sum, **kw)
    for name, a, b in zip(("dq", "dk", "dv"), npu, exact):
        err_npu = (a.double() - model[name].double()).abs().mean()
        err_exact = (b.double() - model[name].double()).abs().mean()
        assert err_npu < 0.5 * err_exact, name


def test_autograd_uses_the_npu_backward():
    q, k, v = (t.requires_grad_() for t in _inputs(torch.float16, sq=32, skv=48))
    res = attnops.flash_attention(q, k, v, causal=True, precision="npu", return_stats=True)
    dy = torch.randn_like(res.out)
    res.out.backward(dy)
    grads = attnops.flash_attention_backward(dy, q.detach(), k.detach(), v.detach(), res.out.detach(),
                                             res.softmax_max, res.softmax_sum, causal=True, precision="npu")
    exact = attnops.flash_attention_backward(dy, q.detach(), k.detach(), v.detach(), res.out.detach(),
                                             res.softmax_max, res.softmax_sum, causal=True)
    for t, g, e in zip((q, k, v), grads, exact):
        assert torch.equal(t.grad, g)
        assert not torch.equal(t.grad, e)


@pytest.mark.parametrize("dtype, gemm", ROUTES)
def test_error_band_against_the_fp64_golden(dtype, gemm, monkeypatch):
    """RMSE about 1.35x and mean relative error about 3x those of fp32-then-cast (docs/precision.md), over several
    key blocks with a causal mask."""
    q, k, v = _inputs(dtype, sq=256, skv=1300, n=2, d=128, seed=3)
    q64, k64, v64 = (t.double() for t in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) * 128 ** -0.5
    s = s.masked_fill(torch.ones(256, 1300, dtype=torch.bool).triu(1300 - 256 + 1), float("-inf"))
    golden = s.softmax(-1) @ v64

    def metrics(x):
        err = x.double() - golden
        big = golden.abs() > 2 ** -10
        return err.pow(2).mean().sqrt(), (err.abs() / golden.abs())[big].mean()

    rmse_e, rel_e = metrics(attnops.flash_attention(q, k, v, causal=True))
    _products(monkeypatch, gemm)
    rmse_n, rel_n = metrics(attnops.flash_attention(q, k, v, causal=True, precision="npu"))
    assert 1.15 < rmse_n / rmse_e < 1.6
    assert 2.0 < rel_n / rel_e < 4.5


def test_exact_is_the_default_and_fp32_is_unchanged():
    q, k, v = _inputs(torch.float16, sq=16, skv=40)
    assert torch.equal(attnops.flash_attention(q, k, v), attnops.flash_attention(q, k, v, precision="exact"))
    q, k, v = (t.float() for t in (q, k, v))  # the kernels compute fp32 inputs in fp32 end to end
    assert torch.equal(attnops.flash_attention(q, k, v), attnops.flash_attention(q, k, v, precision="npu"))


def test_validation():
    q, k, v = _inputs(torch.float16, sq=4, skv=4)
    with pytest.raises(ParamInvalidError, match="precision"):
        attnops.flash_attention(q, k, v, precision="fp16")
    with pytest.raises(ParamInvalidError, match="backend"):
        attnops.flash_attention(q, k, v, precision="npu", backend="triton")
