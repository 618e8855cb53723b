"""precision="npu" for NSA selected and compressed attention: P and dS rounded to the input dtype (ties away from
zero) before their products, outputs and gradients cast ties away (docs/precision.md)."""
import pytest
import torch

import attnops
from attnops._core.errors import ParamInvalidError
from attnops.ops.common.npu_rounding import cast_round

BLOCK, COUNT = 16, 4


def _selected_inputs(dtype, t=64, n=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(t, n, d, generator=g).to(dtype) for _ in range(3))
    topk = torch.arange(COUNT, dtype=torch.int32).expand(t, n, COUNT).contiguous()  # every block (t = 64)
    return q, k, v, topk


def _model(q, k, v, topk, dy):
    """fp64 model of the kernels' rounding on the selected keys: P rounded for P V and for dV, dS for dQ/dK."""
    t, n, d = q.shape
    dtype, scale = q.dtype, d ** -0.5
    keep = torch.ones(t, t, dtype=torch.bool).tril()  # every block selected, causal
    q64, k64, v64, dy64 = (x.double().transpose(0, 1) for x in (q, k, v, dy))  # [N, T, D]
    s = (q64 @ k64.transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))
    e = (s - s.amax(-1, keepdim=True)).exp()
    p = e / e.sum(-1, keepdim=True)
    out = cast_round(cast_round(e, dtype).double() @ v64 / e.sum(-1, keepdim=True), dtype)
    ds = p * (dy64 @ v64.transpose(-1, -2) - (dy64 * out.double()).sum(-1, keepdim=True))
    ds = cast_round(ds, dtype).double()
    p_v = cast_round(p, dtype).double()
    grads = (ds @ k64 * scale, ds.transpose(-1, -2) @ q64 * scale, p_v.transpose(-1, -2) @ dy64)
    return out.transpose(0, 1), [cast_round(x.transpose(0, 1), dtype) for x in grads]


def _mismatch(x, model):
    return (x != model).float().mean().item(), (x.double() - model.double()).abs().mean().item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_selected_attention_follows_the_model(dtype):
    q, k, v, topk = _selected_inputs(dtype)
    dy = _selected_inputs(dtype, seed=1)[0]
    want_out, want_grads = _model(q, k, v, topk, dy)
    results = {}
    for precision in ("npu", "exact"):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        out = attnops.nsa_selected_attention(qq, kk, vv, topk, select_block_size=BLOCK, precision=precision)
        out.backward(dy)
        results[precision] = [out.detach(), qq.grad, kk.grad, vv.grad]
    for npu, exact, want in zip(results["npu"], results["exact"], [want_out, *want_grads]):
        rate_n, err_n = _mismatch(npu, want)
        rate_e, err_e = _mismatch(exact, want)
        assert rate_n < 0.05 and err_n < 0.2 * err_e, (rate_n, rate_e, err_n, err_e)


def test_compress_attention_rounds_p_and_its_backward_ds():
    dtype = torch.float16
    g = torch.Generator().manual_seed(2)
    q = torch.randn(64, 2, 32, generator=g).to(dtype)
    k, v = (torch.randn(12, 1, 32, generator=g).to(dtype) for _ in range(2))
    kw = dict(compress_block_size=32, compress_stride=16, select_block_size=64, select_block_count=1)
    q64, k64, v64 = (x.double().transpose(0, 1) for x in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) * 32 ** -0.5
    e = (s - s.amax(-1, keepdim=True)).exp()
    want = cast_round(cast_round(e, dtype).double() @ v64 / e.sum(-1, keepdim=True), dtype).transpose(0, 1)
    npu = attnops.nsa_compress_attention(q, k, v, precision="npu", **kw).out
    exact = attnops.nsa_compress_attention(q, k, v, **kw).out
    assert _mismatch(npu, want)[1] < 0.2 * _mismatch(exact, want)[1]
    qq = q.clone().requires_grad_()
    attnops.nsa_compress_attention(qq, k, v, precision="npu", **kw).out.float().sum().backward()
    q_exact = q.clone().requires_grad_()
    attnops.nsa_compress_attention(q_exact, k, v, **kw).out.float().sum().backward()
    assert not torch.equal(qq.grad, q_exact.grad)  # the backward of an npu forward rounds dS


def test_validation_and_fp32():
    q, k, v, topk = _selected_inputs(torch.float32, t=32)
    kw = dict(select_block_size=BLOCK)
    assert torch.equal(attnops.nsa_selected_attention(q, k, v, topk[:, :, :2], precision="npu", **kw),
                       attnops.nsa_selected_attention(q, k, v, topk[:, :, :2], **kw))
    with pytest.raises(ParamInvalidError, match="precision"):
        attnops.nsa_selected_attention(q, k, v, topk[:, :, :2], precision="bf16", **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_selected_attention_infer_rounds_p(dtype):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 32, generator=g).to(dtype)
    k_cache, v_cache = (torch.randn(8, 16, 1, 32, generator=g).to(dtype) for _ in range(2))
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    topk = torch.arange(4, dtype=torch.int32).expand(2, 1, 4).contiguous()
    kw = dict(select_block_size=16)
    k64, v64 = (c.double().view(2, 64, 32) for c in (k_cache, v_cache))
    s = q.double() @ k64.transpose(-1, -2) * 32 ** -0.5  # [2, 4, 64]
    e = (s - s.amax(-1, keepdim=True)).exp()
    want = cast_round(cast_round(e, dtype).double() @ v64 / e.sum(-1, keepdim=True), dtype)
    npu = attnops.nsa_selected_attention_infer(q, k_cache, v_cache, topk, table, [64, 64], precision="npu", **kw)
    exact = attnops.nsa_selected_attention_infer(q, k_cache, v_cache, topk, table, [64, 64], **kw)
    assert _mismatch(npu, want)[1] < 0.2 * _mismatch(exact, want)[1]
