"""precision="npu" for FusedInferAttentionScore: the PFA/IFA kernels' output casts, inner_precise, int8 query
planes against int8 KV and the int8 output through fp16 (docs/precision.md)."""
import pytest
import torch

import attnops
from attnops._core.errors import ParamInvalidError, PrecisionNotEmulatedError
from attnops.ops.common.npu_rounding import msd_planes

F16, BF16 = torch.float16, torch.bfloat16


def _ties(dtype, d=64):
    """Pairs of consecutive ``dtype`` values ``[d]`` each (their mean is an exact tie) and the mean."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0x3000, 0x4800 if dtype == F16 else 0x4100, (d,), generator=g, dtype=torch.int16)
    lo, hi = bits.view(dtype), (bits + 1).view(dtype)
    return lo, hi, (lo.float() + hi.float()) / 2


@pytest.mark.parametrize("dtype,sq", [(F16, 1), (BF16, 1), (F16, 2), (BF16, 2)])
def test_output_casts(dtype, sq):
    """Two keys with equal scores: the output is the mean of two neighbouring values, an exact tie. Decode (IFA)
    casts bf16 ties to even, every other output rounds ties away from zero."""
    lo, hi, mid = _ties(dtype)
    q, k = torch.zeros(1, 1, sq, 64, dtype=dtype), torch.zeros(1, 1, 2, 64, dtype=dtype)
    v = torch.stack([lo, hi])[None, None]
    out = attnops.fused_infer_attention(q, k, v, precision="npu")[0, 0]
    away = torch.where(hi.abs() > lo.abs(), hi, lo)
    want = mid.to(dtype) if (dtype, sq) == (BF16, 1) else away
    assert torch.equal(out, want.expand_as(out))
    assert not torch.equal(mid.to(dtype), away)  # the two rules differ on these ties


def test_inner_precise_1_runs_the_fp16_prefill_softmax_in_fp16():
    """Scores 1000 and 1000.2 are one fp16 value: the fp16 softmax weighs both keys equally."""
    q = torch.tensor([1000.0, 0.2]).half().view(1, 1, 1, 2).expand(1, 1, 2, 2)
    k = torch.tensor([[1.0, 0.0], [1.0, 1.0]]).half().view(1, 1, 2, 2)
    v = torch.tensor([[0.0, 0.0], [1.0, 1.0]]).half().view(1, 1, 2, 2)
    kw = dict(scale=1.0, precision="npu")
    fast = attnops.fused_infer_attention(q, k, v, inner_precise=1, **kw)
    precise = attnops.fused_infer_attention(q, k, v, inner_precise=0, **kw)
    assert torch.equal(fast, torch.full_like(fast, 0.5))
    torch.testing.assert_close(precise.float(), torch.full((1, 1, 2, 2), 0.2 ** 0 / (1 + torch.e ** -0.2)),
                               rtol=1e-3, atol=0)


def test_int8_output_goes_through_fp16():
    """The mean 2.4990234 of 2.498047 and 2.5 rounds to fp16 2.5 (a tie, away from zero), then to int8 3; the
    direct rounding gives 2."""
    q, k = torch.zeros(1, 1, 1, 16, dtype=F16), torch.zeros(1, 1, 2, 16, dtype=F16)
    v = torch.tensor([2.498046875, 2.5], dtype=F16).view(1, 1, 2, 1).expand(1, 1, 2, 16)
    kw = dict(quant_scale2=torch.ones(1))
    assert attnops.fused_infer_attention(q, k, v, precision="npu", **kw).unique().tolist() == [3]
    assert attnops.fused_infer_attention(q, k, v, **kw).unique().tolist() == [2]


def test_msd_planes():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 128, generator=g)
    top = x.abs().amax(-1, keepdim=True)
    one = msd_planes(x, 1) * 127 / top
    want = (x * (127 / top)).abs().add(0.5).floor().copysign(x)  # integers, ties away from zero
    assert (one - want).abs().max() < 1e-4  # up to the fp32 rounding of rescaling
    for planes, bound in ((2, 0.5 / (127 * 254)), (3, 0.5 / (127 * 254 ** 2) + 2e-7)):
        assert ((msd_planes(x, planes) - x).abs() / top).max() <= bound


def test_int8_kv_decode_uses_query_planes():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 1, 64, generator=g).half()
    k, v = (torch.randint(-127, 128, (1, 2, 300, 64), generator=g, dtype=torch.int8) for _ in range(2))
    kw = dict(num_key_value_heads=2, antiquant_scale=(torch.rand(2, 2, 64, generator=g) * 0.01 + 0.005).half())
    q64 = q.double()
    ks, vs = (kw["antiquant_scale"][i].double().view(1, 2, 1, 64).repeat_interleave(2, 1) for i in range(2))
    golden = ((q64 @ (k.double().repeat_interleave(2, 1) * ks).transpose(-1, -2)) * 64 ** -0.5).softmax(-1) \
        @ (v.double().repeat_interleave(2, 1) * vs)
    err = {ip: (attnops.fused_infer_attention(q, k, v, precision="npu", inner_precise=ip, **kw).double() - golden)
           .abs().mean() for ip in (0, 1)}
    exact = (attnops.fused_infer_attention(q, k, v, **kw).double() - golden).abs().mean()
    assert err[0] < 1.2 * exact  # 3 planes: finer than fp16
    assert err[1] > err[0]  # 2 planes (inner_precise=1): coarser


@pytest.mark.parametrize("sq", [1, 64])
def test_error_band_against_the_fp64_golden(sq):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, s, 128, generator=g).half() for s in (sq, 1100, 1100))
    q64, k64, v64 = (t.double() for t in (q, k, v))
    golden = (q64 @ k64.transpose(-1, -2) * 128 ** -0.5).softmax(-1) @ v64

    def metrics(x):
        err = x.double() - golden
        big = golden.abs() > 2 ** -10
        return err.pow(2).mean().sqrt(), (err.abs() / golden.abs())[big].mean()

    rmse_e, rel_e = metrics(attnops.fused_infer_attention(q, k, v))
    rmse_n, rel_n = metrics(attnops.fused_infer_attention(q, k, v, precision="npu"))
    assert 1.1 < rmse_n / rmse_e < 1.6
    assert 2.0 < rel_n / rel_e < 4.5


def test_validation():
    q, k = torch.randn(1, 2, 1, 16).half(), torch.randn(1, 2, 8, 16).half()
    with pytest.raises(ParamInvalidError, match="precision"):
        attnops.fused_infer_attention(q, k, k, precision="half")
    with pytest.raises(ParamInvalidError, match="backend"):
        attnops.fused_infer_attention(q, k, k, precision="npu", backend="triton")
    k8 = torch.randint(-8, 8, (1, 2, 8, 16), dtype=torch.int8)
    per_token = dict(key_antiquant_scale=torch.ones(1, 8), value_antiquant_scale=torch.ones(1, 8),
                     key_antiquant_mode=1, value_antiquant_mode=1)
    attnops.fused_infer_attention(q, k8, k8, **per_token)
    with pytest.raises(PrecisionNotEmulatedError, match="precision"):
        attnops.fused_infer_attention(q, k8, k8, precision="npu", **per_token)
